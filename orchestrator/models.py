"""Model handles the strategies use: a remote service over its `Session` stream, or an in-process
backend for tests. Both hand out `ModelSession`s and account every call in `CallStats`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import grpc
from opentelemetry.trace import SpanKind
from specwire.v1 import model_pb2, model_pb2_grpc

from specwire import telemetry, wire
from specwire.errors import StatusError, Unavailable
from specwire.model_service import posted
from specwire.serving import CHANNEL_OPTIONS
from specwire.session import Backend, BackendSession, ModelInfo, ModelSession, OpenRequest, StepRequest, StepResult


@dataclass
class Wait:
    """One call's wait, timed by the same clock readings as the `WaitClock` union it joins."""

    started: float
    elapsed_s: float = 0.0


@dataclass
class WaitClock:
    """Time during which at least one service call was outstanding: the union of the calls'
    intervals. Calls made in parallel (contrastive decoding asks both services at once) overlap,
    so the orchestrator's own time is wall time minus this, not minus the sum of the calls."""

    outstanding: int = 0
    since: float = 0.0
    total_s: float = 0.0

    @contextmanager
    def waiting(self) -> Iterator[Wait]:
        """Time one call. Its `elapsed_s` and the union share their clock readings, so a round's
        parts add up to its wall time exactly, however the threads are scheduled."""
        now = time.perf_counter()
        if self.outstanding == 0:
            self.since = now
        self.outstanding += 1
        wait = Wait(started=now)
        try:
            yield wait
        finally:
            now = time.perf_counter()
            wait.elapsed_s = now - wait.started
            self.outstanding -= 1
            if self.outstanding == 0:
                self.total_s += now - self.since

    def elapsed_s(self) -> float:
        """Waiting time so far, counting a wait still under way."""
        running = time.perf_counter() - self.since if self.outstanding else 0.0
        return self.total_s + running


@dataclass
class CallStats:
    """One service's share of a generation: client-measured time split by the server's report."""

    calls: int = 0
    forward_calls: int = 0
    client_ms: float = 0.0
    compute_ms: float = 0.0
    queue_ms: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    rebuilds: int = 0  # sessions rebuilt on another replica after theirs failed
    # Shared by the services of one generation (`RunStats` links them).
    clock: WaitClock = field(default_factory=WaitClock)

    @property
    def network_ms(self) -> float:
        """Client-measured time the server did not account for: network plus serialization."""
        return max(0.0, self.client_ms - self.compute_ms - self.queue_ms)

    def since(self, before: CallStats) -> CallStats:
        """The share since `before`, an earlier copy (`dataclasses.replace`): a round's part."""
        counted = (f.name for f in fields(self) if f.name != "clock")
        return CallStats(**{name: getattr(self, name) - getattr(before, name) for name in counted})

    def record(self, elapsed_s: float, result: StepResult, sent: int, received: int) -> None:
        self.calls += 1
        self.forward_calls += result.timing.forward_calls
        self.client_ms += elapsed_s * 1e3
        self.compute_ms += result.timing.compute_us / 1e3
        self.queue_ms += result.timing.queue_us / 1e3
        self.bytes_sent += sent
        self.bytes_received += received


class ModelHandle(Protocol):
    info: ModelInfo
    label: str

    def session(self, stats: CallStats) -> ModelSession: ...

    async def close(self) -> None: ...


