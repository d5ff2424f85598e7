"""Prometheus metrics scraped over HTTP from real servers after real generations: the counters
move by what the responses report, and the services' sessions and KV-cache gauges return to 0."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.parser import text_string_to_metric_families
from specwire.client import Client, GenerationError
from specwire.client.sdk import StreamDelta
from specwire.orchestrator.generation import STRATEGIES

from specwire.metrics import serve_metrics
from tests.harness import LoopThread
from tests.observed import Observed, start_observed_stack

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def metered(loop: LoopThread, llama_target_dir: Path, llama_draft_dir: Path) -> Iterator[tuple[Observed, dict[str, str]]]:
    observed = start_observed_stack(loop, llama_target_dir, llama_draft_dir, metrics=True)
    servers = {name: serve_metrics(m.registry, "127.0.0.1", 0) for name, m in observed.metrics.items()}
    urls = {name: f"http://127.0.0.1:{server.server_port}/metrics" for name, server in servers.items()}
    yield observed, urls
    for server in servers.values():
        server.shutdown()
        server.server_close()
    observed.stop()


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples.get((metric, frozenset(labels.items())), 0.0)


def test_metric_names_follow_prometheus_conventions(metered: tuple[Observed, dict[str, str]]) -> None:
    _, urls = metered
    for url in urls.values():
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("specwire_"):
                continue
            if family.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
            if family.type == "histogram" and "length" not in family.name:
                assert family.name.endswith("_seconds"), family.name


def test_counters_follow_a_generation_and_gauges_return_to_zero(metered: tuple[Observed, dict[str, str]]) -> None:
    observed, urls = metered
    strategy = "speculative" if "speculative" in STRATEGIES else "greedy"
    before = {name: scrape(url) for name, url in urls.items()}
    with Client(observed.stack.address, timeout=60) as client:
        # A fixed γ: auto γ may plan every round target-only from the services' timings.
        fixed = {"num_speculative_tokens": 4} if strategy == "speculative" else {}
        result = client.generate(prompt="def add(a, b):", strategy=strategy, max_new_tokens=16, ignore_eos=True, **fixed)
        with pytest.raises(GenerationError):
            client.generate(prompt="x", strategy=strategy, top_p=1.5)
    stats = result.stats

    # The services see the orchestrator end its streams a moment after the reply.
    deadline = time.monotonic() + 10
    while True:
        after = {name: scrape(url) for name, url in urls.items()}
        open_sessions = sum(value(after[s], "specwire_active_sessions") for s in ("target", "draft"))
        if open_sessions == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def moved(process: str, name: str, **labels: str) -> float:
        return value(after[process], name, **labels) - value(before[process], name, **labels)

    orch = "orchestrator"
    assert moved(orch, "specwire_requests_total", strategy=strategy, status="ok") == 1
    assert moved(orch, "specwire_requests_total", strategy=strategy, status="invalid_argument") == 1
    assert value(after[orch], "specwire_requests_in_flight") == 0
    assert moved(orch, "specwire_generated_tokens_total", strategy=strategy) == stats.new_tokens == 16
    assert moved(orch, "specwire_rounds_total", strategy=strategy) == stats.rounds
    for part in ("total", "draft", "target", "queue", "network", "orchestrator"):
        assert moved(orch, "specwire_round_duration_seconds_count", strategy=strategy, part=part) == stats.rounds
    assert moved(orch, "specwire_round_duration_seconds_sum", strategy=strategy, part="total") * 1e3 <= stats.wall_ms
    assert moved(orch, "specwire_service_traffic_bytes_total", service="target", direction="sent") == stats.target_bytes_sent
    assert moved(orch, "specwire_request_duration_seconds_count", strategy=strategy) == 2
    if strategy == "speculative":
        assert moved(orch, "specwire_draft_tokens_proposed_total", strategy=strategy) == stats.drafted_tokens > 0
        assert moved(orch, "specwire_draft_tokens_accepted_total", strategy=strategy) == stats.accepted_tokens
        speculative_rounds = stats.rounds - stats.speculation_off_rounds  # auto γ may run target-only rounds
        assert moved(orch, "specwire_accepted_length_tokens_count", strategy=strategy) == speculative_rounds
        assert moved(orch, "specwire_accepted_length_tokens_sum", strategy=strategy) == stats.accepted_tokens
        assert moved("draft", "specwire_forward_passes_total") == stats.draft_forwards

    assert moved("target", "specwire_forward_passes_total") == stats.target_forwards
    assert moved("target", "specwire_session_messages_total", kind="open", status="ok") == 1
    assert moved("target", "specwire_message_compute_seconds_count", kind="step") > 0
    for service in ("target", "draft"):
        assert value(after[service], "specwire_active_sessions") == 0
        assert value(after[service], "specwire_kv_cache_tokens") == 0
        assert value(after[service], "specwire_service_info", role=service) == 1


def test_kv_cache_gauge_counts_the_tokens_an_open_session_holds(metered: tuple[Observed, dict[str, str]]) -> None:
    observed, urls = metered
    with Client(observed.stack.address, timeout=60) as client:
        stream = cast(
            Generator[StreamDelta, None, None],
            client.stream(input_ids=[5, 6, 7, 8], strategy="greedy", max_new_tokens=50, ignore_eos=True),
        )
        next(stream)  # the first token is decided: the target's session is open
        during = scrape(urls["target"])
        stream.close()
    assert value(during, "specwire_active_sessions") >= 1
    assert value(during, "specwire_kv_cache_tokens") >= 4  # at least the prompt


def test_cancelled_streams_count_as_cancelled_not_error(metered: tuple[Observed, dict[str, str]]) -> None:
    observed, urls = metered
    before = scrape(urls["target"])
    with Client(observed.stack.address, timeout=60) as client:
        for _ in range(4):
            stream = cast(
                Generator[StreamDelta, None, None],
                client.stream(input_ids=[5, 6, 7, 8], strategy="greedy", max_new_tokens=200, ignore_eos=True),
            )
            next(stream)
            stream.close()  # the client goes away with the target mid-message
    deadline = time.monotonic() + 10
    while value(scrape(urls["target"]), "specwire_active_sessions") and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(urls["target"])
    counted = {
        status: sum(
            value(after, "specwire_session_messages_total", kind=kind, status=status)
            - value(before, "specwire_session_messages_total", kind=kind, status=status)
            for kind in ("open", "step")
        )
        for status in ("error", "cancelled")
    }
    assert counted["error"] == 0 and counted["cancelled"] >= 1, counted
