"""The engine's batched forward over a transformers model, reading and writing the slot cache.

One call runs any mix of rows: each row brings its own new tokens, the cache slots they are
written to, their positions and which cache slots each new token attends to. That one shape
covers decoding (1 token), verification (γ+1), short prefills, and tree verification
(positions = depth, `key_mask` = ancestors; Medusa). The call returns the final, normed hidden
states of the new tokens (for Medusa heads), the logits of the positions asked for, and, when
asked, entropix's metrics: the token entropy of those logits and the statistics of the last
layer's attention scores of chosen rows and tokens, computed for those alone. Everything after
the last layer is part of the call so that compiled code fuses it with the rest.

`HFForward` runs any architecture whose attention goes through transformers' attention-function
registry (`AttentionInterface`; Llama, Qwen2/3, Mistral, Gemma-3, GPT-2, …): the model's own
modules embed, project, norm and rotate, and `slot_attention`, registered there, writes each
layer's keys and values into the slot cache and attends with that layer's window. The mask
builders of transformers pass the engine's 4D mask through untouched. `LlamaLike` and `GPT2Like`
are hand-written forwards of the same contract for Llama/Qwen2 and GPT-2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specwire.engine import kernels
from specwire.engine.cache import CacheShape, SlotCache
from specwire.entropy_metrics import PositionMetrics, attention_scores, attention_stats, token_entropy
from specwire.processing import NEG_INF, largest


@dataclass
class ForwardBatch:
    """B rows × T new tokens (padding included); L = cache slots looked at."""

    rows: torch.Tensor  # [B] long: the cache rows
    input_ids: torch.Tensor  # [B, T] long
    slots: torch.Tensor  # [B, T] long: where each new token's key/value is written
    positions: torch.Tensor  # [B, T] long: its position (rotary / learned embedding)
    key_mask: torch.Tensor  # [B, T, L] bool: cache slots each new token attends to (its own included)
    # Every token is written, padding too: padding slots lie past their row's length (or in the
    # scratch row), where nothing reads them before a real token overwrites them.
    # [P] long: the new tokens whose logits are wanted, as indices into the flattened [B·T];
    # None: no logits (hidden states only).
    logit_index: torch.Tensor | None = None
    contiguous_from: int | None = None  # rows are range(contiguous_from, +B): slice, don't gather
    dense: bool = False  # key_mask is all True (no mask needed)
    # Entropix metrics wanted: the token entropy of every logit row, and the last layer's
    # attention statistics for R batch rows × K of their new tokens (offsets in T), or, with
    # `metrics` and no selection, for every row and token of the batch.
    metrics: bool = False
    score_rows: torch.Tensor | None = None  # [R] long, indices into the batch
    score_tokens: torch.Tensor | None = None  # [R, K] long
    # [B, 2] long: each row's real new tokens and the slots they see; given, attention runs per
    # row on exactly those (`row_attention`), so a row's output never depends on its batch.
    extents: torch.Tensor | None = None
    # Logits over a trimmed draft's own K ids (`TargetVocabHead.head`), not scattered into the
    # target's vocabulary: a greedy step's argmax over 16,384 ids instead of 262,144 (Gemma-3).
    narrow: bool = False
    # Ragged rows, packed: the real new tokens as [N] indices into the flattened [B·T], and each
    # one's cache row and slot. The layers then run on N positions rather than B·T, and only
    # attention sees the rows padded. On a CPU a forward's cost follows its positions: Gemma-3-270M
    # (mixed), eight rows, one of 8 new tokens and seven of 1, took 62.8 ms padded to 64
    # positions and 38.0 packed (eager; 26.8 for eight rows of one; docs/engine.md).
    packed: torch.Tensor | None = None
    packed_rows: torch.Tensor | None = None
    packed_slots: torch.Tensor | None = None
    # Fused decode steps (`decode_steps`) of sampled rounds: how each row draws its next token.
    sampling: FusedSampling | None = None


# Fused sampled steps draw among each row's FUSED_TOP_K largest logits, so a sampled round fuses
# only where its top-k is at most this (the orchestrator's drafts sample at top-k ≤ 128).
FUSED_TOP_K = 128


@dataclass
class FusedSampling:
    """Per row of fused decode steps: drawn or argmax, its warpers (temperature → top-k → top-p →
    min-p, `specwire.processing`) and the uniform of each step's draw, the one its round's `pick`
    draws with too (`specwire.processing.draw`)."""

    sampled: torch.Tensor  # [B] bool; False: argmax
    temperature: torch.Tensor  # [B] float32, > 0
    top_k: torch.Tensor  # [B] long, in [1, FUSED_TOP_K]
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    uniforms: torch.Tensor  # [B, steps] float64


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, hidden]: final-normed hidden states of the new tokens
    logits: torch.Tensor | None = None  # [P, vocab] float32, of `logit_index`
    # With `metrics`: entropy and varentropy [P] of the logits, and the attention statistics
    # [R·K] of `score_rows` × `score_tokens` (row-major).
    metrics: PositionMetrics | None = None


class LeanModel(Protocol):
    def cache_shape(self, rows: int, max_len: int) -> CacheShape: ...

    def forward(self, cache: SlotCache, batch: ForwardBatch) -> ForwardOutput: ...


def _inputs(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' ids and positions as the layers take them: [B, T], or packed, [1, N]."""
    if batch.packed is None:
        return batch.input_ids, batch.positions
    ids = batch.input_ids.flatten().index_select(0, batch.packed).unsqueeze(0)
    return ids, batch.positions.flatten().index_select(0, batch.packed).unsqueeze(0)


