"""`specwire train-medusa`: train Medusa-1 heads on a frozen base model (Cai et al. 2024, §2.1).

The base model is frozen; only the heads learn. Head k at position t learns the token at t+k+2,
either from the base model's own distribution there (self-distillation, the default: the soft
target is the base's next-token distribution at position t+k+1, so the heads learn what the
base would say, which is what verification accepts) or from the text itself (`--loss ce`).
Each head's vocabulary map starts as the base's output embedding and its residual block as
the identity, so a fresh head predicts the base's next token.

Deterministic: fixed seeds, a seeded data order and a pinned thread count. Default data: the
standard-library source the demo pair was trained on (`specwire.demo.train_pair`), its training
files for training, its held-out files for the final per-head top-1 / top-5 accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specwire.demo import demo_target_dir
from specwire.demo.train_pair import encode_stream, load_corpus, windows
from specwire.medusa import MedusaConfig, MedusaHeads


def head_losses(
    head_logits: torch.Tensor, base_logits: torch.Tensor, tokens: torch.Tensor, distill: bool
) -> torch.Tensor:
    """Per-head loss. Head k at position t targets position t+k+2 of `tokens`.

    head_logits: [B, T, K, V]; base_logits: [B, T, V] (base at t predicts t+1); tokens: [B, T+1].
    Self-distillation: cross-entropy against softmax(base_logits[t+k+1]) (= KL up to a constant);
    otherwise against the token tokens[t+k+2]. Returns [K].
    """
    steps, heads = head_logits.shape[1], head_logits.shape[2]
    losses = []
    for k in range(heads):
        usable = steps - k - 1  # positions t whose target t+k+2 lies inside the window
        logits = head_logits[:, :usable, k].float()  # [B, usable, V]
        if distill:
            teacher = base_logits[:, k + 1 : k + 1 + usable].float().softmax(dim=-1)  # [B, usable, V]
            losses.append(-(teacher * logits.log_softmax(dim=-1)).sum(dim=-1).mean())
        else:
            target = tokens[:, k + 2 : k + 2 + usable]  # [B, usable]
            losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten()))
    return torch.stack(losses)


@torch.no_grad()
def head_accuracy(model: Any, heads: MedusaHeads, val: np.ndarray, batch_size: int) -> list[dict[str, float]]:
    """Each head's top-1 and top-5 accuracy on held-out windows [N, T+1] (the text's own tokens)."""
    hits = torch.zeros(heads.num_heads, 2)
    counts = torch.zeros(heads.num_heads)
    for start in range(0, len(val), batch_size):
        batch = torch.from_numpy(val[start : start + batch_size])
        hidden = model.base_model(input_ids=batch[:, :-1]).last_hidden_state  # [B, T, H]
        top5 = heads(hidden).topk(5, dim=-1).indices  # [B, T, K, 5]
        for k in range(heads.num_heads):
            usable = batch.shape[1] - 1 - k - 1
            target = batch[:, k + 2 : k + 2 + usable].unsqueeze(-1)  # [B, usable, 1]
            found = top5[:, :usable, k] == target  # [B, usable, 5]
            hits[k, 0] += found[..., 0].sum()
            hits[k, 1] += found.any(dim=-1).sum()
            counts[k] += target.numel()
    return [{"top1": float(hits[k, 0] / counts[k]), "top5": float(hits[k, 1] / counts[k])} for k in range(len(counts))]


def load_streams(tokenizer: Any, data: list[str], max_files: int) -> tuple[np.ndarray, np.ndarray]:
    """Token streams for training and evaluation: `--data` files (every 10th held out) or the stdlib."""
    if data:
        texts = [Path(path).read_text(encoding="utf-8", errors="replace") for path in sorted(data)]
        train = [t for i, t in enumerate(texts) if i % 10 != 9 or len(texts) == 1]
        val = [t for i, t in enumerate(texts) if i % 10 == 9] or [texts[-1][-20000:]]
    else:
        corpus = load_corpus()
        stride = max(1, len(corpus.train) // max_files)
        train = [text for _, text in corpus.train[::stride]]
        val = [text for _, text in corpus.val]
    return encode_stream(tokenizer, train), encode_stream(tokenizer, val)


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_stream, val_stream = load_streams(tokenizer, args.data or [], args.max_files)
    train_windows = windows(train_stream, args.seq_len)
    val_windows = windows(val_stream, args.seq_len)[: args.eval_windows]
    lm_head = model.get_output_embeddings().weight
    config = MedusaConfig(args.heads, args.layers, int(lm_head.shape[1]), int(lm_head.shape[0]))
    if args.init:  # continue from saved heads
        heads = MedusaHeads.load(args.init).train()
        if heads.config != config:
            raise SystemExit(f"--init: heads {heads.config} do not fit {config}")
    else:
        heads = MedusaHeads(config)
        heads.init_from_lm_head(lm_head)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train-medusa", unit="step")
    history: list[list[float]] = []
    for step in bar:
        scale = min(1.0, (step + 1) / max(1, args.steps // 20))  # linear warm-up, then cosine decay
        scale *= 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale
        batch = torch.from_numpy(train_windows[np.sort(rng.choice(len(train_windows), args.batch_size, replace=False))])
        with torch.no_grad():
            out = model.base_model(input_ids=batch[:, :-1])
            hidden = out.last_hidden_state  # [B, T, H]
            base_logits = model.get_output_embeddings()(hidden) if args.loss == "distill" else hidden[..., :0]
        losses = head_losses(heads(hidden), base_logits, batch, args.loss == "distill")  # [K]
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
        history.append(losses.tolist())
        bar.set_postfix(loss=" ".join(f"{value:.2f}" for value in history[-1]))
    heads.eval()
    accuracy = head_accuracy(model, heads, val_windows, args.batch_size)
    heads.save(args.out)
    report = {
        "model": "specwire-demo-target" if Path(args.model) == demo_target_dir() else Path(args.model).name,
        "loss": args.loss,
        "heads": args.heads,
        "layers": args.layers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "init": Path(args.init).name if args.init else None,
        "train_seconds": round(time.perf_counter() - started, 1),
        # Per head, mean training loss over the first and the last tenth of the steps.
        "loss_first": np.mean(history[: max(1, len(history) // 10)], axis=0).tolist(),
        "loss_last": np.mean(history[-max(1, len(history) // 10) :], axis=0).tolist(),
        "held_out_accuracy": accuracy,
    }
    (Path(args.out) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("train-medusa", help="train Medusa heads on a frozen base model")
    parser.add_argument("--model", default=str(demo_target_dir()), help="base model directory (default: demo target)")
    parser.add_argument("--out", required=True, help="directory for the heads (safetensors + medusa_config.json)")
    parser.add_argument("--data", nargs="*", help="text files (default: the stdlib source, as the demo pair)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    parser.add_argument("--loss", choices=["distill", "ce"], default="distill")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-files", type=int, default=400, help="stdlib training files used, evenly spread")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--init", help="continue training these heads (a --out of an earlier run)")


def main(args: argparse.Namespace) -> int:
    report = train(args)
    for k, accuracy in enumerate(report["held_out_accuracy"]):
        print(f"head {k} (token t+{k + 2}): top-1 {accuracy['top1']:.1%}, top-5 {accuracy['top5']:.1%}")
    print(f"saved to {args.out}")
    return 0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specwire")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train-medusa", *argv])
