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

from dataclasses import dataclass

import torch

LOG2_E = 1.4426950408889634  # log₂(x) = ln(x) · log₂(e)


@dataclass
class AttentionStats:
    """Per-query attention statistics, each [rows] float32."""

    entropy: torch.Tensor
    varentropy: torch.Tensor
    agreement: torch.Tensor
    interaction_strength: torch.Tensor


def token_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and varentropy (bits) of softmax(logits). logits: [..., vocab] → two [...] float32.

    H = −Σ p log₂ p; V = Σ p (log₂ p + H)². −inf logits (masked ids) contribute 0.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1) * LOG2_E  # [..., vocab], log₂ p
    p = log_p.exp2()
    plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p))
    entropy = -plogp.sum(dim=-1)  # [...]
    deviation = torch.where(p > 0, log_p + entropy.unsqueeze(-1), torch.zeros_like(p))
    varentropy = (p * deviation.square()).sum(dim=-1)
    return entropy, varentropy


def attention_scores(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """s = q kᵀ · scaling, with grouped key heads repeated to the query heads.

    query: [batch, heads, q_len, d]; key: [batch, kv_heads, k_len, d] → [batch, heads, q_len, k_len] float32.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(groups, dim=1)  # [batch, heads, k_len, d]
    return torch.matmul(query.float(), key.transpose(-1, -2)) * scaling


def attention_stats(scores: torch.Tensor, valid: torch.Tensor) -> AttentionStats:
    """The module docstring's four statistics per query, over the keys `valid` allows.

    scores: [rows, heads, keys] pre-softmax; valid: [rows, keys] bool (at least one True per row).
    """
    valid3 = valid.unsqueeze(1)  # [rows, 1, keys]
    masked = scores.masked_fill(~valid3, float("-inf"))
    log_p = torch.log_softmax(masked, dim=-1) * LOG2_E  # [rows, heads, keys]
    p = log_p.exp2()
    head_entropy = -torch.where(valid3, p * log_p, torch.zeros_like(p)).sum(dim=-1)  # [rows, heads]
    keys = valid.sum(dim=-1).float()  # [rows]
    heads = scores.shape[1]
    mean_p = p.mean(dim=1, keepdim=True)  # [rows, 1, keys]
    agreement = (p - mean_p).abs().sum(dim=(1, 2)) / (heads * keys)
    strength = torch.where(valid3, scores.abs(), torch.zeros_like(scores)).sum(dim=(1, 2)) / (heads * keys)
    return AttentionStats(
        entropy=head_entropy.mean(dim=-1),
        varentropy=head_entropy.var(dim=-1, correction=0),
        agreement=agreement,
        interaction_strength=strength,
    )


@dataclass
class PositionMetrics:
    """What a service returns per scored row (branches × positions), each [rows] float32; the
    attention fields are None when they were not asked for."""

    entropy: torch.Tensor
    varentropy: torch.Tensor
    attention: AttentionStats | None = None
