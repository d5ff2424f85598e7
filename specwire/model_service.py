"""The `ModelService` servicer both model services run: sessions over bidirectional streams.

Each stream owns one backend session (its KV cache rows). A stream's requests are handled in
order off the event loop: on a thread per session when the backend batches (its scheduler
gathers the concurrent sessions' forwards into one), else on a single forward-pass thread so
the model sees one batch at a time. The session is freed in `finally`, whatever ended the stream.

Each message is traced, when tracing is on, as a server span under the client span whose
context the message carries, and counted in the service's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Span, SpanKind

from specwire import telemetry, wire
from specwire.engine.scheduler import compute_on
from specwire.errors import InvalidArgument, StatusError, capped
from specwire.metrics import ModelServiceMetrics
from specwire.session import Backend, BackendSession, OpenRequest, ScoreKind, StepRequest
from specwire.startup import StartupTimes
from specwire.v1 import model_pb2, model_pb2_grpc

log = logging.getLogger("specwire")
T = TypeVar("T")

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name


# A span is named for the message's main operation: the first of these it does.
_MAIN_OPS = ("prefill", "verify_tree", "verify", "propose", "extend", "score", "fork", "reorder", "truncate")


def message_ops(request: OpenRequest | StepRequest) -> list[str]:
    """What a session message asks for, in the order the service does it (span attributes)."""
    if isinstance(request, OpenRequest):
        return ["prefill"]
    ops = []
    if request.keep_tokens is not None:
        ops.append("truncate")
    if request.branch_order:
        ops.append("fork" if len(set(request.branch_order)) < len(request.branch_order) else "reorder")
    if request.tree_parents:
        ops.append("verify_tree")
    elif request.append_ids and request.scoring.positions > 1:
        ops.append("verify")
    elif request.append_ids:
        ops.append("extend")
    if request.scoring.kind != ScoreKind.NONE and not {"verify", "verify_tree"} & set(ops):
        ops.append("score")
    if request.propose:
        ops.append("propose")
    return ops


class SessionUsage:
    """Tokens one session holds over its branches, for the KV-cache gauge."""

    def __init__(self) -> None:
        self.branches = 1
        self.tokens = 0

    def update(self, request: OpenRequest | StepRequest, reply: model_pb2.SessionReply) -> int:
        """Account a handled message; returns the change in tokens held."""
        if isinstance(request, OpenRequest):
            self.branches = request.num_branches
        elif request.branch_order:
            self.branches = len(request.branch_order)
        held = reply.num_tokens * self.branches
        change, self.tokens = held - self.tokens, held
        return change


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(
        self,
        backend: Backend | None,
        max_sessions: int = 256,
        role: str = "",
        tracing: telemetry.Tracing | None = None,
        metrics: ModelServiceMetrics | None = None,
    ) -> None:
        # None while the model loads: calls get UNAVAILABLE and health says NOT_SERVING.
        self.backend = backend
        self.max_sessions = max_sessions
        self.active_sessions = 0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        # A batched backend's forward thread computes; a session thread's own parallel loops would
        # give it an OpenMP pool of its own, which slows that thread's (engine/scheduler.py).
        self.session_executor = ThreadPoolExecutor(max_workers=max_sessions, thread_name_prefix="session",
                                                   initializer=compute_on, initargs=(1,))
        self.role = role or (backend.info().role if backend is not None else "model")
        self.tracing = tracing
        self.metrics = metrics
        self.startup: StartupTimes | None = None  # set once SERVING

    async def Info(self, request: model_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> model_pb2.ModelInfo:
        caller = telemetry.carrier_from_metadata(context.invocation_metadata()) if self.tracing else None
        if self.tracing is not None and caller is not None:
            self.tracing.start_span("Info", telemetry.extract(caller), SpanKind.SERVER).end()
        backend = await self._loaded(context)
        reply = wire.info_to_pb(backend.info())
        if self.startup is not None:
            reply.startup.CopyFrom(wire.startup_to_pb(self.startup))
        return reply

    async def _loaded(self, context: grpc.aio.ServicerContext) -> Backend:
        if self.backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.backend is not None
        return self.backend

    async def Session(
        self, request_iterator: AsyncIterator[model_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[model_pb2.SessionReply]:
        backend = await self._loaded(context)
        if self.active_sessions >= self.max_sessions:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"sessions: {self.max_sessions} already open (--max-sessions)"
            )
        session = backend.new_session()
        remaining = context.time_remaining()
        set_deadline = getattr(session, "set_deadline", None)
        if remaining is not None and set_deadline is not None:
            set_deadline(remaining)  # waiting for cache rows never outlasts the caller's deadline
        self.active_sessions += 1
        usage = SessionUsage()
        if self.metrics is not None:
            self.metrics.active_sessions.set(self.active_sessions)
        try:
            opened = False
            async for message in request_iterator:
                try:
                    reply = await self._handle(session, message, opened, usage)
                except StatusError as error:
                    await context.abort(error.code, error.message)
                except Exception as error:  # a bug: INTERNAL, logged, and the service goes on
                    log.exception("session message failed")
                    await context.abort(grpc.StatusCode.INTERNAL, capped(f"{type(error).__name__}: {error}"))
                opened = True
                yield reply
        finally:
            self.active_sessions -= 1
            if self.metrics is not None:
                self.metrics.active_sessions.set(self.active_sessions)
                self.metrics.kv_cache_tokens.dec(usage.tokens)
            session.close()

    async def _handle(
        self, session: BackendSession, message: model_pb2.SessionRequest, opened: bool, usage: SessionUsage
    ) -> model_pb2.SessionReply:
        kind = message.WhichOneof("kind")
        request: OpenRequest | StepRequest
        handler: Callable[..., object]
        post: Callable[..., bool] | None = None  # a lone step straight to the forward thread (`_run`)
        if kind == "open":
            if opened:
                raise InvalidArgument("open", "a session is opened once; later messages must be `step`")
            request, handler = wire.open_from_pb(message.open), session.open
        elif kind == "step":
            if not opened:
                raise InvalidArgument("step", "the first message of a session must be `open`")
            request, handler = wire.step_from_pb(message.step), session.step
            post = getattr(session, "post", None)
        else:
            raise InvalidArgument("kind", "a session message must carry `open` or `step`")
        span = self._start_span(kind, request) if self.tracing is not None else None
        try:
            reply = await self._run(handler, request, self._executor_for(), post)
        except BaseException as error:  # a cancelled stream too: the span must still end
            if span is not None:
                telemetry.record_error(span, error)
                span.end()
            if self.metrics is not None:
                cancelled = isinstance(error, asyncio.CancelledError)
                self.metrics.message_failed(kind, "cancelled" if cancelled else "error")
            raise
        timing = reply.timing
        if span is not None:
            span.set_attributes({
                "specwire.server.queue_ms": timing.queue_us / 1e3,
                "specwire.server.compute_ms": timing.compute_us / 1e3,
                "specwire.forward_calls": timing.forward_calls,
                "specwire.num_tokens": reply.num_tokens,
            })
            span.end()
        if self.metrics is not None:
            self.metrics.message_handled(kind, timing.queue_us, timing.compute_us, timing.forward_calls)
            self.metrics.kv_cache_tokens.inc(usage.update(request, reply))
        return reply

    def _start_span(self, kind: str, request: OpenRequest | StepRequest) -> Span:
        """A server span under the client span the message names (a new trace if none)."""
        assert self.tracing is not None
        ops = message_ops(request)
        attributes: dict[str, str | int] = {"specwire.message": kind, "specwire.ops": ",".join(ops)}
        if isinstance(request, OpenRequest):
            attributes["specwire.prompt_tokens"] = len(request.prompt_ids)
            attributes["specwire.branches"] = request.num_branches
        else:
            attributes["specwire.appended_tokens"] = len(request.append_ids)
            attributes["specwire.propose"] = request.propose
        attributes["specwire.score_positions"] = request.scoring.positions if request.scoring.kind else 0
        main = next((op for op in _MAIN_OPS if op in ops), "noop")
        name = f"{self.role}.{main}"
        return self.tracing.start_span(name, telemetry.extract(request.trace), SpanKind.SERVER, attributes)

    def _executor_for(self) -> ThreadPoolExecutor:
        batches = self.backend is not None and getattr(self.backend, "batches", False)
        return self.session_executor if batches else self.executor

    async def _run(
        self,
        handler: Callable[..., object],
        request: object,
        executor: ThreadPoolExecutor,
        post: Callable[..., bool] | None = None,
    ) -> model_pb2.SessionReply:
        """`handler(request)` as a reply, on `executor`; or through `post` (`EngineSession.post`)
        where the session takes it: run on the forward thread, its reply handed to this loop."""
        enqueued = time.perf_counter()

        def job() -> model_pb2.SessionReply:
            started = time.perf_counter()
            result = handler(request)
            reply = wire.result_to_pb(result)  # type: ignore[arg-type]
            reply.timing.queue_us = int((started - enqueued) * 1e6)
            reply.timing.compute_us = int((time.perf_counter() - started) * 1e6)
            return reply

        future = posted(post, job) if post is not None else None
        if future is not None:
            return await future
        return await asyncio.get_running_loop().run_in_executor(executor, job)


def posted(post: Callable[..., bool], work: Callable[[], T]) -> asyncio.Future[T] | None:
    """`work` handed to the forward thread through `post` (`EngineSession.post`), its result a
    future of the running loop; None where the session does not take it (not alone)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def then(result: T | None, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits the result
            loop.call_soon_threadsafe(_settle, future, result, error)

    return future if post(work, then) else None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the loop: `future` takes `result`, or `error`, unless its awaiter has gone."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
