"""The life of the processes, real ones on loopback: SIGTERM is honoured at every moment (while
importing, loading, compiling, serving and draining), and no child of `specwire up` or
`specwire bench` outlives its parent, however the parent dies."""

from __future__ import annotations

import json
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
from specwire.client import Client
from specwire.client.launcher import free_base_port
from specwire.orchestrator.models import CallStats, RemoteModel
from specwire.v1 import common_pb2, model_pb2, model_pb2_grpc

from specwire.errors import StatusError
from specwire.session import OpenRequest, StepRequest
from tests.harness import LoopThread, start_orchestrator

ROOT = Path(__file__).resolve().parent.parent
STOP_WITHIN_S = 5.0  # the bar: SIGTERM → exit while starting; SIGKILL of a parent → no child left
GRACE_S = 3.0  # `--grace` of the services these tests drain


class Process:
    """`specwire ARGS…` as a child, its output collected line by line as it comes."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "specwire", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.popen.poll() is None, f"exited with {self.popen.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"not within {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def wait_for_line(self, start: str, timeout: float = 300.0) -> str:
        self.wait_for(lambda: any(start in line for line in self.lines), timeout)
        return next(line for line in self.lines if start in line)

    def exit_s_after(self, sig: int) -> float:
        """Send `sig`; seconds until the process has exited (fails past a minute)."""
        sent = time.monotonic()
        self.popen.send_signal(sig)
        self.popen.wait(timeout=60)
        return time.monotonic() - sent

    def output(self) -> str:
        return "".join(self.lines[-30:])

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    """Processes a test starts; any still running afterwards is killed."""
    started: list[Process] = []
    yield started
    for process in started:
        process.kill()


def serve(processes: list[Process], role: str, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> Process:
    process = Process("-v", "serve", role, "--model", str(model_dir), "--device", "cpu", "--grace", str(GRACE_S), *args,
                      env=env)
    processes.append(process)
    return process


def health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, …), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":  # a zombie has ended; only its parent's wait is missing
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def target_info(address: str) -> model_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest(), timeout=10)


def alive(pids: set[int]) -> set[int]:
    living = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            living.add(pid)
    return living


def survivors_after(pids: set[int], seconds: float) -> set[int]:
    """Those of `pids` still alive `seconds` from now (checked until then, so it returns early)."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


# -- SIGTERM at every moment --------------------------------------------------------------------


def test_sigterm_while_importing_ends_the_service_at_once(processes: list[Process], llama_target_dir: Path) -> None:
    service = serve(processes, "target", llama_target_dir, "--port", "0")
    time.sleep(0.5)  # the interpreter is importing: no handler yet, SIGTERM's default ends it
    assert service.exit_s_after(signal.SIGTERM) < STOP_WITHIN_S
    assert service.popen.returncode in (0, -signal.SIGTERM)


def test_sigterm_while_loading_stops_the_service_within_5_s(
    processes: list[Process], llama_target_dir: Path, tmp_path: Path
) -> None:
    """The ports are bound and answer NOT_SERVING, the weights are being read."""
    port = free_base_port(1)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    service = serve(processes, "target", llama_target_dir, "--port", str(port), "--compile", "on", env=env)
    service.wait_for(lambda: health(f"127.0.0.1:{port}") == "NOT_SERVING")
    below = descendants(service.popen.pid)
    assert service.exit_s_after(signal.SIGTERM) < STOP_WITHIN_S
    assert service.popen.returncode == 0
    assert any("stopped while starting" in line for line in service.lines), service.output()
    assert not any(line.startswith("READY") for line in service.lines)
    assert not survivors_after(below, STOP_WITHIN_S)


def test_sigterm_while_compiling_in_the_background_stops_the_service_within_5_s(
    processes: list[Process], llama_target_dir: Path, tmp_path: Path
) -> None:
    """SERVING at once on eager forwards while torch.compile runs on an empty compile cache (it
    takes minutes here and cannot be interrupted): the process exits without waiting for it."""
    port = free_base_port(1)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    service = serve(processes, "target", llama_target_dir, "--port", str(port), "--compile", "on", env=env)
    service.wait_for(lambda: health(f"127.0.0.1:{port}") == "SERVING")
    assert not target_info(f"127.0.0.1:{port}").compiled  # still compiling
    below = descendants(service.popen.pid)  # compile workers, if torch started any
    assert service.exit_s_after(signal.SIGTERM) < STOP_WITHIN_S
    assert service.popen.returncode == 0
    assert not survivors_after(below, STOP_WITHIN_S)


