"""Weights in fewer bytes: a large model's decode step streams every weight once, so bytes are time.

`--quantize` swaps every `nn.Linear` of the model (the LM head included, also when it is tied to
the embedding, which stays as it is) for one of:
- `int8`: int8 weights, one scale per output channel; activations quantised per row at each
  call (oneDNN's int8 GEMM, which torch ships for x86). y = s_x·s_w·(q_x·q_wᵀ) + b.
- `int4`: 4-bit weights in groups of 32 along the input, each group with its own scale and
  zero point, w = (q − 8)·s + z; activations in bfloat16 (`torch._weight_int4pack_mm_for_cpu`,
  whose float32 path is ~20× slower here).
- `w4a8`: 4-bit weights in groups of W4A8_GROUP inputs, each with its minimum and step, times
  activations quantised per row to int8, through the project's kernel (`w4a8.cpp`, built on first
  use; AVX2, and AVX-512 VNNI where the CPU has it, with the same bits): the int8 dot products of
  llama.cpp's Q4_1 × Q8 formats.
- `mixed`: the output layer (the LM head, the largest layer of a small model) `w4a8`, every
  other linear int8 × int8 through the same kernel file (`W8A8Linear`). Gemma-3-270M's layers
  lose much at 4 bits and its head little (docs/engine.md, "Quantised weights": held-out
  perplexity 32.0 float, 35.4 int8, 34.6 mixed, 44.9 w4a8).
- `w8a8`: every linear, the LM head included, int8 × int8 through that kernel. The head reads
  twice mixed's bytes, but its products of 4 rows or more run on AMX where the CPU has it: for
  servers that verify many rows at once (many sessions, each with drafts).
`auto` picks by the device and the model's size (docs/engine.md): on CPU none below 32 MiB of
float linear weights, then mixed where the w4a8 kernel runs (AVX2 or AVX-512 VNNI), else int4
or int8 as the weights grow; none (bfloat16) on CUDA.
Outputs then differ from the float model's, by an amount measured (`specwire quality`), but
never between a session's solo and batched runs.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import torch
from torch import nn

from specwire.config import QUANTIZE_MODES as MODES
from specwire.engine import kernels
from specwire.engine.trimmed_vocab import TargetVocabHead

log = logging.getLogger("specwire")

# Modes that round activations (int8 per row, int4 through bfloat16): ~1e-7 differences upstream
# can flip a rounding, so the engine keeps each row's arithmetic independent of its batch.
ACTIVATION_QUANTISED = ("int8", "int4", "w4a8", "mixed", "w8a8")
INT4_GROUP = 32
W4A8_GROUP = 32  # inputs a group; 32, 64 or 128 (the kernel sums 32 inputs in int16)
W4A8_TILE = 16  # output channels a tile in w4a8.cpp's layout


# `auto` on CPU: w4a8 from AUTO_MIN_BYTES where its kernel builds and the CPU has AVX2 but not
# AVX-512, or AVX-512 VNNI. Without AVX-512 oneDNN's int8 GEMM has no VNNI and is slow:
# Gemma-3-270M's LM head at 1 / 8 rows, 61.9 / 122 ms int8, 15.4 / 58.4 int4, 7.9 / 25.9 w4a8
# (AMD EPYC without AVX-512, 2 threads). With VNNI both use it, and w4a8 reads half the bytes:
# the LM head 4.97 / 6.50 ms int8, 2.39 / 2.65 w4a8; Gemma-3-270M's compiled forward at 1 / 8 / 16
# positions 14.2 / 17.1 / 21.7 ms int8, 9.7 / 16.2 / 28.6 w4a8; the 48 MiB Gemma draft's decode
# step at 1 / 4 / 8 rows 2.04 / 2.38 / 2.93 ms int8, 1.32 / 1.87 / 2.78 int4, 1.42 / 1.70 / 1.96
# w4a8 (AMD EPYC with AVX-512 VNNI, 2 threads, the draft one). Elsewhere (AVX-512 without VNNI)
# `auto` goes by the bytes of float linear weights (docs/engine.md, "Quantised weights"; measured
# with AVX-512, 2 cores, a decode step at 1 / 4 / 8 rows). Below AUTO_MIN_BYTES none: the weights sit in
# the caches and a step is bound by arithmetic (the 16 MiB demo target: 3.10 / 4.50 / 5.39 ms
# float32, 3.26 / 3.92 / 4.64 int8). Then int4 (the 48 MiB Gemma-3 draft: 6.84 / 10.72 / 14.03
# float32, 4.12 / 5.48 / 7.46 int8, 2.55 / 3.84 / 6.74 int4); from AUTO_INT8_BYTES int8, whose
# GEMM reads the weights once for all rows where the int4 kernel's time grows with them
# (Gemma-3-270M's LM head: 7.4 / 9.4 ms int8 at 1 / 8 rows, 4.9 / 16.8 int4).
AUTO_MIN_BYTES = 32 << 20
AUTO_INT8_BYTES = 256 << 20


def linear_bytes(model: nn.Module) -> int:
    return sum(linear.weight.numel() * linear.weight.element_size() for _, _, linear in _linears(model))


def resolve(mode: str, device: torch.device, model: nn.Module | None = None, capability: str | None = None,
            vnni: bool | None = None) -> str:
    """`auto` → the fastest measured mode for `device`, its CPU's vector instructions
    (`capability`, torch's name: AVX2, AVX512, ...; `vnni`: the w4a8 kernel runs AVX-512 VNNI,
    by default as it finds the CPU) and the model's size; others are checked against the device."""
    if mode not in MODES:
        raise ValueError(f"--quantize must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "auto":
        size = linear_bytes(model) if model is not None else 0
        if device.type != "cpu" or size < AUTO_MIN_BYTES:
            return "none"
        grouped = all(linear.in_features % INT4_GROUP == 0 for _, _, linear in _linears(cast(nn.Module, model)))
        capability = capability or torch.backends.cpu.get_cpu_capability()
        if _head_fits_w4a8(cast(nn.Module, model)) and w4a8_builds():
            vnni = w4a8_kernel().isa() == "avx512vnni" if vnni is None else vnni
            if capability == "AVX2" or vnni:
                return "mixed"
        onednn = torch.backends.mkldnn.is_available()
        return "int4" if grouped and (size < AUTO_INT8_BYTES or not onednn) else "int8" if onednn else "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--quantize {mode} runs on CPU (oneDNN / int4 CPU kernels); on {device.type} use none")
    if mode in ("w4a8", "mixed", "w8a8"):
        w4a8_kernel()  # fails here, with its reason, rather than at the first forward
    if mode == "mixed" and model is not None and not _head_fits_w4a8(model):
        raise ValueError(f"--quantize mixed needs an output layer whose input size divides by {W4A8_GROUP}")
    return mode


