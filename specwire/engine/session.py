"""A generation's sessions: tokens per branch, and their keys and values in a `SessionKV`.

A session holds each branch's tokens and a cache over a prefix of them. Tokens not yet in the
cache are *pending*; any request that needs scores forwards the pending tokens in one call
(cropping the cache first when the positions to score are already cached). That single rule
covers prefill, appending, roll-back, proposal and verification. Warping runs here, on the
device, with `specwire.processing`, so only what decides crosses the wire. `SlotKV` keeps a
session's rows in the service's slot cache and batches through the scheduler; `DynamicKV` runs
transformers' own forward over one `DynamicCache` (`--engine hf`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar, cast

import grpc
import torch
from transformers import DynamicCache

from specwire import attention_probe
from specwire.acceptance import accept_draft, accept_draft_sparse, accept_tree_greedy, accept_tree_sampled
from specwire.engine.batch_costs import CURVE_POSITIONS
from specwire.engine.cache import SlotCache
from specwire.engine.model import CausalLM
from specwire.engine.scheduler import ForwardJob, JobSampling, Scheduler, synchronize
from specwire.entropy_metrics import PositionMetrics, token_entropy
from specwire.errors import InvalidArgument, StatusError, check_token_ids
from specwire.feature_drafter import FeatureDrafter, FeatureDrafterState
from specwire.medusa import MedusaHeads, cut_tree, tree_depths, tree_path, tree_shape
from specwire.processing import (
    ProcessingConfig,
    apply_penalties,
    beam_logprobs,
    greedy_scores,
    sample_rows,
    sampling_distribution,
    sampling_probs,
    scatter_probs,
)
from specwire.session import (
    OpenRequest,
    ScoreKind,
    Scores,
    Scoring,
    ServerTiming,
    StepRequest,
    StepResult,
    Verdict,
    Verification,
)

MAX_BRANCHES = 64
MAX_PROPOSE = 64
MAX_ALTERNATIVES = 8  # `propose_alternatives`: next-best ids per proposed position
MAX_TREE_ROUNDS = 64  # `tree_rounds`: Medusa rounds in one message
LOAD_REFRESH = 16  # replies at the same batch rows between two that carry its costs

def encode_probs(probs: torch.Tensor, config: ProcessingConfig, columns: torch.Tensor | None = None) -> Scores:
    """Sparse (ids + probabilities, descending) when truncation left ≤ half the columns, or when
    the columns are the ids `columns` [K] of a trimmed vocabulary; else dense."""
    if config.truncates:
        support = int((probs > 0).sum(dim=-1).max())
        if support <= probs.shape[-1] // 2:
            values, top = torch.topk(probs, support, dim=-1)
            ids = (top if columns is None else columns[top]).to(torch.int32).masked_fill(values <= 0, -1)
            return Scores(ScoreKind.PROBS, sparse_ids=ids, sparse_values=values)
    if columns is not None:
        ids = columns.to(torch.int32).expand(probs.shape[0], -1).contiguous()
        return Scores(ScoreKind.PROBS, sparse_ids=ids, sparse_values=probs)
    return Scores(ScoreKind.PROBS, dense=probs)

T = TypeVar("T")


def _encode_top(kind: ScoreKind, scores: torch.Tensor, top_n: int, dtype: torch.dtype) -> Scores:
    if 0 < top_n < scores.shape[-1]:
        values, ids = torch.topk(scores, top_n, dim=-1)
        return Scores(kind, sparse_ids=ids.to(torch.int32), sparse_values=values.to(dtype))
    return Scores(kind, dense=scores.to(dtype))


_LOGITS_DTYPES = {"float32": torch.float32, "float16": torch.float16}

ARGMAX_CHUNK = 4096  # ids a chunk in `argmax_rows`


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)`, the first index of each row's maximum, found through the maxima
    of chunks of ARGMAX_CHUNK ids: they vectorise where torch's CPU argmax does not (8 rows of
    Gemma-3's 262,144 float32 logits: 1.1 ms → ~0.1 ms on 2 AMD EPYC cores). The first chunk that
    holds a row's maximum holds its first index."""
    vocab = scores.shape[-1]
    if scores.device.type != "cpu" or vocab % ARGMAX_CHUNK or vocab < 16 * ARGMAX_CHUNK or scores.numel() == 0:
        return scores.argmax(dim=-1)
    chunks = scores.reshape(-1, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    chunk_max = chunks.amax(dim=-1)  # [rows, chunks]
    best = chunk_max.amax(dim=-1, keepdim=True)
    if torch.isnan(best).any():  # argmax takes NaN for the maximum; == never finds it
        return scores.argmax(dim=-1)
    chunk = (chunk_max == best).to(torch.uint8).argmax(dim=-1)  # [rows]
    inner = chunks[torch.arange(len(chunks)), chunk].argmax(dim=-1)
    return (chunk * ARGMAX_CHUNK + inner).view(scores.shape[:-1])


class SessionKV(Protocol):
    """Where a session's keys and values live, and how its forwards run."""

    cached: int  # leading positions of every branch held in the cache

    def open(self, branches: int, prompt: list[int] | None = None) -> None:
        """Fresh branches for `prompt`; `cached` then says how many of its tokens they hold
        already (a prefix cache's hit), else 0."""
        ...

    def crop(self, keep: int) -> None: ...

    def reorder(self, order: list[int]) -> None: ...

    def forward(
        self, tokens: torch.Tensor, start: int, positions: int, more: bool = False, metrics: bool = False
    ) -> tuple[torch.Tensor, PositionMetrics | None]:
        """Logits of each branch's last `positions` tokens, [branches, positions, vocab] float32,
        and with `metrics` entropix's metrics (token entropy, varentropy, the last layer's
        attention statistics) of the same [branches·positions] rows (`specwire.entropy_metrics`),
        from the same forward pass."""
        ...

    def decode(
        self, tokens: torch.Tensor, start: int, steps: int, pick: Callable[[torch.Tensor], torch.Tensor | None],
        plain_greedy: bool = False, narrow: bool = False, sampling: JobSampling | None = None,
    ) -> int:
        """A decode round: forward tokens[:, start:], then up to `steps` − 1 times the tokens
        `pick(logits [branches, vocab] of the last token)` returns, until it returns None.
        Returns the forwards run. `pick` sees the logits of each forward in turn.
        `plain_greedy`: `pick` takes the argmax of the raw logits (`ForwardJob.fuse_greedy`).
        `narrow`: `pick` also takes logits over a trimmed draft's K ids alone (`ForwardJob.narrow`).
        `sampling`: `pick` draws with these warpers and uniforms (`ForwardJob.sampling`)."""
        ...

    def forward_tree(
        self, tokens: torch.Tensor, start: int, positions: int, parents: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def keep_path(self, start: int, kept: list[int]) -> None: ...

    def compute(self, work: Callable[[], T]) -> T:
        """`work()` where the forwards compute (`Scheduler.call`): a feature drafter's steps."""
        ...

    def compute_step(self, work: Callable[[], T]) -> T:
        """`work()`, forwards and all, where the forwards compute while no other session holds
        rows (`Scheduler._run_here`): no hand-off between threads at each forward; else here
        (sessions that share forwards hand their jobs in)."""
        ...

    def post(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> bool:
        """While no other session holds rows: `work()` queued where the forwards compute, and
        `then(result, error)` called there after it (`Scheduler.post`); else False, and nothing
        queued (the caller runs `work` on a thread of its own)."""
        ...

    def take_load(self) -> tuple[int, list[tuple[int, float]], list[tuple[int, float]]]:
        """The rows of the largest batched forward since the last call, and what a forward of
        that many rows, and of one row, costs by its width (`ServerTiming.batch_costs`,
        `one_row_costs`); (0, [], []) unbatched."""
        ...

    def close(self) -> None: ...


class DynamicKV:
    """transformers' own forward over one `DynamicCache`: any model, no batching."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.cache: DynamicCache | None = None
        self.cached = 0

    def open(self, branches: int, prompt: list[int] | None = None) -> None:
        self.cache, self.cached = None, 0

    def crop(self, keep: int) -> None:
        if keep == 0 or self.cache is None:
            self.cache = None
        else:
            self.cache.crop(keep - self.cached)  # transformers ≥ 5: a negative count to remove
        self.cached = keep

    def reorder(self, order: list[int]) -> None:
        if self.cache is not None and self.cached > 0:
            index = torch.tensor(order, dtype=torch.long, device=self.lm.device)
            self.cache.reorder_cache(cast(torch.LongTensor, index))

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start: int, positions: int, more: bool = False, metrics: bool = False
    ) -> tuple[torch.Tensor, PositionMetrics | None]:
        """Attention statistics come from a probe on the last layer's attention function."""
        if self.cache is None:
            self.cache = DynamicCache()
        device = self.lm.device
        kwargs: dict[str, Any] = {}
        if self.lm.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = positions
        with attention_probe.capture(self.lm.model, positions if metrics else 0) as probe:
            out = self.lm.model(
                input_ids=tokens[:, start:].to(device),
                attention_mask=torch.ones(tokens.shape, dtype=torch.long, device=device),
                past_key_values=self.cache,
                use_cache=True,
                **kwargs,
            )
        self.cached = int(tokens.shape[1])
        logits = out.logits[:, -positions:, :].float()
        if probe is None:
            return logits, None
        return logits, PositionMetrics(*token_entropy(logits.flatten(0, 1)), probe.stats)

    def decode(
        self, tokens: torch.Tensor, start: int, steps: int, pick: Callable[[torch.Tensor], torch.Tensor | None],
        plain_greedy: bool = False, narrow: bool = False, sampling: JobSampling | None = None,
    ) -> int:
        for step in range(steps):
            logits, _ = self.forward(tokens, start, 1)
            chosen = pick(logits[:, 0])
            if chosen is None or step + 1 == steps:
                return step + 1
            tokens, start = torch.cat([tokens, chosen], dim=1), self.cached
        return steps

    @torch.inference_mode()
    def forward_tree(
        self, tokens: torch.Tensor, start: int, positions: int, parents: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One branch: the new tokens tokens[:, start:] with parents[i] the parent of new token i
        (-1 = the cached prefix); each attends to the cache and its ancestors at position
        start + depth (Medusa's tree attention). Returns [1, positions, vocab] float32 logits
        of the last `positions` new tokens and [new, hidden] final hidden states of every one."""
        if self.cache is None:
            self.cache = DynamicCache()
        depths, ancestors = tree_shape(tuple(parents))  # [new], [new, new]
        allowed = torch.cat([torch.ones(len(parents), start, dtype=torch.bool), ancestors], dim=1)
        device, dtype = self.lm.device, self.lm.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        position_ids = start + depths  # [new]
        out = self.lm.model.base_model(
            input_ids=tokens[:, start:].to(device),
            attention_mask=mask[None, None].to(device),  # [1, 1, new, start + new]
            position_ids=position_ids[None].to(device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cached = int(tokens.shape[1])
        hidden = out.last_hidden_state[0]  # [new, hidden]
        return self.lm.model.get_output_embeddings()(hidden[-positions:]).float()[None], hidden

    @torch.inference_mode()
    def keep_path(self, start: int, kept: list[int]) -> None:
        """Keep positions start+kept[i] (ascending offsets) at start+i and cut the cache there."""
        if self.cache is None or self.cached <= start:
            return
        source = torch.tensor(kept, dtype=torch.long, device=self.lm.device) + start  # [m]
        for layer in self.cache.layers:
            keys, values = cast(Any, layer).keys, cast(Any, layer).values  # [1, heads, cached, dim]
            keys[:, :, start : start + len(kept)] = keys.index_select(2, source)
            values[:, :, start : start + len(kept)] = values.index_select(2, source)
        self.crop(start + len(kept))

    def compute(self, work: Callable[[], T]) -> T:
        return work()

    def compute_step(self, work: Callable[[], T]) -> T:
        return work()

    def post(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> bool:
        return False

    def take_load(self) -> tuple[int, list[tuple[int, float]], list[tuple[int, float]]]:
        return 0, [], []

    def close(self) -> None:
        self.cache, self.cached = None, 0


class SessionClosed(StatusError):
    """The stream ended while this session's work was under way; nothing is left to answer."""

    code = grpc.StatusCode.CANCELLED


class SlotKV:
    """Rows of the service's slot cache (one per branch); forwards go through the scheduler.

    `close` may come from another thread while a forward or a wait for rows is under way: the
    rows are then released by the thread doing that work, when it ends, and keep nothing.
    The rows' token ids are noted here, from the forwards themselves, so that a row released
    with them can serve a later prompt that begins the same way (`SlotCache`).
    """

    def __init__(self, cache: SlotCache, scheduler: Scheduler, wait_s: float) -> None:
        self.cache = cache
        self.scheduler = scheduler
        self.wait_s = wait_s  # longest wait for free rows; `set_deadline` may shorten it
        self.rows: list[int] = []
        self.cached = 0
        # [branches, n]: the token ids at each row's first n positions (n ≤ cached; a tree's
        # nodes and a round's drawn tokens are left out, so it may fall short of `cached`)
        self.known = torch.empty((0, 0), dtype=torch.long)
        self.batch_rows = 0  # `take_load`
        self._load_rows = 0  # the rows of the last reply that carried curves, and replies since
        self._load_age = 0
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False

    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise SessionClosed("session: closed")
            self._busy = True

    def _leave(self) -> None:
        with self._lock:
            self._busy = False
            if self._closed:
                self._release(keep=False)

    def _release(self, keep: bool) -> None:
        rows, self.rows = self.rows, []
        keep = keep and self.cache.prefix_cache and self.known.shape[0] == len(rows)
        held = self.known[:, : self.cached].tolist() if keep else []
        self.known = torch.empty((0, 0), dtype=torch.long)
        if rows:
            self.cache.release(rows, held)

    def open(self, branches: int, prompt: list[int] | None = None) -> None:
        """Rows for `branches` branches of `prompt`; `cached` says how much of it they hold."""
        self._enter()
        try:
            self._release(keep=True)
            self.rows = self.cache.allocate(branches, self.wait_s, lambda: self._closed, prompt or ())
            self.cached = self.cache.lengths[self.rows[0]]
            if self.cached and branches > 1:
                self.cache.copy_rows(self.rows[:1] * (branches - 1), self.rows[1:])
            self.known = torch.tensor(prompt[: self.cached] if prompt else [], dtype=torch.long).expand(branches, -1)
        finally:
            self._leave()

    def _resize(self, count: int) -> None:
        if count > len(self.rows):
            self.rows = self.rows + self.cache.allocate(count - len(self.rows), self.wait_s, lambda: self._closed)
        elif count < len(self.rows):
            self.cache.release(self.rows[count:])
            self.rows = self.rows[:count]

    def crop(self, keep: int) -> None:
        self.cached = keep  # the next forward writes from here

    def reorder(self, order: list[int]) -> None:
        self._enter()
        try:
            sources = [self.rows[i] for i in order]
            if len(order) > len(self.rows):
                self._resize(len(order))
            targets = self.rows[: len(order)]
            if sources != targets:
                for row in sources:
                    self.cache.lengths[row] = self.cached
                self.cache.copy_rows(sources, targets)
            self._resize(len(order))
            self.known = self.known[order]
        finally:
            self._leave()

    def forward(
        self, tokens: torch.Tensor, start: int, positions: int, more: bool = False, metrics: bool = False
    ) -> tuple[torch.Tensor, PositionMetrics | None]:
        """`more`: the session's next forward follows at once (the scheduler waits for it).
        `metrics`: computed by the lean forward itself, after its LM head (`ForwardJob`)."""
        job = self.run(ForwardJob(list(self.rows), tokens[:, start:], start, positions, more=more,
                                  want_metrics=metrics))
        assert job.logits is not None
        if job.metrics is None:
            return job.logits, None
        return job.logits, job.metrics.flattened()  # [branches, positions] → [branches·positions]

    def decode(
        self, tokens: torch.Tensor, start: int, steps: int, pick: Callable[[torch.Tensor], torch.Tensor | None],
        plain_greedy: bool = False, narrow: bool = False, sampling: JobSampling | None = None,
    ) -> int:
        """One scheduler job for the whole round (`ForwardJob.steps`): batched step by step with
        the other sessions' forwards, with no wake-up of this thread between steps."""
        job = self.run(ForwardJob(list(self.rows), tokens[:, start:], start, 1, steps=steps, pick=pick,
                                  fuse_greedy=plain_greedy, narrow=narrow, sampling=sampling))
        return job.forwards

    def forward_tree(
        self, tokens: torch.Tensor, start: int, positions: int, parents: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DynamicKV.forward_tree`, batched with the other sessions' forwards (one row)."""
        job = ForwardJob(list(self.rows), tokens[:, start:], start, positions, want_hidden=True)
        if parents != list(range(-1, len(parents) - 1)):  # a chain needs neither (and may be chunked)
            depths, job.tree_mask = tree_shape(tuple(parents))  # [new], [new, new]
            job.positions = (start + depths)[None]  # [1, new]
        self.run(job)
        assert job.logits is not None and job.hidden is not None
        return job.logits, job.hidden[0]

    def set_deadline(self, seconds: float) -> None:
        """The caller's deadline is `seconds` away: wait no longer than that for rows."""
        self.wait_s = min(self.wait_s, max(0.0, seconds))

    def run(self, job: ForwardJob) -> ForwardJob:
        """Hook for tree verification (Medusa) and attention statistics (entropix): run `job`
        on this session's rows with its own positions, tree mask, hidden-state and attention
        requests (see `ForwardJob`). The rows then hold job.start + n positions; `keep_path`
        compacts an accepted subset. `forward` is this with the defaults (causal, logits only)."""
        start, tokens = job.start, job.tokens  # a decode round moves these on
        self._enter()
        try:
            job.rows, job.owner = list(self.rows), self
            self.scheduler.run(job)
        finally:
            self._leave()
        known = self.known[:, :start]
        # Recorded only for a cache that keeps keys: elsewhere a forward's tokens need no copy.
        recorded = self.cache.prefix_cache and job.tree_mask is None and job.positions is None
        if recorded and known.shape == (tokens.shape[0], start):
            known = torch.cat([known, tokens.cpu()], dim=1)
        with self._lock:  # a `close` from another thread sees both or neither
            self.batch_rows = max(self.batch_rows, job.batch_rows)
            self.cached = job.start + job.new_tokens
            self.known = known
        return job

    def keep_path(self, start: int, kept: list[int]) -> None:
        """Keep the just-appended positions start+kept[i] (ascending offsets) at start+i in every
        row, and cut the rows there: an accepted tree path becomes an ordinary prefix."""
        if self.cached <= start:  # the tree was never forwarded: nothing to move
            return
        self._enter()
        try:
            for row in self.rows:
                self.cache.keep_positions(row, start, kept)
            self.cached = start + len(kept)
        finally:
            self._leave()

    def compute(self, work: Callable[[], T]) -> T:
        return self.scheduler.call(work, owner=self)

    def compute_step(self, work: Callable[[], T]) -> T:
        # A session that arrives meanwhile is served by the same forwards (`_run_here`).
        if not self._alone():
            return work()
        return self.scheduler.call(work)

    def post(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> bool:
        if not self._alone():
            return False
        self.scheduler.post(work, then)
        return True

    def _alone(self) -> bool:
        """No other session holds cache rows."""
        return self.cache.rows_in_use() <= len(self.rows)

    def take_load(self) -> tuple[int, list[tuple[int, float]], list[tuple[int, float]]]:
        """Curves only where they say something new (`ServerTiming.batch_costs`): above one row,
        when the rows changed or every LOAD_REFRESH replies."""
        rows, self.batch_rows = self.batch_rows, 0
        if rows <= 1 or (rows == self._load_rows and self._load_age < LOAD_REFRESH):
            self._load_rows, self._load_age = rows, self._load_age + 1
            return rows, [], []
        self._load_rows, self._load_age = rows, 0
        costs = self.scheduler.costs
        return rows, costs.curve(rows, CURVE_POSITIONS), costs.curve(1, CURVE_POSITIONS)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self._busy:
                self._release(keep=True)
        self.scheduler.forget(self)


class EngineSession:
    """One generation's branches and tokens, its keys and values in a `SessionKV`.

    Used from one thread at a time (`close` excepted, see `SlotKV`).
    """

    def __init__(self, lm: CausalLM, kv: SessionKV, max_tokens: int, slots: int | None = None) -> None:
        self.lm = lm
        self.kv = kv
        self.max_tokens = max_tokens
        self.slots = slots or max_tokens  # cache slots a row has: committed tokens + tree nodes
        self.tokens = torch.empty((1, 0), dtype=torch.long)  # [branches, length], on CPU
        self.processing = ProcessingConfig()
        self.forward_calls = 0
        # A tree appended by the last step: committed tokens before it, and its parents.
        self.tree_start: int | None = None
        self.tree_parents: list[int] = []
        # Final hidden states kept for Medusa heads applied here (`tree_topk`): the last committed
        # token's [hidden] (None once the tokens change), and the last tree's nodes' [n, hidden].
        self.last_hidden: torch.Tensor | None = None
        self.tree_hidden: torch.Tensor | None = None
        self.drafter = FeatureDrafterState()  # a feature drafter's slots (`--medusa` of that kind)

    @property
    def num_branches(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def open(self, request: OpenRequest) -> StepResult:
        return self._with_load(self._open(request))

    def step(self, request: StepRequest) -> StepResult:
        # Alone, the whole step runs where its forwards do: no hand-off between threads at each
        # forward, and its own work (argmax, warping, acceptance) on that thread's cores.
        return self._with_load(self.kv.compute_step(lambda: self._step(request)))

    def post(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> bool:
        """`work` (this session's `step`, say) run where the forwards compute, `then` after it,
        with no thread waiting, while the session is alone (`SessionKV.post`); else False."""
        return self.kv.post(work, then)

    def _with_load(self, result: StepResult) -> StepResult:
        timing = result.timing
        timing.batch_rows, timing.batch_costs, timing.one_row_costs = self.kv.take_load()
        return result

    def _open(self, request: OpenRequest) -> StepResult:
        if not request.prompt_ids:
            raise InvalidArgument("prompt_ids", "must not be empty")
        if not 1 <= request.num_branches <= MAX_BRANCHES:
            raise InvalidArgument("num_branches", f"must be in [1, {MAX_BRANCHES}], got {request.num_branches}")
        check_token_ids(request.prompt_ids, self.lm.vocab_size, "prompt_ids")
        self._check_length(len(request.prompt_ids), "prompt_ids")
        self.processing = request.processing
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long).unsqueeze(0)
        self.tokens = prompt.expand(request.num_branches, -1).clone()
        self.tree_start, self.last_hidden, self.tree_hidden = None, None, None
        self.drafter = FeatureDrafterState()
        self.kv.open(request.num_branches, list(request.prompt_ids))
        return self._finish(request.scoring, 0, False, 0, 0.0)

    def _step(self, request: StepRequest) -> StepResult:
        if request.tree_keep:
            self._keep_tree(request.tree_keep)
        elif self.tree_start is not None:
            self._truncate(self.tree_start)
        self.tree_start = None
        if request.tree_parents:
            return self._step_tree(request)
        if request.keep_tokens is not None:
            self._truncate(request.keep_tokens)
        if request.branch_order:
            self._reorder(request.branch_order)
        if request.append_ids:
            self._append(request.append_ids)
        if not 0 <= request.propose <= MAX_PROPOSE:
            raise InvalidArgument("propose", f"must be in [0, {MAX_PROPOSE}], got {request.propose}")
        if not 0 <= request.propose_alternatives <= MAX_ALTERNATIVES:
            raise InvalidArgument(
                "propose_alternatives", f"must be in [0, {MAX_ALTERNATIVES}], got {request.propose_alternatives}"
            )
        if request.propose_alternatives and not request.propose_greedy:
            raise InvalidArgument("propose_alternatives", "needs propose_greedy (they are the next-best ids after the argmax)")
        if request.verify is not None:
            if request.propose:
                raise InvalidArgument("verify", "cannot be combined with propose")
            return self._verify(request.scoring, request.verify)
        return self._finish(
            request.scoring,
            request.propose,
            request.propose_greedy,
            request.propose_seed,
            request.propose_min_confidence,
            request.propose_ids_only,
            alternatives=request.propose_alternatives,
        )

    def _step_tree(self, request: StepRequest) -> StepResult:
        """Append a tree of nodes and score every one of them in one forward (tree attention)."""
        if request.keep_tokens is not None:
            self._truncate(request.keep_tokens)
        if self.num_branches != 1 or request.branch_order:
            raise InvalidArgument("tree_parents", "tree verification needs exactly one branch")
        if request.propose:
            raise InvalidArgument("propose", "cannot be combined with tree_parents")
        if request.verify is not None:
            if request.verify.draft_probs.rows:
                raise InvalidArgument("verify.draft_probs", "must be empty with tree_parents: the nodes are the drafts")
            if request.scoring.kind not in (ScoreKind.PROBS, ScoreKind.ARGMAX) or request.scoring.top_n:
                raise InvalidArgument(
                    "verify", "a tree's verification needs scoring PROBS (sampled) or ARGMAX (greedy) at every node, top_n 0"
                )
        if not 0 <= request.tree_rounds <= MAX_TREE_ROUNDS:
            raise InvalidArgument("tree_rounds", f"must be in [0, {MAX_TREE_ROUNDS}], got {request.tree_rounds}")
        if request.tree_rounds > 1 and (not request.tree_topk or request.verify is None):
            raise InvalidArgument("tree_rounds", "more than one round needs tree_topk and verify: the heads fill, the service decides")
        if request.tree_max_tokens < 0:
            raise InvalidArgument("tree_max_tokens", f"must be ≥ 0, got {request.tree_max_tokens}")
        if request.tree_topk:
            if len(request.append_ids) != 1:
                raise InvalidArgument("tree_topk", "needs the root alone in append_ids")
            filled = self._medusa_tree(request.tree_parents, request.tree_topk, request.append_ids[0])
            request = replace(request, append_ids=filled)
        if len(request.tree_parents) != len(request.append_ids):
            raise InvalidArgument(
                "tree_parents", f"has {len(request.tree_parents)} entries for {len(request.append_ids)} append_ids"
            )
        try:
            depth = max(tree_depths(request.tree_parents))
        except ValueError as error:
            raise InvalidArgument("tree_parents", str(error)) from None
        # Nodes sit at committed + depth: the deepest path, not the node count, must fit the context;
        # in the cache each node takes a slot until the next step keeps one path.
        self._check_length(self.length + depth + 1, "tree_parents")
        if self.length + len(request.tree_parents) > self.slots:
            raise InvalidArgument(
                "tree_parents",
                f"{len(request.tree_parents)} nodes after {self.length} tokens exceed the {self.slots} cache slots",
            )
        if request.scoring.kind != ScoreKind.NONE and request.scoring.positions != len(request.append_ids):
            raise InvalidArgument(
                "scoring.positions", f"must equal the tree's {len(request.append_ids)} nodes, got {request.scoring.positions}"
            )
        check_token_ids(request.append_ids, self.lm.vocab_size, "append_ids")
        self._append_tree(request.append_ids, request.tree_parents)
        if request.verify is not None:
            return self._verify_tree(request)
        return self._finish(request.scoring, 0, False, 0, 0.0, tree=self.tree_parents)

    def _append_tree(self, ids: list[int], parents: list[int]) -> None:
        start = self.length
        self.tokens = torch.cat([self.tokens, torch.tensor([ids], dtype=torch.long)], dim=1)
        self.tree_start, self.tree_parents = start, list(parents)
        self.last_hidden, self.tree_hidden = None, None  # the nodes are not committed; scoring fills tree_hidden

    def _verify_tree(self, request: StepRequest) -> StepResult:
        """The tree decided here, the draws from the request's seed; with `tree_rounds`, further
        rounds of it follow, each rooted at the token the last one decided (`_next_tree`)."""
        assert request.verify is not None
        calls_before = self.forward_calls
        generator = torch.Generator().manual_seed(request.verify.seed)
        verdicts: list[Verdict] = []
        nodes: list[torch.Tensor] = []
        scoring, decided = request.scoring, 0
        while True:
            verdict = self._decide_tree(scoring, generator)
            verdicts.append(verdict)
            nodes.append(self.tokens[0, -verdict.tree_nodes :])
            decided += len(verdict.tree_path)  # the accepted nodes below the root, and the next token
            if len(verdicts) >= request.tree_rounds or not self._next_tree(request, verdict, decided):
                break
            scoring = replace(scoring, positions=len(self.tree_parents))
        tree_ids = torch.cat(nodes).to(torch.int32)
        timing = ServerTiming(forward_calls=self.forward_calls - calls_before)
        if request.tree_rounds:
            return StepResult(num_tokens=self.length, round_verdicts=verdicts, tree_ids=tree_ids, timing=timing)
        return StepResult(num_tokens=self.length, verdict=verdicts[0], tree_ids=tree_ids, timing=timing)

    def _decide_tree(self, scoring: Scoring, generator: torch.Generator) -> Verdict:
        """Score the appended tree and decide it: greedy (`acceptance.accept_tree_greedy`) or
        lossless sampling (`acceptance.accept_tree_sampled`: the nodes are deterministic candidates,
        so no q comes with them)."""
        parents = self.tree_parents
        scores, _ = self._score(scoring, tree=parents)
        assert scores is not None
        nodes = self.tokens[0, -len(parents) :]
        if scoring.kind == ScoreKind.ARGMAX:
            assert scores.argmax_ids is not None
            path, next_token = accept_tree_greedy(nodes, parents, scores.argmax_ids)
            return Verdict(len(path) - 1, next_token, tuple(path), len(parents))
        probs = scores.to_dense(self.lm.vocab_size, 0.0).float().cpu()  # [nodes, vocab]
        last, drawn = accept_tree_sampled(nodes, parents, probs[None], generator)
        path = tree_path(parents, int(last[0]))
        return Verdict(len(path) - 1, int(drawn[0]), tuple(path), len(parents))

    def _next_tree(self, request: StepRequest, verdict: Verdict, decided: int) -> bool:
        """Keep the round's path and append the next round's tree (`Step.tree_rounds`): the
        request's tree cut to the depth the budget and the context leave. False, with nothing
        changed, when none is left or the tree does not fit."""
        assert self.tree_start is not None
        committed = self.tree_start + len(verdict.tree_path)
        depth = min(max(tree_depths(request.tree_parents)), self.max_tokens - committed - 1)
        if request.tree_max_tokens:
            depth = min(depth, request.tree_max_tokens - decided - 1)
        if depth < 0:
            return False
        parents, topk = cut_tree(request.tree_parents, request.tree_topk, depth)
        if committed + len(parents) > self.slots:
            return False
        self._keep_tree(list(verdict.tree_path))
        self._append_tree(self._medusa_tree(parents, topk, verdict.next_token), parents)
        return True

    def _medusa_tree(self, parents: list[int], topk: list[int], root: int) -> list[int]:
        """`tree_topk`: the root, then node i's `tree_topk[i-1]`-th best id of head depth(i) − 1,
        the heads applied to the last committed token's kept hidden state (one row)."""
        if self.lm.medusa is None:
            raise InvalidArgument("tree_topk", "this service has no Medusa heads (--medusa)")
        if len(topk) != len(parents) - 1:
            raise InvalidArgument("tree_topk", f"needs {len(parents) - 1} entries, one per node below the root")
        if len(parents) == 1:  # a later round cut to its root (`_next_tree`): nothing to draft
            return [root]
        if any(not 0 <= k < self.lm.vocab_size for k in topk):
            raise InvalidArgument("tree_topk", f"entries must be in [0, {self.lm.vocab_size})")
        try:
            heads = [depth - 1 for depth in tree_depths(parents)[1:]]  # [n−1] the head proposing each node
        except ValueError as error:
            raise InvalidArgument("tree_parents", str(error)) from None
        if heads and not 0 <= min(heads) <= max(heads) < self.lm.medusa.num_heads:
            raise InvalidArgument("tree_parents", f"one root, at most {self.lm.medusa.num_heads} levels below it (the heads)")
        if self.last_hidden is None:
            raise InvalidArgument("tree_topk", "no hidden state at the last committed token: score it (or keep a scored tree's path) first")
        if isinstance(self.lm.medusa, FeatureDrafter):
            top = self._draft_chain(parents, topk, root)
        else:
            with torch.inference_mode():
                top = self.lm.medusa.top_ids(self.last_hidden[None], max(topk, default=0) + 1)[0].cpu()  # [heads, top_k]
        built = top[torch.tensor(heads, dtype=torch.long), torch.tensor(topk, dtype=torch.long)]  # [n−1]
        return [root, *built.tolist()]

    def _draft_chain(self, parents: list[int], topk: list[int], root: int) -> torch.Tensor:
        """[depth, top_k] ids from the feature drafter's chain. It drafts one chain, so every
        node hangs from the root or from a node that took the chain's best id at its depth."""
        assert isinstance(self.lm.medusa, FeatureDrafter)
        on_chain = [True]
        for node, parent in enumerate(parents[1:], start=1):
            if not on_chain[parent]:
                raise InvalidArgument("tree_topk", f"node {node}: a feature drafter's nodes hang from its chain of top-0 ids")
            on_chain.append(topk[node - 1] == 0)
        depth = max(tree_depths(parents))
        try:
            drafter, tokens, top_k = self.lm.medusa, self.tokens[0], max(topk, default=0) + 1
            return self.kv.compute(lambda: self.drafter.draft(drafter, tokens, root, depth, top_k)).cpu()
        except ValueError as error:
            raise InvalidArgument("tree_topk", f"{error}: score it (or keep a scored tree's path) first") from None

    def _keep_tree(self, nodes: list[int]) -> None:
        """Keep one root-to-node path of the last tree: its KV moves to contiguous positions."""
        if self.tree_start is None:
            raise InvalidArgument("tree_keep", "the previous step appended no tree")
        start, parents = self.tree_start, self.tree_parents
        expected = [-1, *nodes[:-1]]
        if any(not 0 <= node < len(parents) for node in nodes) or [parents[n] for n in nodes] != expected:
            raise InvalidArgument("tree_keep", f"must be a root-to-node path of the {len(parents)}-node tree")
        source = torch.tensor(nodes, dtype=torch.long) + start  # [m] positions of the kept nodes
        self.tokens = torch.cat([self.tokens[:, :start], self.tokens[:, source]], dim=1)
        self.kv.keep_path(start, nodes)  # node indices ascend along a path: parents precede children
        self.last_hidden = self.tree_hidden[nodes[-1]] if self.tree_hidden is not None else None
        if self.tree_hidden is not None:
            self.drafter.commit(start, self.tree_hidden[nodes])
        self.tree_hidden = None

    def set_deadline(self, seconds: float) -> None:
        """The caller's deadline is `seconds` away (the servicer says so before `open`)."""
        set_deadline = getattr(self.kv, "set_deadline", None)
        if set_deadline is not None:
            set_deadline(seconds)

    def close(self) -> None:
        self.tree_start = None
        self.drafter = FeatureDrafterState()
        self.kv.close()
        self.tokens = torch.empty((1, 0), dtype=torch.long)

    # -- state changes -------------------------------------------------------------------

    def _check_length(self, length: int, field: str) -> None:
        if length > self.max_tokens:
            raise InvalidArgument(field, f"sequence of {length} tokens exceeds the service's context of {self.max_tokens}")

    def _truncate(self, keep: int) -> None:
        if not 1 <= keep <= self.length:
            raise InvalidArgument("keep_tokens", f"must be in [1, {self.length}], got {keep}")
        self.tokens = self.tokens[:, :keep]
        self.last_hidden = None
        self.drafter.cut(keep)
        if self.kv.cached > keep:
            self.kv.crop(keep)

    def _reorder(self, order: list[int]) -> None:
        if not 1 <= len(order) <= MAX_BRANCHES or any(not 0 <= i < self.num_branches for i in order):
            raise InvalidArgument("branch_order", f"indices must be in [0, {self.num_branches}), at most {MAX_BRANCHES}")
        self.kv.reorder(order)
        self.tokens = self.tokens.index_select(0, torch.tensor(order, dtype=torch.long))
        self.last_hidden = None

    def _append(self, ids: list[int]) -> None:
        if len(ids) % self.num_branches:
            raise InvalidArgument("append_ids", f"{len(ids)} ids do not split evenly over {self.num_branches} branches")
        check_token_ids(ids, self.lm.vocab_size, "append_ids")
        per_branch = len(ids) // self.num_branches
        self._check_length(self.length + per_branch, "append_ids")
        new = torch.tensor(ids, dtype=torch.long).view(self.num_branches, per_branch)
        self.tokens = torch.cat([self.tokens, new], dim=1)
        self.last_hidden = None

    # -- forward passes ------------------------------------------------------------------

    def _forward(self, positions: int, more: bool = False) -> torch.Tensor:
        """Logits for each branch's last `positions` tokens: [branches, positions, vocab] float32.
        `more`: another forward of this message follows right away."""
        return self._forward_measured(positions, more, metrics=False)[0]

    def _uncached_start(self, positions: int) -> int:
        """Where the next forward starts so that it covers the tokens not yet cached and at least
        the last `positions`; the cache is cut back there when it holds more."""
        start = min(self.kv.cached, self.length - positions)
        if start < self.kv.cached:
            self.kv.crop(start)
        return start

    def _forward_measured(
        self, positions: int, more: bool, metrics: bool
    ) -> tuple[torch.Tensor, PositionMetrics | None]:
        """`_forward`, and with `metrics` the positions' entropix metrics from the same pass."""
        start = self._uncached_start(positions)
        logits, measured = self.kv.forward(self.tokens, start, positions, more, metrics)
        self.forward_calls += 1
        return logits, measured

    def _forward_tree(self, positions: int, tree: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One branch: logits [1, positions, vocab] and final hidden states [positions, hidden]
        of the last `positions` tokens. The tokens not yet cached form a chain, then (when `tree`
        is given) the tree's nodes, whose parents index the tree."""
        start = self._uncached_start(positions)
        chain = self.length - start - (len(tree) if tree else 0)
        parents = list(range(-1, chain - 1))  # [pending] the chain of uncached committed tokens
        parents += [chain - 1 if p < 0 else chain + p for p in tree or []]
        logits, hidden = self.kv.forward_tree(self.tokens, start, positions, parents)  # hidden: [new, H]
        self.forward_calls += 1
        if isinstance(self.lm.medusa, FeatureDrafter):
            self.drafter.commit(start, hidden[:chain])  # committed tokens; a tree's nodes wait for `tree_keep`
        return logits, hidden[-positions:]

    def _score(
        self, scoring: Scoring, more: bool = False, tree: list[int] | None = None
    ) -> tuple[Scores | None, torch.Tensor | None]:
        """The scores `scoring` asks for, and the Medusa heads' top ids [positions, heads, top_k]
        when it asks for those too."""
        if scoring.kind == ScoreKind.NONE:
            return None, None
        positions = scoring.positions
        if not 1 <= positions <= self.length:
            raise InvalidArgument("scoring.positions", f"must be in [1, {self.length}], got {positions}")
        score_ids = self._score_ids(scoring)  # checked before paying for a forward pass
        extras = scoring.extras
        medusa_ids, metrics = None, None
        if scoring.medusa_top_k or tree:
            if extras.attention_stats:
                raise InvalidArgument("scoring.extras.attention_stats", "cannot be combined with Medusa tree scoring")
            if self.lm.medusa is None and scoring.medusa_top_k:
                raise InvalidArgument("scoring.medusa_top_k", "this service has no Medusa heads (--medusa)")
            if isinstance(self.lm.medusa, FeatureDrafter) and scoring.medusa_top_k:
                raise InvalidArgument("scoring.medusa_top_k", "this service's heads are a feature drafter: its drafts come with tree_topk")
        # One branch on a service with heads keeps the hidden states (for `tree_topk`) too,
        # unless the attention statistics need the plain forward.
        keep_hidden = (
            self.lm.medusa is not None and self.num_branches == 1 and not more and not extras.attention_stats
        )
        if scoring.medusa_top_k or tree or keep_hidden:
            if self.num_branches != 1:
                raise InvalidArgument("scoring.medusa_top_k", "needs exactly one branch")
            if not 0 <= scoring.medusa_top_k <= self.lm.vocab_size:
                raise InvalidArgument("scoring.medusa_top_k", f"must be in [0, {self.lm.vocab_size}]")
            logits, hidden = self._forward_tree(positions, tree)  # [1, positions, vocab], [positions, hidden]
            if tree:
                self.tree_hidden = hidden  # [nodes, hidden]
            else:
                self.last_hidden = hidden[-1]  # the scored positions end at the last token
            if scoring.medusa_top_k and isinstance(self.lm.medusa, MedusaHeads):
                with torch.inference_mode():
                    top = self.lm.medusa.top_ids(hidden, scoring.medusa_top_k)  # [positions, heads, top_k]
                medusa_ids = top.to(torch.int32).cpu()
        else:
            # [branches, positions, vocab]; with attention statistics, every metric from the forward
            logits, metrics = self._forward_measured(positions, more, extras.attention_stats)
        if extras.wanted and metrics is None:  # of the raw distribution, before any processor, on the device
            with torch.inference_mode():
                metrics = PositionMetrics(*token_entropy(logits.flatten(0, 1)))  # [branches·positions] each
        scores = self._encode_scores(scoring, self._process_positions(scoring, logits, tree), score_ids)
        scores.metrics = metrics
        return scores, medusa_ids

    def _process_positions(self, scoring: Scoring, logits: torch.Tensor, tree: list[int] | None = None) -> torch.Tensor:
        """[branches, positions, vocab] raw logits processed for `scoring.kind`, each position
        with its own history: [branches·positions, vocab]. With `tree` (one branch, the
        positions are its nodes) a node's history is the committed tokens and its own path."""
        positions = logits.shape[1]
        start = self.length - positions
        if not self.processing.has_penalties:  # no history dependence: every position at once
            history = self.tokens[:, :start].repeat_interleave(positions, dim=0).to(logits.device)
            return self._process(scoring, logits.flatten(0, 1), history)
        per_position = []
        for j in range(positions):
            if tree:
                path = torch.tensor(tree_path(tree, j), dtype=torch.long) + start
                history = torch.cat([self.tokens[:, :start], self.tokens[:, path]], dim=1)
            else:
                history = self.tokens[:, : start + j + 1]
            per_position.append(self._process(scoring, logits[:, j], history.to(logits.device)))
        return torch.stack(per_position, dim=1).flatten(0, 1)

    def _encode_scores(self, scoring: Scoring, processed: torch.Tensor, score_ids: torch.Tensor | None) -> Scores:
        """What `scoring` asks for from processed [branches·positions, vocab] scores."""
        config = self.processing
        if scoring.kind == ScoreKind.ARGMAX:
            return Scores(ScoreKind.ARGMAX, argmax_ids=argmax_rows(processed).to(torch.int32))
        if scoring.kind == ScoreKind.PROBS:
            return encode_probs(processed, config)
        dtype = _LOGITS_DTYPES.get(scoring.logits_dtype)
        if dtype is None:
            raise InvalidArgument("scoring.logits_dtype", f"must be float32 or float16, got {scoring.logits_dtype!r}")
        if score_ids is not None:
            values = processed.index_select(1, score_ids.to(processed.device))  # [rows, len(score_ids)]
            ids = score_ids.to(torch.int32).expand(values.shape[0], -1)
            return Scores(scoring.kind, sparse_ids=ids, sparse_values=values.to(dtype))
        return _encode_top(scoring.kind, processed, scoring.top_n, dtype)

    def _processed(self, scoring: Scoring, more: bool = False) -> torch.Tensor:
        """The last `scoring.positions` positions of each branch, processed for `scoring.kind`:
        [branches·positions, vocab]."""
        return self._process_positions(scoring, self._forward(scoring.positions, more))

    def _verify(self, scoring: Scoring, verify: Verification) -> StepResult:
        """Speculative sampling's decision on this service's p (`specwire.acceptance`): the
        drafts are the last γ tokens, q comes with the request, the draws from its seed. Where
        q comes sparse and p's warping leaves few ids, both stay sparse (`accept_draft_sparse`):
        dense, five rows of Gemma-3's 262,144 ids cost ~2.5 ms here beyond the forward."""
        calls_before = self.forward_calls
        q = self._draft_probs(verify.draft_probs)  # [γ, vocab] float32, or sparse ids and values [γ, k]
        gamma = int(q[0].shape[0]) if isinstance(q, tuple) else int(q.shape[0])
        if self.num_branches != 1:
            raise InvalidArgument("verify", f"needs one branch, the session has {self.num_branches}")
        if scoring.kind != ScoreKind.PROBS or scoring.positions != gamma + 1:
            raise InvalidArgument(
                "verify", f"needs scoring PROBS at γ + 1 = {gamma + 1} positions, got {scoring.kind.name} at {scoring.positions}"
            )
        if not 1 <= scoring.positions <= self.length:
            raise InvalidArgument("scoring.positions", f"must be in [1, {self.length}], got {scoring.positions}")
        drafts = self.tokens[0, self.length - gamma :]  # [γ]
        if isinstance(q, tuple):
            ids, values = q
            drafted = ((ids.long() == drafts.unsqueeze(-1)) & (values > 0)).any(dim=-1)
        else:
            drafted = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > 0
        if not bool(drafted.all()):
            raise InvalidArgument("verify.draft_probs", "q of each drafted token must be > 0")
        generator = torch.Generator().manual_seed(verify.seed)
        p = self._verified_probs(scoring)
        if isinstance(q, tuple) and isinstance(p, tuple):
            accepted_len, next_token = accept_draft_sparse(drafts, *q, *p, generator)
        else:
            vocab = self.lm.vocab_size
            dense_q = Scores(ScoreKind.PROBS, sparse_ids=q[0], sparse_values=q[1]).to_dense(vocab, 0.0) if isinstance(q, tuple) else q
            dense_p = scatter_probs(*p, vocab) if isinstance(p, tuple) else p
            accepted_len, next_token = accept_draft(drafts, dense_q, dense_p, generator)
        return StepResult(
            num_tokens=self.length,
            verdict=Verdict(accepted_len, next_token),
            timing=ServerTiming(forward_calls=self.forward_calls - calls_before),
        )

    def _verified_probs(self, scoring: Scoring) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """p at the scored positions: each row's ids and probabilities [γ+1, n] where warping
        leaves few ids and no penalty reads a history (`sampling_distribution`), else dense [γ+1, vocab]."""
        if self.processing.has_penalties:
            return self._processed(scoring).float().cpu()
        logits = self._forward(scoring.positions).flatten(0, 1)  # [γ+1, vocab]
        probs = sampling_distribution(logits, self.tokens[:, :0].to(logits.device), self.processing)  # no history read
        if isinstance(probs, torch.Tensor):
            return probs.float().cpu()
        return probs[0].cpu(), probs[1].float().cpu()

    def _draft_probs(self, scores: Scores) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`Verify.draft_probs` checked: sparse ids [γ, k] and values as they came where each row's
        ids are distinct, else dense rows [γ, vocab] float32."""
        vocab = self.lm.vocab_size
        ids, values, dense = scores.sparse_ids, scores.sparse_values, scores.dense
        if dense is not None:
            rows = given = dense.float()
            if rows.dim() != 2 or rows.shape[1] != vocab:
                raise InvalidArgument("verify.draft_probs", f"dense rows must be [γ, {vocab}], got {list(rows.shape)}")
        elif ids is not None and values is not None:
            if ids.dim() != 2 or ids.shape != values.shape:
                raise InvalidArgument("verify.draft_probs", "sparse ids and values must both be [γ, k]")
            if bool(((ids < -1) | (ids >= vocab)).any()):
                raise InvalidArgument("verify.draft_probs", f"sparse ids must be -1 (padding) or in [0, {vocab})")
            rows, given = values, values[ids >= 0].float()  # what dense rows would hold besides zeros
        else:
            raise InvalidArgument("verify.draft_probs", "must carry dense rows or sparse ids and values")
        if rows.shape[0] > MAX_PROPOSE:
            raise InvalidArgument("verify.draft_probs", f"at most {MAX_PROPOSE} rows, got {rows.shape[0]}")
        if not bool(((given >= 0) & (given <= 1)).all()):  # NaN fails both
            raise InvalidArgument("verify.draft_probs", "probabilities must be finite and in [0, 1]")
        if dense is not None:
            return rows
        assert ids is not None and values is not None
        ordered = ids.sort(dim=-1).values
        if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):  # an id twice: as dense rows read it
            return scores.to_dense(vocab, 0.0)
        return ids, values.float()

    def _score_ids(self, scoring: Scoring) -> torch.Tensor | None:
        """`scoring.score_ids` as an index, or None when every id (or the top_n) is wanted."""
        if not scoring.score_ids:
            return None
        if scoring.kind not in (ScoreKind.LOGITS, ScoreKind.LOGPROBS):
            raise InvalidArgument("scoring.score_ids", f"applies to LOGITS and LOGPROBS only, not {scoring.kind.name}")
        if scoring.top_n:
            raise InvalidArgument("scoring.score_ids", "give score_ids or top_n, not both")
        check_token_ids(list(scoring.score_ids), self.lm.vocab_size, "scoring.score_ids")
        return torch.tensor(scoring.score_ids, dtype=torch.long)

    def _process(self, scoring: Scoring, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        config = self.processing
        if scoring.kind == ScoreKind.ARGMAX:
            return greedy_scores(logits, history, config)
        if scoring.kind == ScoreKind.PROBS:
            return sampling_probs(logits, history, config)
        if scoring.kind == ScoreKind.LOGPROBS:
            return beam_logprobs(logits, history, config)
        return apply_penalties(logits, history, config)

    def _propose(
        self, count: int, greedy: bool, seed: int, min_confidence: float, ids_only: bool = False, alternatives: int = 0
    ) -> tuple[torch.Tensor, Scores | None, torch.Tensor | None]:
        """Draw up to `count` tokens per branch in one decode round; the last drawn stays pending.
        The drawn tokens' distributions come back too unless `greedy` or `ids_only`; with
        `alternatives` (greedy), each position's next-best ids [branches, n, k]."""
        self.last_hidden = None
        uniforms = torch.empty(0)
        if not greedy:  # one uniform a draw, drawn ahead: fused steps draw with them too
            generator = torch.Generator(device=self.lm.device)
            generator.manual_seed(seed)
            uniforms = torch.rand((count, self.num_branches), generator=generator, dtype=torch.float64,
                                  device=self.lm.device).cpu()
        drawn: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        runners_up: list[torch.Tensor] = []
        # A trimmed draft's logits are −inf outside its K ids: choosing among those alone gives
        # the same distribution (and argmax) at a 16th of the width (Gemma's 262,144 ids, K 16,384).
        columns = None if self.processing.has_penalties else self.lm.proposable_ids

        ahead: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # a fused call's steps, warped and drawn at once

        def pick_ahead(logits: torch.Tensor | None) -> None:  # [branches, steps, vocab] (`JobSampling.ahead`)
            ahead.clear()
            if logits is None:
                return
            if columns is not None and logits.shape[-1] != columns.shape[0]:
                logits = logits.index_select(-1, columns)
            steps = min(int(logits.shape[1]), int(uniforms.shape[0]) - len(drawn))
            if steps <= 0:
                return
            flat = logits[:, :steps].transpose(0, 1).flatten(0, 1)  # [steps·branches, K], step-major
            tokens, probs, _ = sample_rows(flat, self.tokens.to(flat.device), self.processing,  # no penalty reads the history
                                           uniforms[len(drawn) : len(drawn) + steps].flatten(), not ids_only)
            rows = probs.unflatten(0, (steps, -1)) if probs is not None else [None] * steps
            ahead.extend(zip(rows, tokens.view(steps, -1), strict=True))

        def pick(logits: torch.Tensor) -> torch.Tensor | None:  # [branches, vocab] → [branches, 1]
            history = self.tokens.to(logits.device)
            gated = bool(drawn) and min_confidence > 0  # the confidence is only worked out when it can stop
            if ahead:  # this step's row of `pick_ahead`'s, to the bit: rows are warped and drawn alone
                row, token = ahead.pop(0)
                if row is not None:
                    dists.append(row)
                return keep(token.unsqueeze(-1), None, gated)
            if columns is not None and logits.shape[-1] != columns.shape[0]:  # the scheduler's are K wide
                logits = logits.index_select(-1, columns)  # [branches, K]
            if greedy:
                scores = greedy_scores(logits, history, self.processing)
                token = argmax_rows(scores).unsqueeze(-1)
                confidence = scores.softmax(dim=-1).amax(dim=-1).min() if gated else None
                if alternatives:
                    others = scores.scatter(-1, token, float("-inf")).topk(alternatives, dim=-1).indices
                    runners_up.append((others if columns is None else columns[others]).cpu())
            else:
                chosen, probs, largest = sample_rows(logits, history, self.processing, uniforms[len(drawn)], not ids_only)
                token = chosen.unsqueeze(-1)
                confidence = largest.min() if gated else None
                if probs is not None:
                    dists.append(probs)
            return keep(token, confidence, gated)

        def keep(token: torch.Tensor, confidence: torch.Tensor | None, gated: bool) -> torch.Tensor | None:
            if columns is not None:
                token = columns[token]
            if gated and float(cast(torch.Tensor, confidence)) < min_confidence:
                if dists:
                    dists.pop()
                if runners_up:
                    runners_up.pop()
                return None
            drawn.append(token.cpu())
            self.tokens = torch.cat([self.tokens, drawn[-1]], dim=1)
            return drawn[-1]

        plain = greedy and not self.processing.has_penalties and min_confidence <= 0
        fusable = not greedy and min_confidence <= 0 and JobSampling.fusable(self.processing)
        sampling = JobSampling(self.processing, uniforms, pick_ahead) if fusable else None
        self.forward_calls += self.kv.decode(self.tokens, self._uncached_start(1), count, pick, plain,
                                             columns is not None, sampling)
        proposed = torch.cat(drawn, dim=1).to(torch.int32)
        if greedy or ids_only:
            others = torch.stack(runners_up, dim=1).to(torch.int32) if runners_up else None  # [branches, n, k]
            return proposed, None, others
        probs = torch.stack(dists, dim=1).flatten(0, 1)  # [branches·n, vocab]
        return proposed, encode_probs(probs, self.processing, columns), None

    def _finish(
        self,
        scoring: Scoring,
        propose: int,
        greedy: bool,
        seed: int,
        min_confidence: float,
        ids_only: bool = False,
        tree: list[int] | None = None,
        alternatives: int = 0,
    ) -> StepResult:
        calls_before = self.forward_calls
        scores, medusa_ids = self._score(scoring, more=propose > 0, tree=tree)
        tree_ids = self.tokens[0, -len(tree) :].to(torch.int32) if tree else None
        proposed, proposal_scores, alternative_ids = None, None, None
        if propose > 0:
            self._check_length(self.length + propose, "propose")
            proposed, proposal_scores, alternative_ids = self._propose(
                propose, greedy, seed, min_confidence, ids_only, alternatives
            )
        # Whoever times this call (the servicer, a LocalSession) must see the GPU work in it.
        synchronize(self.lm.device)
        return StepResult(
            scores=scores,
            proposed_ids=proposed,
            proposal_scores=proposal_scores,
            num_tokens=self.length,
            timing=ServerTiming(forward_calls=self.forward_calls - calls_before),
            medusa_ids=medusa_ids,
            tree_ids=tree_ids,
            alternative_ids=alternative_ids,
        )
