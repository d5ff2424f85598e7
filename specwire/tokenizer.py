"""The tokenizer next to a model: loading it, its fingerprint, the eos ids a config lists. Apart
from the engine, so the orchestrator and the n-gram drafter start without the model code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """sha256 of the id → string mapping: equal fingerprints mean interchangeable token ids."""
    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def split_gguf(source: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None): `--model FILE.gguf`, or a directory with
    `--gguf-file NAME`."""
    if gguf_file is None and source.endswith(".gguf"):
        path = Path(source)
        return str(path.parent), path.name
    return source, gguf_file


def load_tokenizer(source: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer next to a model (or inside a GGUF file), or None when there is none."""
    directory, gguf_file = split_gguf(source)
    try:
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def eos_token_ids(*candidates: int | list[int] | None) -> list[int]:
    """The first eos setting given (an id or a list of ids, as configs hold it), as a list."""
    for candidate in candidates:
        if candidate is not None:
            return [int(candidate)] if isinstance(candidate, int) else [int(c) for c in candidate]
    return []
