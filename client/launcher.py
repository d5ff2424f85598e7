"""Run the three services as child processes (`specwire up`, `specwire demo`, benchmarks), and
the OpenAI-compatible HTTP front as a fourth when asked for.

Each child prints `READY <role> <host>:<port>` once it reports SERVING; the launcher waits for
all of them (every target replica too), and stops them all (SIGTERM, then SIGKILL after a grace
period) on exit. However the launcher itself dies, even by SIGKILL, its children stop too
(`specwire.lifeline`).

`Stack.supervise`, called periodically (`specwire up` does), restarts a child that exited, after
a back-off that doubles with each crash in a row (1 s up to 30 s; reset once a child has stayed
up for a minute), with a log line each time; each target replica is a child of its own. The
others keep serving meanwhile: the orchestrator watches every replica's health
(`specwire.orchestrator.replicas`) and serves what it still can.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specwire.lifeline import Lifeline


@dataclass(frozen=True)
class StackConfig:
    port: int = 50051
    target_model: str | None = None
    draft_model: str | None = None
    drafter: str = "model"
    device: str = "auto"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    extra_target_args: tuple[str, ...] = ()
    extra_draft_args: tuple[str, ...] = ()
    extra_orchestrator_args: tuple[str, ...] = ()
    medusa: str | None = None  # the target's Medusa heads directory (`--medusa`)
    quantize: str = "auto"  # the model services' --quantize
    target_quantize: str | None = None  # the target's, where it differs (None: `quantize`)
    # Torch threads of the target service (each replica) and of the draft; 0: the machine's
    # cores split evenly between the model services.
    target_threads: int = 0
    draft_threads: int = 0
    # Emulated link between the orchestrator and each model service (`specwire.delay_proxy`):
    # any of these > 0 puts a proxy child in front of each service, one-way delay = rtt / 2.
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0
    # More target replicas (ports port+5, port+6, …), all given to the orchestrator.
    target_replicas: int = 1
    # Mutual TLS on the internal hops with a private CA and certificates written here.
    tls_dir: str | None = None
    # Bearer tokens the public API accepts (one per line); None: open.
    auth_token_file: str | None = None
    # The OpenAI-compatible HTTP front (`specwire serve http`) on this port; 0: none.
    http_port: int = 0
    chat_template: str | None = None  # its `--chat-template FILE`

    @property
    def draft_port(self) -> int:
        return self.port + 1

    @property
    def target_port(self) -> int:
        return self.port + 2

    @property
    def target_ports(self) -> list[int]:
        return [self.target_port] + [self.port + 4 + i for i in range(1, self.target_replicas)]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def proxied(self) -> bool:
        return self.rtt_ms > 0 or self.jitter_ms > 0 or self.bandwidth_mbps > 0

    @property
    def draft_proxy_port(self) -> int:
        return self.port + 3

    @property
    def target_proxy_port(self) -> int:
        return self.port + 4


def _proxy_command(listen: str, upstream: str, c: StackConfig) -> list[str]:
    return [
        sys.executable, "-m", "specwire.delay_proxy", "--listen", listen, "--upstream", upstream,
        "--delay-ms", str(c.rtt_ms / 2), "--jitter-ms", str(c.jitter_ms), "--bandwidth-mbps", str(c.bandwidth_mbps),
    ]


def free_base_port(count: int = 5, attempts: int = 200) -> int:
    """A port p with p … p+count−1 all free on loopback (a launcher stack takes consecutive ports)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 60000 - count)
        try:
            with contextlib.ExitStack() as sockets:
                for offset in range(count):
                    sock = sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")


def _replica_metrics(args: list[str], index: int) -> list[str]:
    """Target replica `index`'s flags: from the second on, `--metrics-port T` becomes T + 2 + index
    (the metrics ports follow the gRPC ports: target P+2, its replicas P+5, P+6, …)."""
    if index == 0 or "--metrics-port" not in args:
        return args
    at = args.index("--metrics-port") + 1
    return [*args[:at], str(int(args[at]) + 2 + index), *args[at + 1 :]]


