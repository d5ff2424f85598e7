"""OpenTelemetry tracing for the three services: set-up, W3C context carriers, span helpers.

Off by default. With no exporter `setup_tracing` returns None; components hold that None and
skip every tracing call, so an untraced generation pays an `is None` test per round and per
message. When on, each process gets its own `TracerProvider` with a
ParentBased(TraceIdRatioBased) sampler — the orchestrator's root span decides, the services
follow the sampled flag they are sent — and one exporter:

- `otlp`: OTLP over gRPC, configured by the standard `OTEL_EXPORTER_OTLP_*` variables
  (`OTEL_EXPORTER_OTLP_ENDPOINT`, `…_HEADERS`, `…_TIMEOUT`, …); needs `specwire[otlp]`;
- `console`: spans as JSON on stdout;
- `file`: JSON lines, one span per line in the SDK's own JSON form (`ReadableSpan.to_json`), for
  offline analysis with `specwire trace summarize`.

Trace context crosses processes as W3C `traceparent` / `tracestate`
(https://www.w3.org/TR/trace-context/): in the `TraceContext` field of every stream message
(`specwire.wire` turns it into a dict carrier) and in gRPC metadata for unary calls. Every span
carries `specwire.service`, so spans stay attributed when several services share a process.
In the spirit of text-generation-inference's `server/text_generation_server/tracing.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from specwire.extras import require

EXPORTERS = ("none", "otlp", "console", "file")
SERVICE_ATTRIBUTE = "specwire.service"
TRACE_HEADERS = ("traceparent", "tracestate")

_W3C = TraceContextTextMapPropagator()


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to a file as one line of the SDK's JSON form."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(span.to_json(indent=None) + "\n" for span in spans)
        with self._lock:
            if self._file is None:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._lock:
            if self._file is not None:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclass(frozen=True)
class Tracing:
    """One service's tracer. Spans are started explicitly with a parent context, never made
    "current": strategies are async generators, and a context attached in one step of a
    generator cannot be detached in another."""

    service: str
    provider: TracerProvider
    tracer: trace.Tracer

    def start_span(
        self,
        name: str,
        parent: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
    ) -> Span:
        """A span under `parent` (None: a new trace, subject to the sampler)."""
        span = self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
        span.set_attribute(SERVICE_ATTRIBUTE, self.service)
        return span

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        self.provider.shutdown()


def _exporter(kind: str, trace_file: str | Path | None) -> SpanExporter:
    if kind == "otlp":
        # Endpoint, headers, TLS and timeout come from the OTEL_EXPORTER_OTLP_* variables.
        otlp = require("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "otlp", "--trace-exporter otlp")
        return otlp.OTLPSpanExporter()  # type: ignore[no-any-return]
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind == "file":
        if not trace_file:
            raise ValueError("--trace-exporter file needs --trace-file PATH")
        return JsonLinesSpanExporter(trace_file)
    raise ValueError(f"--trace-exporter must be one of {', '.join(EXPORTERS)}; got {kind!r}")


def setup_tracing(
    service_name: str,
    exporter: str = "none",
    trace_file: str | Path | None = None,
    sample_ratio: float = 1.0,
    *,
    span_exporter: SpanExporter | None = None,
    set_global: bool = False,
) -> Tracing | None:
    """A tracer for `service_name` exporting to `exporter`, or None when tracing is off.

    `span_exporter` adds an exporter of the caller's (tests pass an in-memory one; it is called
    synchronously as each span ends). `set_global` also installs the provider as the process's
    global one, for libraries that trace through the global API.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"--trace-exporter must be one of {', '.join(EXPORTERS)}; got {exporter!r}")
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {sample_ratio}")
    if exporter == "none" and span_exporter is None:
        return None
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: service_name}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    if exporter != "none":
        # Batched off the request path; a short delay keeps a trace file close to live.
        provider.add_span_processor(BatchSpanProcessor(_exporter(exporter, trace_file), schedule_delay_millis=500))
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return Tracing(service_name, provider, provider.get_tracer("specwire"))


# -- W3C context carriers ---------------------------------------------------------------------


def carrier(span: Span) -> dict[str, str]:
    """`traceparent` (and `tracestate`) naming `span` as the parent; empty for an invalid span."""
    headers: dict[str, str] = {}
    _W3C.inject(headers, context=trace.set_span_in_context(span))
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The parent context a carrier names, or None when it names none."""
    if not headers or "traceparent" not in headers:
        return None
    return _W3C.extract(headers)


def parent(span: Span | None) -> otel_context.Context | None:
    """A context whose current span is `span` (None stays None: a new trace)."""
    return trace.set_span_in_context(span) if span is not None else None


def carrier_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str] | None:
    """The W3C headers among gRPC invocation metadata, or None when the caller sent none."""
    if not metadata:
        return None
    headers = {key: value for key, value in metadata if key in TRACE_HEADERS and isinstance(value, str)}
    return headers if "traceparent" in headers else None


def current_metadata() -> list[tuple[str, str]] | None:
    """Metadata carrying the calling thread's current span, for unary calls; None when there is
    no valid current span (tracing not set up in this process, or outside any span)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    _W3C.inject(headers)
    return list(headers.items()) or None


def record_error(span: Span, error: BaseException) -> None:
    """Mark `span` failed with `error`."""
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
