"""Fixtures: tiny local models (Llama and GPT-2 sharing one tokenizer) and real servers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specwire import model_zoo
from specwire.engine import CausalLM, Engine, EngineLimits, trimmed_vocab
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator
from tests.tiny import build_tokenizer, save_gpt2, save_llama

# Two test workers share the machine's cores (`pytest -n 2`): a torch thread each.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# Engines and services started by the tests serve eagerly (a compile per service would cost the
# suite minutes); the compiled forward has tests of its own, which ask for it.
os.environ["SPECWIRE_COMPILE"] = "off"


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_target_dir(models_dir: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    return save_llama(models_dir / "llama-target", tokenizer, seed=1, layers=2, hidden=64)


@pytest.fixture(scope="session")
def llama_draft_dir(models_dir: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    return save_llama(models_dir / "llama-draft", tokenizer, seed=2, layers=1, hidden=32)


@pytest.fixture(scope="session")
def gpt2_target_dir(models_dir: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    return save_gpt2(models_dir / "gpt2-target", tokenizer, seed=3)


@pytest.fixture(scope="session")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def load_engine(path: Path, role: str, warm: bool = True, engine_limits: EngineLimits | None = None) -> Engine:
    """As a model service loads one: warmed up, its forward costs timed for `Info`."""
    engine = Engine(CausalLM.load(str(path), device="cpu", dtype="float32"), role, engine_limits)
    if warm:
        engine.warmup()
    return engine


def make_stack(
    loop: LoopThread, target_dir: Path, draft_dir: Path, warm: bool = True, engine_limits: EngineLimits | None = None,
    **limits: object,
) -> Stack:
    target = loop.run(start_model_server(load_engine(target_dir, "target", warm, engine_limits)))
    draft = loop.run(start_model_server(load_engine(draft_dir, "draft", warm, engine_limits)))
    orchestrator = loop.run(start_orchestrator(target.address, draft.address, str(target_dir), **limits))
    return Stack(loop, target, draft, orchestrator)


@pytest.fixture(scope="session")
def llama_stack(loop: LoopThread, llama_target_dir: Path, llama_draft_dir: Path) -> Iterator[Stack]:
    stack = make_stack(loop, llama_target_dir, llama_draft_dir, max_new_tokens_limit=256)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def gpt2_stack(loop: LoopThread, gpt2_target_dir: Path, llama_draft_dir: Path) -> Iterator[Stack]:
    stack = make_stack(loop, gpt2_target_dir, llama_draft_dir, max_new_tokens_limit=256)
    yield stack
    stack.stop()


def gemma_dir() -> Path | None:
    """Gemma-3-270M as `specwire models fetch gemma-3-270m` prepares it (SPECWIRE_GEMMA_DIR, or the
    default directory), or None where it has not been fetched."""
    path = Path(os.environ.get("SPECWIRE_GEMMA_DIR", str(model_zoo.default_dir("gemma-3-270m"))))
    return path if (path / model_zoo.DONE_MARK).exists() else None


def hf_model(path: Path) -> torch.nn.Module:
    """The model as specwire loads it (a trimmed-vocabulary draft speaks target ids)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    trimmed_vocab.expand(model, path)
    return model
