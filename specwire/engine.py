"""A Hugging Face causal LM served as sessions: one KV cache per generation, a lean forward loop.

A session holds each branch's tokens and a `DynamicCache` over a prefix of them. Tokens not yet
in the cache are *pending*; any request that needs scores forwards the pending tokens in one
call (cropping the cache first when the positions to score are already cached). That single
rule covers prefill, appending, roll-back, proposal and verification. Warping runs here, on the
device, with `specwire.processing`, so only what decides crosses the wire.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from specwire import attention_probe
from specwire.acceptance import accept_draft
from specwire.batching import ForwardJob, Scheduler
from specwire.entropy_metrics import AttentionStats, PositionMetrics, attention_stats, token_entropy
from specwire.errors import InvalidArgument, StatusError, check_token_ids
from specwire.lean_forward import LeanModel, lean_model
from specwire.processing import (
    ProcessingConfig,
    apply_penalties,
    beam_logprobs,
    greedy_scores,
    sampling_probs,
)
from specwire.session import (
    ModelInfo,
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
from specwire.slot_cache import SlotCache

log = logging.getLogger("specwire")

MAX_BRANCHES = 64
# Device types where `--compile auto` compiles: where a measurement showed it pays (none yet).
COMPILE_PAYS_ON: frozenset[str] = frozenset()
MAX_PROPOSE = 64


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


@dataclass(frozen=True)
class EngineLimits:
    """The serving engine's sizes (`--max-batch-rows`, `--max-cache-len`, ...); 0 = derived."""

    max_batch_rows: int = 0  # cache rows = branches of all open sessions together
    max_cache_len: int = 0  # tokens per row; at most the model's context
    max_queued_sessions: int = 64  # sessions waiting for free rows before RESOURCE_EXHAUSTED
    queue_timeout_s: float = 30.0  # longest wait for free rows
    batching: bool = True  # False: transformers' forward, one DynamicCache per session, no batching
    # torch.compile of the batched forward: "on", "off", or "auto" = where it was measured to
    # pay: nowhere yet (on CPU the compiled step was slower; CUDA is unmeasured; see README).
    compile: str = "auto"


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 30


