"""`specwire up --target-replicas 2 --tls DIR --auth-token-file FILE`: two target replicas, mutual
TLS between the services, a token on the public API — what docs/deployment.md tells a user to run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specwire.client import Client, GenerationError
from specwire.client.cli import main as cli
from specwire.client.launcher import free_base_port

ROOT = Path(__file__).resolve().parent.parent


def test_up_runs_two_target_replicas_with_mutual_tls_and_a_token(
    llama_target_dir: Path, llama_draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_base_port(7)
    tokens = tmp_path / "tokens"
    tokens.write_text("team-token\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "up", "--target-model", str(llama_target_dir), "--draft-model",
         str(llama_draft_dir), "--port", str(port), "--device", "cpu", "--target-replicas", "2",
         "--tls", str(tmp_path / "pki"), "--auth-token-file", str(tokens)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        assert any(line.startswith(f"target        127.0.0.1:{port + 2}, 127.0.0.1:{port + 5}") for line in lines), lines
        address = f"127.0.0.1:{port}"
        with Client(address, timeout=60) as anonymous, pytest.raises(GenerationError) as refused:
            assert anonymous.health() == "SERVING"
            anonymous.generate(prompt="def", max_new_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(address, timeout=60, token="team-token") as client:
            replicas = [(r.role, r.state) for r in client.info().replicas]
            assert sorted(replicas) == [("draft", "serving"), ("target", "serving"), ("target", "serving")]
        capsys.readouterr()
        assert cli(["generate", "--address", address, "--token-file", str(tokens), "--prompt", "def",
                    "--max-new-tokens", "4", "--ignore-eos", "--strategy", "speculative", "--json"]) == 0
        assert '"new_tokens": 4' in capsys.readouterr().out
        # The services speak only TLS and want a client certificate signed by the stack's CA.
        for service_port in (port + 1, port + 2, port + 5):
            with grpc.insecure_channel(f"127.0.0.1:{service_port}") as channel, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        ca = (tmp_path / "pki" / "ca.pem").read_bytes()
        credentials = grpc.ssl_channel_credentials(ca)  # trusts the CA, but presents no certificate
        with grpc.secure_channel(f"127.0.0.1:{port + 2}", credentials) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        # Every child is supervised, each replica too: a killed second replica comes back on its port.
        os.kill(replica_pid(process.pid, port + 5), signal.SIGKILL)
        with Client(address, timeout=60, token="team-token") as client:
            deadline = time.monotonic() + 120
            while True:
                states = {r.address: r.state for r in client.info().replicas if r.role == "target"}
                if states[f"127.0.0.1:{port + 5}"] != "serving":
                    break
                assert time.monotonic() < deadline, states
                time.sleep(0.05)
            assert len(client.generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3  # the other serves
            while sorted(r.state for r in client.info().replicas if r.role == "target") != ["serving", "serving"]:
                assert time.monotonic() < deadline, "the killed replica was not restarted"
                time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def replica_pid(parent: int, port: int) -> int:
    """The pid of `parent`'s child serving on `port`, from the command lines."""
    for pid in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"serve" in command and command[command.index(b"--port") + 1] == str(port).encode():
            return int(pid)
    raise AssertionError(f"no child of {parent} serves on {port}")