def test_sigterm_while_the_orchestrator_waits_for_its_services_ends_it_at_once(processes: list[Process]) -> None:
    port = free_base_port(2)  # nothing listens on port + 1
    orchestrator = Process("-v", "serve", "orchestrator", "--port", str(port), "--target", f"127.0.0.1:{port + 1}",
                           "--draft", "none")
    processes.append(orchestrator)
    orchestrator.wait_for_line("target replica")  # it is connecting, for up to 60 s
    assert orchestrator.exit_s_after(signal.SIGTERM) < STOP_WITHIN_S


@pytest.fixture
def served_target(processes: list[Process], llama_target_dir: Path) -> tuple[Process, str]:
    service = serve(processes, "target", llama_target_dir, "--port", "0")
    address = service.wait_for_line("READY target ").split()[-1]
    return service, address


def open_session(loop: LoopThread, address: str) -> Callable[[], object]:
    """A session opened on the service and left open, as a generation between rounds holds it;
    returns a step on it (which raises once the service has cut the stream)."""
    model = loop.run(RemoteModel.connect(address, "target", timeout=30))
    session = model.session(CallStats())
    loop.run(session.open(OpenRequest(prompt_ids=[1, 2, 3])))
    return lambda: loop.run(session.step(StepRequest(append_ids=[4])))


def test_sigterm_while_serving_lets_a_running_generation_finish(
    loop: LoopThread, served_target: tuple[Process, str], llama_target_dir: Path
) -> None:
    service, address = served_target
    orchestrator = loop.run(start_orchestrator(address, None, str(llama_target_dir)))
    try:
        stream = Client(orchestrator.address, timeout=60).stream(prompt="def", max_new_tokens=100, ignore_eos=True)
        tokens = list(next(stream).token_ids)
        service.popen.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        service.wait_for_line("draining")
        assert health(address) in ("NOT_SERVING", "UNAVAILABLE")  # no new work while draining
        for delta in stream:
            tokens += delta.token_ids
        assert len(tokens) == 100  # the generation that was running finished
        service.popen.wait(timeout=60)
        assert time.monotonic() - sent < GRACE_S + 2 and service.popen.returncode == 0
    finally:
        loop.run(orchestrator.running.server.stop(0))


def test_a_session_still_open_at_the_end_of_the_grace_is_cut(loop: LoopThread, served_target: tuple[Process, str]) -> None:
    service, address = served_target
    step = open_session(loop, address)
    step()
    exit_s = service.exit_s_after(signal.SIGTERM)
    assert GRACE_S - 0.5 < exit_s < GRACE_S + 2, exit_s  # it waited for the session, until the grace ran out
    with pytest.raises(StatusError) as cut:
        step()
    assert cut.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_second_sigterm_while_draining_stops_at_once(loop: LoopThread, served_target: tuple[Process, str]) -> None:
    service, address = served_target
    open_session(loop, address)
    service.popen.send_signal(signal.SIGTERM)
    service.wait_for_line("draining")
    assert service.exit_s_after(signal.SIGTERM) < 1.5 < GRACE_S
    assert any("a second signal" in line for line in service.lines), service.output()


# -- no orphans -----------------------------------------------------------------------------------


def model_info(address: str) -> model_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest(), timeout=10)


def phases(startup: common_pb2.StartupTimes) -> list[str]:
    assert startup.serving_s > 0 and sum(p.seconds for p in startup.phases) == pytest.approx(startup.serving_s, abs=0.05)
    return [phase.name for phase in startup.phases]


