"""Weights in fewer bytes: a large model's decode step streams every weight once, so bytes are time.

`--quantize` swaps every `nn.Linear` of the model (the LM head included, also when it is tied to
the embedding, which stays as it is) for one of:
- `int8`: int8 weights, one scale per output channel; activations quantised per row at each
  call (fbgemm's dynamic quantised linear, torch.ao; x86 with AVX2). y = s_x·s_w·(q_x·q_wᵀ) + b.
- `int4`: 4-bit weights in groups of 32 along the input, each group with its own scale and
  zero point, w = (q − 8)·s + z; activations stay float (`torch._weight_int4pack_mm_for_cpu`).
`auto` picks what measured fastest for the device (docs/engine.md, "Quantised weights"): int8 on
CPU, none (bfloat16) on CUDA. Outputs then differ from the float model's, by an amount measured
(`specwire quality`), but never between a session's solo and batched runs.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from typing import Any

import torch
from torch import nn

log = logging.getLogger("specwire")

MODES = ("none", "int8", "int4", "auto")
INT4_GROUP = 32


# `auto` quantises on CPU from this many bytes of float linear weights: below it the weights sit
# in the CPU's caches, a step is bound by arithmetic, and int8's per-call quantisation costs more
# than the bytes it saves (docs/engine.md, "Quantised weights").
AUTO_MIN_BYTES = 64 << 20


def linear_bytes(model: nn.Module) -> int:
    return sum(linear.weight.numel() * linear.weight.element_size() for _, _, linear in _linears(model))


def resolve(mode: str, device: torch.device, model: nn.Module | None = None) -> str:
    """`auto` → the fastest measured mode for `device` and the model's size; others are
    checked against the device."""
    if mode not in MODES:
        raise ValueError(f"--quantize must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "auto":
        large = model is not None and linear_bytes(model) >= AUTO_MIN_BYTES
        fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
        return "int8" if device.type == "cpu" and fbgemm and large else "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--quantize {mode} runs on CPU (fbgemm / int4 CPU kernels); on {device.type} use none")
    return mode


# fbgemm's packed weights are TorchScript objects, which torch.compile cannot take as module
# state without a graph break at every layer: layers hold an index here, and a custom op,
# opaque to the compiler, looks the weights up.
_PACKED: dict[int, Any] = {}
_HANDLES = itertools.count()


@torch.library.custom_op("specwire::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """fbgemm's dynamic int8 linear of x [rows, in] with the packed weights `_PACKED[handle]`."""
    # reduce_range: 7-bit activations, so AVX2's 16-bit pair sums (vpmaddubsw) cannot saturate.
    return torch.ops.quantized.linear_dynamic(x, _PACKED[handle], True)


@int8_linear.register_fake
def _int8_linear_shape(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Int8Linear(nn.Module):
    """fbgemm's dynamic int8 linear over per-channel int8 weights, with activations quantised
    per row, so that a row's output never depends on the other rows of its batch.

    fbgemm quantises a call's whole input with one scale, from its min and max. Each row is
    scaled to max |x| = 1 here and two columns, +1 and −1 (against zero weights), are appended,
    so every call's min and max are exactly −1 and +1: one fixed scale, each row quantised alone.
    y = a·fbgemm([x/a, 1, −1]) + b with a = max |x| per row.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        weight = torch.cat([weight, weight.new_zeros(self.out_features, 2)], dim=1)  # the ±1 columns
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # symmetric, per output channel
        with warnings.catch_warnings():  # quantised tensor types are deprecated; fbgemm's packing still takes them
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        amax = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)  # [rows, 1]
        ends = torch.tensor([1.0, -1.0], device=flat.device).expand(flat.shape[0], 2)
        out = int8_linear(torch.cat([flat / amax, ends], dim=1), self.handle, self.out_features) * amax
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def __del__(self) -> None:
        _PACKED.pop(self.handle, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


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
        self.register_buffer("scale_zero", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_zero)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every nn.Linear, each module once (tied heads included)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                found.append((parent, name, child))
    return found


def quantize(model: Any, mode: str) -> int:
    """Swap the model's linear layers for `mode`'s (int8 or int4), in place; the number swapped."""
    if mode == "none":
        return 0
    kind = {"int8": Int8Linear, "int4": Int4Linear}[mode]
    if mode == "int8":
        torch.backends.quantized.engine = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "x86"
    linears = _linears(model)
    with torch.no_grad():
        for parent, name, linear in linears:
            setattr(parent, name, kind(linear))
    log.info("quantised %d linear layers to %s", len(linears), mode)
    return len(linears)
