"""`specwire distill`: train a draft model to match a target's next-token distributions.

Speculative decoding accepts a drafted token with probability min(1, p/q), so the expected
acceptance per position is α = Σ_x min(p(x), q(x)) = 1 − TV(p, q) (Leviathan et al. 2023,
arXiv:2211.17192, §3.1 and Corollary 3.6). Knowledge distillation (Hinton et al. 2015) moves q
toward p: here the draft minimises KL(p ‖ q) = Σ p (log p − log q) against the target's
distributions on a text corpus, position by position, as DistillSpec (Zhou et al. 2023,
arXiv:2310.08461) does with a fixed dataset. α is measured on held-out text before and after.

The corpus is, by default, the Python standard library the demo pair was trained on
(`specwire.demo.train_pair`: same files, same held-out split); `--data FILES` uses any text
files instead (the last 5% of their tokens held out). Both models must share the tokenizer.
The run is deterministic for a given seed, thread count and step count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from specwire.draft_service import scratch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from specwire import teacher_cache
from specwire.demo import train_pair


def distillation_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p ‖ q) = Σ_x p(x) (log p(x) − log q(x)), p = softmax(target), q = softmax(draft).

    target_logits, draft_logits: [..., V] → scalar.
    """
    target_logp = target_logits.float().log_softmax(dim=-1)  # [..., V]
    draft_logp = draft_logits.float().log_softmax(dim=-1)  # [..., V]
    return (target_logp.exp() * (target_logp - draft_logp)).sum(dim=-1).mean()


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """α per position: Σ_x min(p(x), q(x)) (Leviathan et al. 2023, Def. 3.1). [..., V] → [...]."""
    return torch.minimum(target_logits.float().softmax(dim=-1), draft_logits.float().softmax(dim=-1)).sum(dim=-1)


