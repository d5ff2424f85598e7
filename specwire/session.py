"""The model-session interface strategies are written against, and its message types.

A session is one generation's KV cache on one model service (DESIGN.md, principle 2). The
orchestrator's strategies call `open` once and `step` per round; a step may roll back, reorder
branches, append tokens, score positions and propose continuations. The same dataclasses travel
over gRPC (converted in `specwire.wire`) or straight into an in-process engine in tests, so a
strategy cannot tell the two apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specwire.entropy_metrics import PositionMetrics
from specwire.processing import ProcessingConfig


class ScoreKind(enum.IntEnum):
    """Mirrors `specwire.v1.ScoreKind`."""

    NONE = 0
    ARGMAX = 1
    PROBS = 2
    LOGPROBS = 3
    LOGITS = 4


@dataclass(frozen=True)
class Extras:
    """Per-position uncertainty metrics to return with the scores (`specwire.entropy_metrics`)."""

    entropy: bool = False
    varentropy: bool = False
    attention_stats: bool = False

    @property
    def wanted(self) -> bool:
        return self.entropy or self.varentropy or self.attention_stats


@dataclass(frozen=True)
class Scoring:
    """What to return for the last `positions` tokens of each branch."""

    kind: ScoreKind = ScoreKind.NONE
    positions: int = 1
    top_n: int = 0
    logits_dtype: str = "float32"
    # LOGITS / LOGPROBS: only these ids' scores, for every row (sparse); empty = all / top_n.
    score_ids: tuple[int, ...] = ()
    # Medusa: each head's top `medusa_top_k` ids at every scored position too (0 = none).
    medusa_top_k: int = 0
    extras: Extras = field(default_factory=Extras)


@dataclass(frozen=True)
class OpenRequest:
    prompt_ids: list[int]
    processing: ProcessingConfig = field(default_factory=ProcessingConfig)
    num_branches: int = 1
    scoring: Scoring = field(default_factory=Scoring)
    trace: dict[str, str] | None = None


@dataclass(frozen=True)
class Verification:
    """Speculative sampling decided where p is: the step's last `rows` appended tokens are the
    drafts, `draft_probs` their q (one row each, sparse is enough), `seed` the orchestrator's
    seed for the acceptance draws. The step must score PROBS at rows + 1 positions."""

    draft_probs: Scores  # [γ, k] sparse (or [γ, vocab] dense) rows of the draft's distribution
    seed: int


@dataclass(frozen=True)
class Verdict:
    """What verification decided: the drafts accepted, then the correction or bonus token."""

    accepted_len: int
    next_token: int
    tree_path: tuple[int, ...] = ()  # a tree's accepted nodes from the root; () for a chain
    tree_nodes: int = 0  # in `StepResult.round_verdicts`: the round's node count


@dataclass(frozen=True)
class StepRequest:
    keep_tokens: int | None = None
    branch_order: list[int] = field(default_factory=list)
    append_ids: list[int] = field(default_factory=list)  # num_branches × k, row-major
    scoring: Scoring = field(default_factory=Scoring)
    propose: int = 0
    propose_greedy: bool = False
    propose_seed: int = 0
    propose_min_confidence: float = 0.0
    tree_parents: list[int] = field(default_factory=list)
    tree_keep: list[int] = field(default_factory=list)  # the previous tree's kept root-to-node path
    tree_topk: list[int] = field(default_factory=list)  # Medusa heads applied here: node i+1's top-k index
    verify: Verification | None = None
    propose_ids_only: bool = False  # no proposal_scores in the result
    propose_alternatives: int = 0  # greedy proposals: the k next-best ids at each position too
    tree_rounds: int = 0  # Medusa rounds decided in the service in this message (0 = one)
    tree_max_tokens: int = 0  # with tree_rounds: the most tokens they may decide (0 = no bound)
    trace: dict[str, str] | None = None


@dataclass
class Scores:
    """Scores for rows = branches × positions. Exactly one representation is set per kind."""

    kind: ScoreKind
    argmax_ids: torch.Tensor | None = None  # [rows] int
    dense: torch.Tensor | None = None  # [rows, vocab]
    sparse_ids: torch.Tensor | None = None  # [rows, k] int, -1 = padding
    sparse_values: torch.Tensor | None = None  # [rows, k]
    metrics: PositionMetrics | None = None  # when `Scoring.extras` asked for them

    @property
    def rows(self) -> int:
        for tensor in (self.argmax_ids, self.dense, self.sparse_ids):
            if tensor is not None:
                return int(tensor.shape[0])
        return 0

    def rows_from(self, start: int) -> Scores:
        """These scores without their first `start` rows (and without metrics)."""
        def cut(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[start:]

        return Scores(self.kind, cut(self.argmax_ids), cut(self.dense), cut(self.sparse_ids), cut(self.sparse_values))

    def to_dense(self, vocab_size: int, fill: float) -> torch.Tensor:
        """[rows, vocab] float32; entries a sparse form left out get `fill`."""
        if self.dense is not None:
            return self.dense.float()
        if self.sparse_ids is None or self.sparse_values is None:
            raise ValueError(f"scores of kind {self.kind.name} have no distribution")
        out = torch.full((self.sparse_ids.shape[0], vocab_size), fill, dtype=torch.float32)
        valid = self.sparse_ids >= 0
        rows = torch.arange(self.sparse_ids.shape[0]).unsqueeze(1).expand_as(self.sparse_ids)
        out[rows[valid], self.sparse_ids[valid].long()] = self.sparse_values[valid].float()
        return out


@dataclass
class ServerTiming:
    queue_us: int = 0
    compute_us: int = 0
    forward_calls: int = 0
    batch_rows: int = 0  # rows of the largest batched forward the message rode in; 0 = unbatched
    batch_costs: list[tuple[int, float]] = field(default_factory=list)  # (positions, ms) at those rows
    one_row_costs: list[tuple[int, float]] = field(default_factory=list)  # (positions, ms) at one row


@dataclass
class StepResult:
    scores: Scores | None = None
    proposed_ids: torch.Tensor | None = None  # [branches, n]
    proposal_scores: Scores | None = None
    num_tokens: int = 0
    verdict: Verdict | None = None  # a step with `verify`: its decision, in place of scores
    timing: ServerTiming = field(default_factory=ServerTiming)
    medusa_ids: torch.Tensor | None = None  # [rows, heads, medusa_top_k]
    tree_ids: torch.Tensor | None = None  # [n] the nodes the service built (`tree_topk`), every round's
    round_verdicts: list[Verdict] = field(default_factory=list)  # `tree_rounds`: each round's decision
    alternative_ids: torch.Tensor | None = None  # [branches, n, k] (`propose_alternatives`)


@dataclass(frozen=True)
class CacheUsage:
    """What `Info` and the metrics report about the cache."""

    rows: int
    rows_in_use: int
    max_len: int
    tokens_in_use: int
    bytes_in_use: int
    bytes_total: int
    waiting: int
    rows_kept: int = 0  # free rows holding a closed session's keys (prefix caching)
    reused_tokens: int = 0  # prompt positions found cached since the start


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: list[int]
    max_context: int
    capabilities: list[str]
    role: str
    tokenizer_source: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    cache: CacheUsage | None = None  # the slot cache, where the engine has one
    medusa_heads: int = 0
    # Timed at warm-up, one session alone: (new positions, ms) of a cached forward, ascending;
    # and ms a token of an 8-token greedy round. Empty / 0 when not measured.
    forward_costs: list[tuple[int, float]] = field(default_factory=list)
    decode_ms_per_token: float = 0.0
    quantization: str = "none"  # the linear weights: a resolved --quantize mode (not auto)
    compiled: bool = False  # forwards run compiled code now
    compiling: bool = False  # the background compiler is at work (serving is slower meanwhile)
    medusa_choices: str = ""  # the heads' tuned tree (JSON paths), "" = none


class BackendSession(Protocol):
    """A session inside a model service: synchronous, run on the forward-pass executor."""

    def open(self, request: OpenRequest) -> StepResult: ...

    def step(self, request: StepRequest) -> StepResult: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What a model service serves: a causal LM engine or a model-free drafter."""

    def info(self) -> ModelInfo: ...

    def new_session(self) -> BackendSession: ...


class ModelSession(Protocol):
    """What strategies see: the async session, remote (gRPC stream) or local (in-process)."""

    async def open(self, request: OpenRequest) -> StepResult: ...

    async def step(self, request: StepRequest) -> StepResult: ...

    async def close(self) -> None: ...