def _service_error(label: str, error: grpc.aio.AioRpcError) -> StatusError:
    """A model service's failure as the orchestrator's caller should see it."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"{label} service unavailable: {error.details()}")
    status = StatusError(f"{label} service: {error.details()}")
    status.code = code
    return status


class RemoteSession:
    """A `ModelSession` over one bidirectional `Session` stream."""

    def __init__(
        self,
        stub: model_pb2_grpc.ModelServiceStub,
        label: str,
        stats: CallStats,
        tracing: telemetry.Tracing | None = None,
    ) -> None:
        self._stub = stub
        self._label = label
        self._stats = stats
        self._tracing = tracing
        self._call: grpc.aio.StreamStreamCall | None = None

    async def open(self, request: OpenRequest) -> StepResult:
        self._call = self._stub.Session()
        return await self._exchange(wire.open_to_pb(request))

    async def step(self, request: StepRequest) -> StepResult:
        return await self._exchange(wire.step_to_pb(request))

    async def _exchange(self, message: model_pb2.SessionRequest) -> StepResult:
        """One request, one reply. Traced as a client span under the context the message carries
        (the round's); the message then carries the client span, the parent of the server's."""
        assert self._call is not None, "open() first"
        span = None
        if self._tracing is not None:
            kind = message.WhichOneof("kind")
            trace_field = getattr(message, kind).trace
            if trace_field.traceparent:
                round_context = telemetry.extract(
                    {"traceparent": trace_field.traceparent, "tracestate": trace_field.tracestate}
                )
                span = self._tracing.start_span(
                    f"{self._label}.{kind}", round_context, SpanKind.CLIENT, {"specwire.peer": self._label}
                )
                headers = telemetry.carrier(span)
                trace_field.traceparent = headers.get("traceparent", "")
                trace_field.tracestate = headers.get("tracestate", "")
        try:
            with self._stats.clock.waiting() as wait:
                try:
                    await self._call.write(message)
                    reply = await self._call.read()
                except grpc.aio.AioRpcError as error:
                    raise _service_error(self._label, error) from error
                except asyncio.InvalidStateError:
                    # The stream ended before this message (a draining service cut it): its status says why.
                    code, details = await self._call.code(), await self._call.details()
                    raise _service_error(self._label, grpc.aio.AioRpcError(code, None, None, details)) from None
            elapsed_s = wait.elapsed_s
            if reply is grpc.aio.EOF:
                code = await self._call.code()
                details = await self._call.details()
                raise _service_error(self._label, grpc.aio.AioRpcError(code, None, None, details))
            result = wire.result_from_pb(reply)
            sent, received = message.ByteSize(), reply.ByteSize()
            self._stats.record(elapsed_s, result, sent, received)
        except BaseException as error:
            if span is not None:
                telemetry.record_error(span, error)
                span.end()
            raise
        if span is not None:
            client_ms = elapsed_s * 1e3
            compute_ms, queue_ms = result.timing.compute_us / 1e3, result.timing.queue_us / 1e3
            span.set_attributes({
                "specwire.client_ms": client_ms,
                "specwire.server.compute_ms": compute_ms,
                "specwire.server.queue_ms": queue_ms,
                "specwire.network_ms": max(0.0, client_ms - compute_ms - queue_ms),
                "specwire.forward_calls": result.timing.forward_calls,
                "specwire.bytes_sent": sent,
                "specwire.bytes_received": received,
            })
            span.end()
        return result

    async def close(self) -> None:
        """End the stream; the service frees the KV cache when it sees the stream end."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


class RemoteModel:
    """A model service reached over a gRPC channel."""

    def __init__(self, address: str, label: str, channel: grpc.aio.Channel, info: ModelInfo) -> None:
        self.address = address
        self.label = label
        self.info = info
        self._channel = channel
        self._stub = model_pb2_grpc.ModelServiceStub(channel)
        # The orchestrator's tracer: each session message gets a client span when set.
        self.tracing: telemetry.Tracing | None = None

    @classmethod
    async def connect(cls, address: str, label: str, timeout: float) -> RemoteModel:
        """Open a channel and fetch `Info`, waiting up to `timeout` for the service to come up."""
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = model_pb2_grpc.ModelServiceStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = await stub.Info(
                    model_pb2.InfoRequest(), timeout=5.0, wait_for_ready=True, metadata=telemetry.current_metadata()
                )
                return cls(address, label, channel, wire.info_from_pb(reply))
            except grpc.aio.AioRpcError as error:
                if time.monotonic() > deadline:
                    await channel.close()
                    raise _service_error(f"{label} ({address})", error) from error
                await asyncio.sleep(0.5)

    def session(self, stats: CallStats) -> ModelSession:
        return RemoteSession(self._stub, self.label, stats, self.tracing)

    async def close(self) -> None:
        await self._channel.close()


class LocalSession:
    """A `ModelSession` straight into an in-process backend session (tests, experiments): no
    messages, so a round costs the forwards and the orchestrator alone."""

    def __init__(self, session: BackendSession, stats: CallStats, batches: bool = False) -> None:
        self._session = session
        self._stats = stats
        self._batches = batches

    async def open(self, request: OpenRequest) -> StepResult:
        return await self._timed(self._session.open, request, None)

    async def step(self, request: StepRequest) -> StepResult:
        return await self._timed(self._session.step, request, getattr(self._session, "post", None))

    async def _timed(self, handler: Callable[[Any], StepResult], request: object,
                     post: Callable[..., bool] | None) -> StepResult:
        with self._stats.clock.waiting() as wait:
            result = await self._run(handler, request, post)
        elapsed_s = wait.elapsed_s
        # Timed here, at the boundary, as the servicer times a remote call: no network in between.
        result.timing.compute_us = int(elapsed_s * 1e6)
        self._stats.record(elapsed_s, result, 0, 0)
        return result

    async def _run(self, handler: Callable[[Any], StepResult], request: object,
                   post: Callable[..., bool] | None) -> StepResult:
        """As the servicer runs a message: a lone session's step straight on its engine's forward
        thread (`EngineSession.post`), an opening (which may wait for rows others hold: never on
        that thread) and other batched work on a thread of its own, so that the sessions of one
        event loop still meet in the scheduler; an unbatched backend's here."""
        if not self._batches:
            return handler(request)
        future = posted(post, lambda: handler(request)) if post is not None else None
        if future is not None:
            return await future
        return await asyncio.to_thread(handler, request)

    async def close(self) -> None:
        self._session.close()


class LocalModel:
    """An in-process backend behind the same interface as `RemoteModel`."""

    def __init__(self, backend: Backend, label: str) -> None:
        self.backend = backend
        self.label = label
        self.info = backend.info()

    def session(self, stats: CallStats) -> ModelSession:
        return LocalSession(self.backend.new_session(), stats, getattr(self.backend, "batches", False))

    async def close(self) -> None:
        return None
