"""`specwire trace summarize` over JSON-lines span files written by real runs: in-process servers
with the file exporter, and `specwire up --trace-dir` (three processes, three files, one trace
per generation)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from specwire.bench.trace_summary import PARTS, format_summary, summarize
from specwire.client import Client, cli
from specwire.client.launcher import free_base_port
from specwire.orchestrator.generation import STRATEGIES

from tests.harness import LoopThread
from tests.observed import SERVICES, start_observed_stack

ROOT = Path(__file__).resolve().parent.parent
STRATEGY = "speculative" if "speculative" in STRATEGIES else "greedy"
# A fixed γ: auto γ may plan every round target-only from the services' timings, and the draft
# would then have no span.
FIXED = {"num_speculative_tokens": 4} if STRATEGY == "speculative" else {}
SEQUENTIAL = {"speculative_pipeline": False, **FIXED} if STRATEGY == "speculative" else {}


@pytest.fixture(scope="module")
def traced_run(loop: LoopThread, llama_target_dir: Path, llama_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Any]]]:
    """Two generations traced to DIR/<service>.jsonl; yields DIR and their results."""
    trace_dir = tmp_path_factory.mktemp("traces")
    observed = start_observed_stack(loop, llama_target_dir, llama_draft_dir, trace_dir=trace_dir)
    try:
        with Client(observed.stack.address, timeout=60) as client:
            results = [
                # Sequential rounds: a pipelined round's draft call overlaps its target call.
                client.generate(prompt=prompt, strategy=STRATEGY, max_new_tokens=12, ignore_eos=True, **SEQUENTIAL)
                for prompt in ("def add(a, b):", "for i in range(10):\n")
            ]
        observed.flush()
    finally:
        observed.stop()
    yield trace_dir, results


def test_every_line_is_one_span_in_the_sdk_json_form(traced_run: tuple[Path, list[Any]]) -> None:
    trace_dir, _ = traced_run
    assert sorted(p.name for p in trace_dir.glob("*.jsonl")) == sorted(f"{s}.jsonl" for s in SERVICES)
    for service in SERVICES:
        lines = (trace_dir / f"{service}.jsonl").read_text().splitlines()
        assert lines
        for line in lines:
            span = json.loads(line)
            assert span["resource"]["attributes"]["service.name"] == service
            assert span["context"]["trace_id"].startswith("0x") and span["start_time"] and span["end_time"]


def test_summary_breaks_every_round_down(traced_run: tuple[Path, list[Any]]) -> None:
    trace_dir, results = traced_run
    summary = summarize([trace_dir])
    assert len(summary.traces) == 2
    assert sorted(t["rounds"] for t in summary.traces) == sorted(r.stats.rounds for r in results)
    assert sorted(t["new_tokens"] for t in summary.traces) == [12, 12]
    assert len(summary.rounds) == sum(r.stats.rounds for r in results)
    assert summary.service_spans > 0 and summary.service_spans_joined == summary.service_spans
    assert summary.groups["prefill"]["rounds"] == 2
    # The parts of a round add up to its wall time when nothing overlaps (decode rounds call the
    # services one after the other).
    for record in summary.rounds:
        if record.index > 0:
            assert sum(record.parts_ms.values()) == pytest.approx(record.wall_ms, rel=0.02, abs=0.05)
    decode = summary.groups["decode"]
    assert decode["parts_ms"]["target"]["median"] > 0
    assert sum(decode["parts_ms"][key]["share"] for key, _ in PARTS) == pytest.approx(1.0, abs=0.02)
    total_tokens = sum(r.stats.new_tokens for r in results)
    mean_tokens = (summary.groups["prefill"]["tokens"]["mean"] * 2 + decode["tokens"]["mean"] * decode["rounds"])
    assert mean_tokens == pytest.approx(total_tokens, abs=1e-6)
    table = format_summary(summary)
    for _, label in PARTS:
        assert label in table
    assert "tokens / round" in table and "median" in table and "p90" in table


def test_summarize_command_prints_json_and_plots(
    traced_run: tuple[Path, list[Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_dir, _ = traced_run
    plot = tmp_path / "rounds.png"
    files = [str(trace_dir / f"{s}.jsonl") for s in SERVICES]
    assert cli.main(["trace", "summarize", *files, "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] > 0 and set(out["groups"]) == {"prefill", "decode"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["trace", "summarize", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_up_with_trace_dir_writes_one_trace_across_three_processes(
    llama_target_dir: Path, llama_draft_dir: Path, tmp_path: Path
) -> None:
    port = free_base_port()
    trace_dir = tmp_path / "traces"
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "up", "--target-model", str(llama_target_dir),
         "--draft-model", str(llama_draft_dir), "--port", str(port), "--device", "cpu", "--trace-dir", str(trace_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("Ctrl-C"):
                break
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            result = client.generate(prompt="def add(a, b):", strategy=STRATEGY, max_new_tokens=8, ignore_eos=True,
                                     **FIXED)
        process.send_signal(signal.SIGTERM)  # the services flush their spans as they stop
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    trace_ids: dict[str, set[str]] = {}
    for service in SERVICES if STRATEGY == "speculative" else ("orchestrator", "target"):
        lines = (trace_dir / f"{service}.jsonl").read_text().splitlines()
        trace_ids[service] = {json.loads(line)["context"]["trace_id"] for line in lines}
    (trace_id,) = trace_ids["orchestrator"]
    assert all(ids == {trace_id} for ids in trace_ids.values()), trace_ids
    summary = summarize([trace_dir])
    assert len(summary.rounds) == result.stats.rounds
    assert summary.service_spans_joined == summary.service_spans > 0
