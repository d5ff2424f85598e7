"""The `ModelService` servicer both model services run: sessions over bidirectional streams.

Each stream owns one backend session (a KV cache). Requests are handled in order on a single
forward-pass executor thread, so the event loop stays free and the model sees one batch at a
time. The session is freed in `finally`, whatever ended the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos import model_pb2, model_pb2_grpc
from specwire import wire
from specwire.errors import InvalidArgument, StatusError
from specwire.session import Backend, BackendSession

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, backend: Backend | None, max_sessions: int = 256) -> None:
        # None while the model loads: calls get UNAVAILABLE and health says NOT_SERVING.
        self.backend = backend
        self.max_sessions = max_sessions
        self.active_sessions = 0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    async def Info(self, request: model_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> model_pb2.ModelInfo:
        backend = await self._loaded(context)
        return wire.info_to_pb(backend.info())

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
        self.active_sessions += 1
        try:
            opened = False
            async for message in request_iterator:
                try:
                    reply = await self._handle(session, message, opened)
                except StatusError as error:
                    await context.abort(error.code, error.message)
                opened = True
                yield reply
        finally:
            self.active_sessions -= 1
            session.close()

    async def _handle(
        self, session: BackendSession, message: model_pb2.SessionRequest, opened: bool
    ) -> model_pb2.SessionReply:
        kind = message.WhichOneof("kind")
        if kind == "open":
            if opened:
                raise InvalidArgument("open", "a session is opened once; later messages must be `step`")
            return await self._run(session.open, wire.open_from_pb(message.open))
        if kind == "step":
            if not opened:
                raise InvalidArgument("step", "the first message of a session must be `open`")
            return await self._run(session.step, wire.step_from_pb(message.step))
        raise InvalidArgument("kind", "a session message must carry `open` or `step`")

    async def _run(self, handler: Callable[..., object], request: object) -> model_pb2.SessionReply:
        enqueued = time.perf_counter()

        def job() -> model_pb2.SessionReply:
            started = time.perf_counter()
            result = handler(request)
            reply = wire.result_to_pb(result)  # type: ignore[arg-type]
            reply.timing.queue_us = int((started - enqueued) * 1e6)
            reply.timing.compute_us = int((time.perf_counter() - started) * 1e6)
            return reply

        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

