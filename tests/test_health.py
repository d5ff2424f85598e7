"""Health tells the truth, with real processes on loopback: the orchestrator's health follows a
killed and restarted target within 2 s; a dead draft takes only the draft's strategies away;
`specwire up` restarts a crashed child while target-only traffic keeps succeeding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specwire.client import Client, GenerationError
from specwire.client.launcher import free_base_port
from specwire.orchestrator.health import DRAFT_STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
ORCHESTRATOR = "specwire.v1.Orchestrator"
FOLLOW_S = 2.0  # the bar: health follows the target within this


class Child:
    """`specwire serve ROLE` as a child process on a fixed port, restartable on the same port."""

    def __init__(self, role: str, port: int, *args: str) -> None:
        self.role, self.port, self.args = role, port, args
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "specwire", "serve", self.role, "--port", str(self.port), *self.args]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(f"READY {self.role} "):
                # Keep draining the pipe so the child never blocks on a full one.
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return
        raise AssertionError(f"{self.role} exited with {self.process.wait()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def health(address: str, service: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def seconds_until(condition: Callable[[], bool], limit: float) -> float:
    """Poll `condition` every 20 ms; how long it took to hold (fails past `limit`)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < limit, f"not within {limit} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def children(llama_target_dir: Path, llama_draft_dir: Path) -> Iterator[dict[str, Child]]:
    base = free_base_port(3)
    model = ["--device", "cpu"]
    target = Child("target", base + 2, "--model", str(llama_target_dir), *model)
    draft = Child("draft", base + 1, "--model", str(llama_draft_dir), *model)
    orchestrator = Child(
        "orchestrator", base, "--target", f"127.0.0.1:{base + 2}", "--draft", f"127.0.0.1:{base + 1}",
        "--tokenizer", str(llama_target_dir),
    )
    # Shared by the tests of this module: each leaves every child running again.
    group = {"target": target, "draft": draft, "orchestrator": orchestrator}
    try:
        for child in group.values():
            child.start()
        yield group
    finally:
        for child in group.values():
            child.kill()


def test_health_follows_a_killed_and_restarted_target(children: dict[str, Child]) -> None:
    address = f"127.0.0.1:{children['orchestrator'].port}"
    client = Client(address, timeout=30)
    assert health(address, ORCHESTRATOR) == health(address, "") == "SERVING"
    assert set(client.info().strategies) >= {"greedy", "speculative", "contrastive"}

    children["target"].kill()
    down_s = seconds_until(lambda: health(address, ORCHESTRATOR) == "NOT_SERVING", FOLLOW_S)
    assert health(address, "") == "NOT_SERVING"
    assert client.info().strategies == []
    with pytest.raises(GenerationError) as refused:
        client.generate(prompt="def", max_new_tokens=3)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and refused.value.message.startswith("target:")

    children["target"].start()  # same port; READY once it serves
    up_s = seconds_until(lambda: health(address, ORCHESTRATOR) == "SERVING", FOLLOW_S)
    assert health(address, "") == "SERVING"
    assert len(client.generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3
    print(f"health followed the target down in {down_s:.2f} s, up in {up_s:.2f} s")


def test_a_dead_draft_takes_only_the_draft_strategies_away(children: dict[str, Child]) -> None:
    address = f"127.0.0.1:{children['orchestrator'].port}"
    client = Client(address, timeout=30)
    children["draft"].kill()
    seconds_until(lambda: not DRAFT_STRATEGIES & set(client.info().strategies), FOLLOW_S)
    # Entropix stays: it takes the draft only when asked to speculate.
    assert sorted(client.info().strategies) == ["beam", "best_first_beam", "entropix", "greedy", "sample"]
    assert health(address, ORCHESTRATOR) == "SERVING"  # the target still serves
    speculating = [{"strategy": name} for name in sorted(DRAFT_STRATEGIES)]
    speculating.append({"strategy": "entropix", "num_speculative_tokens": 2})
    for kwargs in speculating:
        with pytest.raises(GenerationError) as refused:
            client.generate(prompt="def", max_new_tokens=3, **kwargs)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and refused.value.message.startswith("draft:")
    assert len(client.generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3
    assert len(client.generate(prompt="def", strategy="entropix", max_new_tokens=3, ignore_eos=True).token_ids) == 3

    children["draft"].start()
    seconds_until(lambda: set(client.info().strategies) >= DRAFT_STRATEGIES, FOLLOW_S)
    assert len(client.generate(prompt="def", strategy="speculative", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def child_pids(parent: int) -> dict[str, int]:
    """The roles of `parent`'s children, by their command lines."""
    found = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    roles = {}
    for pid in found:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"serve" in command:
            roles[command[command.index(b"serve") + 1].decode()] = int(pid)
    return roles


def test_up_restarts_a_killed_draft_while_target_only_requests_keep_succeeding(
    llama_target_dir: Path, llama_draft_dir: Path
) -> None:
    port = free_base_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "up", "--target-model", str(llama_target_dir),
         "--draft-model", str(llama_draft_dir), "--port", str(port), "--device", "cpu"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stderr: list[str] = []
    try:
        assert process.stdout is not None and process.stderr is not None
        for line in process.stdout:
            if line.startswith("Ctrl-C"):
                break
        threading.Thread(target=lambda: stderr.extend(process.stderr or []), daemon=True).start()
        client = Client(f"127.0.0.1:{port}", timeout=30)
        before = child_pids(process.pid)
        assert set(before) == {"target", "draft", "orchestrator"}
        os.kill(before["draft"], signal.SIGKILL)

        # Target-only traffic throughout: from the kill until the draft is back and serving.
        served = 0
        deadline = time.monotonic() + 120
        while True:
            assert len(client.generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3
            served += 1
            if set(client.info().strategies) >= DRAFT_STRATEGIES and child_pids(process.pid).get("draft") not in (
                None, before["draft"]
            ):
                break
            assert time.monotonic() < deadline, "the draft was not restarted"
            time.sleep(0.05)
        assert len(client.generate(prompt="def", strategy="speculative", max_new_tokens=3, ignore_eos=True).token_ids) == 3
        after = child_pids(process.pid)
        assert after["target"] == before["target"] and after["orchestrator"] == before["orchestrator"]
        assert served >= 5
        assert any(line.startswith("draft exited with code -9; restarting in") for line in stderr), stderr
        assert any(line.startswith("draft restarted") for line in stderr), stderr

        process.send_signal(signal.SIGTERM)  # only a signal stops the group
        assert process.wait(timeout=30) == 0
        for pid in after.values():
            assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_supervise_restarts_a_crashing_child_with_doubling_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from specwire.client import launcher

    monkeypatch.setattr(launcher, "RESTART_DELAY_S", 0.05)
    stack = launcher.Stack(launcher.StackConfig())
    stack._spawn("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"], None)
    lines: list[str] = []
    deadline = time.monotonic() + 30
    while sum(line.startswith("crasher restarted") for line in lines) < 3:
        stack.supervise(lines.append)
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)
    stack.stop()
    waits = [float(line.split("restarting in ")[1].split()[0]) for line in lines if "restarting in" in line]
    assert all(line.startswith("crasher exited with code 3") for line in lines if "exited" in line)
    assert waits[:3] == [0.05, 0.1, 0.2]  # doubling while it keeps crashing
