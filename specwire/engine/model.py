"""A Hugging Face causal LM as the engine serves it: loading (a directory, a hub id or a GGUF
file), its tokenizer and the facts `Info` reports (vocabulary, eos ids, context)."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from specwire.engine import quantize, trimmed_vocab
from specwire.feature_drafter import FeatureDrafter, is_feature_drafter
from specwire.medusa import CHOICES_NAME, MedusaHeads, build_tree, load_choices
from specwire.tokenizer import eos_token_ids, load_tokenizer, split_gguf


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
    medusa: MedusaHeads | FeatureDrafter | None = None  # heads on the final hidden state (`--medusa DIR`)
    quantization: str = "none"  # the linear layers' weights (`specwire.engine.quantize`)
    medusa_choices: str = ""  # the heads' tuned tree, JSON (`CHOICES_NAME` beside them); "" = none

    def attach_medusa(self, directory: str) -> None:
        """Load Medusa heads, or a feature drafter, saved beside this model; they run on the
        hidden states of its forward."""
        heads: MedusaHeads | FeatureDrafter
        heads = FeatureDrafter.load(directory) if is_feature_drafter(directory) else MedusaHeads.load(directory)
        hidden = int(self.model.get_output_embeddings().in_features)
        if (heads.config.hidden_size, heads.config.vocab_size) != (hidden, self.vocab_size):
            raise ValueError(
                f"--medusa: heads for hidden {heads.config.hidden_size} / vocab {heads.config.vocab_size}, "
                f"model has {hidden} / {self.vocab_size}"
            )
        self.medusa = heads.to(device=self.device, dtype=self.dtype)
        if isinstance(heads, FeatureDrafter):
            heads.bind(self.model.get_input_embeddings().weight)
        tree = Path(directory) / CHOICES_NAME
        if tree.is_file():
            choices = load_choices(tree)
            build_tree(choices)  # a bad file fails at start-up, naming itself
            self.medusa_choices = json.dumps(choices)
        # The heads only propose (the target verifies), so they read as few bytes as its layers do.
        quantize.quantize(self.medusa, self.quantization)

    @property
    def proposable_ids(self) -> torch.Tensor | None:
        """[K] the only ids a trimmed-vocabulary draft can score finite (`trimmed_vocab`), else None."""
        head = self.model.get_output_embeddings()
        return cast(torch.Tensor, head.target_ids) if isinstance(head, trimmed_vocab.TargetVocabHead) else None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's: quantised layers keep theirs elsewhere)."""
        return cast(torch.dtype, self.model.get_input_embeddings().weight.dtype)

    @classmethod
    def load(
        cls,
        source: str,
        device: str = "auto",
        dtype: str = "auto",
        name: str | None = None,
        quantization: str = "none",
        gguf_file: str | None = None,
    ) -> CausalLM:
        """Load from a local directory, a hub id or a GGUF file (dequantised by transformers),
        then quantise its linear layers (`specwire.engine.quantize`)."""
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        quantize.resolve(quantization, torch_device)  # a bad mode fails before the load
        directory, gguf = split_gguf(source, gguf_file)
        extra = {"gguf_file": gguf} if gguf is not None else {}
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **extra)
        trimmed_vocab.expand(model, directory)  # a draft over the target's K most frequent ids
        model = cast(Any, model).to(torch_device)
        tokenizer_source = str(Path(directory) / gguf) if gguf is not None else source
        lm = cls.from_model(model, load_tokenizer(tokenizer_source), name or source, tokenizer_source)
        lm.quantization = quantize.resolve(quantization, torch_device, model)
        quantize.quantize(model, lm.quantization)
        return lm

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
            vocab_size=int(model.get_output_embeddings().out_features),
            eos_token_ids=eos_token_ids(
                getattr(model.generation_config, "eos_token_id", None),
                getattr(model.config, "eos_token_id", None),
                tokenizer.eos_token_id if tokenizer is not None else None,
            ),
            max_context=_max_context(model.config),
            accepts_logits_to_keep="logits_to_keep" in inspect.signature(model.forward).parameters,
        )
