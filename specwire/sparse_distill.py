"""Learning a trimmed-vocabulary distribution from a sparse teacher (`specwire.teacher_cache`).

The teacher's cached top-k log-probabilities give p on a set S; the student (a draft, or Medusa
heads) has q over its K ids. Both are compared coarsened to S ∩ student ids plus one bucket R for
everything else:

    KL_S(p ‖ q) = Σ_{x ∈ S} p(x) log(p(x)/q(x)) + p(R) log(p(R)/q(R)),

a lower bound on KL(p ‖ q) (the log-sum inequality), exact when p and q are proportional inside R.
α = Σ_x min(p(x), q(x))
(Leviathan et al. 2023, Def. 3.1) is bracketed by Σ_{x ∈ S} min(p, q) ≤ α ≤ that + min(p(R), q(R)).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specwire.engine.trimmed_vocab import TrimmedVocab, most_frequent
from specwire.processing import ProcessingConfig
from specwire.tokenizer import eos_token_ids


def draft_vocabulary(stream: np.ndarray, k: int, target: Any, tokenizer: Any) -> TrimmedVocab:
    """The K most frequent target ids of `stream`, with the ids a draft must always be able to
    read or propose (BOS, every end id, unknown); out-of-K ids read as unknown (or the rarest)."""
    vocab_size = int(target.vocab_size)
    ends = eos_token_ids(getattr(target, "eos_token_id", None), tokenizer.eos_token_id)
    special = [i for i in (tokenizer.bos_token_id, *ends, tokenizer.unk_token_id) if i is not None and i < vocab_size]
    ids = most_frequent(stream, min(k, vocab_size), vocab_size, special)
    fallback = ids.index(tokenizer.unk_token_id) if tokenizer.unk_token_id in ids else len(ids) - 1
    return TrimmedVocab(vocab_size, tuple(ids), fallback)


def sparse_targets(topk_ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k target ids [..., k] as student ids (`table`: `TrimmedVocab.draft_ids`
    with missing = −1), and which of them the student has ([..., k] bool); the others become 0, masked."""
    mapped = table[topk_ids.long()]  # [..., k]
    return mapped.clamp_min(0), mapped >= 0


def _coarse(teacher_logp: torch.Tensor, student_idx: torch.Tensor, inside: torch.Tensor, student_logp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """p and q on S (0 off S) [..., k] and their remainders p(R), q(R) [...]."""
    p = teacher_logp.float().exp() * inside  # [..., k]
    logq = student_logp.gather(-1, student_idx)  # [..., k]
    q = logq.exp() * inside
    return p, logq, q, (1 - p.sum(-1)).clamp_min(0), (1 - q.sum(-1)).clamp_min(0)


def coarse_kl(teacher_logp: torch.Tensor, student_idx: torch.Tensor, inside: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL_S(p ‖ q) per position. teacher_logp, student_idx, inside: [..., k] (`sparse_targets`);
    student_logits: [..., K] → [...]."""
    student_logp = student_logits.float().log_softmax(dim=-1)  # [..., K]
    p, logq, _, p_rest, q_rest = _coarse(teacher_logp, student_idx, inside, student_logp)
    inner = torch.where(inside, p * (teacher_logp.float() - logq), 0.0).sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    rest = p_rest * (p_rest.clamp_min(tiny).log() - q_rest.clamp_min(tiny).log())
    return inner + rest


def alpha_bounds(teacher_logp: torch.Tensor, student_idx: torch.Tensor, inside: torch.Tensor, student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper) bounds on α = Σ_x min(p(x), q(x)) per position [...]."""
    p, _, q, p_rest, q_rest = _coarse(teacher_logp, student_idx, inside, student_logits.float().log_softmax(dim=-1))
    lower = torch.minimum(p, q).sum(-1)
    return lower, lower + torch.minimum(p_rest, q_rest)


def _warp(scores: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(scores / T) over the given candidates (sorted, best first), cut to the smallest
    prefix whose mass reaches top-p (the best always kept) and renormalised. [..., n] → [..., n]."""
    probs = (scores.float() / temperature).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the better candidates
    kept = torch.where(before < top_p, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def warped_alpha(teacher_logp: torch.Tensor, teacher_idx: torch.Tensor, inside: torch.Tensor,
                 student_logits: torch.Tensor, warpers: ProcessingConfig) -> torch.Tensor:
    """α = Σ_x min(p_w(x), q_w(x)) per position [...], p and q warped as a sampled request warps them
    (temperature, then top-k, then top-p; `warpers`' other fields unread): what a sampled round
    accepts. Exact for top-k ≤ the cache's k, since p_w then lives on the cached ids.
    teacher_logp, teacher_idx, inside: [..., k], best first (`sparse_targets`); student_logits
    [..., K]. Differentiable in q's values."""
    k = min(warpers.top_k or teacher_logp.shape[-1], teacher_logp.shape[-1])
    p = _warp(teacher_logp[..., :k], warpers.temperature, warpers.top_p) * inside[..., :k]  # ids the draft lacks: q = 0 there
    values, ids = student_logits.topk(min(k, student_logits.shape[-1]), dim=-1)  # [..., k], best first
    q = _warp(values, warpers.temperature, warpers.top_p)
    same = teacher_idx[..., :k, None] == ids[..., None, :]  # [..., k, k]
    pairs = torch.minimum(p[..., :, None], q[..., None, :])
    return torch.where(same & inside[..., :k, None], pairs, 0.0).sum((-2, -1))
