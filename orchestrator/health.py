"""Whether the model services are up, from their own health streams.

The orchestrator keeps one standard health `Watch` stream (grpc.health.v1) open to each model
service. The service pushes its status as it changes (NOT_SERVING while it loads or drains); a
stream that breaks — the process died, the connection reset — means the service is unreachable
until a new stream reports again, so the watcher marks it down at once and reconnects. The
channel's reconnect back-off is capped (`serving.CHANNEL_OPTIONS`), so a service that comes back
is seen within about a second.

What depends on it: the orchestrator's own health (SERVING while the target is up), the
strategies `Info` lists, and the UNAVAILABLE answer to a request whose service is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("specwire")

# Strategies that need the draft service, and those the target alone serves.
DRAFT_STRATEGIES = frozenset({"speculative", "contrastive"})


@dataclass
class ServiceStates:
    """The last known state of each model service; both up unless a watcher says otherwise
    (in-process models have no watcher)."""

    target_up: bool = True
    draft_up: bool = True
    # Called after any change, with the new states (the server updates its own health).
    listeners: list[Callable[[ServiceStates], None]] = field(default_factory=list)

    def set(self, label: str, up: bool) -> None:
        before = (self.target_up, self.draft_up)
        if label == "target":
            self.target_up = up
        else:
            self.draft_up = up
        if (self.target_up, self.draft_up) != before:
            log.warning("%s service is %s", label, "up" if up else "unreachable or not serving")
            for listener in self.listeners:
                listener(self)


class HealthWatcher:
    """Follows one service's health stream over `channel`, reconnecting whenever it breaks."""

    def __init__(
        self, channel: grpc.aio.Channel, label: str, service: str, states: ServiceStates, retry_s: float = 0.2
    ) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._label = label
        self._service = service
        self._states = states
        self._retry_s = retry_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"health-{self._label}")

    async def _run(self) -> None:
        request = health_pb2.HealthCheckRequest(service=self._service)
        while True:
            try:
                # wait_for_ready: while the service is away the call waits for the channel to
                # reconnect instead of failing at once; the replies are status changes.
                async for reply in self._stub.Watch(request, wait_for_ready=True):
                    self._states.set(self._label, reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass
            self._states.set(self._label, False)
            await asyncio.sleep(self._retry_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
