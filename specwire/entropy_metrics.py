"""Uncertainty metrics of a causal LM at one position: the inputs of entropy-adaptive sampling.

Two families, as in xjdr-alt/entropix (`entropix/torch_sampler.py`, commit 97a51d3,
2024-10-17, `calculate_varentropy_logsoftmax` and `calculate_metrics`), all pure functions over
tensors, in bits where a logarithm appears:

- of the next-token distribution p = softmax(logits):
  entropy H = −Σ_x p(x) log₂ p(x), varentropy V = Σ_x p(x) (log₂ p(x) + H)²;
- of the last layer's pre-softmax attention scores s_h(j) = q_h · k_j / √d over the keys j a
  query may attend to (its real, unpadded, causal context), with p_h = softmax_j s_h:
  attention entropy = mean_h H(p_h); attention varentropy = Var_h H(p_h) (population variance);
  head agreement = mean_{h,j} |p_h(j) − mean_h' p_h'(j)|; interaction strength = mean_{h,j} |s_h(j)|.

How this differs from the reference: the reference takes the scores against its whole
preallocated KV cache (`max_seq_len` slots, unfilled ones scoring q · 0 = 0), so its attention
softmax spreads mass over empty slots, its entropies sit near log₂(max_seq_len) and its means
divide by the cache length. Here every statistic runs over the keys the query really attends to,
so values do not depend on how much cache a server preallocated. The reference's torch port takes
`torch.var` (unbiased); its JAX original `jnp.var` (population), which is what this uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

LOG2_E = 1.4426950408889634  # log₂(x) = ln(x) · log₂(e)
MAX_SURPRISAL = 1e4  # −log₂ p above this is p = 0 in float32 (and keeps 0 · log 0 at 0, not NaN)


@dataclass
class AttentionStats:
    """Per-query attention statistics, each [rows] float32."""

    entropy: torch.Tensor
    varentropy: torch.Tensor
    agreement: torch.Tensor
    interaction_strength: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionStats:
        """The statistics with `fn` applied to each."""
        return AttentionStats(fn(self.entropy), fn(self.varentropy), fn(self.agreement), fn(self.interaction_strength))

    @staticmethod
    def cat(parts: list[AttentionStats], dim: int) -> AttentionStats:
        """Each statistic of `parts` concatenated along `dim`."""
        columns = [[getattr(part, column.name) for part in parts] for column in fields(AttentionStats)]
        return AttentionStats(*(torch.cat(column, dim=dim) for column in columns))


def token_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and varentropy (bits) of softmax(logits). logits: [..., vocab] → two [...] float32.

    With the surprisal s = −log₂ p: H = Σ p s, V = Σ p (s − H)², two passes (the one-pass
    Σ p s² − H² loses digits to cancellation once H² ≫ V). −inf logits (masked ids) contribute 0:
    s is clamped at 10⁴, where p is 0. Few ops, in place where they can be: on a small model a
    decode step pays each op's fixed cost far more than its arithmetic.
    """
    surprisal = torch.log_softmax(logits, dim=-1, dtype=torch.float32).mul_(-LOG2_E).clamp_(max=MAX_SURPRISAL)
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [..., vocab]
    entropy = torch.linalg.vecdot(p, surprisal)  # [...]
    varentropy = torch.linalg.vecdot(p, surprisal.sub_(entropy.unsqueeze(-1)).square_())
    return entropy, varentropy


def attention_scores(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """s = q kᵀ · scaling; query head h reads key head h // (heads / kv_heads) (grouped attention).

    query: [batch, heads, q_len, d]; key: [batch, kv_heads, k_len, d] → [batch, heads, q_len, k_len] float32.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    if query.dtype != torch.float32 or key.dtype != torch.float32:
        query, key = query.float(), key.float()
    grouped = query.reshape(batch * kv_heads, (heads // kv_heads) * q_len, dim)  # heads of a group stacked
    scores = torch.bmm(grouped, key.reshape(batch * kv_heads, k_len, dim).mT).mul_(scaling)  # [batch·kv_heads, g·q_len, k_len]
    return scores.view(batch, heads, q_len, k_len)


def attention_stats(scores: torch.Tensor, valid: torch.Tensor | None) -> AttentionStats:
    """The module docstring's four statistics per query, over the keys `valid` allows.

    scores: [rows, heads, keys] pre-softmax (any value, −inf included, where `valid` is False);
    valid: [rows, keys] bool (at least one True per row), or None when every key is attended to
    (the last new token of a causal step). Few ops, in place where they can be: on a small model
    a decode step pays each op's fixed cost far more than its arithmetic.
    """
    heads = scores.shape[1]
    if valid is None:  # means over heads × keys
        strength = scores.abs().mean(dim=(1, 2))  # [rows]
    else:  # sums over the valid keys, divided by heads × their count
        invalid = ~valid.unsqueeze(1)  # [rows, 1, keys]
        count = valid.sum(dim=-1).mul_(heads)  # [rows]
        scores = scores.masked_fill(invalid, 0.0)  # a copy: −inf-safe |s| first, then −inf for the softmax
        strength = torch.linalg.vector_norm(scores, 1, dim=(1, 2)).div_(count)  # Σ |s| / count
        scores.masked_fill_(invalid, float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [rows, heads, keys]; masked keys: 0 in every head, adding nothing below
    head_entropy = torch.special.entr(p).sum(dim=-1).mul_(LOG2_E)  # [rows, heads], −Σ p ln p (0 ln 0 = 0), in bits
    spread = torch.sub(p, p.sum(dim=1, keepdim=True), alpha=1 / heads).abs_()  # |p_h − mean_h p_h|
    agreement = spread.mean(dim=(1, 2)) if valid is None else spread.sum(dim=(1, 2)).div_(count)
    varentropy, entropy = torch.var_mean(head_entropy, dim=-1, correction=0)
    return AttentionStats(entropy=entropy, varentropy=varentropy, agreement=agreement, interaction_strength=strength)


@dataclass
class PositionMetrics:
    """What a service returns per scored row (branches × positions), each [rows] float32 (the
    scheduler's jobs: [rows, keep]); the attention fields are None when they were not asked for."""

    entropy: torch.Tensor
    varentropy: torch.Tensor
    attention: AttentionStats | None = None

    def flattened(self) -> PositionMetrics:
        """The same metrics with each tensor flattened ([branches, positions] → [branches·positions])."""
        attention = self.attention.map(torch.flatten) if self.attention is not None else None
        return PositionMetrics(self.entropy.flatten(), self.varentropy.flatten(), attention)
