"""`specwire up`: three child processes, healthy, serving; SIGTERM stops all three."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from client import Client

ROOT = Path(__file__).resolve().parent.parent


def free_port_block(size: int = 3) -> int:
    """A port p with p..p+size-1 free right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size >= 65535:
            continue
        try:
            sockets = []
            for offset in range(size):
                s = socket.socket()
                s.bind(("127.0.0.1", base + offset))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port block")


def test_up_serves_and_stops_on_sigterm(llama_target_dir: Path, llama_draft_dir: Path) -> None:
    port = free_port_block()
    process = subprocess.Popen(
        [sys.executable, "-m", "client", "up", "--target-model", str(llama_target_dir),
         "--draft-model", str(llama_draft_dir), "--port", str(port), "--device", "cpu"],
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
            assert len(client.generate(prompt="def", max_new_tokens=5, ignore_eos=True).token_ids) == 5
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