def _output_layer(model: Any) -> nn.Module | None:
    """transformers' LM head (`get_output_embeddings`), a trimmed draft's own linear head inside
    its wrapper (`TargetVocabHead`), None for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = cast(nn.Module | None, get()) if callable(get) else None
    return cast(nn.Module, head.head) if isinstance(head, TargetVocabHead) else head


def _head_fits_w4a8(model: nn.Module) -> bool:
    head = _output_layer(model)
    return isinstance(head, nn.Linear) and head.in_features % W4A8_GROUP == 0


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int8 [out, in], scales [out]): symmetric, one scale per output channel, w ≈ levels·s."""
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def int8_rows(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, in], a/127 [rows]): each row's activations q = round(127·x/a), a = max |x|."""
    flat = x.reshape(-1, in_features).float()
    amax = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    return torch.round(flat / amax * 127).to(torch.int8), (amax / 127).view(-1)


def _shaped(out: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A kernel's [rows, out] float32 result plus the bias, in `x`'s leading shape and dtype."""
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)


class Int8Linear(nn.Module):
    """oneDNN's int8 linear over per-channel int8 weights, with activations quantised per row,
    so that a row's output never depends on the other rows of its batch.

    Each row is scaled to max |x| = 1 and quantised with one fixed scale, 1/127, around 128
    (1/63 around 64 without AVX-512):
    q_x = round(127·x/a) + 128 with a = max |x| per row; then y = ((q_x − 128)·q_wᵀ)·(s_w/127)·a + b,
    the integer sums from the GEMM and every scale applied elementwise, so each row's bits are
    the same in any batch.
    oneDNN's int8 GEMM (`onednn::qlinear_pointwise`) reads the weights once for all the rows of
    a call: eight rows of Gemma-3's LM head cost 1.1× one row here, where fbgemm's dynamic
    linear costs 2×.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        _compile_as_a_call()
        # Without AVX-512 oneDNN sums u8·s8 pairs in int16 (vpmaddubsw), which saturates past
        # 32,767: activations then take 7 bits, q_x = round(63·x/a) + 64 (2·127·127 fits).
        self.levels = 127 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 63
        weight = linear.weight.detach().float()  # [out, in]
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        qweight, scales = int8_channels(weight)
        self.packed: torch.Tensor
        self.out_scales: torch.Tensor
        self.ones: torch.Tensor
        self.zeros: torch.Tensor
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(qweight, [1, self.in_features]))
        self.register_buffer("out_scales", scales / self.levels)  # s_w / levels, applied after the GEMM
        self.register_buffer("ones", torch.ones(self.out_features))
        self.register_buffer("zeros", torch.zeros(self.out_features, dtype=torch.long))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        amax = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)  # [rows, 1]
        zero = self.levels + 1
        qx = torch.round(flat / amax * self.levels).add(zero).to(torch.uint8)
        # The GEMM gives the integer sums (as float32, scales 1); the scales are applied here.
        # oneDNN applies them differently for one row than for several at small output widths
        # (≤ 256 here), which would make a row's output depend on its batch.
        acc = torch.ops.onednn.qlinear_pointwise(
            qx, 1.0, zero, self.packed, self.ones, self.zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
        out = acc * self.out_scales * amax
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _compile_as_a_call() -> None:
    """Inductor lowers `onednn::qlinear_pointwise` only for weights frozen into the graph as
    constants; the engine's weights are module state, so compiled code calls the op as it is."""
    from torch._inductor import lowering

    op = torch.ops.onednn.qlinear_pointwise.default
    if op in lowering.lowerings and op not in lowering.fallbacks:
        lowering.lowerings.pop(op)
        lowering.make_fallback(op)


class Int4Linear(nn.Module):
    """Groups of INT4_GROUP weights at 4 bits (asymmetric, min/max), torch's CPU int4 kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 needs input sizes divisible by {INT4_GROUP}, got {in_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        groups = weight.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.packed: torch.Tensor
        self.scale_zero: torch.Tensor
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.view(out_features, in_features), 1))
        zero = low + 8 * scale  # the kernel computes (q − 8)·s + z
        scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scale_zero", scale_zero)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_zero).float()
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


class W4A8Linear(nn.Module):
    """4-bit weights in groups of W4A8_GROUP inputs, each with its minimum and step (w = u·s + m,
    u = 0..15, float16 s and m: llama.cpp's Q4_1), times int8 activations (per row, as
    Int8Linear's: q = round(127·x/a)), summed in int32 per group."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w4a8_kernel()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        if in_features % W4A8_GROUP:
            raise ValueError(f"w4a8 needs input sizes divisible by {W4A8_GROUP}, got {in_features}")
        self.in_features, self.out_features, self.group = int(in_features), int(out_features), W4A8_GROUP
        groups = weight.view(out_features, in_features // self.group, self.group)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
        # The float16 step and minimum are what the kernel reads, so the levels are rounded against them.
        step, low = ((high - low) / 15).half(), low.half()
        if not (torch.isfinite(step).all() and torch.isfinite(low).all()):
            raise ValueError("w4a8: a weight group's range overflows float16")
        safe = torch.where(step == 0, torch.ones_like(step), step).float()
        # One copy: each further step of the rounding would otherwise allocate another.
        levels = (groups - low.float()[..., None]).div_(safe[..., None]).round_().clamp_(0, 15)
        unsigned = levels.to(torch.uint8).view(out_features, in_features)
        # w4a8.cpp's layout: tiles of 16 channels (the last padded with zero weights); a block of
        # 8 inputs holds two vectors of 8 channels, byte 4c + i of one holding inputs i (low) and 4 + i.
        tiles = -(-out_features // W4A8_TILE)
        pad = tiles * W4A8_TILE - out_features
        if pad:
            unsigned = torch.cat([unsigned, torch.zeros((pad, in_features), dtype=torch.uint8)])
            step = torch.cat([step, step.new_zeros(pad, step.shape[1])])
            low = torch.cat([low, low.new_zeros(pad, low.shape[1])])
        # Inputs i = 0..3 of a channel are one int32 word; a level (≤ 15) shifted by 4 stays in its byte.
        words = unsigned.view(torch.int32).view(tiles, 2, 8, in_features // 8, 2)  # tile, vector, channel, block, nibble
        joined = words[..., 0] | (words[..., 1] << 4)
        self.packed: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("packed", joined.permute(0, 3, 1, 2).contiguous().view(torch.uint8).reshape(tiles, -1))
        both = torch.stack([step, low], dim=-1).view(tiles, W4A8_TILE, -1, 2)  # tile, channel, group, (s, m)
        self.register_buffer("scales", both.permute(0, 2, 3, 1).contiguous())  # tile, group, (s, m), channel
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, row_scale = int8_rows(x, self.in_features)
        qsum = q.view(q.shape[0], -1, self.group).sum(dim=-1, dtype=torch.int32).float()
        out = torch.ops.specwire.w4a8_linear(q, qsum, row_scale, self.packed, self.scales, self.group, self.out_features)
        return _shaped(out, self.bias, x)

    def levels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u [out, in], 0..15; s, m [out, groups], float32) read back from the kernel's layout: w = u·s + m."""
        tiles = self.packed.shape[0]
        blocks = self.packed.view(tiles, self.in_features // 8, 2, 8, 4)
        both = torch.stack([blocks & 15, blocks >> 4], dim=-1)  # tile, block, vector, channel, i, nibble
        unsigned = both.permute(0, 2, 3, 1, 5, 4).reshape(tiles * W4A8_TILE, self.in_features)
        step, low = self.scales.float().permute(0, 3, 1, 2).reshape(tiles * W4A8_TILE, -1, 2).unbind(-1)
        return unsigned[: self.out_features], step[: self.out_features], low[: self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w4a8 groups of {self.group}"


class W8A8Linear(nn.Module):
    """int8 weights, one scale a channel (as Int8Linear's), times int8 activations per row, through
    the project's kernel (`w8a8_linear` in w4a8.cpp): one call, no oneDNN primitive to look up."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w4a8_kernel()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        if in_features % 4:
            raise ValueError(f"w8a8 needs input sizes divisible by 4, got {in_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        levels, scales = int8_channels(weight)
        tiles = -(-out_features // W4A8_TILE)
        pad = tiles * W4A8_TILE - out_features
        levels = torch.cat([levels, levels.new_zeros(pad, in_features)])
        self.packed: torch.Tensor
        self.scales: torch.Tensor
        self.colsum128: torch.Tensor
        # tile, 4 inputs, channel, input within the 4
        layout = levels.view(tiles, W4A8_TILE, in_features // 4, 4).permute(0, 2, 1, 3)
        self.register_buffer("packed", layout.contiguous().view(tiles, -1))
        self.register_buffer("scales", torch.cat([scales, scales.new_zeros(pad)]).contiguous())
        self.register_buffer("colsum128", (levels.sum(dim=1, dtype=torch.int32) * 128).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, row_scale = int8_rows(x, self.in_features)
        out = torch.ops.specwire.w8a8_linear(q, row_scale, self.packed, self.scales, self.colsum128, self.out_features)
        return _shaped(out, self.bias, x)

    def weight_levels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w [out, in] int8, s [out]) read back from the kernel's layout."""
        tiles = self.packed.shape[0]
        levels = self.packed.view(tiles, self.in_features // 4, W4A8_TILE, 4).permute(0, 2, 1, 3)
        return levels.reshape(tiles * W4A8_TILE, -1)[: self.out_features], self.scales[: self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


_W4A8: Any = None


def w4a8_builds() -> bool:
    return kernels.available("w4a8")


def w4a8_kernel() -> Any:
    """The kernel, also the operators `torch.ops.specwire.w4a8_linear` and `w8a8_linear` (opaque
    to the compiler, which sees their outputs' shapes); ValueError where it does not build
    (`kernels.load`)."""
    global _W4A8
    if _W4A8 is not None:
        return _W4A8
    try:
        module = kernels.load("w4a8")
    except ValueError as error:
        raise ValueError(f"--quantize w4a8: {error}") from error

    # Defined and run by the module itself (w4a8.cpp's TORCH_LIBRARY); here only their output shapes.
    @torch.library.register_fake("specwire::w4a8_linear")
    def _(q: torch.Tensor, qsum: torch.Tensor, row_scale: torch.Tensor, packed: torch.Tensor,
          scales: torch.Tensor, group: int, out_features: int) -> torch.Tensor:
        return q.new_empty((q.shape[0], out_features), dtype=torch.float32)

    @torch.library.register_fake("specwire::w8a8_linear")
    def _(q: torch.Tensor, row_scale: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
          colsum128: torch.Tensor, out_features: int) -> torch.Tensor:
        return q.new_empty((q.shape[0], out_features), dtype=torch.float32)

    # $SPECWIRE_AMX=0 keeps w8a8 on VNNI where the CPU has AMX (the same bits; to compare their speed).
    if os.environ.get("SPECWIRE_AMX", "1") == "0":
        module.use_amx(False, module.amx_rows())
    _W4A8 = module
    return module


# Projections of one input in the attention and MLP blocks of Llama-like models: as one int8
# GEMM they read their weights in one oneDNN call instead of two or three (each call has a fixed
# cost of ~25 µs here, and a decode step of Gemma-3-270M makes 126 of them).
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _SharedProduct:
    """The fused product of one input, handed out to its projections; cleared once each has
    taken its part, so no tensor outlives the forward (nor becomes state a compiled graph
    guards on)."""

    def __init__(self, linear: Int8Linear | W4A8Linear | W8A8Linear, sizes: list[int]) -> None:
        self.linear, self.sizes = linear, sizes
        self.input: torch.Tensor | None = None
        self.parts: list[torch.Tensor | None] = []

    def take(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.input is not x or self.parts[index] is None:
            self.input, self.parts = x, list(self.linear(x).split(self.sizes, dim=-1))
        part = self.parts[index]
        assert part is not None
        self.parts[index] = None
        if all(p is None for p in self.parts):
            self.input, self.parts = None, []
        return part


class SharedInputLinear(nn.Module):
    """One of several int8 or w4a8 projections of the same input, computed in one GEMM: the
    first of them called with an input runs it, the others take their columns. Each output
    equals its own layer's bit for bit: the integer sums and the scales are per column."""

    def __init__(self, product: _SharedProduct, index: int) -> None:
        super().__init__()
        self.index, self.in_features, self.out_features = index, product.linear.in_features, product.sizes[index]
        self.product = product
        self.fused = product.linear if index == 0 else None  # registered once, for state_dict and .to()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.take(x, self.index)

    def extra_repr(self) -> str:
        kind = {Int8Linear: "int8", W4A8Linear: "w4a8", W8A8Linear: "w8a8"}[type(self.product.linear)]
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, part {self.index}"


def _fuse_shared_inputs(model: nn.Module, kind: type[Int8Linear] | type[W4A8Linear] | type[W8A8Linear]) -> int:
    """Replace each SHARED_INPUT group of projections without bias by one `kind` GEMM."""
    fused = 0
    for parent in model.modules():
        for names in SHARED_INPUT:
            layers: list[nn.Linear] = [layer for name in names if isinstance(layer := getattr(parent, name, None), nn.Linear)]
            if len(layers) != len(names) or any(layer.bias is not None for layer in layers):
                continue
            if len({layer.in_features for layer in layers}) != 1:
                continue
            weight = torch.cat([layer.weight.detach() for layer in layers])
            joined = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            joined.weight = nn.Parameter(weight, requires_grad=False)
            product = _SharedProduct(kind(joined), [layer.out_features for layer in layers])
            for index, name in enumerate(names):
                setattr(parent, name, SharedInputLinear(product, index))
            fused += 1
    return fused


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every nn.Linear, each module once (tied heads included)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, name, child))
    return found


def quantize(model: Any, mode: str) -> int:
    """Swap the model's linear layers for `mode`'s (int8, int4, w4a8, mixed or w8a8), in place; the number swapped."""
    if mode == "none":
        return 0
    # The kinds whose one GEMM serves a group of projections of one input.
    fusable: dict[str, type[Int8Linear] | type[W4A8Linear] | type[W8A8Linear]] = {
        "int8": Int8Linear, "w4a8": W4A8Linear, "mixed": W8A8Linear, "w8a8": W8A8Linear}
    kind: type[nn.Module] = Int4Linear if mode == "int4" else fusable[mode]
    head = _output_layer(model) if mode == "mixed" else None
    count = len(_linears(model))
    with torch.no_grad():
        groups = 0 if mode == "int4" else _fuse_shared_inputs(model, fusable[mode])
        for parent, name, linear in _linears(model):
            setattr(parent, name, (W4A8Linear if linear is head else kind)(linear))
    log.info("quantised %d linear layers to %s (%d groups of projections of one input fused)", count, mode, groups)
    return count
