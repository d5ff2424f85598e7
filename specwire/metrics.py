"""Prometheus metrics of the three services, each on its own per-process `CollectorRegistry`.

Served over HTTP on `--metrics-port` (0 = off). Names follow Prometheus conventions: a
`specwire_` prefix, base units (`_seconds`, `_bytes`), counters exposed with `_total`.

Orchestrator: requests by strategy and outcome, requests in flight, request duration and time
to first token, generated tokens, rounds, draft tokens proposed and accepted, the accepted
length per round, each round's latency split by part (draft compute, target compute, queue,
network, orchestrator) and bytes exchanged with each service.
Model services: open sessions, tokens their KV caches hold, session messages, forward passes,
and per-message compute and queue time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from specwire.session import CacheUsage

# 50 µs … 10 s: a round of a tiny model on loopback up to a large one across hosts.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
# Accepted draft tokens per round: 0 … γ, γ ≤ 64.
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
# The parts of a round's latency. They add up to the round's wall time when the services are
# called one after the other.
ROUND_PARTS = ("draft", "target", "queue", "network", "orchestrator")


def _registry(process_metrics: bool) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


class OrchestratorMetrics:
    """What the orchestrator counts; `Decoder` and `DecodeContext.round` feed it."""

    def __init__(self, process_metrics: bool = True) -> None:
        self.registry = _registry(process_metrics)
        r = self.registry
        self.requests = Counter(
            "specwire_requests", "Generate and GenerateStream requests by strategy and outcome",
            ["strategy", "status"], registry=r,
        )
        self.requests_in_flight = Gauge("specwire_requests_in_flight", "Generations running now", registry=r)
        self.request_seconds = Histogram(
            "specwire_request_duration_seconds", "Wall time of a generation", ["strategy"],
            buckets=REQUEST_BUCKETS, registry=r,
        )
        self.ttft_seconds = Histogram(
            "specwire_time_to_first_token_seconds", "Time to the first generated token", ["strategy"],
            buckets=REQUEST_BUCKETS, registry=r,
        )
        self.generated_tokens = Counter(
            "specwire_generated_tokens", "Tokens returned to callers", ["strategy"], registry=r
        )
        self.rounds = Counter("specwire_rounds", "Decoding rounds", ["strategy"], registry=r)
        self.draft_proposed = Counter(
            "specwire_draft_tokens_proposed", "Draft tokens proposed for verification", ["strategy"], registry=r
        )
        self.draft_accepted = Counter(
            "specwire_draft_tokens_accepted", "Draft tokens the target accepted", ["strategy"], registry=r
        )
        self.accepted_length = Histogram(
            "specwire_accepted_length_tokens", "Draft tokens accepted per round", ["strategy"],
            buckets=ACCEPTED_BUCKETS, registry=r,
        )
        self.round_seconds = Histogram(
            "specwire_round_duration_seconds",
            "Latency of a decoding round by part: draft / target compute, queue, network, orchestrator, "
            "and the round's wall time (part=total)",
            ["strategy", "part"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.service_bytes = Counter(
            "specwire_service_traffic_bytes", "Protobuf bytes exchanged with a model service",
            ["service", "direction"], registry=r,
        )
        # Labelled children resolved once per strategy: `labels()` costs as much as an update.
        self._per_strategy: dict[str, _RoundInstruments] = {}
        self._traffic_children: dict[tuple[str, str], Any] = {}

    def request_started(self) -> None:
        self.requests_in_flight.inc()

    def request_finished(self, strategy: str, status: str, wall_s: float, ttft_s: float) -> None:
        self.requests_in_flight.dec()
        self.requests.labels(strategy, status).inc()
        self.request_seconds.labels(strategy).observe(wall_s)
        if ttft_s > 0.0:
            self.ttft_seconds.labels(strategy).observe(ttft_s)

    def tokens_generated(self, strategy: str, count: int) -> None:
        if count:
            self.generated_tokens.labels(strategy).inc(count)

    def round_finished(
        self,
        strategy: str,
        wall_s: float,
        parts_s: Mapping[str, float],
        bytes_by_service: Mapping[str, tuple[int, int]],
        drafted: int | None,
        accepted: int | None,
    ) -> None:
        """One round: its wall time, its parts (`ROUND_PARTS`), (sent, received) bytes per service,
        and the draft tokens proposed / accepted when the strategy reported them."""
        instruments = self._per_strategy.get(strategy)
        if instruments is None:
            instruments = self._per_strategy[strategy] = _RoundInstruments(self, strategy)
        instruments.rounds.inc()
        instruments.seconds["total"].observe(wall_s)
        for part, seconds in parts_s.items():
            instruments.seconds[part].observe(seconds)
        for service, (sent, received) in bytes_by_service.items():
            if sent:
                self._traffic(service, "sent").inc(sent)
            if received:
                self._traffic(service, "received").inc(received)
        if drafted is not None:
            instruments.proposed.inc(drafted)
        if accepted is not None:
            instruments.accepted.inc(accepted)
            instruments.accepted_length.observe(accepted)


    def _traffic(self, service: str, direction: str) -> Any:
        child = self._traffic_children.get((service, direction))
        if child is None:
            child = self._traffic_children[(service, direction)] = self.service_bytes.labels(service, direction)
        return child


class _RoundInstruments:
    """One strategy's labelled round instruments."""

    def __init__(self, metrics: OrchestratorMetrics, strategy: str) -> None:
        self.rounds = metrics.rounds.labels(strategy)
        self.seconds = {part: metrics.round_seconds.labels(strategy, part) for part in (*ROUND_PARTS, "total")}
        self.proposed = metrics.draft_proposed.labels(strategy)
        self.accepted = metrics.draft_accepted.labels(strategy)
        self.accepted_length = metrics.accepted_length.labels(strategy)


