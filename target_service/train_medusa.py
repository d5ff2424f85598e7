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

from specwire import teacher_cache
from specwire.demo import demo_target_dir
from specwire.demo.train_pair import encode_stream, load_corpus, windows
from specwire.engine.trimmed_vocab import TrimmedVocab
from specwire.medusa import MedusaConfig, MedusaHeads
from specwire.sparse_distill import coarse_kl, draft_vocabulary, sparse_targets


def set_learning_rate(optimizer: torch.optim.Optimizer, step: int, args: argparse.Namespace) -> None:
    """Linear warm-up over the first 5% of the steps, then cosine decay from --lr."""
    scale = min(1.0, (step + 1) / max(1, args.steps // 20))
    scale *= 0.5 * (1 + math.cos(math.pi * step / args.steps))
    for group in optimizer.param_groups:
        group["lr"] = args.lr * scale


def take_step(optimizer: torch.optim.Optimizer, losses: torch.Tensor, history: list[list[float]], bar: Any) -> None:
    """One step on the heads' summed losses [K]; each head's loss goes to `history` and the bar."""
    optimizer.zero_grad(set_to_none=True)
    losses.sum().backward()
    optimizer.step()
    history.append(losses.tolist())
    bar.set_postfix(loss=" ".join(f"{value:.2f}" for value in history[-1]))

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


def hits_at(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, how many of its top-1 and top-5 ids equal the text's token ([N, 2]) and over how
    many positions ([N]). hidden: [B, T, H] at tokens[:, :T]; tokens: [B, T+1]."""
    top5 = heads.vocab_ids[heads.scores(hidden).topk(5, dim=-1).indices]  # [B, T, N, 5]: vocabulary ids
    hits = torch.zeros(heads.num_heads, 2)
    counts = torch.zeros(heads.num_heads)
    for k in range(heads.num_heads):
        usable = tokens.shape[1] - 1 - k - 1
        target = tokens[:, k + 2 : k + 2 + usable].unsqueeze(-1)  # [B, usable, 1]
        found = top5[:, :usable, k] == target  # [B, usable, 5]
        hits[k, 0] += found[..., 0].sum()
        hits[k, 1] += found.any(dim=-1).sum()
        counts[k] += target.numel()
    return hits, counts


def accuracy_report(hits: torch.Tensor, counts: torch.Tensor) -> list[dict[str, float]]:
    return [{"top1": float(hits[k, 0] / counts[k]), "top5": float(hits[k, 1] / counts[k])} for k in range(len(counts))]


@torch.no_grad()
def head_accuracy(model: Any, heads: MedusaHeads, val: np.ndarray, batch_size: int) -> list[dict[str, float]]:
    """Each head's top-1 and top-5 accuracy on held-out windows [N, T+1] (the text's own tokens)."""
    hits = torch.zeros(heads.num_heads, 2)
    counts = torch.zeros(heads.num_heads)
    for start in range(0, len(val), batch_size):
        batch = torch.from_numpy(val[start : start + batch_size])
        hidden = model.base_model(input_ids=batch[:, :-1]).last_hidden_state  # [B, T, H]
        batch_hits, batch_counts = hits_at(heads, hidden, batch)
        hits, counts = hits + batch_hits, counts + batch_counts
    return accuracy_report(hits, counts)


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


def new_heads(args: argparse.Namespace, lm_head: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> MedusaHeads:
    """Fresh heads whose vocabulary maps start as the base's (rows `vocab_ids` when trimmed), or
    `--init`'s saved heads when their shape fits. Those keep their own ids: another corpus ranks
    ids otherwise, and re-ranking would scramble the rows they learned."""
    head_vocab = 0 if vocab_ids is None else len(vocab_ids)
    config = MedusaConfig(args.heads, args.layers, int(lm_head.shape[1]), int(lm_head.shape[0]), head_vocab)
    if args.init:  # continue from saved heads
        heads = MedusaHeads.load(args.init).train()
        if heads.config != config:
            raise SystemExit(f"--init: heads {heads.config} do not fit {config}")
        return heads
    heads = MedusaHeads(config, vocab_ids)
    heads.init_from_lm_head(lm_head)
    return heads


def cached_target(
    args: argparse.Namespace, vocab_top: int
) -> tuple[teacher_cache.TeacherCache, teacher_cache.CorpusWindows, Any, TrimmedVocab | None]:
    """The teacher cache (built, with hidden states, if missing), its corpus, the float32 target,
    and the `vocab_top` ids most frequent in the training text (None for 0); seeds and threads set."""
    cache, corpus = teacher_cache.build_from_args(args, Path(args.model), Path(args.teacher_cache), hidden=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = model.config.get_text_config()
    config.eos_token_id = model.generation_config.eos_token_id or config.eos_token_id
    vocab = draft_vocabulary(corpus.train_stream, vocab_top, config, tokenizer) if vocab_top else None
    return cache, corpus, model, vocab


def train_from_cache(args: argparse.Namespace) -> dict[str, Any]:
    """Self-distillation from a teacher cache (`specwire.teacher_cache`, with hidden states): no base
    forward per step. Head k at position t learns the base's cached top-k distribution at t+k+1
    through the coarsened KL of `specwire.sparse_distill`, over the `--vocab-top` ids."""
    cache, corpus, model, vocab = cached_target(args, args.vocab_top)
    lm_head = model.get_output_embeddings().weight.detach()
    heads = new_heads(args, lm_head, None if vocab is None else torch.tensor(vocab.ids))
    del model, lm_head
    table = heads.vocab_ids.new_full((heads.config.vocab_size,), -1)
    table[heads.vocab_ids] = torch.arange(len(heads.vocab_ids))
    cached, held_out = cache.load("train", args.windows), cache.load("held_out", args.held_out_windows)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    history: list[list[float]] = []
    bar = tqdm(range(args.steps), desc="train-medusa", unit="step")
    for step in bar:
        set_learning_rate(optimizer, step, args)
        chosen = torch.from_numpy(np.sort(rng.choice(len(cached["tokens"]), args.batch_size, replace=False)))
        scores = heads.scores(cached["hidden"][chosen].float())  # [B, T, N, head_vocab]
        idx, inside = sparse_targets(cached["topk_ids"][chosen], table)  # [B, T, k]
        teacher = cached["topk_logp"][chosen]
        steps_in = scores.shape[1]
        losses = torch.stack([
            coarse_kl(teacher[:, k + 1 :], idx[:, k + 1 :], inside[:, k + 1 :], scores[:, : steps_in - k - 1, k]).mean()
            for k in range(heads.num_heads)
        ])  # [N]: head k at t against the base at t+k+1
        take_step(optimizer, losses, history, bar)
    heads.eval()
    with torch.no_grad():
        hits, counts = torch.zeros(heads.num_heads, 2), torch.zeros(heads.num_heads)
        for start in range(0, len(held_out["tokens"]), args.batch_size):
            batch_hits, batch_counts = hits_at(heads, held_out["hidden"][start : start + args.batch_size].float(),
                                               held_out["tokens"][start : start + args.batch_size].long())
            hits, counts = hits + batch_hits, counts + batch_counts
    return save_with_report(args, heads, history, accuracy_report(hits, counts), time.perf_counter() - started,
                            teacher_cache={"windows": len(cached["tokens"]), "held_out_windows": len(held_out["tokens"])},
                            head_vocab=heads.config.head_vocab)


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_stream, val_stream = load_streams(tokenizer, args.data or [], args.max_files)
    train_windows = windows(train_stream, args.seq_len)
    val_windows = windows(val_stream, args.seq_len)[: args.eval_windows]
    heads = new_heads(args, model.get_output_embeddings().weight)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train-medusa", unit="step")
    history: list[list[float]] = []
    for step in bar:
        set_learning_rate(optimizer, step, args)
        batch = torch.from_numpy(train_windows[np.sort(rng.choice(len(train_windows), args.batch_size, replace=False))])
        with torch.no_grad():
            out = model.base_model(input_ids=batch[:, :-1])
            hidden = out.last_hidden_state  # [B, T, H]
            base_logits = model.get_output_embeddings()(hidden) if args.loss == "distill" else hidden[..., :0]
        losses = head_losses(heads(hidden), base_logits, batch, args.loss == "distill")  # [K]
        take_step(optimizer, losses, history, bar)
    heads.eval()
    accuracy = head_accuracy(model, heads, val_windows, args.batch_size)
    return save_with_report(args, heads, history, accuracy, time.perf_counter() - started)


def save_with_report(
    args: argparse.Namespace, heads: MedusaHeads, history: list[list[float]], accuracy: list[dict[str, float]],
    seconds: float, **extra: Any
) -> dict[str, Any]:
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
        "train_seconds": round(seconds, 1),
        # Per head, mean training loss over the first and the last tenth of the steps.
        "loss_first": np.mean(history[: max(1, len(history) // 10)], axis=0).tolist(),
        "loss_last": np.mean(history[-max(1, len(history) // 10) :], axis=0).tolist(),
        "held_out_accuracy": accuracy,
        **extra,
    }
    (Path(args.out) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("train-medusa")
    parser.add_argument("--model", default=str(demo_target_dir()), help="base model directory (default: demo target)")
    parser.add_argument("--out", required=True, help="directory for the heads (safetensors + medusa_config.json)")
    parser.add_argument("--data", nargs="*", help="text files (default: the stdlib source, as the demo pair)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kind", choices=["medusa", "feature"], default="medusa",
                        help="medusa: Medusa-1 heads; feature: one decoder layer drafting a chain from the target's "
                             "features (EAGLE; needs --teacher-cache)")
    parser.add_argument("--heads", type=int, default=3, help="heads, or a feature drafter's deepest draft")
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
    cached = parser.add_argument_group("from a teacher cache (specwire teacher-cache; built, with hidden states, if missing)")
    cached.add_argument("--teacher-cache", help="learn from this cache instead of running the model per step")
    cached.add_argument("--vocab-top", type=int, default=0, help="heads score only the K most frequent ids (0: all)")
    teacher_cache.add_arguments(cached, common=False)


def main(args: argparse.Namespace) -> int:
    if args.kind == "feature":
        if not args.teacher_cache:
            raise SystemExit("--kind feature learns from a teacher cache: give --teacher-cache DIR")
        from specwire.target_service.train_feature_drafter import train_feature_drafter

        report = train_feature_drafter(args)
        depths = ", ".join(f"{value:.1%}" for value in report["held_out_depth_agreement"])
        print(f"held-out greedy agreement by depth: {depths}\nsaved to {args.out}")
        return 0
    report = train_from_cache(args) if args.teacher_cache else train(args)
    for k, accuracy in enumerate(report["held_out_accuracy"]):
        print(f"head {k} (token t+{k + 2}): top-1 {accuracy['top1']:.1%}, top-5 {accuracy['top5']:.1%}")
    print(f"saved to {args.out}")
    return 0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specwire")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train-medusa", *argv])