def _tls_args(c: StackConfig) -> tuple[list[str], list[str], list[str]]:
    """`serve` flags for mutual TLS on the internal hops: a private CA and certificates, made
    once in `c.tls_dir`. The model services require the orchestrator's client certificate."""
    if not c.tls_dir:
        return [], [], []
    from specwire.security import make_certificates

    directory = Path(c.tls_dir)
    if (directory / "ca.pem").exists():
        issued = {name: (directory / f"{name}.pem", directory / f"{name}.key") for name in ("orchestrator", "draft", "target")}
    else:
        issued = make_certificates(directory, hosts=sorted({"localhost", "127.0.0.1", c.host}))
    ca = str(directory / "ca.pem")

    def server(name: str) -> list[str]:
        cert, key = issued[name]
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", ca]

    cert, key = issued["orchestrator"]
    orchestrator = ["--services-tls-ca", ca, "--services-tls-cert", str(cert), "--services-tls-key", str(key)]
    return server("target"), server("draft"), orchestrator


def _http_args(c: StackConfig) -> list[str]:
    """`serve http` flags: in front of this stack's orchestrator, checking the same bearer tokens
    and presenting the file's first one to the orchestrator."""
    args = ["--orchestrator", c.address, "--host", c.host, "--port", str(c.http_port)]
    if c.chat_template:
        args += ["--chat-template", c.chat_template]
    if c.auth_token_file:
        args += ["--auth-token-file", c.auth_token_file, "--orchestrator-token-file", c.auth_token_file]
    return args


def shares_cores(c: StackConfig, threads: int, cores: int | None = None) -> bool:
    """The model services compute on this machine's CPUs with more threads than it has cores, and
    no emulated link delays them: a pipelined draft would take cores from the target's
    verification instead of overlapping it (Gemma-3-270M int8 with its int4 draft on 2 cores,
    target on both: auto γ 1.03× greedy pipelined, 1.36× sequential)."""
    import torch

    on_cpu = c.device == "cpu" or (c.device == "auto" and not torch.cuda.is_available())
    used = (c.target_threads or threads) * c.target_replicas + (c.draft_threads or threads)
    return on_cpu and not c.proxied and used > (cores or os.cpu_count() or 1)


def _serve_command(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "specwire", "serve", role, *args]


RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a child up this long has its back-off reset


@dataclass
class Restarts:
    """One child's crash history, for the back-off."""

    command: list[str]
    ready_label: str | None
    started: float = 0.0
    delay_s: float = 0.0  # the back-off the next crash waits; 0 = none yet
    due: float | None = None  # when a pending restart happens


