"""Continuous batching: every forward takes whatever the concurrent sessions have ready.

Each session runs on its own thread and hands its forward (a `ForwardJob`: its rows, their new
tokens, where they start) to the service's `Scheduler`. One thread of the scheduler runs every
forward, with every job queued by then; sessions that arrive during a forward are served
together by the next one. A decode round (k tokens drawn one after another) is one job of k
steps: the forward thread runs its step in every forward and calls the job's `pick` to choose
the next tokens, so the session's thread sleeps until the round is done instead of waking for
every token.

One thread, because each thread that runs torch's parallel loops keeps a pool of OpenMP workers
of its own: with more pools than cores, libgomp's workers stop spinning between loops and sleep
instead, and every loop pays a wake-up (Gemma-3-270M int8 on 2 cores: a decode step run from a
second thread took 41–44 ms instead of 30). So the threads that hand jobs in compute on one
thread (`compute_on`, which also keeps torch from raising the count again at the thread's first
parallel loop: one such pool made the compiled decode step 31–34 ms instead of 20–22), and the
background compiler's thread ends when it has nothing to compile.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import glob
import logging
import os
import queue
import statistics
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, TypeVar, cast

import torch

from specwire.engine import kernels
from specwire.engine.batch_costs import BatchCosts
from specwire.engine.cache import SlotCache
from specwire.engine.forward import (
    FUSED_TOP_K,
    ForwardBatch,
    ForwardOutput,
    FusedSampling,
    LeanModel,
    decode_steps,
    row_keys,
)
from specwire.engine.trimmed_vocab import TargetVocabHead
from specwire.entropy_metrics import AttentionStats, PositionMetrics
from specwire.errors import ResourceExhausted
from specwire.processing import ProcessingConfig

log = logging.getLogger("specwire")

# Jobs longer than this (prefills) run in a forward of their own, chunked to this size, so a
# long prompt neither pads the decoders' batch nor holds them up for one long call.
PREFILL_CHUNK = 64
# Compiled CPU engines run up to this many decode steps in one call when every job of a forward
# is a plain greedy round (`ForwardJob.fuse_greedy`) or a sampled one fused steps can draw for
# (`ForwardJob.sampling`), as many as at least half of its rows have left, 2 at the least (`_fused`).
FUSED_STEPS = 4
# A session away for t (its usual time between jobs) is due back within DUE_SHARE·t of then, or
# half a forward where that is more (`Scheduler._due`).
DUE_SHARE = 0.1
# The forward thread exits after this long without a job, and a new one starts with the next.
IDLE_EXIT_S = 5.0
T = TypeVar("T")
_caller = threading.local()  # `single`: this thread computes on one thread


@dataclass(frozen=True)
class JobSampling:
    """A sampled decode round's warpers and the uniform of each of its draws, [steps, rows]
    float64: `pick` draws step i with `uniforms[i]`, and fused steps with the same. `ahead`, if
    given, gets a fused call's logits [rows, steps, vocab] before `pick` takes its steps one by
    one, and None after: warping and drawing every step at once costs what one step does."""

    config: ProcessingConfig
    uniforms: torch.Tensor
    ahead: Callable[[torch.Tensor | None], None] | None = None

    @staticmethod
    def fusable(config: ProcessingConfig) -> bool:
        """Warpers `fused_draw` applies: no penalties, top-k in [1, FUSED_TOP_K], one token kept."""
        return (not config.has_penalties and 0 < config.top_k <= FUSED_TOP_K and config.temperature > 0
                and config.min_tokens_to_keep == 1)


@dataclass
class ForwardJob:
    """Rows of one session with the same new-token count. Results are filled in by the scheduler."""

    rows: list[int]
    tokens: torch.Tensor  # [rows, n] long, CPU
    start: int  # cache slot of the first new token (the rows' tokens before it are cached)
    keep: int  # logits for the last `keep` new tokens of each row
    positions: torch.Tensor | None = None  # [rows, n]; None = start + arange(n)
    tree_mask: torch.Tensor | None = None  # [n, n] bool: new token i sees new token j; None = causal
    want_hidden: bool = False
    want_metrics: bool = False  # entropix's metrics of the `keep` tokens (`PositionMetrics`)
    owner: object = None  # the session the job comes from
    more: bool = False  # the owner sends its next job right after this one
    # A decode round: up to `steps` forwards. After each, `pick(logits [rows, vocab] of the last
    # token)` returns the rows' next tokens [rows, 1] (forwarded next, as one new token each) or
    # None to end the round early. It runs on the scheduler's forward thread; the owner is waiting.
    steps: int = 1
    pick: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    # `pick` takes the argmax of the raw logits (greedy, no penalties, no confidence gate), so
    # the scheduler may run up to FUSED_STEPS steps in one compiled call, each fed the argmax of
    # the one before; `pick` still chooses every token, and where it differs (a tie broken
    # otherwise) the round goes on unfused from there.
    fuse_greedy: bool = False
    # A sampled round fused steps can draw for (no penalties, no confidence gate, top-k in
    # [1, FUSED_TOP_K]): fed each step's draw with the uniform `pick` takes for it (`fused_draw`),
    # and `pick` still chooses every token, as for `fuse_greedy`.
    sampling: JobSampling | None = None
    # `pick` takes logits over a trimmed draft's K ids alone: a scheduler whose model has such a
    # head computes those (`ForwardBatch.narrow`) and scatters them into the target's vocabulary
    # only for the jobs that do not take them.
    narrow: bool = False
    forwards: int = 0  # run so far
    batch_rows: int = 0  # rows of the largest forward it rode in
    # results
    logits: torch.Tensor | None = None  # [rows, keep, vocab] float32
    hidden: torch.Tensor | None = None  # [rows, n, hidden]
    # With `want_metrics`: token entropy, varentropy and the last layer's attention statistics
    # of the `keep` tokens whose logits are returned, each [rows, keep].
    metrics: PositionMetrics | None = None
    error: BaseException | None = None
    done: bool = False
    _wake: threading.Event = field(default_factory=threading.Event)  # set when done

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class _Call:
    """Work for the forward thread (`Scheduler.call`) and its outcome."""

    work: Callable[[], Any]
    owner: object = None  # the session whose forward follows it
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    then: Callable[[Any, BaseException | None], None] | None = None  # `Scheduler.post`'s

    def run(self) -> None:
        """The work; `finish` is the caller's to call."""
        try:
            self.result = self.work()
        except BaseException as error:  # the caller raises it; the forward thread goes on
            self.error = error

    def finish(self) -> None:
        self.done.set()
        if self.then is not None:
            try:
                self.then(self.result, self.error)
            except Exception:  # the poster's bug: the forward thread goes on
                log.exception("a posted call's continuation")


@dataclass
class SchedulerStats:
    forwards: int = 0
    rows: int = 0  # summed over forwards: rows per forward = rows / forwards
    max_rows: int = 0  # the widest forward so far
    busy_s: float = 0.0


