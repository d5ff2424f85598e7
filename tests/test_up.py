"""`specwire up`: three child processes, healthy, serving; SIGTERM stops all three."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from specwire.client import Client
from specwire.client.launcher import Stack, StackConfig, free_base_port, shares_cores

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.medusa_fixtures"]  # `--medusa` passes the heads on to the target


def test_up_serves_and_stops_on_sigterm(llama_target_dir: Path, llama_draft_dir: Path, llama_heads_dir: Path) -> None:
    port = free_base_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "up", "--target-model", str(llama_target_dir),
         "--draft-model", str(llama_draft_dir), "--medusa", str(llama_heads_dir), "--port", str(port), "--device", "cpu"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        assert any(line.startswith(f"orchestrator  127.0.0.1:{port}") for line in lines), lines
        assert any(line.startswith(f"target        127.0.0.1:{port + 2}") for line in lines), lines
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.health() == "SERVING"
            greedy = client.generate(prompt="def", max_new_tokens=5, ignore_eos=True).token_ids
            assert len(greedy) == 5
            assert client.generate(prompt="def", strategy="medusa", max_new_tokens=5, ignore_eos=True).token_ids == greedy
        children = [int(pid) for pid in subprocess.run(
            ["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()]
        assert len(children) == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        for pid in children:  # every child is gone too
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            assert not alive, f"child {pid} survived"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_pipelined_drafting_is_turned_off_where_the_model_services_share_the_cpus_cores() -> None:
    """`specwire up` / `bench` pass `--speculative-pipeline off` to the orchestrator where the
    services' threads outnumber the cores and no emulated link delays them."""
    assert not shares_cores(StackConfig(device="cpu"), threads=1, cores=2)  # 1 + 1 threads
    assert shares_cores(StackConfig(device="cpu", target_threads=2), threads=1, cores=2)
    assert shares_cores(StackConfig(device="cpu", target_replicas=2), threads=1, cores=2)
    assert not shares_cores(StackConfig(device="cpu", target_threads=2, rtt_ms=20.0), threads=1, cores=2)
    assert not shares_cores(StackConfig(device="cuda", target_threads=2), threads=1, cores=2)


def test_the_target_gets_its_own_quantize_mode_and_the_draft_the_stacks(monkeypatch: Any) -> None:
    """`specwire up --quantize mixed --target-quantize w8a8`: one --quantize per service, each its own."""
    commands: dict[str, list[str]] = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, role, command, *args, **kwargs: commands.__setitem__(role, command))
    monkeypatch.setattr(Stack, "_wait", lambda self, roles, timeout: None)
    Stack(StackConfig(device="cpu", quantize="mixed", target_quantize="w8a8")).start()
    for role, mode in (("target", "w8a8"), ("draft", "mixed")):
        command = commands[role]
        assert command.count("--quantize") == 1 and command[command.index("--quantize") + 1] == mode
    Stack(StackConfig(device="cpu", quantize="int8")).start()
    assert all(commands[role][commands[role].index("--quantize") + 1] == "int8" for role in ("target", "draft"))
