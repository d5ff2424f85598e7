"""The Python SDK: sync `Client` and asyncio `AsyncClient` over the `Orchestrator` API.

Parameters are named like the CLI flags with underscores (`temperature`, `top_k`, `num_beams`,
`stop_strings`, `input_ids`, …), as in transformers' `generate`; docs/strategies.md lists the few that
are ours (`ignore_eos`, `seed`, `num_speculative_tokens`, …). Enum parameters take lowercase
names (`strategy="beam"`, `early_stopping=True | False | "never"`, `cd_form="li"`); results give
`finish_reason` as "eos", "length" or "stop". Results are typed.

Tracing: when the calling process has set up OpenTelemetry (a global tracer provider), each call
is a client span, child of the caller's current span, and its W3C context travels in the call's
metadata, so the orchestrator's root span — and with it the whole generation — joins the
caller's trace. Without a provider this costs a no-op span per call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from specwire.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from specwire import security, telemetry
from specwire.errors import echo
from specwire.serving import CHANNEL_OPTIONS

_STATS_FIELDS = orchestrator_pb2.GenerationStats.DESCRIPTOR.fields


def _is_map(descriptor: Any) -> bool:
    return descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry  # type: ignore[no-any-return]


def _stats_field_type(descriptor: Any) -> Any:
    if _is_map(descriptor):
        return dict[str, int]
    base = float if descriptor.cpp_type in (descriptor.CPPTYPE_DOUBLE, descriptor.CPPTYPE_FLOAT) else int
    return list[base] if descriptor.is_repeated else base  # type: ignore[valid-type]


#: Per-request statistics, one attribute per `GenerationStats` field of the proto.
Stats = make_dataclass(
    "Stats",
    [(f.name, _stats_field_type(f),
      field(default_factory=dict if _is_map(f) else list) if f.is_repeated else field(default=0))
     for f in _STATS_FIELDS],
    frozen=True,
)


def _stats_from_pb(message: orchestrator_pb2.GenerationStats) -> Any:
    values = {}
    for f in _STATS_FIELDS:
        value = getattr(message, f.name)
        values[f.name] = dict(value) if _is_map(f) else list(value) if f.is_repeated else value
    return Stats(**values)


@dataclass(frozen=True)
class Decision:
    """How strategy "entropix" chose one token: its state, the target's metrics, the warpers."""

    state: str
    entropy: float
    varentropy: float
    attn_entropy: float
    attn_varentropy: float
    agreement: float
    interaction_strength: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    clarified: bool = False


def _decisions_from_pb(messages: Any) -> list[Decision]:
    return [Decision(**{f.name: getattr(m, f.name) for f in fields(Decision)}) for m in messages]


def stats_as_dict(stats: Any) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in fields(stats)}


@dataclass(frozen=True)
class BeamSequence:
    """One beam hypothesis."""

    token_ids: list[int]
    text: str
    score: float


@dataclass(frozen=True)
class GenerateResult:
    token_ids: list[int]  # new tokens only
    text: str
    finish_reason: str  # "eos", "length" or "stop"
    stats: Any  # Stats
    sequences: list[BeamSequence] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)  # strategy "entropix": one per token

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stats": stats_as_dict(self.stats),
        }
        if self.sequences:
            out["sequences"] = [{"token_ids": s.token_ids, "text": s.text, "score": s.score} for s in self.sequences]
        if self.decisions:
            out["decisions"] = [vars(d) for d in self.decisions]
        return out


@dataclass(frozen=True)
class StreamDelta:
    token_ids: list[int]
    text: str
    finish_reason: str = ""  # set on the last delta
    stats: Any = None  # Stats, on the last delta
    decisions: list[Decision] = field(default_factory=list)  # entropix's trace, on the last delta


