"""The OpenAI-compatible HTTP front (`specwire serve http`): Starlette on uvicorn, a thin
translator over the orchestrator's Generate API through the asyncio SDK; it decides nothing.

POST /v1/completions and /v1/chat/completions (server-sent events with `stream: true`), GET
/v1/models and /health. A client that goes away cancels its generations at once: the gRPC calls
end, and with them the services' sessions and KV-cache rows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc
import uvicorn
from specwire.client.sdk import AsyncClient, GenerateResult, GenerationError, StreamDelta
from specwire.openai_http import protocol
from specwire.openai_http.chat import ChatTemplate
from specwire.openai_http.protocol import Plan
from specwire.v1 import orchestrator_pb2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from specwire.config import HttpFrontConfig
from specwire.errors import echo
from specwire.security import TokenFile, bearer_token

log = logging.getLogger("specwire")
T = TypeVar("T")
CLIENT_GONE = 499  # never seen by the client; what access logs call a request it abandoned


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first; `work` is then cancelled."""
    job, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait([job, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (job, watch):
            task.cancel()
        await asyncio.gather(job, watch, return_exceptions=True)
    return None if job.cancelled() else job.result()


async def merged(streams: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several streams as they come, each with its stream's position. The first
    error ends them all; so does closing or cancelling this generator."""
    end = object()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item))
            await queue.put((position, end))
        except Exception as error:  # handed to the reader, which raises it
            await queue.put((position, error))

    tasks = [asyncio.ensure_future(pump(position, stream)) for position, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is end:
                running -= 1
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event(payload: object) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events. The events' generator is closed, cancelling the generations behind it,
    as soon as the client disconnects, not at the next write (which may be many tokens away)."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def respond() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(receive, respond())
        finally:
            await self.events.aclose()


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as error:
        raise protocol.invalid("body", f"not JSON: {error}") from None
    if not isinstance(body, dict):
        raise protocol.invalid("body", f"expected a JSON object, got {echo(body)}")
    return body


def _error_response(error: GenerationError, names: dict[str, str]) -> JSONResponse:
    status, payload = protocol.error_body(error, names)
    return JSONResponse(payload, status_code=status)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's error shape."""
    assert isinstance(error, HTTPException)
    message = f"{request.method} {request.url.path}: {error.detail}"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


class Front:
    """The HTTP endpoints over one orchestrator connection."""

    def __init__(
        self,
        client: AsyncClient,
        info: orchestrator_pb2.OrchestratorInfo,
        template: ChatTemplate,
        model_name: str,
        tokens: TokenFile | None = None,
    ) -> None:
        self.client = client
        self.info = info
        self.template = template
        self.model_name = model_name
        self.tokens = tokens
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    def _authorize(self, request: Request) -> None:
        if self.tokens is None:
            return
        token = bearer_token([("authorization", request.headers.get("authorization", ""))])
        if token is None:
            raise GenerationError(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing `Bearer <token>` header")
        if not self.tokens.accepts(token):
            raise GenerationError(grpc.StatusCode.UNAUTHENTICATED, "authorization: token not accepted")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise GenerationError(
                grpc.StatusCode.NOT_FOUND, f"model: {echo(model)} is not served here; this server serves {self.model_name!r}"
            )

    def _room(self, prompt_tokens: int) -> int:
        """A chat's default max_tokens, as OpenAI's: as many as the context and the limit allow."""
        return max(1, min(self.info.max_new_tokens_limit, self.info.max_context - prompt_tokens))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        body: dict[str, Any] = {}
        try:
            self._authorize(request)
            body = await _json_object(request)
            if chat:
                prompt_ids = self.template.render(protocol.chat_messages(body))
                plan = protocol.chat_plan(body, prompt_ids, self._room(len(prompt_ids)))
            else:
                plan = protocol.completion_plan(body)
            self._check_model(plan.model)
            head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
            names = protocol.param_names(body, chat)
            if plan.stream:
                return await self._stream(request, plan, head, chat, names)
            results = await until_disconnected(request.receive, self._generate_all(plan))
        except GenerationError as error:
            return _error_response(error, protocol.param_names(body, chat))
        if results is None:
            return Response(status_code=CLIENT_GONE)
        respond = protocol.chat_response if chat else protocol.completion_response
        return JSONResponse(respond(plan, results, head))

    async def _generate_all(self, plan: Plan) -> list[GenerateResult]:
        tasks = [asyncio.ensure_future(self.client.generate(**choice.params)) for choice in plan.choices]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one choice failed: its siblings' answers would go unread
                task.cancel()

    async def _stream(self, request: Request, plan: Plan, head: dict[str, Any], chat: bool, names: dict[str, str]) -> Response:
        deltas = merged([self.client.stream(**choice.params) for choice in plan.choices])
        try:
            # Waiting for the first delta lets a refused request answer with its HTTP status.
            first = await until_disconnected(request.receive, anext(deltas))
        except BaseException:
            await deltas.aclose()
            raise
        if first is None:
            await deltas.aclose()
            return Response(status_code=CLIENT_GONE)
        return EventStream(self._events(plan, head, chat, names, first, deltas))

    async def _events(
        self,
        plan: Plan,
        head: dict[str, Any],
        chat: bool,
        names: dict[str, str],
        first: tuple[int, StreamDelta],
        deltas: AsyncGenerator[tuple[int, StreamDelta], None],
    ) -> AsyncGenerator[str, None]:
        """OpenAI's chunks: per choice, the role (chat), the text as it comes, then the finish
        reason with our statistics; the usage when asked for; `data: [DONE]`."""
        extra = {"usage": None} if plan.include_usage else {}
        kind = "chat.completion.chunk" if chat else "text_completion"
        opened: set[int] = set()
        stats: dict[int, Any] = {}
        item: tuple[int, StreamDelta] | None = first
        try:
            while item is not None:
                position, delta = item
                index = plan.choices[position].index
                if chat and index not in opened:
                    opened.add(index)
                    yield _event({**head, "object": kind, "choices": [protocol.chunk_choice(chat, index, None)], **extra})
                if delta.finish_reason:
                    stats[index] = delta.stats
                    choice = protocol.chunk_choice(chat, index, delta.text, delta.finish_reason, delta.stats)
                    yield _event({**head, "object": kind, "choices": [choice], **extra})
                elif delta.text:
                    yield _event({**head, "object": kind, "choices": [protocol.chunk_choice(chat, index, delta.text)], **extra})
                item = await anext(deltas, None)
            if plan.include_usage:
                yield _event({**head, "object": kind, "choices": [], "usage": protocol.usage(plan, stats)})
        except GenerationError as error:  # after the 200: the error goes as an event, as OpenAI's do
            yield _event(protocol.error_body(error, names)[1])
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except GenerationError as error:
            return _error_response(error, {})
        model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specwire",
                 "max_model_len": self.info.max_context}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        """200 while the orchestrator reports SERVING, 503 otherwise (open: probes send no token)."""
        try:
            status = await self.client.health()
        except grpc.RpcError:
            status = "UNREACHABLE"
        return JSONResponse({"status": status.lower()}, status_code=200 if status == "SERVING" else 503)


async def _orchestrator_info(client: AsyncClient, timeout_s: float) -> orchestrator_pb2.OrchestratorInfo:
    """Info, waiting up to `timeout_s` for an orchestrator that is still starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.info()
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise SystemExit(f"the orchestrator at {client.address} answered {error.code().name}: {error.details()}") from None
            await asyncio.sleep(0.5)


async def open_front(config: HttpFrontConfig) -> Front:
    """Connect to the orchestrator, read its Info, load the tokenizer for chat templates."""
    tls = config.orchestrator_tls
    client = AsyncClient(
        config.orchestrator, tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
        tls_key=tls.key if tls else None, token=config.orchestrator_token,
    )
    info = await _orchestrator_info(client, config.connect_timeout_s)
    source = config.tokenizer or info.tokenizer_source or info.target_model
    template = await asyncio.to_thread(ChatTemplate.load, source, config.chat_template)
    tokens = TokenFile(config.auth_token_file) if config.auth_token_file else None
    return Front(client, info, template, config.model_name or info.target_model, tokens)


async def run(config: HttpFrontConfig) -> None:
    front = await open_front(config)
    server = uvicorn.Server(uvicorn.Config(
        front.app(), host=config.host, port=config.port, lifespan="off", log_level="warning",
        timeout_graceful_shutdown=int(config.grace_s),
    ))
    socket = server.config.bind_socket()
    serving = asyncio.ensure_future(server.serve(sockets=[socket]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:  # the same READY line the gRPC services print: the launcher waits for it
        print(f"READY http {config.host}:{socket.getsockname()[1]}", flush=True)
    try:
        await serving
    finally:
        await front.client.close()


def main(config: HttpFrontConfig) -> None:
    asyncio.run(run(config))