def greedy_agreement(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Whether argmax q = argmax p per position: a greedy round's acceptance. [..., V] → [...] bool."""
    return target_logits.argmax(dim=-1) == draft_logits.argmax(dim=-1)


@torch.no_grad()
def measure(target: Any, draft: Any, held_out: np.ndarray, batch_size: int) -> dict[str, float]:
    """α, greedy agreement and KL(p ‖ q), averaged over every held-out position."""
    draft.eval()
    alpha_sum, agree_sum, kl_sum, count = 0.0, 0.0, 0.0, 0
    for start in range(0, len(held_out), batch_size):
        batch = torch.from_numpy(held_out[start : start + batch_size, :-1])  # [B, T]
        target_logits = target(input_ids=batch).logits  # [B, T, V]
        draft_logits = draft(input_ids=batch).logits  # [B, T, V]
        positions = batch.numel()
        alpha_sum += float(acceptance(target_logits, draft_logits).sum())
        agree_sum += float(greedy_agreement(target_logits, draft_logits).sum())
        kl_sum += float(distillation_loss(target_logits, draft_logits)) * positions
        count += positions
    draft.train()
    return {"alpha": alpha_sum / count, "greedy_agreement": agree_sum / count, "kl": kl_sum / count}


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def distill(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    tokenizer = cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(args.target))
    if tokenizer.get_vocab() != AutoTokenizer.from_pretrained(args.draft).get_vocab():
        raise SystemExit("--draft: its tokenizer differs from the target's; distillation needs shared token ids")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).train()
    train_stream, held_stream = teacher_cache.corpus_streams(tokenizer, [Path(p) for p in args.data])
    train_windows = train_pair.windows(train_stream, args.seq_len)
    held_out = train_pair.windows(held_stream, args.seq_len)
    if len(held_out) > args.eval_windows:  # a fixed, evenly spaced subset
        held_out = held_out[np.linspace(0, len(held_out) - 1, args.eval_windows).round().astype(np.int64)]
    if len(train_windows) < args.batch_size or len(held_out) == 0:
        raise SystemExit(f"--data: too little text for windows of {args.seq_len} tokens")
    print(f"{len(train_windows)} training windows, {len(held_out)} held out, {args.seq_len} tokens each", flush=True)

    before = measure(target, draft, held_out, args.batch_size)
    print(f"before: α {before['alpha']:.4f}, greedy agreement {before['greedy_agreement']:.4f}, KL {before['kl']:.4f}")
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = train_pair.batches(train_windows, args.batch_size, args.seed)
    started = time.perf_counter()
    loss_ema: float | None = None
    with tqdm(total=args.steps, desc="distill", unit="step", dynamic_ncols=True) as bar:
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
            batch = next(data)[:, :-1]  # [B, T]
            with torch.no_grad():
                target_logits = target(input_ids=batch).logits  # [B, T, V]
            loss = distillation_loss(target_logits, draft(input_ids=batch).logits)
            loss_ema = scratch.optimizer_step(optimizer, loss, draft, loss_ema)
            bar.update(1)
            bar.set_postfix(kl=f"{loss_ema:.4f}")
    train_s = time.perf_counter() - started
    after = measure(target, draft, held_out, args.batch_size)
    print(f"after:  α {after['alpha']:.4f}, greedy agreement {after['greedy_agreement']:.4f}, KL {after['kl']:.4f}")

    out = Path(args.out)
    train_pair.save_model(draft, tokenizer, out)
    report = {
        "target": str(args.target),
        "draft": str(args.draft),
        "data": [str(p) for p in args.data] or ["stdlib (specwire.demo.train_pair split)"],
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "train_seconds": round(train_s, 1),
        "held_out_windows": int(len(held_out)),
        "before": {k: round(v, 4) for k, v in before.items()},
        "after": {k: round(v, 4) for k, v in after.items()},
    }
    (out / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (report: distill_report.json)")
    return report


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("distill")
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--draft", help="draft model to start from (shares the target's tokenizer)")
    parser.add_argument("--out", required=True, help="where the distilled draft is written")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up steps")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows α is measured on (--draft)")
    scratch_flags = parser.add_argument_group("a new draft over a trimmed vocabulary, from a teacher cache")
    scratch_flags.add_argument("--from-scratch", action="store_true", help="build a new draft instead of --draft")
    scratch_flags.add_argument("--init", help="a draft of --from-scratch to train further (its vocabulary, and its shape unless --grow-layers)")
    scratch_flags.add_argument("--grow-layers", type=int, default=0,
                               help="with --init: that draft deepened to this many layers (a multiple), computing what it did")
    scratch_flags.add_argument("--layers", type=int, default=4)
    scratch_flags.add_argument("--hidden", type=int, default=384, help="width (heads of 64)")
    scratch_flags.add_argument("--vocab-top", type=int, default=16384, help="K: the target's most frequent ids kept")
    scratch_flags.add_argument("--embedding-init", choices=["target", "random"], default="target",
                               help="the draft's embedding: the target's rows, projected (default), or random")
    scratch_flags.add_argument("--text-windows", type=int, default=0,
                               help="uncached training windows learnt from the text's own next tokens")
    scratch_flags.add_argument("--text-weight", type=float, default=1.0, help="weight of their cross-entropy")
    scratch_flags.add_argument("--text-batch", type=int, default=8, help="text windows per step (with --batch-size cached)")
    scratch_flags.add_argument("--accept-weight", type=float, default=0.0,
                               help="weight of 1 − α under --accept-warpers beside the KL (DistillSpec's TVD)")
    scratch_flags.add_argument("--accept-warpers", default="0.666,27,0.9",
                               help="T,K,P: the sampled requests α is measured (and, with --accept-weight, trained) for; "
                                    "default the bench's sampling row")
    scratch_flags.add_argument(
        "--bf16", action="store_true",
        help="bfloat16 autocast where bfloat16 products run faster than float32 ones here (timed); float32 elsewhere",
    )
    scratch_flags.add_argument("--teacher-cache", help="the teacher cache directory (default: OUT.teacher; built if missing)")
    teacher_cache.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "batch_size", "seq_len", "eval_windows", "threads", "layers", "hidden", "vocab_top", "text_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.from_scratch == (args.draft is not None):
        raise SystemExit("give exactly one of --draft (distil an existing draft) and --from-scratch")
    if args.grow_layers and not args.init:
        raise SystemExit("--grow-layers deepens the draft of --init: give --init too")
    if args.init and not args.from_scratch:
        raise SystemExit("--init trains a draft of --from-scratch further: give --from-scratch too")
    if args.from_scratch:
        report = scratch.train(args)
        for label in ("before", "after"):
            figures = report[label]
            print(f"{label}: α {figures['alpha']:.4f} (≤ {figures['alpha_upper']:.4f}), "
                  f"greedy agreement {figures['greedy_agreement']:.4f}, KL {figures['kl']:.4f}")
        print(f"wrote {args.out} (report: {scratch.REPORT})")
        return 0
    distill(args)
    return 0
