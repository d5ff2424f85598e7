"""Replicas and failover with real processes: SIGKILL a target replica under four concurrent
streams, and every output equals its uninterrupted run, for greedy, speculative and beam."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specwire.client import Client, GenerationError
from specwire.client.launcher import free_base_port
from specwire.orchestrator import replicas as replicas_module
from specwire.orchestrator.models import CallStats
from specwire.orchestrator.replicas import ReplicaSet, resolve, split_addresses
from specwire.orchestrator.server import SERVICE_NAME as ORCHESTRATOR
from specwire.v1 import model_pb2_grpc

from specwire import serving, telemetry
from specwire.config import OrchestratorConfig
from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.errors import StatusError
from specwire.metrics import OrchestratorMetrics
from specwire.model_service import SERVICE_NAME as MODEL_SERVICE
from specwire.model_service import ModelServicer
from specwire.session import ModelInfo, OpenRequest, ScoreKind, Scoring, StepRequest
from tests.conftest import load_engine
from tests.harness import (
    LoopThread,
    OrchestratorServer,
    start_model_server,
    start_observed_orchestrator,
    start_orchestrator,
)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fib(n):", "class Stack:", "import os\n", "for i in range("]


def spawn(role: str, model_dir: Path, port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "serve", role, "--model", str(model_dir), "--port", str(port), "--device", "cpu"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return process


def wait_ready(process: subprocess.Popen[str], role: str) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(f"READY {role} "):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return
    raise AssertionError(f"{role} exited with {process.wait()}")


@dataclass
class Replicas:
    """Two target replicas and one draft, each a `specwire serve` child on a fixed port."""

    target_dir: Path
    draft_dir: Path
    ports: dict[str, int]
    processes: dict[str, subprocess.Popen[str]]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> None:
        role = "draft" if name == "draft" else "target"
        self.processes[name] = spawn(role, self.draft_dir if role == "draft" else self.target_dir, self.ports[name])

    def kill(self, name: str) -> None:
        os.kill(self.processes[name].pid, signal.SIGKILL)
        self.processes[name].wait()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def replicas(llama_target_dir: Path, llama_draft_dir: Path) -> Iterator[Replicas]:
    base = free_base_port(3)
    group = Replicas(llama_target_dir, llama_draft_dir, {"a": base, "b": base + 1, "draft": base + 2}, {})
    for name in group.ports:
        group.start(name)
    try:
        for name, process in group.processes.items():
            wait_ready(process, "draft" if name == "draft" else "target")
        yield group
    finally:
        group.stop()


@dataclass
class Observed:
    spans: InMemorySpanExporter
    metrics: OrchestratorMetrics


@pytest.fixture(scope="module")
def observed() -> Observed:
    return Observed(InMemorySpanExporter(), OrchestratorMetrics(process_metrics=False))


@pytest.fixture(scope="module")
def orchestrator(loop: LoopThread, replicas: Replicas, llama_target_dir: Path, observed: Observed) -> Iterator[OrchestratorServer]:
    config = OrchestratorConfig(
        target=f"{replicas.address('a')},{replicas.address('b')}", draft=replicas.address("draft"),
        tokenizer=str(llama_target_dir), connect_timeout_s=10.0, max_new_tokens_limit=512,
    )
    tracing = telemetry.setup_tracing("orchestrator", span_exporter=observed.spans)
    server = loop.run(start_observed_orchestrator(config, tracing, observed.metrics))
    yield server
    loop.run(server.running.server.stop(0))


def target_set(orchestrator: OrchestratorServer) -> ReplicaSet:
    assert isinstance(orchestrator.decoder.target, ReplicaSet)
    return orchestrator.decoder.target


def wait_serving(loop: LoopThread, handle: ReplicaSet, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(state.state == "serving" for state in handle.states()) < count:
        assert time.monotonic() < deadline, f"replicas not serving: {handle.states()}"
        time.sleep(0.1)


def run_streams(
    address: str, params: dict[str, Any] | list[dict[str, Any]], on_started: Any = None
) -> list[tuple[list[int], int]]:
    """The four prompts as concurrent streams: (tokens, sessions_rebuilt) each, in prompt order.
    `params`: for all four, or one set per stream."""
    per_stream = params if isinstance(params, list) else [params] * len(PROMPTS)
    results: list[Any] = [None] * len(PROMPTS)

    def one(index: int) -> None:
        tokens: list[int] = []
        rebuilt = -1
        with Client(address, timeout=120) as client:
            for delta in client.stream(prompt=PROMPTS[index], ignore_eos=True, **per_stream[index]):
                tokens += delta.token_ids
                if delta.stats is not None:
                    rebuilt = delta.stats.sessions_rebuilt
        results[index] = (tokens, rebuilt)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    if on_started is not None:
        on_started()
    for thread in threads:
        thread.join(180)
    assert all(result is not None for result in results), "a stream failed"
    return results


GREEDY = {"strategy": "greedy", "max_new_tokens": 400}
# The orchestrator's generator draws every seed the target samples with: replica-independent.
SEEDED = {"strategy": "sample", "temperature": 1.0, "seed": 11, "max_new_tokens": 400}
STRATEGIES: dict[str, dict[str, Any] | list[dict[str, Any]]] = {
    "greedy and seeded sampling": [GREEDY, GREEDY, SEEDED, SEEDED],
    "speculative": {"strategy": "speculative", "num_speculative_tokens": 3, "max_new_tokens": 300},
    "beam": {"strategy": "beam", "num_beams": 3, "max_new_tokens": 160},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_killing_a_target_replica_loses_nothing(
    loop: LoopThread, replicas: Replicas, orchestrator: OrchestratorServer, observed: Observed, strategy: str
) -> None:
    params = STRATEGIES[strategy]
    handle = target_set(orchestrator)
    wait_serving(loop, handle, 2)
    started = time.monotonic()
    uninterrupted = run_streams(orchestrator.address, params)
    # Kill a quarter of the way in: every session is past its opening, none near its end.
    kill_after_s = (time.monotonic() - started) / 4
    assert all(rebuilt == 0 for _, rebuilt in uninterrupted)
    rebuilt_before = _rebuilt_counter(observed)
    observed.spans.clear()
    killed: dict[str, int] = {}

    def kill_the_busiest() -> None:
        deadline = time.monotonic() + 30
        while sum(state.active_sessions for state in handle.states()) < len(PROMPTS):
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.005)
        time.sleep(kill_after_s)
        busiest = max(handle.states(), key=lambda state: state.active_sessions)
        name = next(n for n in ("a", "b") if replicas.address(n) == busiest.address)
        replicas.kill(name)
        killed[name] = busiest.active_sessions
        replicas.start(name)  # its replacement starts loading at once, on the same port

    interrupted = run_streams(orchestrator.address, params, kill_the_busiest)
    ((name, held),) = killed.items()
    assert held >= 2  # four sessions spread over two replicas
    for (expected, _), (tokens, _) in zip(uninterrupted, interrupted, strict=True):
        assert tokens == expected
    rebuilt = sum(r for _, r in interrupted)
    assert 1 <= rebuilt <= held  # a session that finished between the count and the kill needs none
    # Counted in the metrics, traced as a span inside the generation's trace, from the lost replica.
    assert _rebuilt_counter(observed) - rebuilt_before == rebuilt
    spans = observed.spans.get_finished_spans()
    rebuilds = [span for span in spans if span.name == "session.rebuild"]
    assert len(rebuilds) == rebuilt
    generations = {span.context.trace_id for span in spans if span.name == "generate"}
    for span in rebuilds:
        assert span.attributes is not None and span.attributes["specwire.rebuild.from"] == replicas.address(name)
        assert span.context.trace_id in generations
    assert {s.address: s for s in handle.states()}[replicas.address(name)].failures >= 1
    # The replacement comes up on the port; the orchestrator's health watch takes it in again.
    wait_ready(replicas.processes[name], "target")
    wait_serving(loop, handle, 2)


def _rebuilt_counter(observed: Observed) -> float:
    value = observed.metrics.registry.get_sample_value("specwire_sessions_rebuilt_total", {"role": "target"})
    return value or 0.0


def test_a_draining_replica_takes_no_new_sessions_and_finishes_its_own(
    loop: LoopThread, replicas: Replicas, orchestrator: OrchestratorServer
) -> None:
    """SIGTERM (a rolling update): health turns NOT_SERVING, new sessions go to the other replica,
    the sessions it holds run on within its drain window; it exits cleanly."""
    params = {"strategy": "greedy", "max_new_tokens": 300}
    handle = target_set(orchestrator)
    wait_serving(loop, handle, 2)
    uninterrupted = run_streams(orchestrator.address, params)

    def drain_a() -> None:
        deadline = time.monotonic() + 30
        while sum(state.active_sessions for state in handle.states()) < len(PROMPTS):
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.005)
        replicas.processes["a"].send_signal(signal.SIGTERM)

    interrupted = run_streams(orchestrator.address, params, drain_a)
    assert [tokens for tokens, _ in interrupted] == [tokens for tokens, _ in uninterrupted]
    assert replicas.processes["a"].wait(30) == 0
    assert {s.address: s.state for s in handle.states()}[replicas.address("a")] != "serving"
    picked = handle.pick()
    assert picked is not None and picked.address == replicas.address("b")
    replicas.start("a")
    wait_ready(replicas.processes["a"], "target")
    wait_serving(loop, handle, 2)


def test_new_sessions_go_to_the_least_loaded_healthy_replica(
    loop: LoopThread, replicas: Replicas, orchestrator: OrchestratorServer
) -> None:
    handle = target_set(orchestrator)
    wait_serving(loop, handle, 2)
    with Client(orchestrator.address, timeout=60) as client:
        info = client.info()
    listed = {(r.role, r.address): r.state for r in info.replicas}
    assert listed[("target", replicas.address("a"))] == "serving"
    assert listed[("target", replicas.address("b"))] == "serving"
    assert listed[("draft", replicas.address("draft"))] == "serving"
    first = handle.pick()
    assert first is not None
    first.active_sessions += 1  # as if it held a session: the next goes to the other one
    try:
        second = handle.pick()
        assert second is not None and second.address != first.address
    finally:
        first.active_sessions -= 1


def orchestrator_health(address: str) -> set[str]:
    """The orchestrator's health for "" and its service, as status names."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        replies = [stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2) for name in ("", ORCHESTRATOR)]
    return {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) for reply in replies}