def cache_size(lean: LeanModel, lm: CausalLM, limits: EngineLimits) -> tuple[int, int]:
    """(rows, max_len): the flags where given; else the model's context (at most 4096 tokens)
    and as many rows as fit in half the free GPU memory (at most 256), or a tenth of the free
    RAM (at most 32: a CPU gains little from wider batches)."""
    max_len = limits.max_cache_len or min(lm.max_context, 4096)
    max_len = min(max_len, lm.max_context)
    if limits.max_batch_rows:
        return limits.max_batch_rows, max_len
    share, most = (2, 256) if lm.device.type == "cuda" else (10, 32)
    per_row = lean.cache_shape(1, max_len).bytes
    return max(1, min(most, _available_memory(lm.device) // share // per_row)), max_len


class Engine:
    """A `Backend` over one causal LM: a slot cache and a batching scheduler where the lean
    forward supports the model, else one transformers `DynamicCache` per session."""

    def __init__(self, lm: CausalLM, role: str, limits: EngineLimits | None = None) -> None:
        self.lm = lm
        self.role = role
        self.limits = limits or EngineLimits()
        self._fingerprint = tokenizer_fingerprint(lm.tokenizer)
        self.cache: SlotCache | None = None
        self.scheduler: Scheduler | None = None
        lean = lean_model(lm.model) if self.limits.batching else None
        if lean is not None:
            rows, max_len = cache_size(lean, lm, self.limits)
            self.cache = SlotCache(lean.cache_shape(rows, max_len), lm.device, self.limits.max_queued_sessions)
            self.scheduler = Scheduler(lean, self.cache, lm.device)
            log.info(
                "%s: slot cache of %d rows × %d tokens (%.1f MiB)", role, rows, max_len, self.cache.shape.bytes / 2**20
            )
            if self.limits.compile not in ("auto", "on", "off"):
                raise ValueError(f"--compile must be auto, on or off; got {self.limits.compile!r}")
            if self.limits.compile == "on" or (self.limits.compile == "auto" and lm.device.type in COMPILE_PAYS_ON):
                self.scheduler.compile()

    @property
    def batches(self) -> bool:
        """Sessions may run on threads of their own: their forwards meet in the scheduler."""
        return self.scheduler is not None

    def info(self) -> ModelInfo:
        usage = self.cache.usage() if self.cache is not None else None
        return ModelInfo(
            model_name=self.lm.name,
            vocab_size=self.lm.vocab_size,
            tokenizer_fingerprint=self._fingerprint,
            eos_token_ids=self.lm.eos_token_ids,
            max_context=self.max_tokens,
            capabilities=["session", "propose", "branches", "verify", "entropy", "attention_stats"]
            + (["batching"] if self.batches else []),
            role=self.role,
            tokenizer_source=self.lm.tokenizer_source,
            device=str(self.lm.device),
            dtype=str(next(self.lm.model.parameters()).dtype).removeprefix("torch."),
            cache=usage,
        )

    @property
    def max_tokens(self) -> int:
        """The longest sequence a session may hold."""
        if self.cache is not None:
            return min(self.lm.max_context, self.cache.shape.max_len)
        return self.lm.max_context

    def new_session(self) -> EngineSession:
        kv: SessionKV
        if self.cache is not None and self.scheduler is not None:
            kv = SlotKV(self.cache, self.scheduler, self.limits.queue_timeout_s)
        else:
            kv = DynamicKV(self.lm)
        return EngineSession(self.lm, kv, self.max_tokens)

    def warmup(self) -> None:
        """One short generation, so the first request doesn't pay for lazy initialisation."""
        session = self.new_session()
        prompt = [i % self.lm.vocab_size for i in range(1, 9)]
        session.open(OpenRequest(prompt_ids=prompt, scoring=Scoring(ScoreKind.ARGMAX)))
        session.step(StepRequest(append_ids=[1], propose=2, propose_greedy=True))
        session.close()


def encode_probs(probs: torch.Tensor, config: ProcessingConfig) -> Scores:
    """Sparse (ids + probabilities, descending) when truncation left ≤ half the vocabulary."""
    vocab = probs.shape[-1]
    if config.truncates:
        support = int((probs > 0).sum(dim=-1).max())
        if support <= vocab // 2:
            values, ids = torch.topk(probs, support, dim=-1)
            ids = ids.to(torch.int32).masked_fill(values <= 0, -1)
            return Scores(ScoreKind.PROBS, sparse_ids=ids, sparse_values=values)
    return Scores(ScoreKind.PROBS, dense=probs)


def _encode_top(kind: ScoreKind, scores: torch.Tensor, top_n: int, dtype: torch.dtype) -> Scores:
    if 0 < top_n < scores.shape[-1]:
        values, ids = torch.topk(scores, top_n, dim=-1)
        return Scores(kind, sparse_ids=ids.to(torch.int32), sparse_values=values.to(dtype))
    return Scores(kind, dense=scores.to(dtype))


_LOGITS_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class SessionKV(Protocol):
    """Where a session's keys and values live, and how its forwards run."""

    cached: int  # leading positions of every branch held in the cache

    def open(self, branches: int) -> None: ...

    def crop(self, keep: int) -> None: ...

    def reorder(self, order: list[int]) -> None: ...

    def forward(
        self, tokens: torch.Tensor, start: int, positions: int, more: bool = False, attention: bool = False
    ) -> tuple[torch.Tensor, AttentionStats | None]:
        """Logits of each branch's last `positions` tokens, [branches, positions, vocab] float32,
        and with `attention` the last layer's attention statistics of the same [branches·positions]
        rows (`specwire.entropy_metrics`), from the same forward pass."""
        ...

    def close(self) -> None: ...


class DynamicKV:
    """transformers' own forward over one `DynamicCache`: any model, no batching."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.cache: DynamicCache | None = None
        self.cached = 0

    def open(self, branches: int) -> None:
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
        self, tokens: torch.Tensor, start: int, positions: int, more: bool = False, attention: bool = False
    ) -> tuple[torch.Tensor, AttentionStats | None]:
        """Attention statistics come from a probe on the last layer's attention function."""
        if self.cache is None:
            self.cache = DynamicCache()
        device = self.lm.device
        kwargs: dict[str, Any] = {}
        if self.lm.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = positions
        with attention_probe.capture(self.lm.model, positions if attention else 0) as probe:
            out = self.lm.model(
                input_ids=tokens[:, start:].to(device),
                attention_mask=torch.ones(tokens.shape, dtype=torch.long, device=device),
                past_key_values=self.cache,
                use_cache=True,
                **kwargs,
            )
        self.cached = int(tokens.shape[1])
        return out.logits[:, -positions:, :].float(), probe.stats if probe is not None else None

    def close(self) -> None:
        self.cache, self.cached = None, 0


class SessionClosed(StatusError):
    """The stream ended while this session's work was under way; nothing is left to answer."""

    code = grpc.StatusCode.CANCELLED


class SlotKV:
    """Rows of the service's slot cache (one per branch); forwards go through the scheduler.

    `close` may come from another thread while a forward or a wait for rows is under way: the
    rows are then released by the thread doing that work, when it ends.
    """

    def __init__(self, cache: SlotCache, scheduler: Scheduler, wait_s: float) -> None:
        self.cache = cache
        self.scheduler = scheduler
        self.wait_s = wait_s  # longest wait for free rows; `set_deadline` may shorten it
        self.rows: list[int] = []
        self.cached = 0
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
                self._release()

    def _release(self) -> None:
        rows, self.rows = self.rows, []
        if rows:
            self.cache.release(rows)

    def open(self, branches: int) -> None:
        self._enter()
        try:
            self._resize(branches)
            self.cached = 0
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
        finally:
            self._leave()

    def forward(
        self, tokens: torch.Tensor, start: int, positions: int, more: bool = False, attention: bool = False
    ) -> tuple[torch.Tensor, AttentionStats | None]:
        """`more`: the session's next forward follows at once (the scheduler waits for it).
        `attention`: the lean forward returns this job's last-layer scores (`ForwardJob`)."""
        job = self.run(ForwardJob(list(self.rows), tokens[:, start:], start, positions, more=more,
                                  want_attention=attention))
        assert job.logits is not None
        if not attention:
            return job.logits, None
        scores = job.attention_scores
        assert scores is not None  # [branches, heads, positions, keys], −inf where not attended to
        rows = scores.transpose(1, 2).flatten(0, 1)  # [branches·positions, heads, keys]
        # The last new token attends to every slot; earlier ones are causally masked.
        valid = None if positions == 1 else torch.isfinite(rows[:, 0])  # [branches·positions, keys]
        return job.logits, attention_stats(rows, valid)

    def set_deadline(self, seconds: float) -> None:
        """The caller's deadline is `seconds` away: wait no longer than that for rows."""
        self.wait_s = min(self.wait_s, max(0.0, seconds))

    def run(self, job: ForwardJob) -> ForwardJob:
        """Hook for tree verification (Medusa) and attention statistics (entropix): run `job`
        on this session's rows with its own positions, tree mask, hidden-state and attention
        requests (see `ForwardJob`). The rows then hold job.start + n positions; `keep_path`
        compacts an accepted subset. `forward` is this with the defaults (causal, logits only)."""
        self._enter()
        try:
            job.rows, job.owner = list(self.rows), self
            self.scheduler.run(job)
        finally:
            self._leave()
        self.cached = job.start + job.new_tokens
        return job

    def keep_path(self, start: int, kept: list[int]) -> None:
        """Keep the just-appended positions start+kept[i] (ascending offsets) at start+i in every
        row, and cut the rows there: an accepted tree path becomes an ordinary prefix."""
        self._enter()
        try:
            for row in self.rows:
                self.cache.keep_positions(row, start, kept)
            self.cached = start + len(kept)
        finally:
            self._leave()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self._busy:
                self._release()
        self.scheduler.forget(self)


class EngineSession:
    """One generation's branches and tokens, its keys and values in a `SessionKV`.

    Used from one thread at a time (`close` excepted, see `SlotKV`).
    """

    def __init__(self, lm: CausalLM, kv: SessionKV, max_tokens: int) -> None:
        self.lm = lm
        self.kv = kv
        self.max_tokens = max_tokens
        self.tokens = torch.empty((1, 0), dtype=torch.long)  # [branches, length], on CPU
        self.processing = ProcessingConfig()
        self.forward_calls = 0

    @property
    def num_branches(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def open(self, request: OpenRequest) -> StepResult:
        if not request.prompt_ids:
            raise InvalidArgument("prompt_ids", "must not be empty")
        if not 1 <= request.num_branches <= MAX_BRANCHES:
            raise InvalidArgument("num_branches", f"must be in [1, {MAX_BRANCHES}], got {request.num_branches}")
        check_token_ids(request.prompt_ids, self.lm.vocab_size, "prompt_ids")
        self._check_length(len(request.prompt_ids), "prompt_ids")
        self.processing = request.processing
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long).unsqueeze(0)
        self.tokens = prompt.expand(request.num_branches, -1).clone()
        self.kv.open(request.num_branches)
        return self._finish(request.scoring, 0, False, 0, 0.0)

    def step(self, request: StepRequest) -> StepResult:
        if request.tree_parents:
            raise InvalidArgument("tree_parents", "tree verification is not supported by this service")
        if request.keep_tokens is not None:
            self._truncate(request.keep_tokens)
        if request.branch_order:
            self._reorder(request.branch_order)
        if request.append_ids:
            self._append(request.append_ids)
        if not 0 <= request.propose <= MAX_PROPOSE:
            raise InvalidArgument("propose", f"must be in [0, {MAX_PROPOSE}], got {request.propose}")
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
        )

    def set_deadline(self, seconds: float) -> None:
        """The caller's deadline is `seconds` away (the servicer says so before `open`)."""
        set_deadline = getattr(self.kv, "set_deadline", None)
        if set_deadline is not None:
            set_deadline(seconds)

    def close(self) -> None:
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
        if self.kv.cached > keep:
            self.kv.crop(keep)

    def _reorder(self, order: list[int]) -> None:
        if not 1 <= len(order) <= MAX_BRANCHES or any(not 0 <= i < self.num_branches for i in order):
            raise InvalidArgument("branch_order", f"indices must be in [0, {self.num_branches}), at most {MAX_BRANCHES}")
        self.kv.reorder(order)
        self.tokens = self.tokens.index_select(0, torch.tensor(order, dtype=torch.long))

    def _append(self, ids: list[int]) -> None:
        if len(ids) % self.num_branches:
            raise InvalidArgument("append_ids", f"{len(ids)} ids do not split evenly over {self.num_branches} branches")
        check_token_ids(ids, self.lm.vocab_size, "append_ids")
        per_branch = len(ids) // self.num_branches
        self._check_length(self.length + per_branch, "append_ids")
        new = torch.tensor(ids, dtype=torch.long).view(self.num_branches, per_branch)
        self.tokens = torch.cat([self.tokens, new], dim=1)

    # -- forward passes ------------------------------------------------------------------

    def _forward(self, positions: int, more: bool = False) -> torch.Tensor:
        """Logits for each branch's last `positions` tokens: [branches, positions, vocab] float32.
        `more`: another forward of this message follows right away."""
        return self._forward_measured(positions, more, attention=False)[0]

    def _forward_measured(
        self, positions: int, more: bool, attention: bool
    ) -> tuple[torch.Tensor, AttentionStats | None]:
        """`_forward`, and with `attention` the positions' attention statistics from the same pass."""
        start = min(self.kv.cached, self.length - positions)
        if start < self.kv.cached:
            self.kv.crop(start)
        logits, stats = self.kv.forward(self.tokens, start, positions, more, attention)
        self.forward_calls += 1
        return logits, stats

    def _score(self, scoring: Scoring, more: bool = False) -> Scores | None:
        if scoring.kind == ScoreKind.NONE:
            return None
        positions = scoring.positions
        if not 1 <= positions <= self.length:
            raise InvalidArgument("scoring.positions", f"must be in [1, {self.length}], got {positions}")
        score_ids = self._score_ids(scoring)  # checked before paying for a forward pass
        extras = scoring.extras
        logits, attention = self._forward_measured(positions, more, extras.attention_stats)  # [branches, positions, vocab]
        metrics = None
        if extras.wanted:  # of the raw distribution, before any processor, on the device
            entropy, varentropy = token_entropy(logits.flatten(0, 1))  # [branches·positions] each
            metrics = PositionMetrics(entropy, varentropy, attention)
        scores = self._encode_scores(scoring, self._process_positions(scoring, logits), score_ids)
        scores.metrics = metrics
        return scores

    def _process_positions(self, scoring: Scoring, logits: torch.Tensor) -> torch.Tensor:
        """[branches, positions, vocab] raw logits processed for `scoring.kind`, each position
        with its own history: [branches·positions, vocab]."""
        positions = logits.shape[1]
        per_position = []
        for j in range(positions):
            history = self.tokens[:, : self.length - positions + j + 1].to(logits.device)
            per_position.append(self._process(scoring, logits[:, j], history))
        return torch.stack(per_position, dim=1).flatten(0, 1)

    def _encode_scores(self, scoring: Scoring, processed: torch.Tensor, score_ids: torch.Tensor | None) -> Scores:
        """What `scoring` asks for from processed [branches·positions, vocab] scores."""
        config = self.processing
        if scoring.kind == ScoreKind.ARGMAX:
            return Scores(ScoreKind.ARGMAX, argmax_ids=processed.argmax(dim=-1).to(torch.int32))
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
        drafts are the last γ tokens, q comes with the request, the draws from its seed."""
        calls_before = self.forward_calls
        draft_probs = self._draft_probs(verify.draft_probs)  # [γ, vocab] float32, on CPU
        gamma = int(draft_probs.shape[0])
        if self.num_branches != 1:
            raise InvalidArgument("verify", f"needs one branch, the session has {self.num_branches}")
        if scoring.kind != ScoreKind.PROBS or scoring.positions != gamma + 1:
            raise InvalidArgument(
                "verify", f"needs scoring PROBS at γ + 1 = {gamma + 1} positions, got {scoring.kind.name} at {scoring.positions}"
            )
        if not 1 <= scoring.positions <= self.length:
            raise InvalidArgument("scoring.positions", f"must be in [1, {self.length}], got {scoring.positions}")
        drafts = self.tokens[0, self.length - gamma :]  # [γ]
        if bool((draft_probs.gather(-1, drafts.unsqueeze(-1)) <= 0).any()):
            raise InvalidArgument("verify.draft_probs", "q of each drafted token must be > 0")
        target_probs = self._processed(scoring).float().cpu()  # [γ+1, vocab]
        generator = torch.Generator().manual_seed(verify.seed)
        accepted_len, next_token = accept_draft(drafts, draft_probs, target_probs, generator)
        return StepResult(
            num_tokens=self.length,
            verdict=Verdict(accepted_len, next_token),
            timing=ServerTiming(forward_calls=self.forward_calls - calls_before),
        )

    def _draft_probs(self, scores: Scores) -> torch.Tensor:
        """`Verify.draft_probs` as checked dense rows: [γ, vocab] float32."""
        vocab = self.lm.vocab_size
        ids, values, dense = scores.sparse_ids, scores.sparse_values, scores.dense
        if dense is not None:
            rows = dense.float()
            if rows.dim() != 2 or rows.shape[1] != vocab:
                raise InvalidArgument("verify.draft_probs", f"dense rows must be [γ, {vocab}], got {list(rows.shape)}")
        elif ids is not None and values is not None:
            if ids.dim() != 2 or ids.shape != values.shape:
                raise InvalidArgument("verify.draft_probs", "sparse ids and values must both be [γ, k]")
            if bool(((ids < -1) | (ids >= vocab)).any()):
                raise InvalidArgument("verify.draft_probs", f"sparse ids must be -1 (padding) or in [0, {vocab})")
            rows = scores.to_dense(vocab, 0.0)
        else:
            raise InvalidArgument("verify.draft_probs", "must carry dense rows or sparse ids and values")
        if rows.shape[0] > MAX_PROPOSE:
            raise InvalidArgument("verify.draft_probs", f"at most {MAX_PROPOSE} rows, got {rows.shape[0]}")
        if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()) or bool((rows > 1).any()):
            raise InvalidArgument("verify.draft_probs", "probabilities must be finite and in [0, 1]")
        return rows

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

    def _propose(self, count: int, greedy: bool, seed: int, min_confidence: float) -> tuple[torch.Tensor, Scores | None]:
        """Draw up to `count` tokens per branch; the last drawn token stays pending."""
        generator = None
        if not greedy:
            generator = torch.Generator(device=self.lm.device)
            generator.manual_seed(seed)
        drawn: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for index in range(count):
            logits = self._forward(1, more=index + 1 < count)[:, 0]  # [branches, vocab]
            history = self.tokens.to(logits.device)
            gated = index > 0 and min_confidence > 0  # the confidence is only worked out when it can stop
            if greedy:
                scores = greedy_scores(logits, history, self.processing)
                token = scores.argmax(dim=-1, keepdim=True)
                confidence = scores.softmax(dim=-1).amax(dim=-1).min() if gated else None
            else:
                probs = sampling_probs(logits, history, self.processing)
                token = torch.multinomial(probs, 1, generator=generator)
                confidence = probs.amax(dim=-1).min()
                dists.append(probs)
            if gated and float(cast(torch.Tensor, confidence)) < min_confidence:
                if dists:
                    dists.pop()
                break
            drawn.append(token.cpu())
            self.tokens = torch.cat([self.tokens, drawn[-1]], dim=1)
        proposed = torch.cat(drawn, dim=1).to(torch.int32)
        if greedy:
            return proposed, None
        probs = torch.stack(dists, dim=1).flatten(0, 1)  # [branches·n, vocab]
        return proposed, encode_probs(probs, self.processing)

    def _finish(
        self, scoring: Scoring, propose: int, greedy: bool, seed: int, min_confidence: float, ids_only: bool = False
    ) -> StepResult:
        calls_before = self.forward_calls
        scores = self._score(scoring, more=propose > 0)
        proposed, proposal_scores = None, None
        if propose > 0:
            self._check_length(self.length + propose, "propose")
            proposed, proposal_scores = self._propose(propose, greedy, seed, min_confidence)
            if ids_only:
                proposal_scores = None
        if self.lm.device.type == "cuda":
            # Whoever times this call (the servicer, a LocalSession) must see the GPU work in it.
            torch.cuda.synchronize(self.lm.device)
        return StepResult(
            scores=scores,
            proposed_ids=proposed,
            proposal_scores=proposal_scores,
            num_tokens=self.length,
            timing=ServerTiming(forward_calls=self.forward_calls - calls_before),
        )
