"""A dead model service gives UNAVAILABLE promptly; incompatible services are refused at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from specwire.client import Client, GenerationError
from specwire.orchestrator.generation import check_compatible
from specwire.orchestrator.models import LocalModel

from specwire.engine import load_tokenizer
from specwire.errors import FailedPrecondition
from tests.conftest import load_engine
from tests.harness import LoopThread, start_model_server, start_orchestrator
from tests.tiny import build_tokenizer, save_llama

ROOT = Path(__file__).resolve().parent.parent


def spawn_service(role: str, model_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """`specwire serve ROLE` as a real child process on a free port; returns it and its address."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "serve", role, "--model", str(model_dir), "--port", "0", "--device", "cpu"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(f"READY {role} "):
            return process, line.split()[-1]
    raise AssertionError(f"{role} service exited with {process.wait()}")


@pytest.fixture
def child_target(llama_target_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process, address = spawn_service("target", llama_target_dir)
    yield process, address
    if process.poll() is None:
        process.kill()
    process.wait()


def test_killed_target_gives_unavailable_promptly(
    loop: LoopThread, child_target: tuple[subprocess.Popen[str], str], llama_target_dir: Path
) -> None:
    process, address = child_target
    orchestrator = loop.run(start_orchestrator(address, None, str(llama_target_dir)))
    try:
        client = Client(orchestrator.address, timeout=60)
        assert len(client.generate(prompt="def", max_new_tokens=4, ignore_eos=True).token_ids) == 4
        stream = client.stream(prompt="def", max_new_tokens=400, ignore_eos=True)
        next(stream)
        os.kill(process.pid, signal.SIGKILL)  # the target dies mid-generation
        started = time.monotonic()
        with pytest.raises(GenerationError) as during:
            list(stream)
        assert during.value.code == grpc.StatusCode.UNAVAILABLE and "target" in during.value.message
        with pytest.raises(GenerationError) as after:
            client.generate(prompt="def", max_new_tokens=4)
        assert after.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 20, "UNAVAILABLE should come promptly, not after a hang"
    finally:
        loop.run(orchestrator.running.server.stop(0))


def test_sigterm_drains_and_exits(child_target: tuple[subprocess.Popen[str], str]) -> None:
    process, _ = child_target
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0


def test_vocab_mismatch_is_refused_naming_it(llama_target_dir: Path, models_dir: Path) -> None:
    other_tokenizer = build_tokenizer(vocab_size=300)
    other = save_llama(models_dir / "other-vocab", other_tokenizer, seed=4, layers=1, hidden=32)
    target = LocalModel(load_engine(llama_target_dir, "target"), "target")
    draft = LocalModel(load_engine(other, "draft"), "draft")
    tokenizer = load_tokenizer(str(llama_target_dir))
    assert tokenizer is not None
    with pytest.raises(FailedPrecondition, match=r"vocab size differs: draft 300 vs target 320"):
        check_compatible(target.info, draft.info, tokenizer)
    with pytest.raises(FailedPrecondition, match="tokenizer fingerprint differs"):
        check_compatible(target.info, None, other_tokenizer)


def test_orchestrator_refuses_to_start_with_a_mismatched_draft(loop: LoopThread, llama_target_dir: Path, models_dir: Path) -> None:
    other = save_llama(models_dir / "other-vocab-2", build_tokenizer(vocab_size=300), seed=5, layers=1, hidden=32)
    target = loop.run(start_model_server(load_engine(llama_target_dir, "target")))
    draft = loop.run(start_model_server(load_engine(other, "draft")))
    try:
        result = subprocess.run(
            [sys.executable, "-m", "specwire", "serve", "orchestrator", "--port", "0",
             "--target", target.address, "--draft", draft.address],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode != 0
        assert "refuses to start" in result.stderr and "vocab size differs: draft 300 vs target 320" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        for server in (target, draft):
            loop.run(server.running.server.stop(0))