class GenerationError(Exception):
    """A request was refused or failed: `code` is the gRPC status. The orchestrator raises it;
    so does the SDK itself, with INVALID_ARGUMENT, for an enum name it cannot encode."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# Enum fields travel as numbers; the SDK takes and gives their lowercase names.
_ENUM_PREFIXES = {
    "strategy": (orchestrator_pb2.Strategy, "STRATEGY_"),
    "early_stopping": (orchestrator_pb2.EarlyStopping, "EARLY_STOPPING_"),
    "cd_form": (orchestrator_pb2.ContrastiveForm, "CONTRASTIVE_FORM_"),
    "medusa_acceptance": (orchestrator_pb2.MedusaAcceptance, "MEDUSA_ACCEPTANCE_"),
}

_SCALAR_PARAMS = {f.name for f in orchestrator_pb2.GenerateRequest.DESCRIPTOR.fields} - {
    "prompt",
    "input_ids",
    "max_new_tokens",
    "stop_strings",
    *_ENUM_PREFIXES,
    "entropix",
}
_ENTROPIX_PARAMS = {f.name for f in orchestrator_pb2.EntropixParams.DESCRIPTOR.fields}


def enum_names(field_name: str) -> list[str]:
    """The names an enum parameter takes, e.g. ["greedy", "sample", …] for "strategy"."""
    enum, prefix = _ENUM_PREFIXES[field_name]
    return [v.name.removeprefix(prefix).lower() for v in enum.DESCRIPTOR.values if v.number]


def _enum_number(field_name: str, value: str | bool) -> int:
    enum, prefix = _ENUM_PREFIXES[field_name]
    name = str(value).lower()  # early_stopping: True / False / "never"
    if name not in enum_names(field_name):
        expected = ", ".join(enum_names(field_name))
        raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: unknown value {echo(value)}; expected one of {expected}")
    return enum.Value(prefix + name.upper())


def build_request(
    prompt: str | None = None,
    input_ids: Sequence[int] | None = None,
    strategy: str = "greedy",
    max_new_tokens: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    early_stopping: bool | str | None = None,
    cd_form: str | None = None,
    medusa_acceptance: str | None = None,
    entropix: dict[str, float] | None = None,
    **params: Any,
) -> orchestrator_pb2.GenerateRequest:
    """A `GenerateRequest` from keyword parameters named as in transformers' `generate`.
    Give `prompt` (text) or `input_ids` (token ids); `early_stopping` is True, False or "never";
    `entropix` maps `EntropixParams` field names to values."""
    unknown = set(params) - _SCALAR_PARAMS
    if unknown:
        raise TypeError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
    unknown = set(entropix or {}) - _ENTROPIX_PARAMS
    if unknown:
        raise TypeError(f"unknown entropix parameter(s): {', '.join(sorted(unknown))}")
    request = orchestrator_pb2.GenerateRequest(strategy=_enum_number("strategy", strategy))  # type: ignore[arg-type]
    if prompt is not None and input_ids is not None:
        raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: give either prompt or input_ids, not both")
    if prompt is not None:
        request.prompt = prompt
    if input_ids is not None:
        request.input_ids.ids.extend(input_ids)
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if stop_strings is not None:
        request.stop_strings.extend([stop_strings] if isinstance(stop_strings, str) else stop_strings)
    if early_stopping is not None:
        request.early_stopping = _enum_number("early_stopping", early_stopping)  # type: ignore[assignment]
    if cd_form is not None:
        request.cd_form = _enum_number("cd_form", cd_form)  # type: ignore[assignment]
    if medusa_acceptance is not None:
        request.medusa_acceptance = _enum_number("medusa_acceptance", medusa_acceptance)  # type: ignore[assignment]
    for name, value in params.items():
        if name == "medusa_choices" and not isinstance(value, str) and value is not None:
            value = json.dumps([list(path) for path in value])  # paths of top-k indices
        if value is not None:
            setattr(request, name, value)
    for name, value in (entropix or {}).items():
        setattr(request.entropix, name, value)
    return request


def finish_reason_name(number: int) -> str:
    """FINISH_REASON_EOS → "eos", …; UNSPECIFIED (not finished) → ""."""
    return orchestrator_pb2.FinishReason.Name(number).removeprefix("FINISH_REASON_").lower() if number else ""  # type: ignore[arg-type]


def _result_from_pb(reply: orchestrator_pb2.GenerateResponse) -> GenerateResult:
    return GenerateResult(
        token_ids=list(reply.token_ids),
        text=reply.text,
        finish_reason=finish_reason_name(reply.finish_reason),
        stats=_stats_from_pb(reply.stats),
        sequences=[BeamSequence(list(s.token_ids), s.text, s.score) for s in reply.sequences],
        decisions=_decisions_from_pb(reply.decisions),
    )


def _delta_from_pb(delta: orchestrator_pb2.GenerateDelta) -> StreamDelta:
    return StreamDelta(
        token_ids=list(delta.token_ids),
        text=delta.text,
        finish_reason=finish_reason_name(delta.finish_reason),
        stats=_stats_from_pb(delta.stats) if delta.HasField("stats") else None,
        decisions=_decisions_from_pb(delta.decisions),
    )


def _error(error: grpc.RpcError) -> GenerationError:
    return GenerationError(error.code(), error.details() or "")  # type: ignore[attr-defined]


def _client_span(method: str) -> tuple[Span, list[tuple[str, str]] | None]:
    """A client span for one call under the current span, and the metadata that carries it
    (None when the span is a no-op: no tracer provider in this process)."""
    span = trace.get_tracer("specwire.client").start_span(f"specwire.Orchestrator/{method}", kind=SpanKind.CLIENT)
    if not span.get_span_context().is_valid:  # no provider: pass on whatever context is current
        return span, telemetry.current_metadata()
    return span, list(telemetry.carrier(span).items())


def _authorized(metadata: list[tuple[str, str]] | None, token: str | None) -> list[tuple[str, str]] | None:
    """The call's metadata plus `authorization: Bearer <token>` when the client has a token."""
    if token is None:
        return metadata
    return [*(metadata or []), ("authorization", f"Bearer {token}")]