class Scheduler:
    """Runs `ForwardJob`s over one model and one slot cache, batching whatever is queued.

    A session with two forwards in one message (scores, then a decode round) comes back with
    its next job a moment after the first was served; so does one whose caller answers at once
    (a speculative round: verify, accept, verify again), as its own past returns show. The
    forward thread, about to start a forward while such a session is still missing, waits for
    it, up to half the last forward's time, so the streams stay in step instead of splitting into
    groups that take turns (8 verifying sessions on Gemma-3-270M: 4.0 rows a forward without
    this). Sessions slower to return than that are not waited for. A session alone never waits.
    """

    def __init__(self, model: LeanModel, cache: SlotCache, device: torch.device, row_invariant: bool = False) -> None:
        # Activation-quantised linears turn ~1e-7 differences in attention into other tokens:
        # with this set, attention gives a row the same bits in any batch (`row_attention`), so
        # batching never changes a session's output.
        self.row_invariant = row_invariant
        self.model = model
        self.cache = cache
        self.device = device
        self._mutex = threading.Lock()
        self._arrived = threading.Condition(self._mutex)
        self._queue: list[ForwardJob] = []
        self._calls: list[_Call] = []  # `call`s waiting for the forward thread
        self._worker: threading.Thread | None = None  # runs every forward (`_run_forwards`)
        self.compile_failures: list[Shape] = []  # shapes served eagerly: their compile raised
        self._exiting = False  # the interpreter is exiting: the forward thread ends now (`_end_forward_threads`)
        _SCHEDULERS.add(self)
        self._threads = torch.get_num_threads()  # the forward thread's, as set where the engine is made
        head = getattr(model, "lm_head", None)
        self._trimmed_head = head if isinstance(head, TargetVocabHead) else None  # forwards give its K logits
        self._awaited: set[int] = set()  # ids of owners served with `more` that have not come back
        self._served_at: dict[int, float] = {}  # owner id → when its last job ended
        self._return_s: dict[int, float] = {}  # owner id → its time from a job's end to its next (EMA)
        self._last_forward_s = 0.0
        self.stats = SchedulerStats()
        self.costs = BatchCosts()  # what its forwards took, by rows and width
        self._compiled: Callable[..., ForwardOutput] | None = None
        self._compiled_steps: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self.compile_s = 0.0  # how long `compile` took for the common shapes
        self._warm: set[tuple[bool, ...]] = set()  # `shape_key`s the compiled forward has run
        self._warm_steps: set[tuple[bool, int, bool]] = set()  # `steps_key`s of the fused steps compiled
        self._ready = False  # the common shapes are compiled
        self._background = False  # a compile thread takes the shapes serving meets
        self._compiler: threading.Thread | None = None  # that thread, while it has shapes to compile
        self._on_ready: Callable[[], None] | None = None  # run once the compiler is idle and gone
        self._pending: list[Shape] = []
        self._requested: set[Shape] = set()
        self._requests: queue.SimpleQueue[Shape] = queue.SimpleQueue()

    def compile(self, background: bool = False, on_ready: Callable[[], None] | None = None,
                short_steps: bool = True) -> bool:
        """Run forwards through `torch.compile`, shape by shape as each is compiled. On failure
        log why and stay eager. `background`: serve eagerly meanwhile and compile on a thread of
        its own (a service is SERVING in seconds, and each shape turns fast once compiled);
        `on_ready` runs once the compiler is idle, on a thread of its own (`_when_gone`); in the
        foreground, once the common shapes are compiled (`compiled`). `short_steps`: the
        model's decode step is short enough for a call's fixed cost to matter, so compile the
        fused decode steps (`decode_steps`) and a C++ kernel wrapper; both cut that cost, and
        both take minutes more to compile for a long model. Returns False when compilation
        failed (always True in the background, which reports through the log).

        CPU: graphs over symbolic shapes (rows, new tokens, slots looked at), so batches of any
        size run compiled code without recompiling; torch specialises sizes of 1, a run of
        consecutive rows (read in place) and entropix's metrics, hence a few graphs, one per
        `shape_key`. A forward whose key is not compiled yet runs eagerly and, in the
        background, has its key compiled: no session ever waits for a compiler. Compiled
        arithmetic is not bit-identical to eager (fused reductions): tokens equal, logits to
        ~1e-6. CUDA: CUDA graphs, which want static shapes, so rows are padded to powers of two
        and slots to multiples of 64, one graph per bucket (decode at 1, 2, 4, 8 rows compiled
        now). Compiled code is cached on disk (TORCHINDUCTOR_CACHE_DIR) for the next start.
        """
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                # The cache is written in place: static, or CUDA graphs would skip every forward.
                for tensor in self.cache.keys + self.cache.values:
                    torch._dynamo.mark_static_address(tensor)
                forward = torch.compile(self.model.forward, mode="reduce-overhead")
                steps = None
            else:
                # No per-call checks of sizes, strides and alignment; for short steps, the
                # wrapper that calls the kernels in C++: a decode step's ~30 µs of Python less.
                # No guards on the modules' attributes, which never change once served: dynamo's
                # look-up before each call 170 → 69 µs (the Gemma draft's 1-ms step).
                checks_off = ("size_asserts", "scalar_asserts", "alignment_asserts")
                options: dict[str, str | int | bool | Callable[..., Any]] = {"cpp_wrapper": short_steps}
                options.update(dict.fromkeys(checks_off, False))
                options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
                forward = torch.compile(self.model.forward, dynamic=True, options=options)
                steps = torch.compile(decode_steps, dynamic=True, options=options) if short_steps else None
        except Exception as error:  # a compiler that cannot even start: serve eagerly
            log.warning("torch.compile failed, serving eagerly: %s: %s", type(error).__name__, error)
            return False
        self._pending = [shape for shape in self._common_shapes(not cuda) if steps is not None or not shape.steps]
        if not background:
            _compile_settings()  # dynamo's config is per thread: this one compiles
            return self._compile_pending(forward, steps, on_ready)
        self._background = True
        self._start_compiler(self._compile_pending, forward, steps, on_ready)
        return True

    def _start_compiler(self, work: Callable[..., Any], *args: Any) -> None:
        """`work` on a compile thread of its own, with the forward thread's torch threads (inductor
        generates its kernels for the compiling thread's count) and the engine's dynamo settings."""
        def compile_thread() -> None:
            _compile_settings()  # dynamo's config is per thread
            compute_on(self._threads)
            work(*args)

        with self._mutex:
            self._compiler = threading.Thread(target=compile_thread, name="specwire-compile", daemon=True)
            self._compiler.start()

    def _common_shapes(self, cpu: bool) -> list[Shape]:
        """The shapes compiled first, most used first. CPU: one row at a decode step, one
        session's fused steps (greedy and sampled, of each count) and several sessions' (greedy,
        of each count; fused rows are always gathered), a verification scored at its last or
        every token, gathered and consecutive rows (other sessions' decode steps and
        verifications, and both packed: rows of different widths, `ForwardBatch.packed`),
        entropix's steps with its metrics (a decode step, a prompt scored at its last token, a
        verification scored at every token and at its last few). CUDA: decode steps at 1, 2, 4
        and 8 rows."""
        if not cpu:
            return [Shape("gathered" if rows > 1 else "one", rows, 1, 1) for rows in (1, 2, 4, 8)]
        # One session's shorter and sampled fused calls too: met at once by speculative drafts,
        # whose compiling when met took the CPU from a bench's timed rounds.
        fused = [Shape("one", 1, 1, 1, steps=count, sampled=sampled) for sampled in (False, True)
                 for count in range(FUSED_STEPS, 1, -1)]
        fused_rows = [Shape("gathered", 3, 1, 1, steps=count) for count in range(FUSED_STEPS, 1, -1)]
        return [Shape("one", 1, 1, 1), *fused, Shape("one", 1, 3, 1), Shape("one", 1, 3, 3),
                Shape("gathered", 3, 1, 1), *fused_rows, Shape("gathered", 3, 3, 1),
                Shape("run", 3, 1, 1), Shape("run", 3, 3, 1),
                Shape("gathered", 3, 3, 3, packed=True), Shape("run", 3, 3, 3, packed=True),
                Shape("one", 1, 1, 1, metrics=True), Shape("one", 1, 3, 1, metrics=True),
                Shape("one", 1, 3, 3, metrics=True), Shape("one", 1, 4, 3, metrics=True)]

    def _compile_pending(self, forward: Callable[..., ForwardOutput], steps: Callable[..., Any] | None,
                         on_ready: Callable[[], None] | None) -> bool:
        """Compile the common shapes (`compiled` then), then in the background entropix's and
        whatever shape serving meets; without a background thread, those compile when met."""
        started = time.perf_counter()
        self._compiled, self._compiled_steps = forward, steps  # used for the warm keys alone
        try:
            while self._pending and not self._pending[0].metrics:  # entropix's shapes come after `compiled`
                self._compile_shape(self._pending.pop(0))
        except Exception as error:  # any compiler failure: serve eagerly
            self._compiled = self._compiled_steps = None
            self._compiler = None
            log.warning("torch.compile failed, serving eagerly: %s: %s", type(error).__name__, error)
            return False
        self.compile_s = time.perf_counter() - started
        self._ready = True
        log.info("compiled the forward (%s, %d shapes) in %.1f s", self.device.type, len(self._warm), self.compile_s)
        for shape in self._pending:
            self._request_shape(shape)
        self._pending = []
        if not self._background:
            if on_ready is not None:
                on_ready()
            return True
        self._on_ready = on_ready
        self._compile_requested()
        return True

    def _compile_requested(self) -> None:
        """Compile the shapes serving met that were not compiled yet, then end the thread: its
        OpenMP workers would otherwise slow the forward thread's (module docstring)."""
        while True:
            with self._mutex:
                if self._requests.empty():
                    on_ready, self._on_ready = self._on_ready, None
                    self._compiler = None if on_ready is None else threading.Thread(
                        target=self._when_gone, args=(threading.current_thread(), on_ready),
                        name="specwire-compile", daemon=True)
                    if self._compiler is not None:
                        self._compiler.start()
                    return
            shape = self._requests.get()
            try:
                self._compile_shape(shape)
            except Exception as error:  # that shape stays eager
                self.compile_failures.append(shape)
                log.warning("torch.compile failed for %s, served eagerly: %s: %s", shape, type(error).__name__, error)

    def _when_gone(self, compiler: threading.Thread, on_ready: Callable[[], None]) -> None:
        """`on_ready` once `compiler` has ended, then the shapes requested meanwhile. Timing on
        the compile thread would count its OpenMP pool's toll on the forward thread's (Gemma-3-270M
        int8: a decode step 33 ms there, 20.6 ms after it ended); `compiling` holds until done."""
        compiler.join()
        try:
            on_ready()
        except Exception:  # the earlier costs stand; `compiling` must still end
            log.exception("after compiling")
        _compile_settings()
        compute_on(self._threads)  # `on_ready`'s jobs set this thread to one: compile for the forward thread's
        self._compile_requested()

    @property
    def threads(self) -> int:
        """The forward thread's torch threads."""
        return self._threads

    @property
    def compiling(self) -> bool:
        """The background compiler has shapes to compile (it slows serving meanwhile)."""
        return self._compiler is not None

    def _compile_shape(self, shape: Shape) -> None:
        """Run one forward of `shape` through the compiled code on rows no session owns (the
        scratch row, or a run of free rows) and mark its key compiled."""
        scratch = self.cache.scratch_row
        try:
            run = self.cache.allocate(shape.rows, timeout_s=0.0) if shape.kind == "run" else []
        except ResourceExhausted:  # every row is a session's: it waits for a later request
            self._requested.discard(shape)
            return
        try:
            rows = run or [scratch] * shape.rows
            # From slot 2 on: a job at slot 0 would look at one slot, and specialise that too.
            job = ForwardJob(rows, torch.zeros((len(rows), shape.tokens), dtype=torch.long), 2, shape.keep,
                             want_metrics=shape.metrics)
            jobs = [job]
            if shape.packed:  # the first row `tokens` wide, the others one
                jobs = [ForwardJob(rows[:1], job.tokens[:1], 2, shape.keep, want_metrics=shape.metrics),
                        ForwardJob(rows[1:], job.tokens[1:, :1], 2, 1, want_metrics=shape.metrics)]
            if shape.steps:
                assert self._compiled_steps is not None
                if shape.sampled:
                    uniforms = torch.full((shape.steps, len(rows)), 0.5, dtype=torch.float64)
                    job.sampling = JobSampling(ProcessingConfig(temperature=0.7, top_k=8, top_p=0.9), uniforms)
                self._forward_steps([job], shape.steps, self._compiled_steps)
                self._warm_steps.add(steps_key(len(rows), shape.steps, shape.sampled))
            else:
                self._forward(jobs, self._compiled, warm=True)
        finally:
            if run:
                self.cache.release(run)

    def _request(self, jobs: list[ForwardJob], batch: ForwardBatch, steps: int = 0, sampled: bool = False) -> None:
        """A shape serving met that is not compiled: compile it in the background."""
        contiguous = batch.contiguous_from is not None and not steps  # fused steps gather their rows
        rows = int(batch.input_ids.shape[0])
        kind = "one" if rows == 1 else "run" if contiguous else "gathered"
        width = int(batch.input_ids.shape[1])
        picked = 0 if batch.logit_index is None else int(batch.logit_index.shape[0])
        tokens = 1 if width == 1 else min(width, 4)
        keep = 1 if picked <= rows else tokens if picked == rows * width else 2  # the last, all, or some
        metrics = any(job.want_metrics for job in jobs)
        self._request_shape(Shape(kind, 1 if rows == 1 else 3, tokens, keep, metrics, steps, batch.packed is not None,
                                  sampled))

    def _request_shape(self, shape: Shape) -> None:
        with self._mutex:
            if shape in self._requested or not self._background:
                return
            self._requested.add(shape)
            self._requests.put(shape)
            start = self._ready and self._compiler is None  # before `compiled`, the first thread takes it
        if start:
            self._start_compiler(self._compile_requested)

    @property
    def compiled(self) -> bool:
        """Forwards run compiled code (after `compile`, once its common shapes are)."""
        return self._ready

    def time_decode_step(self, rows: int, start: int, repeats: int = 200) -> tuple[float, float | None]:
        """Median ms of one decode step of cache rows 0..rows−1 (free ones) at `start` cached
        positions, batch building and logits included, no token choice: one forward, and a step
        of fused greedy steps (None where they are not compiled). The rows' lengths go back to 0."""
        if rows > self.cache.scratch_row:
            raise ValueError(f"rows must be ≤ {self.cache.scratch_row}, got {rows}")
        self.cache.forget_kept(range(rows))

        def job() -> ForwardJob:  # as a proposal's step: a trimmed draft's logits stay K wide
            return ForwardJob(list(range(rows)), torch.zeros((rows, 1), dtype=torch.long), start, 1, narrow=True)

        try:
            single = self._median_ms(lambda: self._forward([job()]), repeats)
            fused = self._median_ms(lambda: self._forward_steps([job()]), repeats, FUSED_STEPS) if self._compiled_steps else None
        finally:
            for row in range(rows):
                self.cache.lengths[row] = 0
        return single, fused

    def time_verification(self, rows: int, width: int, start: int, repeats: int = 50) -> float:
        """Median ms of one forward of `rows` sessions' rows of `width` new positions each, every
        position scored, packed as the sessions' verifications are; compiled first where the
        scheduler compiles. The rows' lengths go back to 0."""
        if rows > self.cache.scratch_row:
            raise ValueError(f"rows must be ≤ {self.cache.scratch_row}, got {rows}")
        self.cache.forget_kept(range(rows))
        owners = [object() for _ in range(rows)]

        def jobs() -> list[ForwardJob]:
            return [ForwardJob([row], torch.zeros((1, width), dtype=torch.long), start, width, owner=owners[row])
                    for row in range(rows)]

        try:
            self._forward(jobs(), warm=True)
            return self._median_ms(lambda: self._forward(jobs()), repeats)
        finally:
            for row in range(rows):
                self.cache.lengths[row] = 0

    def _median_ms(self, step: Callable[[], object], repeats: int, per: int = 1) -> float:
        """Median ms of `step` over `repeats` runs after 5 unmeasured ones, divided by `per`."""
        for _ in range(5):
            step()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            step()
            synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3 / per

    def forget(self, owner: object) -> None:
        """`owner` sends no more jobs (its session closed): stop expecting it."""
        with self._mutex:
            self._awaited.discard(id(owner))
            self._served_at.pop(id(owner), None)
            self._return_s.pop(id(owner), None)
            self._arrived.notify_all()

    def call(self, work: Callable[[], T], owner: object = None) -> T:
        """`work()` run on the forward thread, before its next forward, and its result: work that
        sessions do between their forwards (a feature drafter's steps) computes on that thread's
        cores, not on a second OpenMP pool (module docstring), and never beside a forward.
        `owner`: the session whose job follows; the next forward waits for it, as for one served
        with `more` (`Scheduler`), so sessions drafting in turn still verify together. Work that
        runs on the forward thread already (a call's) runs in place."""
        if self._on_forward_thread():
            return work()
        _compute_single()
        waiting = _Call(work, owner)
        with self._mutex:
            self._calls.append(waiting)
            self._arrived.notify_all()
            self._start_worker()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return cast(T, waiting.result)

    def post(self, work: Callable[[], T], then: Callable[[T | None, BaseException | None], None]) -> None:
        """`call` without a thread waiting for it: `then(result, error)` runs on the forward
        thread once `work` has. An event loop hands a lone step straight to that thread this way,
        with no thread of its own to wake at either end (the served Gemma-3-270M pair's
        speculation: 186.7 against 171.0 tok/s, docs/engine.md)."""
        with self._mutex:
            self._calls.append(_Call(work, then=then))
            self._arrived.notify_all()
            self._start_worker()

    def _start_worker(self) -> None:
        """Under `_mutex`: start the forward thread unless it runs."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._run_forwards, name="specwire-forward", daemon=True)
            _FORWARD_THREADS.add(self._worker)
            self._worker.start()

    def _on_forward_thread(self) -> bool:
        return threading.current_thread() is self._worker

    def run(self, job: ForwardJob) -> ForwardJob:
        """Queue `job` and return once the forward thread has its results in. The calling thread
        computes on one thread from then on (module docstring). From a call's work, on the forward
        thread, the forward runs there and then (`_run_here`)."""
        here = self._on_forward_thread()
        if not here:
            _compute_single()
        if job.new_tokens > PREFILL_CHUNK and job.tree_mask is None and job.positions is None:
            if job.pick is None:
                return self._run_chunked(job)
            # A decode round after a long append: the append's prefix first, chunked.
            head = job.new_tokens - 1
            self._run_chunked(ForwardJob(job.rows, job.tokens[:, :head], job.start, 1))
            job.tokens, job.start = job.tokens[:, head:], job.start + head
        if here:
            return self._run_here(job)
        with self._mutex:
            self._queue.append(job)
            owner = id(job.owner)
            if owner in self._served_at:
                back = time.perf_counter() - self._served_at.pop(owner)
                old = self._return_s.get(owner)
                self._return_s[owner] = back if old is None else 0.7 * old + 0.3 * back
            if self._awaited:
                self._awaited.discard(owner)
            self._arrived.notify_all()
            self._start_worker()
        job._wake.wait()
        if job.error is not None:
            raise job.error
        return job

    def _run_here(self, job: ForwardJob) -> ForwardJob:
        """`run` on the forward thread, from a call's work (a lone session's step,
        `SlotKV.compute_step`): the queued calls first, then one forward of the job with every
        job queued meanwhile, until the job is done. No hand-off to another thread and back."""
        with self._mutex:
            self._queue.append(job)
        while not job.done:
            with self._mutex:
                calls, self._calls = self._calls, []
                batch, self._queue = self._queue, []
            self._run_calls(calls)
            self._execute_batch(batch)
        if job.error is not None:
            raise job.error
        return job

    def _run_calls(self, calls: list[_Call]) -> None:
        for waiting in calls:
            waiting.run()
            with self._mutex:  # awaited before its owner can send the job
                if waiting.owner is not None and waiting.error is None:
                    self._awaited.add(id(waiting.owner))
            waiting.finish()

    def _execute_batch(self, batch: list[ForwardJob]) -> None:
        """Forward `batch`; the jobs whose rounds go on are queued again, before any newer."""
        if not batch:
            return
        # A job wider than PREFILL_CHUNK (a wide tree) runs alone: nothing pads past SLACK.
        wide = [job for job in batch if job.new_tokens > PREFILL_CHUNK]
        try:
            for group in [[job] for job in wide] + [[job for job in batch if job.new_tokens <= PREFILL_CHUNK]]:
                if group:
                    self._execute(group)
        except BaseException as error:  # a bug outside the forward: its jobs fail, serving goes on
            log.exception("forward thread")
            for job in batch:
                if not job.done:
                    job.error, job.done = error, True
                    job._wake.set()
        with self._mutex:
            self._queue = [job for job in batch if not job.done] + self._queue  # rounds going on

    def _run_chunked(self, job: ForwardJob) -> ForwardJob:
        """A long prefill as a sequence of PREFILL_CHUNK-token jobs, batched with the others."""
        n = job.new_tokens
        metrics: list[PositionMetrics] = []
        for begin in range(0, n, PREFILL_CHUNK):
            end = min(n, begin + PREFILL_CHUNK)
            keep = min(end - begin, max(0, job.keep - (n - end)))  # of this chunk's tokens
            wanted = job.want_metrics and keep > 0
            part = self.run(
                ForwardJob(job.rows, job.tokens[:, begin:end], job.start + begin, max(keep, 1),
                           want_hidden=job.want_hidden, want_metrics=wanted)
            )
            job.batch_rows = max(job.batch_rows, part.batch_rows)
            if part.hidden is not None:  # [rows, chunk, hidden]
                job.hidden = part.hidden if job.hidden is None else torch.cat([job.hidden, part.hidden], 1)
            if keep > 0:
                assert part.logits is not None
                job.logits = part.logits[:, -keep:] if job.logits is None else torch.cat([job.logits, part.logits[:, -keep:]], 1)
            if wanted:
                assert part.metrics is not None  # [rows, keep] each
                metrics.append(part.metrics)
        if metrics:
            job.metrics = _join_metrics(metrics)
        job.done = True
        return job

    def _run_forwards(self) -> None:
        """The forward thread: run forwards over the queue while there are jobs; exit after
        IDLE_EXIT_S without any (its OpenMP workers go with it)."""
        compute_on(self._threads)
        # CUDA: no OpenMP pool to give back, and a new thread would record its CUDA graphs again.
        idle_exit_s = IDLE_EXIT_S if self.device.type != "cuda" else None
        while True:
            with self._mutex:
                if not self._arrived.wait_for(lambda: bool(self._queue or self._calls) or self._exiting,
                                              timeout=idle_exit_s) or (self._exiting and not self._queue):
                    self._worker = None
                    for waiting in self._calls:  # exiting: they fail rather than hang
                        waiting.error = RuntimeError("scheduler: the forward thread ended")
                        waiting.finish()
                    self._calls = []
                    return
                due, wait_s = self._due() if not self._calls else (set(), 0.0)
                self._awaited |= due
                if self._awaited and not self._calls:
                    self._arrived.wait_for(lambda: not self._awaited or bool(self._calls),
                                           timeout=max(self._last_forward_s / 2, wait_s))
                    if not self._calls:
                        self._awaited.clear()  # the late ones join a later forward
                calls, self._calls = self._calls, []
                if calls:  # before the forward, whose sessions may be among their callers'
                    batch = []
                else:
                    batch, self._queue = self._queue, []
            self._run_calls(calls)
            self._execute_batch(batch)

    def _execute(self, jobs: list[ForwardJob]) -> None:
        started = time.perf_counter()
        count = _fused(jobs) if self._compiled_steps is not None else 0
        fused = count > 1 and self._steps_warm(jobs, count)
        fed = torch.empty(0)
        width = 1
        try:
            if fused:
                fed = self._forward_steps(jobs, count)
            else:
                width = self._forward(jobs)
        except BaseException as error:  # every waiter must wake, with the reason
            for job in jobs:
                job.error = error
        forwards = count if fused else 1
        self.stats.forwards += forwards
        rows = sum(len(job.rows) for job in jobs)
        self.stats.rows += rows * forwards
        self.stats.max_rows = max(self.stats.max_rows, rows)
        elapsed = time.perf_counter() - started
        self.stats.busy_s += elapsed
        if all(job.error is None for job in jobs):
            self.costs.record(rows, width, elapsed * 1e3 / forwards)
        for job in jobs:
            job.batch_rows = max(job.batch_rows, rows)
        with self._mutex:
            self._last_forward_s = elapsed / forwards
            self._awaited |= {id(job.owner) for job in jobs if job.more and job.owner is not None}
        first = 0
        for job in jobs:
            count = len(job.rows)
            if job.error is None and fused:
                going_on = self._next_steps(job, fed[first : first + count])
            else:
                job.forwards += 1
                going_on = job.error is None and job.pick is not None and self._next_step(job)
            first += count
            if not going_on:
                job.done = True
                self._expect_back(job)
                job._wake.set()

    def _due(self) -> tuple[set[int], float]:
        """Owners away whose usual return (`_return_s`) falls within its slack of now (DUE_SHARE
        of their time away, or half a forward), and how long to wait for the last of them:
        sessions that left together come back together (a speculative round's verifications all
        answered by one forward, then each session's draft step), so a forward for the first of
        them waits for the rest rather than splitting them into groups. One later than its slack
        is not waited for again."""
        now, half = time.perf_counter(), self._last_forward_s / 2
        due, wait_s = set(), 0.0
        for owner, left in self._served_at.items():
            away = self._return_s.get(owner)
            if away is None:
                continue
            slack = max(half, DUE_SHARE * away)
            if abs(left + away - now) <= slack:
                due.add(owner)
                wait_s = max(wait_s, left + away + slack - now)
        return due, wait_s

    def _expect_back(self, job: ForwardJob) -> None:
        """`job` ended: await its owner before the next forward where it has been back within
        half a forward before (`Scheduler`)."""
        if job.owner is None or job.error is not None:
            return
        owner = id(job.owner)
        with self._mutex:
            self._served_at[owner] = time.perf_counter()
            if self._return_s.get(owner, float("inf")) < self._last_forward_s / 2:
                self._awaited.add(owner)

    def _next_steps(self, job: ForwardJob, fed: torch.Tensor) -> bool:
        """After fused steps (`fed`: the tokens [rows, steps] the forward chose): the round's
        `pick` chooses each step's tokens in turn, up to where it differs from what the forward
        fed itself; True when the round goes on (unfused, from a difference)."""
        assert job.logits is not None  # [rows, steps, vocab or a trimmed draft's K]
        logits, steps = job.logits, int(fed.shape[1])
        ahead = job.sampling.ahead if job.sampling is not None else None
        going_on = True
        try:
            if ahead is not None:
                ahead(logits)
            for step in range(steps):
                job.logits = logits[:, step : step + 1]
                job.forwards += 1
                going_on = self._next_step(job)
                if not going_on or (step + 1 < steps and not torch.equal(job.tokens, fed[:, step : step + 1])):
                    break
        except BaseException as error:  # from `ahead`: the owner raises it
            job.error, going_on = error, False
        finally:
            if ahead is not None:
                ahead(None)
        for row in job.rows:  # cached: the tokens forwarded and kept (the last chosen is not yet)
            self.cache.lengths[row] = job.start + (0 if going_on else 1)
        return going_on

    @staticmethod
    def _next_step(job: ForwardJob) -> bool:
        """Pick a decode round's next tokens; True when the round goes on with another forward."""
        assert job.pick is not None and job.logits is not None
        try:
            tokens = job.pick(job.logits[:, -1])
        except BaseException as error:  # the owner raises it
            job.error = error
            return False
        if tokens is None or job.forwards >= job.steps:
            return False
        job.start += job.new_tokens
        job.tokens = tokens
        return True

    def _steps_warm(self, jobs: list[ForwardJob], count: int) -> bool:
        """`count` fused steps of these jobs are compiled (else they are asked for, and the round
        runs step by step meanwhile)."""
        sampled = any(job.sampling is not None for job in jobs)
        key = steps_key(sum(len(job.rows) for job in jobs), count, sampled)
        if key in self._warm_steps:
            return True
        if self._background:
            self._request(jobs, self._build(jobs, steps=count), steps=count, sampled=sampled)
        elif self._compiled_steps is not None:  # compiled in place, as `compile` without background
            self._warm_steps.add(key)
            return True
        return False

    def _build(self, jobs: list[ForwardJob], steps: int = 1, **padding: Any) -> ForwardBatch:
        """`build_batch` for this cache; row-invariant keys with room for `steps` fused steps; a
        trimmed draft's K logits alone (`_for_job` scatters them for the jobs that need all ids)."""
        limit = self.cache.keys[0].shape[2] if self.row_invariant else 0
        batch = build_batch(jobs, self.device, self.cache.scratch_row, row_invariant=limit,
                            steps=steps if self.row_invariant else 1, **padding)
        batch.narrow = self._trimmed_head is not None
        return batch

    def _for_job(self, job: ForwardJob, logits: torch.Tensor) -> torch.Tensor:
        """A job's logits as it takes them: a trimmed draft's K, scattered over the target's
        vocabulary unless the job picks among those K alone (`ForwardJob.narrow`)."""
        if self._trimmed_head is None or job.narrow:
            return logits
        return self._trimmed_head.scatter(logits)

    @torch.inference_mode()
    def _forward_steps(self, jobs: list[ForwardJob], count: int = FUSED_STEPS,
                       steps: Callable[..., Any] | None = None) -> torch.Tensor:
        """`count` decode steps of fusable rounds (`_fused`) in one compiled call (`steps`,
        default the installed one): each job's logits [rows, count, vocab], or over a trimmed
        draft's K ids (its rounds pick among those alone); returns the tokens the forward fed
        itself."""
        steps = steps or self._compiled_steps
        assert steps is not None
        batch = self._build(jobs, steps=count)
        batch.logit_index = logit_index(jobs, 1, self.device)
        batch.dense = False  # guarded on (a mask or none): one graph
        # Rows gathered, never sliced: a slice's first row is a guard of the graph, and a session
        # at row 0 wanted a graph of its own, past dynamo's limit of 8 graphs, so its fused steps
        # ran eagerly (8 Gemma draft streams: 0.38× greedy's). Fused steps serve small models,
        # whose gathered keys are small.
        batch.contiguous_from = None
        batch.sampling = fused_sampling(jobs, count, self.device)
        _own_symbols(batch)
        fed, logits = steps(self.model, self.cache, batch, count)
        first = 0
        for job in jobs:
            job.logits = self._for_job(job, logits[first : first + len(job.rows)])
            first += len(job.rows)
        return fed

    @torch.inference_mode()
    def _forward(
        self, jobs: list[ForwardJob], forward: Callable[..., ForwardOutput] | None = None, warm: bool = False
    ) -> int:
        """One forward of `jobs`: through the compiled code where their shape is compiled (or
        `warm`: compile it now, through `forward`), else eagerly. Returns the width its cost
        follows (`BatchCosts`): the widest row's, or packed, the rows' mean, rounded up."""
        forward = forward or self._compiled
        metrics = any(job.want_metrics for job in jobs)
        cuda = self.device.type == "cuda"
        compiled = forward is not None and not (metrics and cuda)
        pad = compiled and cuda  # CUDA graphs: few static shapes
        batch = self._build(jobs, pad_rows=pad, key_multiple=64 if pad else 1, pack=not pad)
        batch.logit_index = logit_index(jobs, int(batch.input_ids.shape[1]), self.device, pad)
        if metrics:
            batch.metrics = True
            batch.score_rows, batch.score_tokens = score_selection(jobs, self.device)
        if compiled and not cuda:
            key = shape_key(batch)
            if warm or not self._background:
                self._warm.add(key)  # compiled now, in place
            elif key not in self._warm:
                compiled = False
                self._request(jobs, batch)
        if compiled:
            assert forward is not None
            # Guarded on (a mask or none): one graph. CUDA graphs would also specialise the first row.
            batch.dense = False
            if cuda:
                batch.contiguous_from = None
                _cuda_graphs_in_this_thread()
            else:
                _own_symbols(batch)
            out = forward(self.cache, batch)
            if cuda:  # a graph's outputs are its buffers, which its next replay overwrites
                hidden = out.hidden.clone() if any(job.want_hidden for job in jobs) else out.hidden
                out = ForwardOutput(hidden, out.logits.clone() if out.logits is not None else None)
        else:
            out = self.model.forward(self.cache, batch)
        assert out.logits is not None
        width = int(batch.score_tokens.shape[1]) if batch.score_tokens is not None else int(batch.input_ids.shape[1])
        # Attention statistics [R, K]: the asking jobs' rows in job order × K tokens, each row's last `keep` its own.
        per_row = out.metrics.attention.map(lambda t: t.view(-1, width)) if out.metrics and out.metrics.attention else None
        first = offset = scored = 0
        for job in jobs:
            count, n, size = len(job.rows), job.new_tokens, len(job.rows) * job.keep
            if job.want_hidden:
                job.hidden = out.hidden[first : first + count, :n]  # [rows, n, hidden]
            for row in job.rows:
                self.cache.lengths[row] = job.start + n
            job.logits = self._for_job(job, out.logits[offset : offset + size].view(count, job.keep, -1))
            if job.want_metrics:
                assert out.metrics is not None and per_row is not None
                job.metrics = PositionMetrics(  # token metrics: [P] like the logits
                    out.metrics.entropy[offset : offset + size].view(count, job.keep),
                    out.metrics.varentropy[offset : offset + size].view(count, job.keep),
                    per_row.map(itemgetter((slice(scored, scored + count), slice(width - job.keep, None)))),
                )
                scored += count
            first += count
            offset += size
        rows, width = batch.input_ids.shape
        return int(width) if batch.packed is None else -(-int(batch.packed.shape[0]) // int(rows))


@dataclass(frozen=True)
class Shape:
    """A forward's shape as compiled code specialises it: `kind` of rows ("one", a "run" of
    consecutive rows read in place, or "gathered" rows), new tokens per row (the first row's,
    where the others have one: `packed`), logits kept per row, entropix's metrics, fused decode
    steps (how many; 0: one forward), sampled or greedy."""

    kind: str
    rows: int
    tokens: int
    keep: int
    metrics: bool = False
    steps: int = 0
    packed: bool = False
    sampled: bool = False


_SCHEDULERS: weakref.WeakSet[Scheduler] = weakref.WeakSet()
_FORWARD_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _end_forward_threads() -> None:
    """End the forward threads before the interpreter finalises. One that ended later, its
    scheduler's last reference with it, would free tensors in a thread that can no longer take
    the GIL: the process aborts ("terminate called without an active exception")."""
    for scheduler in list(_SCHEDULERS):
        with scheduler._mutex:
            scheduler._exiting = True
            scheduler._arrived.notify_all()
    for thread in list(_FORWARD_THREADS):
        thread.join(timeout=IDLE_EXIT_S)


def _compute_single() -> None:
    """The calling thread, one that hands work to a forward thread, computes on one thread from
    now on (module docstring)."""
    if not getattr(_caller, "single", False):
        compute_on(1)
        _caller.single = True


def compute_on(threads: int) -> None:
    """This thread's parallel loops use `threads` threads. torch sets a thread's count at its
    first parallel loop to the count any thread set last, undoing a count set before then
    (torch 2.13): `get_num_threads` has that first-time set-up happen now, and so does each
    kernel's copy of it (`kernels.init_threads`). At one thread, the thread's OpenMP pool, if it
    made one, is given back (`_release_openmp_pool`)."""
    torch.get_num_threads()
    kernels.init_threads()
    torch.set_num_threads(threads)
    if threads == 1:
        _release_openmp_pool()


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its Linux wheels ship one), else None."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    try:
        return ctypes.CDLL(found[0]) if found else None
    except OSError:
        return None


def _release_openmp_pool() -> None:
    """End this thread's OpenMP workers (OpenMP 5.0 `omp_pause_resource_all`; libgomp frees the
    calling thread's pool alone). A thread that loaded a model with several threads keeps a pool
    whose idle workers count against libgomp's spinning budget for every thread: in-process, an
    engine created on the main thread decoded Gemma-3-270M int8 at 32 ms a token, 18 ms once the
    main thread's pool was gone (its int4 draft: 3.0 → 1.4 ms a drafted token; 2 cores)."""
    pause = getattr(_libgomp(), "omp_pause_resource_all", None)  # libgomp from GCC 9 on
    if pause is not None:
        pause(1)  # omp_pause_soft; the pool comes back if ever needed


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work, so that a timer around it counts that work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _own_symbols(batch: ForwardBatch) -> None:
    """Give each size of the batch's tensors (above 1) a symbol of its own in the graphs dynamo
    traces. Otherwise sizes equal when a graph is traced are unified ("duck sizing": 3 rows of 3
    tokens, a 64-slot key width and a head dim of 64), a later call where they differ fails that
    guard, and the forward thread recompiles inline, holding every session for as long as that
    takes (Gemma-3-270M's draft, 8 speculative streams on 2 cores: 0.7 s a token)."""
    for tensor in (batch.rows, batch.input_ids, batch.slots, batch.positions, batch.key_mask, batch.logit_index,
                   batch.packed, batch.packed_rows, batch.packed_slots):
        if tensor is not None:
            for dim, size in enumerate(tensor.shape):
                if size > 1:
                    torch._dynamo.mark_dynamic(tensor, dim)


def _cuda_graphs_in_this_thread() -> None:
    """Before torch 2.13 (pytorch/pytorch#184357), inductor's CUDA graph trees lived only in the
    thread that imported them (pytorch/pytorch#123177): give this thread trees of its own, as
    torch 2.13 does by itself."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if not hasattr(local, "tree_manager_containers") and not torch._C._is_key_in_tls("tree_manager_containers"):
        local.tree_manager_containers = {}
        local.tree_manager_locks = defaultdict(threading.Lock)


def _compile_settings() -> None:
    """Dynamo's settings for the engine's graphs, in the calling thread (its config is
    thread-local). A graph per shape key (and per model, when several engines share a process):
    more than the default 8 per function. Python floats as constants: the forward's are the
    model's (Gemma-3-270M: 109 RMSNorm epsilons a forward), and left unspecialised each became a
    tensor at every call, 0.25 ms a forward (sampling's floats travel as tensors, `FusedSampling`)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.specialize_float = True


def shape_key(batch: ForwardBatch) -> tuple[bool, ...]:
    """What torch specialises a compiled forward on: sizes of 1 (rows, new tokens, logits,
    and the metrics' selection), a run of rows read in place, the metrics, and packed rows."""
    rows, tokens = batch.input_ids.shape
    picked = 0 if batch.logit_index is None else int(batch.logit_index.shape[0])
    key: tuple[bool, ...] = (rows == 1, tokens == 1, picked == 1, batch.contiguous_from is not None, batch.metrics,
                             batch.packed is not None)
    if batch.score_tokens is not None:
        key += (batch.score_tokens.shape[0] == 1, batch.score_tokens.shape[1] == 1)
    return key


def steps_key(rows: int, count: int = FUSED_STEPS, sampled: bool = False) -> tuple[bool, int, bool]:
    """What a fused call's graph specialises on: one row or more, its steps, sampled or greedy."""
    return rows == 1, count, sampled


def _fused(jobs: list[ForwardJob]) -> int:
    """How many steps `jobs` run in one call, 0 for one forward: each a fusable round (greedy or
    sampled) at one new token; the most steps, up to FUSED_STEPS and at least 2, that half of the
    rows have to go. The others ride along and keep their first steps (`_next_steps`): the later
    ones write keys past their rows' lengths, where padding's go, and cost a few rows of a batch
    where a step at every round's end would otherwise be a forward of its own, unfused, for
    every row (8 streams were fused in few forwards, since some round was nearly always ending)."""
    if not all((job.fuse_greedy or job.sampling is not None) and job.pick is not None and job.new_tokens == 1
               and not job.want_metrics and not job.want_hidden for job in jobs):
        return 0
    rows = sum(len(job.rows) for job in jobs)
    for count in range(FUSED_STEPS, 1, -1):
        full = sum(len(job.rows) for job in jobs if job.steps - job.forwards >= count)
        if full > 0 and 2 * full >= rows:
            return count
    return 0


def fused_sampling(jobs: list[ForwardJob], count: int, device: torch.device) -> FusedSampling | None:
    """The rows' draws for `count` fused steps (`decode_steps`), None where every job is greedy.
    A sampled job's rows take the uniforms of their next `count` draws; steps past a round's end
    and greedy rows take 0.5 (unused)."""
    if all(job.sampling is None for job in jobs):
        return None
    uniforms = []
    for job in jobs:
        drawn = torch.full((len(job.rows), count), 0.5, dtype=torch.float64)
        if job.sampling is not None:
            ahead = job.sampling.uniforms[job.forwards : job.forwards + count].T  # [rows, ≤ count]
            drawn[:, : ahead.shape[1]] = ahead
        uniforms.append(drawn)
    configs = [ProcessingConfig(top_k=1) if job.sampling is None else job.sampling.config for job in jobs]
    rows = torch.tensor([len(job.rows) for job in jobs])

    def per_row(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).repeat_interleave(rows).to(device)

    return FusedSampling(
        sampled=per_row([job.sampling is not None for job in jobs], torch.bool),
        temperature=per_row([config.temperature for config in configs], torch.float32),
        top_k=per_row([config.top_k for config in configs], torch.long),
        top_p=per_row([config.top_p for config in configs], torch.float32),
        min_p=per_row([config.min_p for config in configs], torch.float32),
        uniforms=torch.cat(uniforms).to(device),
    )


def _join_metrics(parts: list[PositionMetrics]) -> PositionMetrics:
    """Per-chunk metrics ([rows, keep] each) joined along the kept tokens."""
    return PositionMetrics(
        torch.cat([part.entropy for part in parts], dim=1),
        torch.cat([part.varentropy for part in parts], dim=1),
        AttentionStats.cat([part.attention for part in parts if part.attention is not None], dim=1),
    )


def logit_index(jobs: list[ForwardJob], width: int, device: torch.device, pad: bool = False) -> torch.Tensor:
    """[P] indices into the batch's flattened [B·T] new tokens: each job's rows' last `keep`
    tokens, in job and row order. `pad` repeats index 0 up to a power of two (CUDA graphs)."""
    index: list[int] = []
    first = 0
    for job in jobs:
        n, keep = job.new_tokens, job.keep
        for row in range(first, first + len(job.rows)):
            index += range(row * width + n - keep, row * width + n)
        first += len(job.rows)
    if pad:
        index += [0] * (bucket(len(index)) - len(index))
    return torch.tensor(index, dtype=torch.long, device=device)


def score_selection(
    jobs: list[ForwardJob], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch rows ([R]) and new-token offsets ([R, K], K = the widest `keep`) whose attention
    statistics the asking jobs want: each row's last `keep` tokens, left-padded with its first.
    (None, None) when that is every row and token of the batch (a lone decode step, say)."""
    widest = max(job.new_tokens for job in jobs)
    if all(job.want_metrics and job.keep == job.new_tokens == widest for job in jobs):
        return None, None
    rows: list[int] = []
    tokens: list[list[int]] = []
    width = max(job.keep for job in jobs if job.want_metrics)
    first = 0
    for job in jobs:
        if job.want_metrics:
            n, keep = job.new_tokens, job.keep
            offsets = [n - keep] * (width - keep) + list(range(n - keep, n))
            rows += range(first, first + len(job.rows))
            tokens += [offsets] * len(job.rows)
        first += len(job.rows)
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device)


def bucket(size: int) -> int:
    """The next power of two: the row counts compiled code is specialised for."""
    return 1 << max(0, size - 1).bit_length()


def build_batch(
    jobs: list[ForwardJob], device: torch.device, scratch_row: int, pad_rows: bool = False, key_multiple: int = 1,
    row_invariant: int = 0, steps: int = 1, pack: bool = True,
) -> ForwardBatch:
    """Pad the jobs' rows to one [B, T] batch with per-row slots, positions and key masks.
    Where rows differ in width and `pack`, the real tokens are also indexed packed
    (`ForwardBatch.packed`), so that the layers compute those alone.

    `pad_rows` rounds B up to a power of two with rows of the scratch row, and `key_multiple`
    rounds the slots looked at (L) up, so compiled code sees few distinct shapes.
    `row_invariant` (the cache's length, or 0): attention per row over its own extent
    (`ForwardBatch.extents`), over keys in whole blocks (`row_keys`). `steps`: fused greedy
    steps the keys must have room for.
    """
    rows = [row for job in jobs for row in job.rows]
    real = len(rows)  # before padding
    T = max(job.new_tokens for job in jobs)
    L = max(job.start + job.new_tokens for job in jobs) + steps - 1
    L = row_keys(L, row_invariant) if row_invariant else -(-L // key_multiple) * key_multiple
    B = bucket(len(rows)) if pad_rows else len(rows)
    # Plain Python until the tensors: a decode step is a few dozen µs of small-op overhead otherwise.
    starts = [job.start for job in jobs for _ in job.rows] + [0] * (B - real)  # padding: slot 0
    lengths = [job.new_tokens for job in jobs for _ in job.rows] + [1] * (B - real)
    rows += [scratch_row] * (B - real)  # padding rows: the scratch row, one token
    slots = torch.tensor(starts).unsqueeze(1)  # [B, 1]
    if T > 1:
        slots = slots + torch.arange(T)  # [B, T]
    ragged = any(n < T for n in lengths)
    if ragged or real < B:
        input_ids = torch.zeros((B, T), dtype=torch.long)
        first = 0
        for job in jobs:
            input_ids[first : first + len(job.rows), : job.new_tokens] = job.tokens
            first += len(job.rows)
    else:
        input_ids = torch.cat([job.tokens for job in jobs])
    # Causal over the cache: token t of a row sees slots ≤ its own; padding sees slot 0 only (no NaN).
    seen = torch.where(torch.arange(T) < torch.tensor(lengths)[:, None], slots, 0) if ragged else slots
    key_mask = torch.arange(L) <= seen[:, :, None]  # [B, T, L]
    positions = slots.clone()
    first = 0
    for job in jobs:
        count, n, start = len(job.rows), job.new_tokens, job.start
        if job.positions is not None:
            positions[first : first + count, :n] = job.positions
        if job.tree_mask is not None:
            key_mask[first : first + count, :n, start : start + n] = job.tree_mask
        first += count
    contiguous = rows == list(range(rows[0], rows[0] + B))
    packed = packed_rows = packed_slots = None
    if ragged and pack:
        packed = torch.tensor([row * T + t for row, n in enumerate(lengths[:real]) for t in range(n)])
        packed_rows = torch.tensor(rows)[packed // T].to(device)
        packed_slots = slots.flatten()[packed].to(device)
        packed = packed.to(device)
    return ForwardBatch(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        input_ids=input_ids.to(device),
        slots=slots.to(device),
        positions=positions.to(device),
        key_mask=key_mask.to(device),
        contiguous_from=rows[0] if contiguous else None,
        dense=T == 1 and all(start == L - 1 for start in starts),  # every row sees every slot
        extents=torch.tensor([[n, start + n] for n, start in zip(lengths, starts, strict=True)], device=device)
        if row_invariant else None,
        packed=packed,
        packed_rows=packed_rows,
        packed_slots=packed_slots,
    )
