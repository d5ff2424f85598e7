"""Medusa heads and candidate trees (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads", arXiv:2401.10774).

Medusa-1 heads sit on the target's last hidden state h_t. Head k (k = 0 … K−1) is
`medusa_num_layers` residual blocks h ← h + SiLU(W h + b), W zero-initialised, then a linear map
to the vocabulary; it predicts the token k+1 places after the one the base head predicts, i.e.
x_{t+k+2}. They are stored beside a model as `medusa_heads.safetensors` plus `medusa_config.json`.
With `head_vocab` = K the maps cover only K of the vocabulary's ids (`vocab_ids`, the most frequent:
a 262k-id map per head would cost more than the base model's step); the other ids score −inf.

A candidate tree comes from `medusa_choices`, as in the reference implementation: each choice is
a path of top-k indices, one per head, e.g. (0, 1) = head 0's top-1 followed by head 1's top-2.
Node 0 is the root (the token just decided); node i+1 is choice i, choices ordered by depth.
Everything here is a pure function or a plain module; the engine and the orchestrator share it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"
CHOICES_NAME = "choices.json"  # the tree tuned for the heads (`tune_medusa_tree`), beside them


@dataclass(frozen=True)
class MedusaConfig:
    medusa_num_heads: int
    medusa_num_layers: int
    hidden_size: int
    vocab_size: int
    head_vocab: int = 0  # K ids each head scores (`vocab_ids`); 0: all `vocab_size`


class ResBlock(nn.Module):
    """h + SiLU(W h + b), W zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    """N heads over the last hidden state: [..., hidden] → [..., N, vocab] logits."""

    vocab_ids: torch.Tensor  # [head_vocab] long: the ids the heads' maps score (all when not trimmed)

    def __init__(self, config: MedusaConfig, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        width = config.head_vocab or config.vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(config.hidden_size) for _ in range(config.medusa_num_layers)],
                nn.Linear(config.hidden_size, width, bias=False),
            )
            for _ in range(config.medusa_num_heads)
        )
        ids = torch.arange(width) if vocab_ids is None else vocab_ids.long()
        if ids.shape != (width,) or (config.head_vocab and not bool(((ids >= 0) & (ids < config.vocab_size)).all())):
            raise ValueError(f"medusa vocab_ids: {width} ids in [0, {config.vocab_size}) expected")
        self.register_buffer("vocab_ids", ids)

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., N, head_vocab]: each head's logits over its own ids (`vocab_ids`)."""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.scores(hidden)  # [..., N, head_vocab]
        if not self.config.head_vocab:
            return scores
        logits = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return logits.index_copy(-1, self.vocab_ids, scores)  # [..., N, vocab]

    def top_ids(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """[..., N, k] each head's k best ids, as `forward(hidden).topk(k)` ranks them, without
        building a vocabulary-wide row per head when the heads are trimmed."""
        if not self.config.head_vocab or k > self.config.head_vocab:
            return self(hidden).topk(k, dim=-1).indices
        return self.vocab_ids[self.scores(hidden).topk(k, dim=-1).indices]

    def init_from_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Start every head's vocabulary map as the base model's (reference practice): a fresh
        head then predicts the base's next token, a better start than random."""
        with torch.no_grad():
            for head in self.heads:
                cast(nn.Linear, cast(nn.Sequential, head)[-1]).weight.copy_(lm_head_weight[self.vocab_ids])

    def save(self, directory: str | Path) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {name: (tensor.to(torch.float16) if tensor.is_floating_point() else tensor).detach().contiguous()
                 for name, tensor in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME))
        (out / CONFIG_NAME).write_text(json.dumps(self.config.__dict__, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> MedusaHeads:
        path = Path(directory)
        if not (path / CONFIG_NAME).is_file():
            raise ValueError(f"--medusa: {path} has no {CONFIG_NAME}")
        config = MedusaConfig(**json.loads((path / CONFIG_NAME).read_text()))
        state = load_file(str(path / WEIGHTS_NAME))
        heads = cls(config, state.get("vocab_ids"))
        state.setdefault("vocab_ids", heads.vocab_ids)  # heads saved before trimming existed
        heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return heads.eval()


# -- trees -------------------------------------------------------------------------------------


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node (a root, parent −1, has depth 0). Parents must precede children."""
    depths: list[int] = []
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"tree_parents[{index}] = {parent}: must be -1 or an earlier node's index")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_attention(parents: list[int]) -> torch.Tensor:
    """allowed[i, j] = node j is node i or one of its ancestors. parents: [n] → [n, n] bool."""
    size = len(parents)
    allowed = torch.eye(size, dtype=torch.bool)  # [n, n]
    for index, parent in enumerate(parents):
        if parent >= 0:
            allowed[index] |= allowed[parent]
    return allowed


@functools.lru_cache(maxsize=256)
def tree_shape(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [n] long, `tree_attention` [n, n] bool) of a tree, read-only: a served tree comes
    back every round, and building them in Python took ~0.5 ms of a Gemma-3-270M round."""
    return torch.tensor(tree_depths(list(parents)), dtype=torch.long), tree_attention(list(parents))


def tree_path(parents: list[int], node: int) -> list[int]:
    """Nodes from the root down to `node`, inclusive."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_children(parents: list[int]) -> list[list[int]]:
    """Each node's children, in node order (the order acceptance tries them)."""
    children: list[list[int]] = [[] for _ in parents]
    for index, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(index)
    return children


def cut_tree(parents: list[int], topk: list[int], depth: int) -> tuple[list[int], list[int]]:
    """The tree's nodes at depth ≤ `depth`, in their order, with their parents re-indexed and the
    other nodes' `topk` (one entry a node below the root, as `Step.tree_topk`). Choices sorted by
    depth (`build_tree`) cut this way equal the tree built from the choices of ≤ `depth` nodes."""
    kept = [node for node, at in enumerate(tree_depths(parents)) if at <= depth]
    index = {node: i for i, node in enumerate(kept)}
    return [parents[node] if parents[node] < 0 else index[parents[node]] for node in kept], [topk[node - 1] for node in kept[1:]]


@dataclass(frozen=True)
class TreeLayout:
    """A Medusa candidate tree, laid out once per `medusa_choices`. n = len(choices) + 1 nodes."""

    choices: tuple[tuple[int, ...], ...]  # sorted by depth, then lexicographically
    parents: list[int]  # [n]; parents[0] = −1 (the root: the token just decided)
    head_index: torch.Tensor  # [n−1] long: which head proposes node i+1 (its depth − 1)
    topk_index: torch.Tensor  # [n−1] long: which of that head's top-k it takes
    attention: torch.Tensor  # [n, n] bool: ancestors and self (`tree_attention`)
    position_offsets: torch.Tensor  # [n] long: depth, added to the committed length
    retrieve_paths: torch.Tensor  # [leaves, max_depth+1] long: root→leaf node indices, −1 padded
    top_k: int  # the largest top-k index used, plus one: what each head must return

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def num_heads(self) -> int:
        return int(self.head_index.max()) + 1 if self.head_index.numel() else 0


def build_tree(medusa_choices: list[list[int]] | list[tuple[int, ...]]) -> TreeLayout:
    """The tree for `medusa_choices`. Every prefix of a choice must be a choice too."""
    choices = sorted({tuple(int(i) for i in choice) for choice in medusa_choices}, key=lambda c: (len(c), c))
    if any(not choice or min(choice) < 0 for choice in choices):
        raise ValueError("medusa_choices: every choice is a non-empty path of top-k indices ≥ 0")
    node_of = {(): 0} | {choice: index + 1 for index, choice in enumerate(choices)}
    missing = [choice for choice in choices if choice[:-1] not in node_of]
    if missing:
        raise ValueError(f"medusa_choices: the prefix of {list(missing[0])} is not a choice")
    parents = [-1] + [node_of[choice[:-1]] for choice in choices]
    leaves = [node for node, kids in enumerate(tree_children(parents)) if not kids]
    depth = max((len(c) for c in choices), default=0)
    retrieve = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)  # [leaves, max_depth+1]
    for row, leaf in enumerate(leaves):
        path = tree_path(parents, leaf)
        retrieve[row, : len(path)] = torch.tensor(path)
    return TreeLayout(
        choices=tuple(choices),
        parents=parents,
        head_index=torch.tensor([len(c) - 1 for c in choices], dtype=torch.long),
        topk_index=torch.tensor([c[-1] for c in choices], dtype=torch.long),
        attention=tree_attention(parents),
        position_offsets=torch.tensor(tree_depths(parents), dtype=torch.long),
        retrieve_paths=retrieve,
        top_k=max((max(c) for c in choices), default=-1) + 1,
    )


def tree_tokens(layout: TreeLayout, root_token: int, head_top_ids: torch.Tensor) -> list[int]:
    """Node tokens: the root, then each choice's token from its head's top-k.

    head_top_ids: [K, top_k] ids, each head's best first (the heads at the root's predecessor).
    """
    candidates = head_top_ids[layout.head_index, layout.topk_index]  # [n−1]
    return [root_token, *candidates.tolist()]


def load_choices(path: str | Path) -> list[list[int]]:
    """`medusa_choices` from a JSON file: a list of lists of top-k indices."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list) or not all(isinstance(c, list) and all(isinstance(i, int) for i in c) for c in data):
        raise ValueError(f"{path}: medusa_choices must be a JSON list of lists of integers")
    return data