def _tls(tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> security.ClientTLS | None:
    return security.ClientTLS(tls_ca, tls_cert, tls_key) if tls_ca else None


def _end(span: Span, error: BaseException | None = None) -> None:
    if error is not None:
        telemetry.record_error(span, error)
    span.end()


class _Connection:
    """What both clients hold: the orchestrator's address, a channel (`_connect`: blocking or
    asyncio) with its stub, the default timeout and the bearer token."""

    _connect: Any

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
    ) -> None:
        """`tls_ca`: the CA that signed the orchestrator's certificate (TLS; plaintext without);
        `tls_cert`/`tls_key`: this client's own, where the server requires one; `token`: sent as
        `authorization: Bearer <token>` on every call but health."""
        self.address = address
        self.timeout = timeout
        self._token = token
        self._channel = self._connect(address, _tls(tls_ca, tls_cert, tls_key), CHANNEL_OPTIONS)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)


class Client(_Connection):
    """Blocking client. `Client("host:50051").generate(prompt="def f(", max_new_tokens=32)`."""

    _connect = staticmethod(security.sync_channel)


    def generate(self, prompt: str | None = None, **params: Any) -> GenerateResult:
        request = build_request(prompt, **params)
        span, metadata = _client_span("Generate")
        try:
            reply = self._stub.Generate(request, timeout=self.timeout, metadata=_authorized(metadata, self._token))
        except grpc.RpcError as error:
            failure = _error(error)
            _end(span, failure)
            raise failure from None
        _end(span)
        return _result_from_pb(reply)

    def stream(self, prompt: str | None = None, **params: Any) -> Iterator[StreamDelta]:
        request = build_request(prompt, **params)
        span, metadata = _client_span("GenerateStream")
        failure: GenerationError | None = None
        call = self._stub.GenerateStream(request, timeout=self.timeout, metadata=_authorized(metadata, self._token))
        try:
            for delta in call:
                yield _delta_from_pb(delta)
        except grpc.RpcError as error:
            failure = _error(error)
            raise failure from None
        finally:
            call.cancel()  # a caller that stops reading ends the generation now, not when the call is collected
            _end(span, failure)

    def health(self) -> str:
        """"SERVING", "NOT_SERVING", … as the standard health service reports it."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def info(self) -> orchestrator_pb2.OrchestratorInfo:
        return self._stub.Info(
            orchestrator_pb2.OrchestratorInfoRequest(), timeout=self.timeout, metadata=_authorized(telemetry.current_metadata(), self._token)
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Connection):
    """asyncio client with the same calls as `Client`."""

    _connect = staticmethod(security.aio_channel)


    async def generate(self, prompt: str | None = None, **params: Any) -> GenerateResult:
        request = build_request(prompt, **params)
        span, metadata = _client_span("Generate")
        try:
            reply = await self._stub.Generate(request, timeout=self.timeout, metadata=_authorized(metadata, self._token))
        except grpc.aio.AioRpcError as error:
            failure = _error(error)
            _end(span, failure)
            raise failure from None
        _end(span)
        return _result_from_pb(reply)

    async def stream(self, prompt: str | None = None, **params: Any) -> AsyncIterator[StreamDelta]:
        request = build_request(prompt, **params)
        span, metadata = _client_span("GenerateStream")
        failure: GenerationError | None = None
        call = self._stub.GenerateStream(request, timeout=self.timeout, metadata=_authorized(metadata, self._token))
        try:
            async for delta in call:
                yield _delta_from_pb(delta)
        except grpc.aio.AioRpcError as error:
            failure = _error(error)
            raise failure from None
        finally:
            call.cancel()  # as in Client.stream
            _end(span, failure)

    async def health(self) -> str:
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def info(self) -> orchestrator_pb2.OrchestratorInfo:
        return await self._stub.Info(
            orchestrator_pb2.OrchestratorInfoRequest(), timeout=self.timeout, metadata=_authorized(telemetry.current_metadata(), self._token)
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
