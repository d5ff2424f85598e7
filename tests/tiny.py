"""Tiny models and a tiny tokenizer built locally: no hub, seconds to make."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "the quick brown fox jumps over the lazy dog. " * 4,
]


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE with `<|endoftext|>` as id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def save_llama(
    path: Path,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    sharpen: float = 8.0,
) -> Path:
    """A random Llama; `sharpen` scales the head so the logits are peaky (random init gives
    near-uniform logits, and sequences of near-ties)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_gpt2(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> Path:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_qwen2(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> Path:
    """A random Qwen2 (q/k/v biases, grouped-query attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:  # random biases, so the test sees them used
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _save(model: torch.nn.Module, path: Path, tokenizer: PreTrainedTokenizerFast, sharpen: float = 8.0) -> Path:
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_qwen3(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int) -> Path:
    """A random Qwen3 (q/k RMSNorm, grouped-query attention, an explicit head_dim)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )
    return _save(Qwen3ForCausalLM(config), path, tokenizer)


def save_mistral(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int, window: int = 8) -> Path:
    """A random Mistral whose sliding window (`window` tokens) is shorter than the tests' texts."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=window,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )
    return _save(MistralForCausalLM(config), path, tokenizer)


def save_gemma3(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int, window: int = 8) -> Path:
    """A random Gemma-3 shaped like Gemma-3-270M in small: sliding layers of `window` tokens and
    a global one, one key/value head, q/k norms, a tied, scaled embedding."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=window, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return _save(Gemma3ForCausalLM(config), path, tokenizer)
