"""The command line: JSON output, error reporting without tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import Stack

ROOT = Path(__file__).resolve().parent.parent


def specwire(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specwire", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_generate_json_has_tokens_text_reason_and_stats(llama_stack: Stack) -> None:
    run = specwire("generate", "--address", llama_stack.address, "--input-ids", "5,6,7", "--max-new-tokens", "6",
                   "--ignore-eos", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["token_ids"]) == 6 and isinstance(out["text"], str)
    assert out["finish_reason"] == "length" and out["stats"]["new_tokens"] == 6


def test_generate_beam_json_lists_sequences(llama_stack: Stack) -> None:
    run = specwire("generate", "--address", llama_stack.address, "--prompt", "def add(a, b):", "--strategy", "beam",
                   "--num-beams", "3", "--num-return-sequences", "2", "--early-stopping", "true",
                   "--max-new-tokens", "8", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["sequences"]) == 2 and out["sequences"][0]["token_ids"] == out["token_ids"]
    assert out["sequences"][0]["score"] >= out["sequences"][1]["score"]


def test_generate_stops_at_a_stop_string_given_by_flag(llama_stack: Stack) -> None:
    free = json.loads(specwire("generate", "--address", llama_stack.address, "--input-ids", "5,6,7",
                               "--max-new-tokens", "12", "--ignore-eos", "--json").stdout)
    stop = free["text"][len(free["text"]) // 2:][:1]
    assert stop, free
    run = specwire("generate", "--address", llama_stack.address, "--input-ids", "5,6,7", "--max-new-tokens", "12",
                   "--ignore-eos", "--stop-strings", stop, "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["finish_reason"] == "stop" and out["text"] == free["text"][: free["text"].index(stop)]


def test_generate_stream_prints_the_text_then_one_summary_line(llama_stack: Stack) -> None:
    args = ("generate", "--address", llama_stack.address, "--input-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos")
    unary = json.loads(specwire(*args, "--json").stdout)
    run = specwire(*args, "--stream")
    assert run.returncode == 0, run.stderr
    assert run.stdout == unary["text"]
    assert run.stderr.strip().startswith("[length] 6 tokens in ") and "\n" not in run.stderr.strip()


def test_generate_speculative_summary_states_the_acceptance_its_stats_hold(llama_stack: Stack) -> None:
    args = ("generate", "--address", llama_stack.address, "--input-ids", "5,6,7", "--max-new-tokens", "12",
            "--ignore-eos", "--strategy", "speculative", "--num-speculative-tokens", "3")
    stats = json.loads(specwire(*args, "--json").stdout)["stats"]
    run = specwire(*args)
    assert run.returncode == 0, run.stderr
    figures = re.search(r"(\d+) of (\d+) drafted tokens accepted \((\d+)%\), ([\d.]+) tokens/forward", run.stderr)
    assert figures, run.stderr
    # Greedy and a fixed γ: the same rounds, so the same figures as the JSON run's.
    assert (int(figures[1]), int(figures[2])) == (stats["accepted_tokens"], stats["drafted_tokens"])
    assert int(figures[3]) == round(100 * stats["acceptance_rate"])
    assert float(figures[4]) == pytest.approx(stats["tokens_per_target_forward"], abs=0.005)


def test_unknown_strategy_is_refused_by_the_parser() -> None:
    run = specwire("generate", "--prompt", "x", "--strategy", "nucleus")
    assert run.returncode == 2 and "invalid choice: 'nucleus'" in run.stderr and "Traceback" not in run.stderr


def test_generate_entropix_json_trace_and_plot(llama_stack: Stack, tmp_path: Path) -> None:
    plot = tmp_path / "states.png"
    run = specwire("generate", "--address", llama_stack.address, "--input-ids", "5,6,7", "--max-new-tokens", "5",
                   "--ignore-eos", "--strategy", "entropix", "--seed", "3", "--entropix", "adaptive_samples=3",
                   "--json", "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["decisions"]) == 5 and {"state", "entropy", "top_k", "min_p"} <= set(out["decisions"][0])
    assert sum(out["stats"]["entropix_states"].values()) == 5
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_error_prints_status_and_message_without_traceback(llama_stack: Stack) -> None:
    run = specwire("generate", "--address", llama_stack.address, "--prompt", "x", "--top-p", "1.5")
    assert run.returncode != 0
    assert run.stderr.startswith("INVALID_ARGUMENT: top_p:") and "Traceback" not in run.stderr


def test_unreachable_orchestrator_is_unavailable() -> None:
    run = specwire("generate", "--address", "127.0.0.1:1", "--prompt", "x", "--timeout", "10")
    assert run.returncode != 0 and run.stderr.startswith("UNAVAILABLE") and "Traceback" not in run.stderr


def test_the_command_sets_short_openmp_waits_before_torch_loads_unless_the_environment_chooses() -> None:
    """libgomp reads its wait settings once, when torch loads it: `run` must set them first."""
    code = (
        "import os, sys\n"
        "from specwire.__main__ import OPENMP_SPINS, short_openmp_waits\n"
        "assert 'torch' not in sys.modules\n"
        "short_openmp_waits(os.environ)\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), OPENMP_SPINS)\n"
    )
    chosen = {"": {}, "OMP_WAIT_POLICY": {"OMP_WAIT_POLICY": "PASSIVE"}, "GOMP_SPINCOUNT": {"GOMP_SPINCOUNT": "5"}}
    unset = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    outputs = {}
    for name, setting in chosen.items():
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=unset | setting, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        outputs[name] = run.stdout.split()
    assert outputs[""] == ["10000", "None", "10000"]
    assert outputs["OMP_WAIT_POLICY"] == ["None", "PASSIVE", "10000"]
    assert outputs["GOMP_SPINCOUNT"] == ["5", "None", "10000"]
