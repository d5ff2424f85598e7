"""`specwire distill --from-scratch`: a small draft over a trimmed vocabulary, distilled from a
teacher cache (`specwire.teacher_cache`).

The draft is a fresh Llama of `--layers` × `--hidden` whose vocabulary is the target's `--vocab-top`
ids most frequent in the training text (`specwire.engine.trimmed_vocab`); it reads and scores
target ids once loaded. It learns from the cached teacher: at each position the target's top-k
log-probabilities S, which the draft matches by minimising the KL divergence between p and q
coarsened to S ∩ draft ids plus one bucket for the rest,

    KL_S(p ‖ q) = Σ_{x ∈ S} p(x) log(p(x)/q(x)) + p(R) log(p(R)/q(R)),  R = everything else,

a lower bound on KL(p ‖ q) (the log-sum inequality) that is exact when p and q agree inside R.
Held-out figures come from the same cache: greedy agreement (argmax q = the teacher's top-1) is
exact; α = Σ_x min(p, q) is bracketed by Σ_{x ∈ S} min(p, q) ≤ α ≤ that + min(p(R), q(R)).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specwire import teacher_cache
from specwire.engine.model import eos_token_ids
from specwire.engine.trimmed_vocab import TrimmedVocab, most_frequent

HEAD_DIM = 64
REPORT = "distill_report.json"


@dataclass(frozen=True)
class DraftShape:
    layers: int
    hidden: int
    vocab_top: int  # K: the target ids the draft's head covers
    kv_heads: int = 2

    @property
    def heads(self) -> int:
        return max(1, self.hidden // HEAD_DIM)

    @property
    def intermediate(self) -> int:
        return 64 * round(self.hidden * 8 / 3 / 64)  # Llama's ratio, rounded to 64


def draft_vocabulary(stream: np.ndarray, k: int, target: Any, tokenizer: Any) -> TrimmedVocab:
    """The K most frequent target ids of `stream`, with the ids a draft must always be able to
    read or propose (BOS, every end id, unknown); out-of-K ids read as unknown (or the rarest)."""
    vocab_size = int(target.vocab_size)
    ends = eos_token_ids(getattr(target, "eos_token_id", None), tokenizer.eos_token_id)
    special = [i for i in (tokenizer.bos_token_id, *ends, tokenizer.unk_token_id) if i is not None and i < vocab_size]
    ids = most_frequent(stream, min(k, vocab_size), vocab_size, special)
    fallback = ids.index(tokenizer.unk_token_id) if tokenizer.unk_token_id in ids else len(ids) - 1
    return TrimmedVocab(vocab_size, tuple(ids), fallback)


def new_draft(shape: DraftShape, vocab: TrimmedVocab, target_config: Any, max_positions: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama over the K draft ids, tied embedding and head."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab.ids),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=min(shape.kv_heads, shape.heads),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=None,  # ids in the config are target ids; none may mark a draft embedding row
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
    )
    return LlamaForCausalLM(config)


def draft_targets(topk_ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k target ids [..., k] as draft ids (`vocab_table`), and which of them
    the draft has ([..., k] bool); the others become draft id 0, masked."""
    mapped = table[topk_ids.long()]  # [..., k]
    return mapped.clamp_min(0), mapped >= 0