def _unpack(packed: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[1, N, ...] → [B, T, ...], zeros where a row is padded; unchanged when not packed."""
    if batch.packed is None:
        return packed
    B, T = batch.input_ids.shape
    rest = packed.shape[2:]
    return packed.new_zeros((B * T, *rest)).index_copy(0, batch.packed, packed[0]).view(B, T, *rest)


def _outputs(
    hidden: torch.Tensor, lm_head: Any, batch: ForwardBatch, scores: list[torch.Tensor], softcap: float | None = None
) -> ForwardOutput:
    """The call's results from the final-normed hidden states [B, T, E] and the last layer's
    chosen attention scores (`_chosen_scores`; present when `batch.metrics`)."""
    if batch.logit_index is None:
        return ForwardOutput(hidden)
    if batch.narrow:
        lm_head = lm_head.head
    logits = lm_head(hidden.flatten(0, 1).index_select(0, batch.logit_index)).float()  # [P, vocab]
    if softcap:  # Gemma-2: logits = cap · tanh(logits / cap)
        logits = torch.tanh(logits / softcap) * softcap
    if not scores:
        return ForwardOutput(hidden, logits)
    entropy, varentropy = token_entropy(logits)
    rows = scores[0].transpose(1, 2).flatten(0, 1)  # [R·K, heads, L], −inf where not attended to
    attention = attention_stats(rows, torch.isfinite(rows[:, 0]))
    return ForwardOutput(hidden, logits, PositionMetrics(entropy, varentropy, attention))


def _attend(
    query: torch.Tensor,  # [B, Hq, T, D]
    cache: SlotCache,
    layer: int,
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    batch: ForwardBatch,
    scaling: float,
    scores_out: list[torch.Tensor] | None,
    gqa: bool = False,  # fewer key/value heads than query heads
    mask: torch.Tensor | None = None,  # [B, 1, T, L]; None: batch.key_mask (or none when dense)
    softcap: float | None = None,  # Gemma-2's tanh cap on the scores
) -> torch.Tensor:
    """Write the new keys/values into their slots, attend over the rows' slots: [B, T, Hq·D]
    (packed, `ForwardBatch.packed`: [1, N, Hq·D] from [1, H, N, D])."""
    key_store, value_store = cache.keys[layer], cache.values[layer]  # [rows + 1, Hkv, slots, D]
    if batch.packed is not None:
        key_store[batch.packed_rows, :, batch.packed_slots] = key[0].transpose(0, 1)  # [N, Hkv, D]
        value_store[batch.packed_rows, :, batch.packed_slots] = value[0].transpose(0, 1)
        query = _unpack(query.transpose(1, 2), batch).transpose(1, 2)  # [B, Hq, T, D]
    else:
        rows = batch.rows.unsqueeze(1)  # [B, 1], broadcast against slots [B, T]
        key_store[rows, :, batch.slots] = key.transpose(1, 2)  # [B, T, Hkv, D] at (row, :, slot)
        value_store[rows, :, batch.slots] = value.transpose(1, 2)
    length = batch.key_mask.shape[-1]
    fused = batch.extents is not None and softcap is None
    in_place: torch.Tensor | None = None  # the cache's rows `row_attention` reads, where it reads them there
    if batch.contiguous_from is not None:
        first = batch.contiguous_from
        keys = key_store[first : first + len(batch.rows), :, :length]
        values = value_store[first : first + len(batch.rows), :, :length]
    elif fused and scores_out is None:
        # Gathered rows, read where the cache holds them: a copy of every row's keys per layer
        # was ~18% of a 32-row Gemma-3 decode step.
        keys, values, in_place = key_store[:, :, :length], value_store[:, :, :length], batch.rows
    else:
        keys = key_store[:, :, :length].index_select(0, batch.rows)  # [B, Hkv, L, D]
        values = value_store[:, :, :length].index_select(0, batch.rows)
    if mask is None and not batch.dense:
        mask = batch.key_mask.unsqueeze(1)  # [B, 1, T, L]
    if scores_out is not None:
        scores_out.append(_chosen_scores(query, keys, batch, scaling))
    if fused:
        mask = mask if mask is not None else batch.key_mask.unsqueeze(1)
        if _kernel_takes(query):
            out = torch.ops.specwire.row_attention_kernel(query, keys, values, mask, batch.extents, scaling, in_place)
        else:
            out = torch.ops.specwire.row_attention(query, keys, values, mask, batch.extents, scaling, gqa, in_place)
    elif softcap is not None:  # no fused kernel takes a cap: q·kᵀ, tanh cap, mask, softmax, ·v
        groups = query.shape[1] // keys.shape[1]
        scores = attention_scores(query, keys, scaling)  # [B, Hq, T, L] float32
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1).to(values.dtype)
        out = weights @ values.repeat_interleave(groups, dim=1)
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    out = out.transpose(1, 2).flatten(2)  # [B, T, Hq·D]
    if batch.packed is not None:
        return out.flatten(0, 1).index_select(0, batch.packed).unsqueeze(0)
    return out


# CPU SDPA's result for a row moves with the key length padded around it (its vectorised loops
# end in a tail) and with the thread that computes it; at key lengths in whole ROW_BLOCKs,
# masked beyond the row's slots, and on one thread, one new token a row gets the same bits in
# any batch (`tests/test_architectures.py`).
ROW_BLOCK = 64


def row_keys(slots: int, limit: int) -> int:
    """Keys a row-invariant attention looks at for a row (or batch) over `slots` slots: whole
    ROW_BLOCKs, at most `limit` (the cache's length)."""
    return min(-(-slots // ROW_BLOCK) * ROW_BLOCK, limit)


@torch.library.custom_op("specwire::row_attention", mutates_args=())
def row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  extents: torch.Tensor, scale: float, gqa: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention whose result for a token depends on that token's row and position alone:
    [B, Hq, T, D] (zeros at padding). `row_attention.cpp` where it builds (every thread, any T);
    else the SDPA calls below.

    Activation-quantised linears turn ~1e-7 differences into other tokens, and CPU SDPA's result
    for a row moves with the lengths padded around it: with the new tokens (T), and with the keys
    unless they are whole ROW_BLOCKs (`row_keys`); and with the thread computing it
    (`_sdpa_one_thread`). keys/values/mask span `row_keys` of the longest row. One new token a
    row (decode steps): one SDPA for the batch. Otherwise each new token is an entry of its own,
    as a decode step at its position would be: a verification of γ + 1 positions then chooses the
    tokens γ + 1 decode steps would (greedy speculation equals greedy decoding). A one-token
    entry's bits hold at any width in whole ROW_BLOCKs, masked, so the entries go in few SDPAs
    without copying keys: one a row (its keys broadcast over its tokens) or one a token index
    (over the rows), whichever is fewer. An opaque op to the compiler: the loop reads the
    extents' values. `rows` [B]: keys/values are the cache's rows, batch row b reads rows[b]."""
    B, _, T, _ = query.shape
    if _kernel_takes(query):
        return cast(torch.Tensor, torch.ops.specwire.row_attention_kernel(query, keys, values, mask, extents, scale, rows))
    if rows is not None:
        keys, values = keys.index_select(0, rows), values.index_select(0, rows)
    calls: list[Callable[[], None]] = []
    if T == 1:
        if B == 1 or torch.get_num_threads() < 2:
            return _sdpa_one_thread(query, keys, values, mask, scale, gqa)
        out = torch.empty_like(query)
        mask = mask.expand(B, *mask.shape[1:])
        for half_rows in (slice(0, B // 2), slice(B // 2, B)):  # a row's bits do not depend on its batch

            def half(rows: slice = half_rows) -> None:
                out[rows] = _sdpa_one_thread(query[rows], keys[rows], values[rows], mask[rows], scale, gqa)

            calls.append(half)
        _on_two_threads(calls)
        return out
    width = keys.shape[2]
    out = torch.zeros_like(query)
    mask = mask.expand(B, 1, T, width)
    tokens = extents[:, 0].tolist()
    if B <= T:
        for b, n in enumerate(tokens):

            def row(b: int = b, n: int = n) -> None:
                out[b, :, :n] = _sdpa_one_thread(
                    query[b, :, :n].transpose(0, 1).unsqueeze(2),  # [n, Hq, 1, D]
                    keys[b : b + 1].expand(n, *keys.shape[1:]), values[b : b + 1].expand(n, *values.shape[1:]),
                    mask[b, :, :n].transpose(0, 1).unsqueeze(2), scale, gqa,
                )[:, :, 0].transpose(0, 1)

            calls.append(row)
    else:
        for t in range(T):
            having = [b for b, n in enumerate(tokens) if n > t]
            # Every row: a view of the keys; some: a copy of theirs.
            chosen = slice(None) if len(having) == B else torch.tensor(having, dtype=torch.long, device=query.device)

            def token(t: int = t, chosen: slice | torch.Tensor = chosen) -> None:
                out[chosen, :, t] = _sdpa_one_thread(
                    query[chosen, :, t : t + 1], keys[chosen], values[chosen], mask[chosen, :, t : t + 1], scale, gqa
                )[:, :, 0]

            calls.append(token)
    _on_two_threads(calls)
    return out


_helper: ThreadPoolExecutor | None = None


def _on_two_threads(calls: list[Callable[[], None]]) -> None:
    """Run one-thread SDPA calls on this thread and a helper at once, where this thread may use
    two: a call's bits depend on its running on one thread, not on which. Eight rows' attention
    is single-threaded work otherwise (`_sdpa_one_thread`)."""
    global _helper
    if len(calls) < 2 or torch.get_num_threads() < 2:
        for call in calls:
            call()
        return
    if _helper is None:
        from specwire.engine.scheduler import compute_on

        _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-attention",
                                     initializer=compute_on, initargs=(1,))

    def theirs() -> None:
        with torch.inference_mode():
            for call in calls[1::2]:
                call()

    pending = _helper.submit(theirs)
    try:
        for call in calls[0::2]:
            call()
    finally:
        pending.result()


def _sdpa_one_thread(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float, gqa: bool) -> torch.Tensor:
    """SDPA on one thread. Which thread computes a row follows from the batch's size, and the
    row's bits followed it (torch 2.13, AMD Zen 4: rows changed with the batch at 2 threads and
    at equal key widths; never on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    finally:
        torch.set_num_threads(threads)


@torch.compiler.assume_constant_result
def _row_kernel() -> bool:
    """Whether `row_attention.cpp` builds here; then its operator `specwire::row_attention_kernel`
    (compiled code calls it with no Python between: ~7 µs less a call than the Python op) has its
    shape for the compiler registered. A module flag, not `functools.cache`: dynamo traces through
    a cache's wrapper, and this function's body does not trace."""
    global _ROW_KERNEL
    if _ROW_KERNEL is None:
        _ROW_KERNEL = kernels.available("row_attention")
        if _ROW_KERNEL:
            torch.library.register_fake("specwire::row_attention_kernel")(_row_kernel_shape)
    return _ROW_KERNEL


_ROW_KERNEL: bool | None = None


def _kernel_takes(query: torch.Tensor) -> bool:
    """Whether `row_attention.cpp`'s operator computes this attention: float32 on a CPU, where
    the kernel builds."""
    return query.dtype == torch.float32 and query.device.type == "cpu" and _row_kernel()


def _row_kernel_shape(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      extents: torch.Tensor, scale: float, rows: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(query)


@row_attention.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, extents: torch.Tensor,
      scale: float, gqa: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(query)


def _chosen_scores(query: torch.Tensor, keys: torch.Tensor, batch: ForwardBatch, scaling: float) -> torch.Tensor:
    """q·kᵀ·scaling of the batch's chosen rows and tokens only, masked: [R, Hq, K, L] float32.
    query: [B, Hq, T, D]; keys: [B, Hkv, L, D]."""
    if batch.score_rows is None or batch.score_tokens is None:  # every row and token (R = B, K = T)
        scores = attention_scores(query, keys, scaling)
        return scores if batch.dense else scores.masked_fill(~batch.key_mask.unsqueeze(1), float("-inf"))
    rows, tokens = batch.score_rows, batch.score_tokens  # [R], [R, K]
    R, K = tokens.shape
    chosen = query.index_select(0, rows)  # [R, Hq, T, D]
    chosen = chosen.gather(2, tokens[:, None, :, None].expand(R, chosen.shape[1], K, chosen.shape[3]))  # [R, Hq, K, D]
    scores = attention_scores(chosen, keys.index_select(0, rows), scaling)  # [R, Hq, K, L]
    mask = batch.key_mask.index_select(0, rows).gather(1, tokens[:, :, None].expand(R, K, keys.shape[2]))  # [R, K, L]
    return scores.masked_fill(~mask.unsqueeze(1), float("-inf"))


class LlamaLike:
    """Llama and Qwen2: RMSNorm, rotary q/k (biases as the modules have them), gated MLP."""

    def __init__(self, model: Any) -> None:
        base = model.model
        self.model = model
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.gqa = self.heads != self.kv_heads  # a bool here: compiled code must not see it as symbolic
        self.dtype = next(model.parameters()).dtype

    def cache_shape(self, rows: int, max_len: int) -> CacheShape:
        return CacheShape(len(self.layers), self.kv_heads, self.head_dim, rows, max_len, self.dtype)

    def forward(self, cache: SlotCache, batch: ForwardBatch) -> ForwardOutput:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        ids, positions = _inputs(batch)
        hidden = self.embed(ids)  # [B, T, E] (packed: [1, N, E])
        cos, sin = self.rotary(hidden, positions)  # [B, T, D]
        B, T = ids.shape
        scores: list[torch.Tensor] = []
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            wanted = scores if batch.metrics and index == last else None
            out = _attend(q, cache, index, k, v, batch, attn.scaling, wanted, self.gqa)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return _outputs(_unpack(self.norm(hidden), batch), self.lm_head, batch, scores)


class GPT2Like:
    """GPT-2: learned positions, LayerNorm, fused c_attn (Conv1D), GELU MLP."""

    def __init__(self, model: Any) -> None:
        base = model.transformer
        self.model = model
        self.wte = base.wte
        self.wpe = base.wpe
        self.blocks = list(base.h)
        self.ln_f = base.ln_f
        self.lm_head = model.lm_head
        config = model.config
        self.heads = int(config.n_head)
        self.head_dim = int(config.n_embd) // self.heads
        self.dtype = next(model.parameters()).dtype

    def cache_shape(self, rows: int, max_len: int) -> CacheShape:
        return CacheShape(len(self.blocks), self.heads, self.head_dim, rows, max_len, self.dtype)

    def forward(self, cache: SlotCache, batch: ForwardBatch) -> ForwardOutput:
        ids, positions = _inputs(batch)
        hidden = self.wte(ids) + self.wpe(positions)  # [B, T, E] (packed: [1, N, E])
        B, T = ids.shape
        scores: list[torch.Tensor] = []
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(hidden)).split(attn.split_size, dim=2)
            q, k, v = (t.view(B, T, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            wanted = scores if batch.metrics and index == last else None
            out = _attend(q, cache, index, k, v, batch, attn.scaling, wanted)
            hidden = hidden + attn.c_proj(out)
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return _outputs(_unpack(self.ln_f(hidden), batch), self.lm_head, batch, scores)


ATTENTION = "specwire"  # the name our attention function is registered under in transformers


@dataclass
class _Pass:
    """What the attention calls of one forward share: the cache, the batch, the masks per window."""

    cache: SlotCache
    batch: ForwardBatch
    last_layer: int
    scores: list[torch.Tensor]
    masks: dict[int, torch.Tensor]

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, T, L]: the batch's key mask, cut to the `window` slots before each token's
        position (transformers' sliding window: key k is seen when k > q − window); None when
        every slot is seen."""
        batch = self.batch
        if window is None:  # no test of the window against the length: compiled code would guard on it
            return None if batch.dense else batch.key_mask.unsqueeze(1)
        if window not in self.masks:
            recent = torch.arange(batch.key_mask.shape[-1], device=batch.key_mask.device) > batch.positions[:, :, None] - window
            self.masks[window] = (batch.key_mask & recent).unsqueeze(1)
        return self.masks[window]


def slot_attention(
    module: Any,
    query: torch.Tensor,  # [B, Hq, T, D], rotary applied
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    specwire_pass: _Pass | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function hook (`AttentionInterface`): the model's own modules
    project, norm and rotate; here the new keys/values go into the slot cache and the queries
    attend over their rows. Called outside an engine forward (transformers' `generate` on the
    same model), it is transformers' SDPA (or its eager path where scores are soft-capped)."""
    if specwire_pass is None:
        fallback = sys.modules[type(module).__module__].eager_attention_forward if softcap else ALL_ATTENTION_FUNCTIONS["sdpa"]
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                        sliding_window=sliding_window, softcap=softcap, **kwargs)
    batch = specwire_pass.batch
    layer = int(module.layer_idx)
    wanted = specwire_pass.scores if batch.metrics and layer == specwire_pass.last_layer else None
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = _attend(query, specwire_pass.cache, layer, key, value, batch, scale, wanted,
                  query.shape[1] != key.shape[1], specwire_pass.mask(sliding_window), softcap)
    return out.view(*out.shape[:2], query.shape[1], query.shape[3]), None  # [B, T, Hq, D]


AttentionInterface.register(ATTENTION, slot_attention)
# transformers' `generate` on a model switched to ATTENTION builds the masks SDPA would get.
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class HFForward:
    """Any transformers causal LM over the slot cache: its own forward, with `slot_attention`.

    The model's base module runs unchanged (embedding scale, norms, rotary per layer type,
    sliding and global layers); the engine passes per-row positions and a 4D mask, which
    transformers' mask builders hand through untouched, and our attention function applies
    each layer's window. The LM head then runs on the scored positions only.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        config = model.get_decoder().config if hasattr(model, "get_decoder") else model.config
        self.layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.dtype = model.get_input_embeddings().weight.dtype
        model.set_attn_implementation(ATTENTION)

    def cache_shape(self, rows: int, max_len: int) -> CacheShape:
        return CacheShape(self.layers, self.kv_heads, self.head_dim, rows, max_len, self.dtype)

    def forward(self, cache: SlotCache, batch: ForwardBatch) -> ForwardOutput:
        scores: list[torch.Tensor] = []
        shared = _Pass(cache, batch, self.layers - 1, scores, {})
        ids, positions = _inputs(batch)
        out = self.base(
            input_ids=ids,
            position_ids=positions,
            attention_mask=batch.key_mask.unsqueeze(1),  # 4D: transformers' mask builders pass it on
            use_cache=False,
            specwire_pass=shared,
        )
        return _outputs(_unpack(out.last_hidden_state, batch), self.lm_head, batch, scores, self.softcap)


def lean_model(model: Any, generic: bool = True) -> LeanModel | None:
    """The engine's forward for this model: `HFForward` for every architecture whose attention
    goes through transformers' attention-function registry (`generic`), else the hand-written
    Llama/Qwen2/GPT-2 forwards; None where none fits (transformers' own forward serves it)."""
    if generic and getattr(model, "_supports_attention_backend", False):
        return HFForward(model)
    config = model.config
    kind = getattr(config, "model_type", "")
    if kind == "llama" or (kind == "qwen2" and not getattr(config, "use_sliding_window", False)):
        return LlamaLike(model)
    if kind == "gpt2" and not getattr(config, "reorder_and_upcast_attn", False):
        return GPT2Like(model)
    return None


def decode_steps(model: LeanModel, cache: SlotCache, batch: ForwardBatch, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` one-token decode forwards of the batch's rows in one call, each fed the token chosen
    from the one before: its argmax, or with `batch.sampling` a sampled row's draw (`fused_draw`).
    Returns (tokens [B, steps], logits [B, steps, vocab] float32; with `batch.narrow`, over the
    trimmed head's K ids). Compiled, a call pays the compiled code's fixed per-call cost once for
    all its steps. `batch`: one new token per row (no padding), the logits of every row, causal
    over each row's own slots."""
    ids, slots, positions = batch.input_ids, batch.slots, batch.positions
    length = batch.key_mask.shape[-1]
    tokens, logits = [], []
    step_batch = batch
    for step in range(steps):
        if step:
            slots, positions = slots + 1, positions + 1
            # Row-invariant batches span whole blocks with room for every step (`build_batch`).
            width = length if batch.extents is not None else length + step
            key_mask = torch.arange(width, device=slots.device) <= slots[:, :, None]  # [B, 1, width]
            extents = None if batch.extents is None else torch.cat([torch.ones_like(slots), slots + 1], dim=1)
            step_batch = ForwardBatch(batch.rows, ids, slots, positions, key_mask, batch.logit_index,
                                      batch.contiguous_from, extents=extents, narrow=batch.narrow)
        out = model.forward(cache, step_batch)
        assert out.logits is not None
        ids = out.logits.argmax(dim=-1, keepdim=True)  # [B, 1]
        if batch.sampling is not None:
            drawn = fused_draw(out.logits, batch.sampling, step)
            ids = torch.where(batch.sampling.sampled[:, None], drawn, ids)
        if batch.narrow:
            ids = model.lm_head.target_ids[ids]  # type: ignore[attr-defined]  # draft column → target id
        tokens.append(ids)
        logits.append(out.logits)
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def fused_draw(logits: torch.Tensor, rows: FusedSampling, step: int) -> torch.Tensor:
    """Each row's draw at `step` from softmax(warp(logits)) over its FUSED_TOP_K largest logits:
    [B, 1] columns. The inverse transform runs over the survivors in column order with the
    step's uniform, as `specwire.processing.draw` does over the whole row, so it draws what the
    round's `pick` draws unless rounding moves a boundary past the uniform; `pick` decides, and
    the round goes on unfused from a difference. Nucleus (Holtzman et al. 2020) in descending
    order: a token stays while the mass above it is below p."""
    width = min(FUSED_TOP_K, logits.shape[-1])
    values, columns = largest(logits.float(), width)  # [B, width], descending
    rank = torch.arange(width, device=logits.device)
    scores = (values / rows.temperature[:, None]).masked_fill(rank >= rows.top_k[:, None], NEG_INF)
    probs = scores.softmax(dim=-1)
    above = probs.cumsum(dim=-1) - probs
    nucleus = (above >= rows.top_p[:, None]) & (rows.top_p[:, None] < 1.0) & (rank > 0)
    scores = scores.masked_fill(nucleus, NEG_INF)
    probs = scores.softmax(dim=-1)
    scores = scores.masked_fill((probs < rows.min_p[:, None] * probs[:, :1]) & (rank > 0), NEG_INF)
    probs = scores.softmax(dim=-1)
    columns, order = columns.sort(dim=-1)  # column order, as `draw` runs over a row
    cumulative = probs.gather(-1, order).double().cumsum(dim=-1)  # [B, width]
    uniform = rows.uniforms[:, step : step + 1] * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, uniform, right=True).clamp(max=width - 1)
    return columns.gather(-1, chosen)
