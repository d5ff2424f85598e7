"""A Hugging Face causal LM as the engine serves it: loading (a directory, a hub id or a GGUF
file), its tokenizer and the facts `Info` reports (vocabulary, eos ids, context)."""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specwire.medusa import MedusaHeads


def resolve_device(spec: str) -> torch.device:
    """`auto` picks CUDA when there is one."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA that supports it, float32 on CPU (half matmuls are slow there)."""
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if spec not in names:
        raise ValueError(f"--dtype must be one of auto, {', '.join(names)}; got {spec!r}")
    return names[spec]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """sha256 of the id → string mapping: equal fingerprints mean interchangeable token ids."""
    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def load_tokenizer(source: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer next to a model, or None when the directory has none."""
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def eos_token_ids(*candidates: int | list[int] | None) -> list[int]:
    """The first eos setting given (an id or a list of ids, as configs hold it), as a list."""
    for candidate in candidates:
        if candidate is not None:
            return [int(candidate)] if isinstance(candidate, int) else [int(c) for c in candidate]
    return []


def _max_context(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass
class CausalLM:
    """A loaded model with what its sessions and `Info` need."""

    model: Any
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    tokenizer_source: str
    device: torch.device
    vocab_size: int
    eos_token_ids: list[int]
    max_context: int
    accepts_logits_to_keep: bool
    medusa: MedusaHeads | None = None  # heads on the final hidden state (`--medusa DIR`)

    def attach_medusa(self, directory: str) -> None:
        """Load Medusa heads saved beside this model; they run on the hidden states of its forward."""
        heads = MedusaHeads.load(directory)
        hidden = int(self.model.get_output_embeddings().weight.shape[1])
        if (heads.config.hidden_size, heads.config.vocab_size) != (hidden, self.vocab_size):
            raise ValueError(
                f"--medusa: heads for hidden {heads.config.hidden_size} / vocab {heads.config.vocab_size}, "
                f"model has {hidden} / {self.vocab_size}"
            )
        dtype = next(self.model.parameters()).dtype
        self.medusa = heads.to(device=self.device, dtype=dtype)

    @classmethod
    def load(cls, source: str, device: str = "auto", dtype: str = "auto", name: str | None = None) -> CausalLM:
        """Load from a local directory or a hub id."""
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        model = cast(Any, model).to(torch_device)
        return cls.from_model(model, load_tokenizer(source), name or source, source)

    @classmethod
    def from_model(
        cls, model: Any, tokenizer: PreTrainedTokenizerBase | None, name: str, tokenizer_source: str = ""
    ) -> CausalLM:
        model.eval()
        device = next(model.parameters()).device
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            tokenizer_source=tokenizer_source,
            device=device,
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            eos_token_ids=eos_token_ids(
                getattr(model.generation_config, "eos_token_id", None),
                getattr(model.config, "eos_token_id", None),
                tokenizer.eos_token_id if tokenizer is not None else None,
            ),
            max_context=_max_context(model.config),
            accepts_logits_to_keep="logits_to_keep" in inspect.signature(model.forward).parameters,
        )

