"""Published models' shapes with random weights, for timing where their weights cannot be had
(`specwire bounds --target-shape/--draft-shape`). A forward's cost depends on the shapes alone;
what random weights predict is meaningless, so nothing here measures acceptance.

Sizes from each model's published config.json: Llama-3.1-8B and Llama-3.2-1B (Meta, 2024),
Gemma-3-270M (Google, 2025); `gemma-draft` is the draft `specwire pair gemma-3-270m` distils.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specwire.engine import CausalLM, quantize

_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA | {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0,
    },
    "llama-3.2-1b": _LLAMA | {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
    "gemma-3-270m": {
        "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "vocab_size": 262144, "sliding_window": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    },
    "gemma-draft": _LLAMA | {
        "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 16384, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
    },
}


def random_lm(shape: str, device: str, dtype: torch.dtype, quantization: str = "none") -> CausalLM:
    """A model of `shape` (SHAPES) with random weights, made on `device`."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got {shape!r}")
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lm = CausalLM.from_model(model, None, f"random {shape}")
    lm.quantization = quantize.resolve(quantization, lm.device, model)
    quantize.quantize(model, lm.quantization)
    return lm
