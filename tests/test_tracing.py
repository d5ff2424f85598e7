"""Every round trip is a span: one trace per generation across orchestrator, draft and target,
a round span per round under the root, a client span per service call under its round, the
service's span under the client span — and the round spans add up to the response's stats."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from specwire.client import AsyncClient, Client
from specwire.orchestrator import speculative
from specwire.orchestrator.generation import STRATEGIES
from specwire.orchestrator.models import WaitClock
from specwire.orchestrator.speedup import LoadTrial
from specwire.orchestrator.stats import RunStats

from specwire import telemetry
from tests.harness import LoopThread
from tests.observed import Observed, start_observed_stack

PROMPT = "def add(a, b):"
pytest_plugins = ["tests.medusa_fixtures"]  # the traced target has heads, so every strategy runs


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(
    loop: LoopThread, llama_target_dir: Path, llama_draft_dir: Path, llama_heads_dir: Path, exporter: InMemorySpanExporter
) -> Iterator[Observed]:
    observed = start_observed_stack(
        loop, llama_target_dir, llama_draft_dir, span_exporter=exporter, medusa_dir=llama_heads_dir
    )
    yield observed
    observed.stop()


def service(span: ReadableSpan) -> str:
    assert span.attributes is not None
    return str(span.attributes[telemetry.SERVICE_ATTRIBUTE])


def attr(span: ReadableSpan, name: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(name)


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@pytest.mark.parametrize("strategy", ["greedy", "speculative"])
def test_one_generation_is_one_trace_with_rounds_calls_and_service_spans(
    traced: Observed, exporter: InMemorySpanExporter, strategy: str
) -> None:
    if strategy not in STRATEGIES:
        pytest.skip(f"strategy {strategy!r} is not registered yet")
    exporter.clear()
    # A fixed γ: auto γ may plan every round target-only from the services' timings.
    fixed = {"num_speculative_tokens": 4} if strategy == "speculative" else {}
    result = Client(traced.stack.address, timeout=60).generate(
        prompt=PROMPT, strategy=strategy, max_new_tokens=20, ignore_eos=True, **fixed
    )
    stats = result.stats
    spans = exporter.get_finished_spans()

    # Each span is attributed to the service that made it, resource and attribute agreeing.
    for span in spans:
        assert span.resource.attributes["service.name"] == service(span)
    by_service = Counter(service(span) for span in spans)
    assert set(by_service) == {"orchestrator", "target"} | ({"draft"} if strategy == "speculative" else set())

    (root,) = [s for s in spans if s.name == "generate"]
    assert root.parent is None and root.kind == SpanKind.SERVER
    assert root.context is not None
    assert {s.context.trace_id for s in spans if s.context is not None} == {root.context.trace_id}
    assert attr(root, "specwire.strategy") == strategy
    assert attr(root, "specwire.stats.new_tokens") == stats.new_tokens == 20
    assert attr(root, "specwire.stats.prompt_tokens") == stats.prompt_tokens
    assert attr(root, "specwire.finish_reason") == result.finish_reason == "length"

    rounds = sorted((s for s in spans if s.name == "round"), key=lambda s: int(attr(s, "specwire.round.index")))
    assert len(rounds) == stats.rounds
    assert [attr(s, "specwire.round.index") for s in rounds] == list(range(stats.rounds))
    assert all(parent_id(s) == span_id(root) for s in rounds)

    round_ids = {span_id(s) for s in rounds}
    clients = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert clients and all(parent_id(s) in round_ids and service(s) == "orchestrator" for s in clients)
    servers = [s for s in spans if s.kind == SpanKind.SERVER and service(s) in ("draft", "target")]
    client_by_id = {span_id(s): s for s in clients}
    assert len(servers) == len(clients)
    for server in servers:
        client = client_by_id[parent_id(server)]  # type: ignore[index]
        assert attr(client, "specwire.peer") == service(server)
        # The client waited at least as long as the server worked.
        assert attr(client, "specwire.client_ms") >= attr(server, "specwire.server.compute_ms")

    # Round attributes add up to the response's statistics.
    def total(name: str) -> float:
        return sum(float(attr(s, name) or 0) for s in rounds)

    assert total("specwire.round.bytes_sent") == stats.target_bytes_sent + stats.draft_bytes_sent
    assert total("specwire.round.bytes_received") == stats.target_bytes_received + stats.draft_bytes_received
    assert total("specwire.round.target.compute_ms") == pytest.approx(stats.target_compute_ms, abs=0.01)
    assert total("specwire.round.draft.compute_ms") == pytest.approx(stats.draft_compute_ms, abs=0.01)
    server_compute = sum(float(attr(s, "specwire.server.compute_ms")) for s in servers if service(s) == "target")
    assert server_compute == pytest.approx(stats.target_compute_ms, abs=0.01)
    assert total("specwire.round.wall_ms") <= stats.wall_ms
    if strategy == "speculative":
        assert total("specwire.round.drafted") == stats.drafted_tokens > 0
        assert total("specwire.round.accepted") == stats.accepted_tokens
        assert all(attr(s, "specwire.round.gamma") is not None for s in rounds)
        # The target's replies name the batch they rode in: this generation's row alone.
        assert attr(rounds[-1], "specwire.round.batch_rows") == 1


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - {"greedy", "speculative"}))
def test_every_strategy_traces_one_round_span_per_round(
    traced: Observed, exporter: InMemorySpanExporter, strategy: str
) -> None:
    exporter.clear()
    result = Client(traced.stack.address, timeout=60).generate(
        prompt=PROMPT, strategy=strategy, max_new_tokens=6, ignore_eos=True, seed=0
    )
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans if s.context is not None}) == 1
    assert sum(1 for s in spans if s.name == "round") == result.stats.rounds
    clients = {span_id(s) for s in spans if s.kind == SpanKind.CLIENT}
    servers = [s for s in spans if service(s) in ("draft", "target")]
    assert servers and all(parent_id(s) in clients for s in servers)


def test_the_callers_span_in_metadata_parents_the_root(traced: Observed, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    caller = traced.tracings["orchestrator"].start_span("experiment")
    with trace.use_span(caller, end_on_exit=True), Client(traced.stack.address, timeout=60) as client:
        client.generate(prompt=PROMPT, max_new_tokens=3)
        client.info()
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "generate"]
    (info,) = [s for s in spans if s.name == "Info"]
    assert caller.get_span_context().trace_id == root.context.trace_id  # type: ignore[union-attr]
    assert parent_id(root) == parent_id(info) == caller.get_span_context().span_id


def test_untraced_generation_carries_no_trace_context(llama_stack: object) -> None:
    """Off by default: no tracer, `ctx.trace()` is None, nothing to carry."""
    from tests.harness import Stack

    assert isinstance(llama_stack, Stack)
    decoder = llama_stack.orchestrator.decoder
    assert decoder.tracing is None and decoder.metrics is None
    result = Client(llama_stack.address, timeout=60).generate(prompt=PROMPT, max_new_tokens=3, ignore_eos=True)
    # The first token from the open, then one multi-step round for the other two.
    assert result.stats.new_tokens == 3 and result.stats.rounds == 2


def test_overlapping_calls_count_once_in_waiting_time() -> None:
    """Contrastive decoding calls both services at once: the orchestrator's own time is wall
    time minus the union of the waits, not minus their sum."""
    stats = RunStats()
    assert stats.draft.clock is stats.target.clock

    async def call(seconds: float) -> None:
        with stats.target.clock.waiting():
            await asyncio.sleep(seconds)

    async def generation() -> None:
        await asyncio.gather(call(0.2), call(0.2))  # one 0.2 s wait, not two
        await call(0.05)

    started = time.perf_counter()
    asyncio.run(generation())
    stats.wall_ms = (time.perf_counter() - started) * 1e3
    assert 250.0 <= stats.waiting_ms < 420.0  # the sum would be 450
    assert stats.orchestrator_ms == pytest.approx(stats.wall_ms - stats.waiting_ms)
    assert WaitClock().elapsed_s() == 0.0


def test_services_follow_the_orchestrators_sampling_decision() -> None:
    """ParentBased sampling: a trace the root drops is dropped in every process it reaches."""
    exporter = InMemorySpanExporter()
    dropping = telemetry.setup_tracing("orchestrator", sample_ratio=0.0, span_exporter=exporter)
    keeping = telemetry.setup_tracing("target", sample_ratio=1.0, span_exporter=exporter)
    assert dropping is not None and keeping is not None
    root = dropping.start_span("generate")
    headers = telemetry.carrier(root)
    assert not int(headers["traceparent"][-2:], 16) & 1  # W3C trace-flags: the sampled bit is off
    keeping.start_span("target.extend", telemetry.extract(headers)).end()
    root.end()
    assert exporter.get_finished_spans() == ()
    kept = keeping.start_span("generate")
    assert int(telemetry.carrier(kept)["traceparent"][-2:], 16) & 1
    kept.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["generate"]
    assert telemetry.extract(None) is None and telemetry.extract({}) is None
    assert telemetry.carrier_from_metadata([("traceparent", headers["traceparent"]), ("x", "y")]) == {
        "traceparent": headers["traceparent"]
    }


def test_entropix_round_spans_carry_each_decision(traced: Observed, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    result = Client(traced.stack.address, timeout=60).generate(
        prompt=PROMPT, strategy="entropix", max_new_tokens=5, ignore_eos=True, seed=2
    )
    rounds = sorted((s for s in exporter.get_finished_spans() if s.name == "round"),
                    key=lambda s: int(attr(s, "specwire.round.index")))
    assert [attr(s, "specwire.round.entropix.state") for s in rounds] == [d.state for d in result.decisions]
    for span, decision in zip(rounds, result.decisions, strict=True):
        assert attr(span, "specwire.round.entropix.entropy") == pytest.approx(decision.entropy, rel=1e-6)
        assert attr(span, "specwire.round.entropix.top_k") == decision.top_k


def test_concurrent_generations_held_off_by_their_trial_say_so_and_keep_greedy_output(
    traced: Observed, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `LoadTrial` whose epoch runs all target-only: concurrent auto-γ generations' rounds carry
    `load_trial` off and are target-only, and each output equals the generation run alone."""
    client = Client(traced.stack.address, timeout=60)
    params = {"prompt": PROMPT, "strategy": "speculative", "max_new_tokens": 24, "ignore_eos": True}
    alone = client.generate(**params).token_ids
    trial = LoadTrial(epoch_s=3600.0, speculate=False)  # one long epoch, off

    class Held(dict[object, LoadTrial]):
        def setdefault(self, key: object, default: LoadTrial | None = None) -> LoadTrial:
            return trial

    monkeypatch.setattr(speculative, "_TRIALS", Held())
    exporter.clear()

    async def together() -> list[list[int]]:
        async with AsyncClient(traced.stack.address, timeout=60) as concurrent:
            results = await asyncio.gather(*(concurrent.generate(**params) for _ in range(3)))
        return [result.token_ids for result in results]

    outputs = asyncio.run(together())
    assert outputs == [alone] * 3
    rounds = [s for s in exporter.get_finished_spans() if s.name == "round"]
    held = [s for s in rounds if attr(s, "specwire.round.load_trial") == "off"]
    assert held and all(attr(s, "specwire.round.speculation") == "off" for s in held)
    assert not any(attr(s, "specwire.round.load_trial") == "on" for s in rounds)
