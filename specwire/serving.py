"""Server bootstrap shared by the three services: grpc.aio, health, reflection, graceful drain.

A service is SERVING on the standard health protocol only once `ready()` has run (model loaded
and warmed up). SIGTERM or SIGINT flips health to NOT_SERVING, stops accepting calls and gives
in-flight generations `grace` seconds to finish; one that comes while the model is still loading
or compiling stops the service at once (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specwire.security import ServerTLS

log = logging.getLogger("specwire")
T = TypeVar("T")

# Messages carry dense distributions (vocab × positions × 4 bytes); 64 MiB covers a 256k vocab
# at γ = 64 in float32.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer on an idle stream within seconds, not at the next TCP timeout.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A service that restarts is reached again within about a second (gRPC's default back-off
    # grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS: list[tuple[str, int]] = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


class _Malformed:
    """What a request that failed to parse is handed on as, so the handler can answer it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as error:  # protobuf's DecodeError, or anything a parser raises
            return _Malformed(error)

    return parse


async def _refuse(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed protobuf bytes ({request.error})"[:200])


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse get INVALID_ARGUMENT, not grpcio's UNKNOWN.

    The method's deserializer is swapped for one that hands the failure on; the handler, wrapped,
    answers it before the servicer sees anything (for a request stream, at the bad message).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = _tolerant(handler.request_deserializer)
        streaming = handler.request_streaming
        kind = ("stream_" if streaming else "unary_") + ("stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)

        async def checked(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            async for request in requests:
                await _refuse(request, context)
                yield request

        async def admitted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if streaming:
                return checked(request, context)
            await _refuse(request, context)
            return request

        # grpc.aio tells handler styles apart by their function kind, so the wrapper keeps it.
        if inspect.isasyncgenfunction(inner):

            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in inner(await admitted(request, context), context):
                    yield reply

        else:

            async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
                return await inner(await admitted(request, context), context)

        return handler._replace(request_deserializer=deserialize, **{kind: wrapped})  # type: ignore[attr-defined, no-any-return]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    # A plaintext port with the health service only, for probes that cannot speak TLS (kubelet).
    health_server: grpc.aio.Server | None = None
    health_port: int = 0


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str,
    port: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
    health_port: int = 0,
) -> RunningServer:
    """Bind, register the services plus health and reflection, start. Health starts NOT_SERVING.
    With `tls`, the port speaks only TLS (mutual TLS when `tls.client_ca` is set); `health_port`
    (0: none) also serves the health service alone, in plaintext, for probes.

    `interceptors` run first, in order, on the call's metadata alone (token auth refuses before
    the request is parsed); the malformed-bytes check runs last, just before the servicer."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*interceptors, MalformedRequestInterceptor()])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names) + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", tls.credentials())
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    health_server = None
    if health_port:
        health_server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MalformedRequestInterceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        if health_server.add_insecure_port(f"{host}:{health_port}") == 0:
            raise OSError(f"could not bind the health port {host}:{health_port}")
        await health_server.start()
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return RunningServer(server, bound, health_servicer, health_server, health_port if health_server else 0)


async def mark_serving(running: RunningServer, service_names: Sequence[str]) -> None:
    for name in ("", *service_names):
        await running.health.set(name, health_pb2.HealthCheckResponse.SERVING)


async def drain(running: RunningServer, grace: float) -> None:
    """Stop taking new calls, let running ones finish within `grace` seconds."""
    await running.health.enter_graceful_shutdown()
    await running.server.stop(grace)
    if running.health_server is not None:
        await running.health_server.stop(0)


async def in_thread(work: Callable[[], T]) -> T:
    """`work()` on a daemon thread of its own, awaited. Unlike `asyncio.to_thread`, a wait that
    is cancelled leaves nothing for the process's exit to join: loading a model or compiling it
    cannot be interrupted, and a service told to stop must not wait for either to end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[Any], None], value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(lambda: None if future.done() else outcome(value))

    def run() -> None:
        try:
            result = work()
        except BaseException as error:  # handed to the waiter, which raises it
            settle(future.set_exception, error)
        else:
            settle(future.set_result, result)

    threading.Thread(target=run, daemon=True, name="startup").start()
    return await future


async def _signalled_first(task: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Wait for `task` or `stop`, whichever comes first; True when `stop` did (the task is left
    running)."""
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, signalled], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    return not task.done()


async def serve_until_signalled(
    running: RunningServer,
    service_names: Sequence[str],
    ready: Callable[[], Awaitable[None]],
    label: str,
    host: str,
    grace: float = 10.0,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Run `ready` (load + warm up), report SERVING, and serve until SIGTERM/SIGINT; then drain:
    new calls are refused and running ones get `grace` seconds. A signal is honoured at any
    moment: while `ready` runs, the service stops at once (nothing was served; `ready` is left
    to itself, see `in_thread`); a second signal while draining cuts the grace short.
    `on_serving` runs once SERVING is set (the orchestrator makes its health follow the services')."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(ready())
    if await _signalled_first(starting, stop):
        starting.cancel()
        log.warning("%s stopped while starting", label)
        await drain(running, 0)
        return
    starting.result()  # a failed start raises here
    await mark_serving(running, service_names)
    if on_serving is not None:
        on_serving()
    # One parseable line: `specwire up` and the tests wait for it.
    print(f"READY {label} {host}:{running.port}", flush=True)
    await stop.wait()
    log.info("%s draining (grace %.0fs)", label, grace)
    stop.clear()
    draining = asyncio.ensure_future(drain(running, grace))
    if await _signalled_first(draining, stop):
        log.warning("%s: a second signal, stopping now", label)
        await drain(running, 0)
        await draining


def exit_now(code: int = 0) -> NoReturn:
    """End the process without joining its threads (a model still loading or compiling): the
    logs and stdio flushed first, nothing else run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def wait_for_health(address: str, timeout: float, service: str = "") -> None:
    """Poll the standard health check until SERVING or raise TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f}s")
            await asyncio.sleep(0.2)
