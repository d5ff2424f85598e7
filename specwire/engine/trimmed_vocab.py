"""A draft over a trimmed vocabulary: the target's K most frequent token ids.

A real target's vocabulary (262,144 ids for Gemma-3) makes a draft's LM head as costly as the
target's own. Frequency-ranked drafting (FR-Spec, Zhao et al. 2025, arXiv:2502.14856; EAGLE-3
trims its head likewise) keeps only the K ids most frequent in the training text. Such a draft is
saved as an ordinary causal LM of vocabulary K plus `draft_vocab.json`, the K target ids in draft-id
order. Loaded, it is expanded to speak the target's ids: its input embedding reads target ids
(ids outside the K read as `fallback`), and its head returns logits over all V target ids, −inf
outside the K. Its distribution q is then exactly zero there, which speculative sampling handles
like any other q: a target token outside the K can only come from the residual max(0, p − q),
so the output keeps the target's distribution (Leviathan et al. 2023, Theorem 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

VOCAB_FILE = "draft_vocab.json"


@dataclass(frozen=True)
class TrimmedVocab:
    """Draft id i is target id `ids[i]`; target ids outside `ids` read as draft id `fallback`."""

    target_vocab_size: int
    ids: tuple[int, ...]
    fallback: int

    def __post_init__(self) -> None:
        if len(set(self.ids)) != len(self.ids) or not all(0 <= i < self.target_vocab_size for i in self.ids):
            raise ValueError(f"{VOCAB_FILE}: ids must be distinct target ids in [0, {self.target_vocab_size})")
        if not 0 <= self.fallback < len(self.ids):
            raise ValueError(f"{VOCAB_FILE}: fallback must be a draft id in [0, {len(self.ids)})")

    def draft_ids(self, missing: int | None = None) -> torch.Tensor:
        """[V] long: each target id's draft id; outside the K, `fallback` (or `missing`)."""
        table = torch.full((self.target_vocab_size,), self.fallback if missing is None else missing, dtype=torch.long)
        table[torch.tensor(self.ids, dtype=torch.long)] = torch.arange(len(self.ids))
        return table

    def save(self, directory: str | Path) -> None:
        data = {"target_vocab_size": self.target_vocab_size, "fallback": self.fallback, "ids": list(self.ids)}
        (Path(directory) / VOCAB_FILE).write_text(json.dumps(data) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> TrimmedVocab | None:
        """The directory's trimmed vocabulary, or None for an ordinary model."""
        path = Path(directory) / VOCAB_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(int(data["target_vocab_size"]), tuple(int(i) for i in data["ids"]), int(data["fallback"]))


def most_frequent(stream: np.ndarray, k: int, vocab_size: int, always: Sequence[int] = ()) -> list[int]:
    """The k ids most frequent in `stream` (ties: lower id first), `always` included in place of
    the least frequent: a draft must be able to propose end-of-turn ids however rare."""
    counts = np.bincount(stream.astype(np.int64), minlength=vocab_size)
    ranked = np.argsort(-counts, kind="stable")
    forced = list(dict.fromkeys(int(i) for i in always))
    chosen = [int(i) for i in ranked[: k + len(forced)] if int(i) not in forced][: k - len(forced)]
    return chosen + forced


class TargetIdEmbedding(nn.Module):
    """The draft's embedding, indexed by target ids: embed(draft_ids[x])."""

    draft_ids: torch.Tensor  # [V]

    def __init__(self, embedding: nn.Module, vocab: TrimmedVocab) -> None:
        super().__init__()
        self.embedding = embedding
        self.register_buffer("draft_ids", vocab.draft_ids(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.embedding.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.embedding(self.draft_ids[input_ids]))


class TargetVocabHead(nn.Module):
    """The draft's head over its K ids, scattered into logits over the V target ids (−inf elsewhere)."""

    target_ids: torch.Tensor  # [K]

    def __init__(self, head: nn.Module, vocab: TrimmedVocab, in_features: int) -> None:
        super().__init__()
        self.head = head
        self.in_features = in_features
        self.out_features = vocab.target_vocab_size
        self.register_buffer("target_ids", torch.tensor(vocab.ids, dtype=torch.long), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.scatter(self.head(hidden))

    def scatter(self, trimmed: torch.Tensor) -> torch.Tensor:
        """[..., K] logits over the draft's ids → [..., V] over the target's, −inf outside."""
        logits = trimmed.new_full((*trimmed.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return logits.index_copy(-1, self.target_ids, trimmed)


def expand(model: Any, directory: str | Path) -> TrimmedVocab | None:
    """Make a trimmed-vocabulary draft loaded from `directory` read and score target ids, in
    place; nothing for an ordinary model. Its config then states the target's vocabulary size."""
    vocab = TrimmedVocab.load(directory)
    if vocab is None:
        return None
    head = model.get_output_embeddings()
    if int(head.out_features) != len(vocab.ids):
        raise ValueError(f"{VOCAB_FILE}: {len(vocab.ids)} ids for a model of vocabulary {int(head.out_features)}")
    model.set_input_embeddings(TargetIdEmbedding(model.get_input_embeddings(), vocab))
    model.set_output_embeddings(TargetVocabHead(head, vocab, int(head.in_features)))
    model.config.vocab_size = vocab.target_vocab_size
    return vocab