def test_up_serves_stating_each_start_and_no_child_outlives_a_sigkill_of_up(
    processes: list[Process], llama_target_dir: Path, llama_draft_dir: Path
) -> None:
    port = free_base_port()
    up = Process("up", "--target-model", str(llama_target_dir), "--draft-model", str(llama_draft_dir),
                 "--port", str(port), "--device", "cpu")
    processes.append(up)
    up.wait_for_line("Ctrl-C stops all three")
    assert phases(Client(f"127.0.0.1:{port}", timeout=10).info().startup) == ["boot", "connect"]
    for service_port in (port + 1, port + 2):
        assert phases(model_info(f"127.0.0.1:{service_port}").startup) == ["boot", "load", "engine", "warmup"]
    children = descendants(up.popen.pid)
    assert len(children) >= 3
    up.popen.kill()
    up.popen.wait()
    assert not survivors_after(children, STOP_WITHIN_S)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_child_of_bench_outlives_bench(
    processes: list[Process], llama_target_dir: Path, llama_draft_dir: Path, tmp_path: Path, sig: int
) -> None:
    """Killed while its stack is still starting: the stack is started on a thread of bench's, the
    case where a death signal tied to the forking thread would misfire."""
    bench = Process("bench", "--rows", "specwire_greedy", "--target-model", str(llama_target_dir),
                    "--draft-model", str(llama_draft_dir), "--repeats", "1", "--max-new-tokens", "2", "--device", "cpu",
                    "--json", "--out", str(tmp_path / "bench.json"))
    processes.append(bench)
    bench.wait_for(lambda: len(descendants(bench.popen.pid)) >= 2)  # target and draft spawned
    children = descendants(bench.popen.pid)
    assert bench.exit_s_after(sig) < STOP_WITHIN_S, bench.output()
    assert not survivors_after(children, STOP_WITHIN_S)


def test_sigterm_ends_a_stack_command_even_when_its_interrupt_is_swallowed() -> None:
    """A KeyboardInterrupt raised inside a finaliser is printed and dropped; the kernel's alarm,
    armed by the signal, still ends the process."""
    code = (
        "import time\n"
        "from specwire.client.cli import interrupt_on_sigterm\n"
        "interrupt_on_sigterm(1)\n"
        "ready = False\n"
        "while True:\n"
        "    try:\n"  # from before 'ready': a signal right after it still lands in here
        "        if not ready:\n"
        "            ready = True\n"
        "            print('ready', flush=True)\n"
        "        time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n"
        "        print('swallowed', flush=True)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGALRM
    assert 1.0 <= time.monotonic() - sent < 1.0 + 2
    assert process.stdout.read() == "swallowed\n"


# -- time to SERVING ------------------------------------------------------------------------------


def test_startup_time_measures_start_restart_and_drain(
    llama_target_dir: Path, llama_draft_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "startup.json"
    result = subprocess.run(
        [sys.executable, "-m", "specwire", "startup-time", "--target-model", str(llama_target_dir),
         "--draft-model", str(llama_draft_dir), "--device", "cpu", "--compile", "off", "--grace", "1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    run = report["runs"][0]
    for start in ("cold", "warm"):
        services = run[start]["services"]
        assert list(services["target"]["phases"]) == ["boot", "load", "engine", "warmup"]
        assert list(services["orchestrator"]["phases"]) == ["boot", "connect"]
        # The launcher waits for target and draft, then starts the orchestrator.
        slowest = max(services["target"]["serving_s"], services["draft"]["serving_s"])
        assert run[start]["stack_s"] > slowest + services["orchestrator"]["serving_s"] - 0.5
    assert run["restart"]["restart_s"] > 1.0 + run["restart"]["service"]["serving_s"] - 0.5  # after the 1 s back-off
    drain = run["drain"]
    assert 1.0 <= drain["target_holding_a_session_s"] < 1.0 + 3  # it waited for the session, the grace
    assert drain["draft_idle_s"] < STOP_WITHIN_S and drain["orchestrator_idle_s"] < STOP_WITHIN_S
    assert set(report["median"]) >= {"cold_stack_s", "warm_stack_s", "restart_s"}


def test_the_forward_threads_end_before_the_interpreter_finalises(llama_target_dir: Path) -> None:
    """A forward thread that ended during finalisation, its engine's last reference with it,
    freed tensors where the GIL can no longer be taken: the process aborted at exit. The exit
    hook ends every forward thread first, idle or not, its engine still referenced or not."""
    from specwire.engine import scheduler as scheduler_module
    from tests.conftest import load_engine

    engine = load_engine(llama_target_dir, "target")
    session = engine.new_session()
    session.open(OpenRequest([5, 17, 42]))
    session.close()
    threads = [t for t in list(scheduler_module._FORWARD_THREADS) if t.is_alive()]
    assert threads, "the forward just run left its thread waiting for work"
    del engine, session
    scheduler_module._end_forward_threads()
    assert not any(thread.is_alive() for thread in threads)
    for other in list(scheduler_module._SCHEDULERS):  # the session's other engines serve on
        other._exiting = False
