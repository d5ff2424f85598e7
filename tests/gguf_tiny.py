"""A tiny Llama written as a GGUF file, as llama.cpp's converter lays one out, for the GGUF tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def _llama_cpp_rotary_order(weight: torch.Tensor, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's rotary layout (its converter's permutation; transformers undoes it)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).numpy()


def write_llama_gguf(model: Any, tokenizer: Any, path: Path) -> Path:
    """`model` (a LlamaForCausalLM) and its byte-level BPE `tokenizer` as one float32 GGUF file."""
    import gguf

    config = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in tokenizer.all_special_tokens else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    merges = tokenizer.backend_tokenizer.model.get_merges() if hasattr(tokenizer.backend_tokenizer.model, "get_merges") else None
    if merges is None:
        import json

        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, (list, tuple)) else m for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            array = _llama_cpp_rotary_order(data, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _llama_cpp_rotary_order(data, config.num_key_value_heads)
        else:
            array = data.numpy()
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
