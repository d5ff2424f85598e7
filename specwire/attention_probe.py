"""Last-layer attention statistics from the same forward pass, with any attention kernel.

Hugging Face attention modules (Llama, Qwen2, Mistral, GPT-2, …) compute their query and their
full key tensor — rotary applied, the cache already holding the new keys — and hand both to an
*attention function* chosen by `config._attn_implementation` (eager, sdpa, flash, …). The probe
gives the last attention module its own copy of the config naming `specwire_probe`, a function
that delegates to the model's own implementation and, only while a capture is armed, also
computes QKᵀ·scaling for the last `positions` queries against every cached key and reduces it to
`specwire.entropy_metrics.attention_stats` on the device. Fused kernels never return attention
weights; recomputing the few score rows asked for costs one small matmul per step.

The keys a query attends to come from the mask the model built (bool: True = attend; additive
float: finite and above half the dtype's minimum; 2-D padding masks combined with causality) or,
when the kernel got none (sdpa infers causality), from causal order alone.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specwire.entropy_metrics import AttentionStats, attention_scores, attention_stats

PROBE_IMPLEMENTATION = "specwire_probe"


def valid_keys(
    mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, positions: int, device: torch.device
) -> torch.Tensor | None:
    """[batch, positions, k_len] bool: which keys each of the last `positions` queries attends
    to; None when that is every key (the last query alone, no mask: a plain decode step)."""
    if mask is None and positions == 1:
        return None
    offset = k_len - q_len  # query i sits at absolute position offset + i
    query_pos = torch.arange(q_len - positions, q_len, device=device) + offset  # [positions]
    causal = torch.arange(k_len, device=device).unsqueeze(0) <= query_pos.unsqueeze(1)  # [positions, k_len]
    causal = causal.expand(batch, -1, -1)
    if mask is None:
        return causal
    if mask.dim() == 2:  # [batch, k_len] padding mask (flash kernels)
        return causal & mask.bool()[:, None, -k_len:]
    rows = mask[:, 0, -positions:, -k_len:]  # [batch or 1, positions, k_len]
    if rows.dtype != torch.bool:
        rows = torch.isfinite(rows) & (rows > torch.finfo(rows.dtype).min / 2)
    return rows.expand(batch, -1, -1)


class AttentionProbe:
    """Installed once per model on its last attention module; armed per forward by `capture`."""

    def __init__(self, model: Any) -> None:
        modules = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
        if not modules:
            raise ValueError(f"{type(model).__name__} has no attention module the probe recognises")
        self.module = max(modules, key=lambda m: int(m.layer_idx))
        config = self.module.config
        self.delegate = self._delegate_for(self.module, config._attn_implementation or "eager")
        self.module.config = copy.copy(config)
        self.module.config._attn_implementation = PROBE_IMPLEMENTATION
        self.module.specwire_probe = self
        self.positions = 0
        self.stats: AttentionStats | None = None

    @staticmethod
    def _delegate_for(module: Any, implementation: str) -> Callable[..., Any]:
        if implementation == "eager":
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if eager is None:
                raise ValueError(f"{type(module).__name__}: no eager attention function to delegate to")
            return eager  # type: ignore[no-any-return]
        return ALL_ATTENTION_FUNCTIONS[implementation]  # type: ignore[no-any-return]

    def measure(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        batch, _, q_len, head_dim = query.shape
        positions = min(self.positions, q_len)
        scale = scaling if scaling is not None else head_dim**-0.5
        scores = attention_scores(query[:, :, -positions:], key, scale)  # [batch, heads, positions, k_len]
        valid = valid_keys(mask, batch, q_len, key.shape[2], positions, scores.device)
        rows = scores.transpose(1, 2).flatten(0, 1)  # [batch·positions, heads, k_len]
        self.stats = attention_stats(rows, valid.flatten(0, 1) if valid is not None else None)


def _probe_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
    probe: AttentionProbe = module.specwire_probe
    if probe.positions:
        probe.measure(query, key, attention_mask, kwargs.get("scaling"))
    return probe.delegate(module, query, key, value, attention_mask, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(PROBE_IMPLEMENTATION, _probe_attention)


@contextmanager
def capture(model: Any, positions: int) -> Iterator[AttentionProbe | None]:
    """Arm the model's probe (installing it on first use) for one forward pass; yields None when
    `positions` is 0. After the forward, `probe.stats` holds [batch·positions] statistics."""
    if positions <= 0:
        yield None
        return
    probe: AttentionProbe | None = getattr(model, "specwire_probe", None)
    if probe is None:
        probe = AttentionProbe(model)
        model.specwire_probe = probe
    probe.positions, probe.stats = positions, None
    try:
        yield probe
    finally:
        probe.positions = 0