@dataclass
class Stack:
    config: StackConfig
    processes: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    _ready: dict[str, threading.Event] = field(default_factory=dict)
    _lifeline: Lifeline | None = None  # every child stops when this process dies
    _restarts: dict[str, Restarts] = field(default_factory=dict)
    _log_dir: Path | None = None

    def start(self, timeout: float = 600.0, log_dir: Path | None = None) -> None:
        """Start draft and target, then the orchestrator; wait until all report READY."""
        c = self.config
        if c.proxied and c.target_replicas > 1:
            raise RuntimeError("the delay proxy fronts one target replica: use --rtt-ms etc. with --target-replicas 1")
        self._log_dir = log_dir
        # The model services share this machine's cores: each gets its part, so no service's
        # threads spin on a core another one needs (on 2 cores that cut a compiled greedy round from 5.8–6.2 to 5.0 ms).
        threads = max(1, (os.cpu_count() or 1) // (c.target_replicas + 1))
        model_args = ["--device", c.device, "--dtype", c.dtype, "--host", c.host]
        target_tls, draft_tls, orchestrator_tls = _tls_args(c)
        target_args = [*model_args, "--quantize", c.target_quantize or c.quantize,
                       "--threads", str(c.target_threads or threads), *target_tls, *c.extra_target_args]
        if c.target_model:
            target_args += ["--model", c.target_model]
        if c.medusa:
            target_args += ["--medusa", c.medusa]
        draft_args = [*model_args, "--quantize", c.quantize, "--threads", str(c.draft_threads or threads), *draft_tls,
                      "--port", str(c.draft_port), "--drafter", c.drafter, *c.extra_draft_args]
        # The n-gram drafter needs only a tokenizer: the target's, unless told otherwise.
        draft_source = c.draft_model or (c.target_model if c.drafter == "ngram" else None)
        if draft_source:
            draft_args += ["--model", draft_source]
        targets = [("target" if i == 0 else f"target-{i + 1}", port) for i, port in enumerate(c.target_ports)]
        for index, (name, port) in enumerate(targets):
            replica_args = _replica_metrics(target_args, index)
            self._spawn(name, _serve_command("target", *replica_args, "--port", str(port)), log_dir, ready_label="target")
        self._spawn("draft", _serve_command("draft", *draft_args), log_dir)
        self._wait([name for name, _ in targets] + ["draft"], timeout)
        target_address, draft_address = ",".join(f"{c.host}:{port}" for _, port in targets), f"{c.host}:{c.draft_port}"
        if c.proxied:
            proxies = {"target-proxy": (c.target_proxy_port, f"{c.host}:{c.target_port}"), "draft-proxy": (c.draft_proxy_port, draft_address)}
            for role, (port, upstream) in proxies.items():
                self._spawn(role, _proxy_command(f"{c.host}:{port}", upstream, c), log_dir, ready_label="proxy")
            self._wait(list(proxies), timeout)
            target_address, draft_address = f"{c.host}:{c.target_proxy_port}", f"{c.host}:{c.draft_proxy_port}"
        orchestrator_args = [
            "--host", c.host,
            "--port", str(c.port),
            "--target", target_address,
            "--draft", draft_address,
            *orchestrator_tls,
            *(["--speculative-pipeline", "off"] if shares_cores(c, threads) else []),
            *c.extra_orchestrator_args,
        ]
        if c.auth_token_file:
            orchestrator_args += ["--auth-token-file", c.auth_token_file]
        if c.target_model:
            orchestrator_args += ["--tokenizer", c.target_model]
        self._spawn("orchestrator", _serve_command("orchestrator", *orchestrator_args), log_dir)
        self._wait(["orchestrator"], timeout)
        if c.http_port:
            self._spawn("http", _serve_command("http", *_http_args(c)), log_dir)
            self._wait(["http"], timeout)

    def _spawn(self, role: str, command: list[str], log_dir: Path | None, ready_label: str | None = None) -> None:
        if self._lifeline is None:
            self._lifeline = Lifeline()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # A session of its own: Ctrl-C in a terminal reaches `up`, which stops the children in order.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=self._lifeline.child_env(env), pass_fds=(self._lifeline.read_fd,),
        )
        self.processes[role] = process
        restarted = role in self._restarts
        history = self._restarts.setdefault(role, Restarts(command, ready_label))
        history.started = time.monotonic()
        ready = self._ready[role] = threading.Event()
        mode = "a" if restarted else "w"
        log_file = open(log_dir / f"{role}.log", mode) if log_dir else None  # noqa: SIM115 - lives with the thread

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith(f"READY {ready_label or role} "):
                    ready.set()
                if log_file:
                    log_file.write(line)
                    log_file.flush()
                elif not line.startswith("READY"):
                    sys.stderr.write(f"[{role}] {line}")

        threading.Thread(target=pump, daemon=True, name=f"log-{role}").start()

    def _wait(self, roles: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for role in roles:
            while not self._ready[role].wait(0.2):
                if self.processes[role].poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{role} service exited with code {self.processes[role].returncode} before it was ready")
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{role} service was not ready within {timeout:.0f}s")

    def supervise(self, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        """Restart children that exited, each after its back-off; call this every fraction of a second."""
        now = time.monotonic()
        for role, process in list(self.processes.items()):
            history = self._restarts[role]
            if process.poll() is None:
                if history.delay_s and now - history.started > STABLE_AFTER_S:
                    history.delay_s = 0.0
                continue
            if history.due is None:
                history.delay_s = min(MAX_RESTART_DELAY_S, 2 * history.delay_s) if history.delay_s else RESTART_DELAY_S
                history.due = now + history.delay_s
                log(f"{role} exited with code {process.returncode}; restarting in {history.delay_s:g} s")
            elif now >= history.due:
                history.due = None
                self._spawn(role, history.command, self._log_dir, history.ready_label)
                log(f"{role} restarted (pid {self.processes[role].pid})")

    def dead(self) -> str | None:
        """The role of a child that has exited, if any."""
        for role, process in self.processes.items():
            if process.poll() is not None:
                return role
        return None

    def stop(self, grace: float = 10.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None

    def ready(self, role: str) -> bool:
        """Whether `role`'s current process has printed its READY line."""
        return role in self._ready and self._ready[role].is_set()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
