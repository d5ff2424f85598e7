"""Real servers on ephemeral loopback ports, run on a background event loop in the test process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from specwire.orchestrator.generation import Decoder
from specwire.orchestrator.server import SERVICE_NAME as ORCHESTRATOR_SERVICE
from specwire.orchestrator.server import OrchestratorServicer, build_decoder, watch_services
from specwire.v1 import model_pb2_grpc, orchestrator_pb2_grpc

from specwire import serving, telemetry
from specwire.config import OrchestratorConfig
from specwire.metrics import ModelServiceMetrics, OrchestratorMetrics
from specwire.model_service import SERVICE_NAME as MODEL_SERVICE
from specwire.model_service import ModelServicer
from specwire.session import Backend

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread; `run` executes a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-loop")
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class ModelServer:
    servicer: ModelServicer
    running: serving.RunningServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"


async def start_model_server(
    backend: Backend | None,
    tracing: telemetry.Tracing | None = None,
    metrics: ModelServiceMetrics | None = None,
) -> ModelServer:
    """A model service on a free port; `None` leaves it as it is while its model loads."""
    servicer = ModelServicer(backend, tracing=tracing, metrics=metrics)

    def register(server: grpc.aio.Server) -> None:
        model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)

    running = await serving.start_server(register, [MODEL_SERVICE], "127.0.0.1", 0)
    if backend is not None:
        await serving.mark_serving(running, [MODEL_SERVICE])
    return ModelServer(servicer, running)


@dataclass
class OrchestratorServer:
    decoder: Decoder
    running: serving.RunningServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"


async def start_orchestrator(target: str, draft: str | None, tokenizer: str, **limits: Any) -> OrchestratorServer:
    return await start_observed_orchestrator(
        OrchestratorConfig(target=target, draft=draft, tokenizer=tokenizer, connect_timeout_s=10.0, **limits)
    )


async def start_observed_orchestrator(
    config: OrchestratorConfig,
    tracing: telemetry.Tracing | None = None,
    metrics: OrchestratorMetrics | None = None,
) -> OrchestratorServer:
    """An orchestrator on a free port, tracing and counting when given a tracer and metrics."""
    decoder = await build_decoder(config, tracing, metrics)
    servicer = OrchestratorServicer(decoder)

    def register(server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)

    running = await serving.start_server(register, [ORCHESTRATOR_SERVICE], "127.0.0.1", 0)
    await serving.mark_serving(running, [ORCHESTRATOR_SERVICE])
    watch_services(decoder, running)
    return OrchestratorServer(decoder, running)


@dataclass
class Stack:
    """Target + draft + orchestrator, all in-process, on loopback."""

    loop: LoopThread
    target: ModelServer
    draft: ModelServer
    orchestrator: OrchestratorServer
    extra: list[Any] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.orchestrator.address

    def stop(self) -> None:
        for server in (self.orchestrator, self.target, self.draft):
            self.loop.run(server.running.server.stop(0))