def seconds_until(condition: Any, limit: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < limit, f"not within {limit} s"
        time.sleep(0.02)
    return time.monotonic() - started


def test_the_orchestrator_serves_while_any_target_replica_does(
    loop: LoopThread, replicas: Replicas, orchestrator: OrchestratorServer
) -> None:
    """Its health (one watcher per replica, nothing else): SERVING with one of two target replicas
    left, NOT_SERVING within 2 s of losing the last, SERVING again within 2 s of one's return."""
    handle = target_set(orchestrator)
    wait_serving(loop, handle, 2)
    address = orchestrator.address
    replicas.kill("a")
    seconds_until(lambda: sum(state.state == "serving" for state in handle.states()) == 1, 2.0)
    assert orchestrator_health(address) == {"SERVING"}
    with Client(address, timeout=60) as client:
        assert len(client.generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3
        replicas.kill("b")
        down_s = seconds_until(lambda: orchestrator_health(address) == {"NOT_SERVING"}, 2.0)
        assert client.info().strategies == []
        with pytest.raises(GenerationError) as refused:
            client.generate(prompt="def", max_new_tokens=3)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and refused.value.message.startswith("target:")
        replicas.start("b")
        wait_ready(replicas.processes["b"], "target")
        up_s = seconds_until(lambda: orchestrator_health(address) == {"SERVING"}, 2.0)
        assert len(client.generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3
    replicas.start("a")
    wait_ready(replicas.processes["a"], "target")
    wait_serving(loop, handle, 2)
    print(f"orchestrator health followed the last target replica down in {down_s:.2f} s, up in {up_s:.2f} s")


def test_draft_loss_falls_back_to_target_only_rounds(
    loop: LoopThread, replicas: Replicas, orchestrator: OrchestratorServer
) -> None:
    """Last in the module: the draft stays dead. A greedy speculative generation whose draft dies
    mid-way goes on in target-only rounds, its output unchanged; new requests for the draft's
    strategies are then refused UNAVAILABLE, naming the draft, and the target's still served."""
    params = {"strategy": "speculative", "num_speculative_tokens": 3, "max_new_tokens": 300, "ignore_eos": True}
    with Client(orchestrator.address, timeout=120) as client:
        expected = client.generate(prompt=PROMPTS[0], **params)
        tokens: list[int] = []
        for delta in client.stream(prompt=PROMPTS[0], **params):
            if not tokens:
                replicas.kill("draft")  # after the first round
            tokens += delta.token_ids
            if delta.stats is not None:
                during = delta.stats
        assert tokens == expected.token_ids
        assert 0 < during.drafted_tokens < expected.stats.drafted_tokens
        for strategy in ("speculative", "contrastive"):
            with pytest.raises(GenerationError) as refused:
                client.generate(prompt=PROMPTS[0], strategy=strategy, max_new_tokens=4)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert refused.value.message.startswith("draft:"), refused.value.message
        assert sorted(client.info().strategies) == ["beam", "best_first_beam", "entropix", "greedy", "sample"]
        greedy = client.generate(prompt=PROMPTS[0], strategy="greedy", max_new_tokens=300, ignore_eos=True)
        assert greedy.token_ids == expected.token_ids


def test_a_dns_name_stands_for_its_addresses_and_names_their_certificate(loop: LoopThread) -> None:
    assert loop.run(resolve("localhost:5,127.0.0.1:6")) == [("127.0.0.1:5", "localhost"), ("127.0.0.1:6", None)]
    assert loop.run(resolve("no-such-host.invalid:5")) == []


def test_addresses_split_on_commas() -> None:
    assert split_addresses("a:1, 10.0.0.2:2,[::1]:3") == [("a", 1), ("10.0.0.2", 2), ("::1", 3)]
    with pytest.raises(ValueError, match="expected host:port"):
        split_addresses("nohost")


# How a replica is full: one session allowed, or one slot-cache row and no queue for rows.
FULL = {
    "sessions": ({"max_sessions": 1}, EngineLimits(), "--max-sessions"),
    "cache rows": ({"max_sessions": 8}, EngineLimits(max_batch_rows=1, max_queued_sessions=0), "--max-batch-rows"),
}


@pytest.mark.parametrize("full_of", list(FULL))
def test_a_full_replica_passes_the_session_to_one_with_room(loop: LoopThread, llama_target_dir: Path, full_of: str) -> None:
    """RESOURCE_EXHAUSTED (the full replica's one session or one cache row taken by another
    orchestrator's session) moves the session to a replica with room; it is not counted as a
    failure of the full one. With no replica with room, the caller gets RESOURCE_EXHAUSTED naming
    the limit."""
    servicer_limits, engine_limits, flag = FULL[full_of]
    lm = CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32")
    engines = [Engine(lm, "target", engine_limits), Engine(lm, "target")]

    async def scenario() -> tuple[list[str], list[int], int]:
        servers = []
        for engine, limits in zip(engines, (servicer_limits, {"max_sessions": 8}), strict=True):
            servicer = ModelServicer(engine, **limits)

            def register(server: grpc.aio.Server, servicer: ModelServicer = servicer) -> None:
                model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)

            running = await serving.start_server(register, [MODEL_SERVICE], "127.0.0.1", 0)
            await serving.mark_serving(running, [MODEL_SERVICE])
            servers.append(running)
        full, roomy = (f"127.0.0.1:{running.port}" for running in servers)
        other = await ReplicaSet.connect(full, "target", 10.0)  # someone else's session fills it
        occupant = other.session(CallStats())
        await occupant.open(OpenRequest([1, 2, 3]))
        refused = other.session(CallStats())  # no other replica there: the limit is named
        with pytest.raises(StatusError) as no_room:
            await refused.open(OpenRequest([1, 2, 3]))
        await refused.close()
        assert no_room.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and flag in no_room.value.message
        replicas = await ReplicaSet.connect(f"{full},{roomy}", "target", 10.0)
        try:
            while sum(state.state == "serving" for state in replicas.states()) < 2:
                await asyncio.sleep(0.05)
            stats = CallStats()
            sessions = [replicas.session(stats) for _ in range(3)]
            for session in sessions:
                await session.open(OpenRequest([5, 6, 7], scoring=Scoring(ScoreKind.ARGMAX)))
            steps = [await session.step(StepRequest(append_ids=[8], scoring=Scoring(ScoreKind.ARGMAX))) for session in sessions]
            homes = [state.address for state in replicas.states() for _ in range(state.active_sessions)]
            failures = sum(state.failures for state in replicas.states())
            tried_full = {state.address: state.sessions_opened for state in replicas.states()}[full]
            assert tried_full >= 1  # ties alternate: some session was offered to the full replica first
            for session in sessions:
                await session.close()
            return homes, [int(step.scores.argmax_ids[0]) for step in steps if step.scores is not None], failures
        finally:
            await occupant.close()
            for handle in (replicas, other):
                await handle.close()
            for running in servers:
                await running.server.stop(0)

    homes, argmax, failures = loop.run(scenario())
    assert len(homes) == 3 and len(set(homes)) == 1 and failures == 0
    assert len(argmax) == 3 and len(set(argmax)) == 1


def test_a_replica_serving_another_model_is_kept_out(
    loop: LoopThread, llama_target_dir: Path, gpt2_target_dir: Path
) -> None:
    async def scenario() -> tuple[dict[str, str], list[str]]:
        servers = [
            await start_model_server(load_engine(model_dir, "target")) for model_dir in (llama_target_dir, gpt2_target_dir)
        ]
        replicas = await ReplicaSet.connect(",".join(server.address for server in servers), "target", 10.0)
        try:
            deadline = time.monotonic() + 10
            while any(state.state in ("unknown", "unreachable") for state in replicas.states()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            picks = [picked.address for picked in (replicas.pick() for _ in range(3)) if picked is not None]
            return {state.address: state.state for state in replicas.states()}, picks
        finally:
            await replicas.close()
            for server in servers:
                await server.running.server.stop(0)

    states, picks = loop.run(scenario())
    assert sorted(states.values()) == ["mismatched", "serving"]
    serving = next(address for address, state in states.items() if state == "serving")
    assert picks == [serving] * 3


def test_sessions_still_open_when_the_drain_window_ends_move_to_another_replica(
    loop: LoopThread, llama_target_dir: Path
) -> None:
    """Drain with a short window under long generations: the cut sessions are rebuilt elsewhere."""
    servers = [loop.run(start_model_server(load_engine(llama_target_dir, "target"))) for _ in range(2)]
    targets = ",".join(server.address for server in servers)
    orchestrator = loop.run(start_orchestrator(targets, None, str(llama_target_dir), max_new_tokens_limit=512, max_tokens_per_round=1))
    try:
        handle = target_set(orchestrator)
        wait_serving(loop, handle, 2)
        params = {"strategy": "greedy", "max_new_tokens": 400}
        uninterrupted = run_streams(orchestrator.address, params)
        draining = servers[0]

        def drain_with_a_short_window() -> None:
            deadline = time.monotonic() + 30
            # The servicer's own count: the health states the orchestrator polls can lag, and a
            # session seen late may be near its end when the window closes.
            while draining.servicer.active_sessions < 2:
                assert time.monotonic() < deadline, "streams did not start"
                time.sleep(0.005)
            loop.run(serving.drain(draining.running, grace=0.3))

        interrupted = run_streams(orchestrator.address, params, drain_with_a_short_window)
        assert [tokens for tokens, _ in interrupted] == [tokens for tokens, _ in uninterrupted]
        assert sum(rebuilt for _, rebuilt in interrupted) >= 2
    finally:
        loop.run(orchestrator.running.server.stop(0))
        for server in servers:
            loop.run(server.running.server.stop(0))


def test_the_info_a_replica_gave_while_compiling_is_fetched_again_when_it_is_done(
    loop: LoopThread, llama_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation plans from `Info`'s costs; a service compiling in the background reports its
    eager warm-up timings until the compiler ends, so the orchestrator must ask again then."""
    monkeypatch.setattr(replicas_module, "INFO_REFRESH_S", 0.05)
    engine = load_engine(llama_target_dir, "target")
    measured = engine.info()
    compiling = threading.Event()
    compiling.set()

    def info() -> ModelInfo:
        if compiling.is_set():  # as while compiling: eager costs
            return replace(measured, compiling=True, decode_ms_per_token=55.0)
        return replace(measured, compiling=False, compiled=True, decode_ms_per_token=8.0)

    engine.info = info  # type: ignore[method-assign]

    async def scenario() -> tuple[float, float, float]:
        server = await start_model_server(engine)
        replicas = await ReplicaSet.connect(server.address, "target", 10.0)
        try:
            before = replicas.info.decode_ms_per_token
            await asyncio.sleep(0.3)
            still = replicas.info.decode_ms_per_token
            compiling.clear()
            deadline = time.monotonic() + 10
            while replicas.info.decode_ms_per_token != 8.0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return before, still, replicas.info.decode_ms_per_token
        finally:
            await replicas.close()
            await server.running.server.stop(0)

    assert loop.run(scenario()) == (55.0, 55.0, 8.0)