def _coarse(teacher_logp: torch.Tensor, draft_idx: torch.Tensor, inside: torch.Tensor, draft_logp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """p and q on S (0 off S) [..., k] and their remainders p(R), q(R) [...]."""
    p = teacher_logp.float().exp() * inside  # [..., k]
    logq = draft_logp.gather(-1, draft_idx)  # [..., k]
    q = logq.exp() * inside
    return p, logq, q, (1 - p.sum(-1)).clamp_min(0), (1 - q.sum(-1)).clamp_min(0)


def coarse_kl(teacher_logp: torch.Tensor, draft_idx: torch.Tensor, inside: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL_S(p ‖ q) per position (module docstring). teacher_logp, draft_idx, inside: [..., k];
    draft_logits: [..., K] → [...]."""
    draft_logp = draft_logits.float().log_softmax(dim=-1)  # [..., K]
    p, logq, _, p_rest, q_rest = _coarse(teacher_logp, draft_idx, inside, draft_logp)
    inner = torch.where(inside, p * (teacher_logp.float() - logq), 0.0).sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    rest = p_rest * (p_rest.clamp_min(tiny).log() - q_rest.clamp_min(tiny).log())
    return inner + rest


def alpha_bounds(teacher_logp: torch.Tensor, draft_idx: torch.Tensor, inside: torch.Tensor, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) bounds on α = Σ_x min(p(x), q(x)) per position [...] (module docstring)."""
    p, _, q, p_rest, q_rest = _coarse(teacher_logp, draft_idx, inside, draft_logits.float().log_softmax(dim=-1))
    lower = torch.minimum(p, q).sum(-1)
    return lower, lower + torch.minimum(p_rest, q_rest)


def vocab_table(vocab: TrimmedVocab) -> torch.Tensor:
    """[V] long: each target id's draft id, −1 outside the K (training masks those)."""
    table = torch.full((vocab.target_vocab_size,), -1, dtype=torch.long)
    table[torch.tensor(vocab.ids, dtype=torch.long)] = torch.arange(len(vocab.ids))
    return table


def draft_inputs(tokens: torch.Tensor, table: torch.Tensor, fallback: int) -> torch.Tensor:
    """Target ids [..] → draft ids, out-of-K ids as `fallback` (as `TargetIdEmbedding` reads them)."""
    mapped = table[tokens.long()]
    return torch.where(mapped < 0, fallback, mapped)


@torch.no_grad()
def measure(model: Any, split: dict[str, torch.Tensor], vocab: TrimmedVocab, batch_size: int) -> dict[str, float]:
    """Held-out α (lower and upper bound), greedy agreement and KL_S, averaged over positions."""
    model.eval()
    table, target_ids = vocab_table(vocab), torch.tensor(vocab.ids)
    sums = np.zeros(4)
    count = 0
    for start in range(0, len(split["tokens"]), batch_size):
        tokens = split["tokens"][start : start + batch_size]
        logits = model(input_ids=draft_inputs(tokens[:, :-1], table, vocab.fallback)).logits.float()  # [B, T, K]
        idx, inside = draft_targets(split["topk_ids"][start : start + batch_size], table)
        teacher = split["topk_logp"][start : start + batch_size]
        lower, upper = alpha_bounds(teacher, idx, inside, logits)
        top1 = split["topk_ids"][start : start + batch_size, :, 0].long()  # [B, T]: the teacher's argmax
        agree = target_ids[logits.argmax(-1)] == top1
        sums += [float(lower.sum()), float(upper.sum()), float(agree.sum()), float(coarse_kl(teacher, idx, inside, logits).sum())]
        count += lower.numel()
    model.train()
    alpha, alpha_upper, agreement, kl = sums / count
    return {"alpha": alpha, "alpha_upper": alpha_upper, "greedy_agreement": agreement, "kl": kl}


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + float(np.cos(np.pi * progress))))


def train(args: argparse.Namespace) -> dict[str, Any]:
    target = Path(args.target)
    cache_dir = Path(args.teacher_cache) if args.teacher_cache else Path(f"{args.out}.teacher")
    cache = teacher_cache.build_from_args(args, target, cache_dir, hidden=False)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    tokenizer = cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(str(target)))
    target_config = AutoConfig.from_pretrained(str(target))
    generation = GenerationConfig.from_pretrained(str(target))
    target_config.eos_token_id = generation.eos_token_id or target_config.eos_token_id
    train_stream, _ = teacher_cache.corpus_streams(tokenizer, args.data)
    vocab = draft_vocabulary(train_stream, args.vocab_top, target_config, tokenizer)
    shape = DraftShape(args.layers, args.hidden, len(vocab.ids))
    max_positions = int(getattr(target_config, "max_position_embeddings", 4096))
    model = new_draft(shape, vocab, target_config, max_positions, args.seed).train()
    train_split, held_out = cache.load("train", args.windows), cache.load("held_out", args.held_out_windows)
    table = vocab_table(vocab)
    print(f"{len(train_split['tokens'])} cached training windows, {len(held_out['tokens'])} held out; "
          f"draft {shape.layers} × {shape.hidden}, vocabulary {len(vocab.ids)} of {vocab.target_vocab_size}", flush=True)
    before = measure(model, held_out, vocab, args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    order = np.concatenate([rng.permutation(len(train_split["tokens"])) for _ in range(-(-args.steps * args.batch_size // len(train_split["tokens"])) + 1)])
    started = time.perf_counter()
    loss_ema: float | None = None
    with tqdm(total=args.steps, desc="distill", unit="step", dynamic_ncols=True) as bar:
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
            chosen = torch.from_numpy(np.sort(order[step * args.batch_size : (step + 1) * args.batch_size]))
            tokens = train_split["tokens"][chosen]
            idx, inside = draft_targets(train_split["topk_ids"][chosen], table)
            logits = model(input_ids=draft_inputs(tokens[:, :-1], table, vocab.fallback)).logits  # [B, T, K]
            loss = coarse_kl(train_split["topk_logp"][chosen], idx, inside, logits).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            value = loss.item()
            loss_ema = value if loss_ema is None else 0.98 * loss_ema + 0.02 * value
            bar.update(1)
            bar.set_postfix(kl=f"{loss_ema:.3f}")
    train_s = time.perf_counter() - started
    after = measure(model, held_out, vocab, args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    vocab.save(out)
    report = {
        "target": target.name,
        "teacher_cache": {"windows": len(train_split["tokens"]), "held_out_windows": len(held_out["tokens"]),
                          "seq_len": cache.spec.seq_len, "top_k": cache.spec.top_k},
        "shape": asdict(shape) | {"heads": shape.heads, "intermediate": shape.intermediate},
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_coverage": float(np.isin(train_stream, np.asarray(vocab.ids)).mean()),
        "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "threads": args.threads,
        "train_seconds": round(train_s, 1),
        "before": {k: round(v, 4) for k, v in before.items()},
        "after": {k: round(v, 4) for k, v in after.items()},
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report