class ModelServiceMetrics:
    """What a model service counts; `ModelServicer` feeds it."""

    def __init__(self, role: str, process_metrics: bool = True) -> None:
        self.registry = _registry(process_metrics)
        r = self.registry
        self.info = Info("specwire_service", "The model this service runs", registry=r)
        self.info.info({"role": role})
        self.active_sessions = Gauge("specwire_active_sessions", "Open sessions (streams)", registry=r)
        self.kv_cache_tokens = Gauge(
            "specwire_kv_cache_tokens",
            "Tokens the open sessions hold over all their branches (their KV caches cover all but the newest)",
            registry=r,
        )
        self.messages = Counter(
            "specwire_session_messages", "Session messages handled, by kind (open/step) and outcome",
            ["kind", "status"], registry=r,
        )
        self.forward_passes = Counter("specwire_forward_passes", "Model forward calls", registry=r)
        self.compute_seconds = Histogram(
            "specwire_message_compute_seconds", "Compute time of a session message (forwards, warping, encoding)",
            ["kind"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "specwire_message_queue_seconds", "Time a session message waited for the forward-pass executor",
            buckets=LATENCY_BUCKETS, registry=r,
        )

        self.cache_rows = Gauge(
            "specwire_kv_cache_rows",
            "Rows of the slot cache: in use, kept (free, holding a closed session's keys) and free", ["state"], registry=r
        )
        self.cache_slot_tokens = Gauge(
            "specwire_kv_cache_slot_tokens", "Positions held by the slot cache's rows in use", registry=r
        )
        self.cache_bytes = Gauge(
            "specwire_kv_cache_bytes", "Bytes of the slot cache: in use, free and total", ["state"], registry=r
        )
        self.cache_waiting = Gauge(
            "specwire_kv_cache_waiting_sessions", "Sessions waiting for free slot-cache rows", registry=r
        )
        self.prefix_reused_tokens = Gauge(
            "specwire_kv_prefix_reused_tokens",
            "Prompt positions found in kept slot-cache rows instead of computed, since the start", registry=r
        )

    def watch_batches(self, stats: Callable[[], Any]) -> None:
        """Read the forward thread's totals (`SchedulerStats`) at every scrape: rows ÷ forwards is
        how full the batches run (a speculative stream out of step with the others halves it)."""
        r = self.registry
        for name, text, read in (
            ("specwire_engine_forwards", "Forwards the engine ran since the start (a fused call counts its steps)",
             lambda: stats().forwards),
            ("specwire_engine_forward_rows", "Rows over all those forwards (÷ forwards: rows a forward)",
             lambda: stats().rows),
            ("specwire_engine_widest_forward_rows", "The most rows one forward has taken", lambda: stats().max_rows),
            ("specwire_engine_busy_seconds", "Time the forward thread spent in forwards", lambda: stats().busy_s),
        ):
            Gauge(name, text, registry=r).set_function(read)

    def describe(self, role: str, model: str, device: str, dtype: str) -> None:
        self.info.info({"role": role, "model": model, "device": device, "dtype": dtype})

    def watch_cache(self, usage: Callable[[], CacheUsage]) -> None:
        """Read the slot cache's gauges from `usage` at every scrape."""
        self.cache_rows.labels("in_use").set_function(lambda: usage().rows_in_use)
        self.cache_rows.labels("kept").set_function(lambda: usage().rows_kept)
        self.cache_rows.labels("free").set_function(lambda: (lambda u: u.rows - u.rows_in_use - u.rows_kept)(usage()))
        self.cache_slot_tokens.set_function(lambda: usage().tokens_in_use)
        self.cache_bytes.labels("in_use").set_function(lambda: usage().bytes_in_use)
        self.cache_bytes.labels("free").set_function(lambda: (lambda u: u.bytes_total - u.bytes_in_use)(usage()))
        self.cache_bytes.labels("total").set_function(lambda: usage().bytes_total)
        self.cache_waiting.set_function(lambda: usage().waiting)
        self.prefix_reused_tokens.set_function(lambda: usage().reused_tokens)

    def message_handled(self, kind: str, queue_us: int, compute_us: int, forward_calls: int) -> None:
        self.messages.labels(kind, "ok").inc()
        self.queue_seconds.observe(queue_us / 1e6)
        self.compute_seconds.labels(kind).observe(compute_us / 1e6)
        self.forward_passes.inc(forward_calls)

    def message_failed(self, kind: str, status: str = "error") -> None:
        """A message that did not complete: "error", or "cancelled" (the caller went away)."""
        self.messages.labels(kind, status).inc()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread (port 0: any free port,
    read back from `server.server_port`). Stop with `server.shutdown()`."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
