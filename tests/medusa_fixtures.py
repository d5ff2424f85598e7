"""Random Medusa heads beside the tiny target models, and stacks serving them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specwire.engine import CausalLM, Engine
from specwire.medusa import MedusaConfig, MedusaHeads
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator


def save_random_heads(model_dir: Path, out: Path, heads: int = 3, seed: int = 0, plausible: bool = False) -> Path:
    """Heads with random (not zero) residual weights, so every part of the head is exercised.

    `plausible`: vocabulary maps copied from the model's output layer (as training starts), so
    the candidates are tokens the model finds likely and acceptance is exercised often.
    """
    config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    medusa = MedusaHeads(MedusaConfig(heads, 1, int(config.hidden_size), int(config.vocab_size)))
    with torch.no_grad():
        for parameter in medusa.parameters():
            parameter.normal_(0.0, 0.1 if plausible else 0.5)
        if plausible:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            medusa.init_from_lm_head(model.get_output_embeddings().weight)
    medusa.save(out)
    return out


def medusa_engine(model_dir: Path, heads_dir: Path) -> Engine:
    lm = CausalLM.load(str(model_dir), device="cpu", dtype="float32")
    lm.attach_medusa(str(heads_dir))
    return Engine(lm, "target")


def medusa_stack(loop: LoopThread, model_dir: Path, heads_dir: Path, draft_dir: Path) -> Stack:
    """A target with heads (and a draft, unused by Medusa, so the stack is the usual one)."""
    target = loop.run(start_model_server(medusa_engine(model_dir, heads_dir)))
    draft = loop.run(start_model_server(Engine(CausalLM.load(str(draft_dir), device="cpu", dtype="float32"), "draft")))
    orchestrator = loop.run(start_orchestrator(target.address, draft.address, str(model_dir), max_new_tokens_limit=256))
    return Stack(loop, target, draft, orchestrator)


@pytest.fixture(scope="session")
def llama_heads_dir(llama_target_dir: Path, models_dir: Path) -> Path:
    return save_random_heads(llama_target_dir, models_dir / "llama-medusa", seed=5)


@pytest.fixture(scope="session")
def gpt2_heads_dir(gpt2_target_dir: Path, models_dir: Path) -> Path:
    return save_random_heads(gpt2_target_dir, models_dir / "gpt2-medusa", seed=6)


@pytest.fixture(scope="session")
def llama_medusa_stack(
    loop: LoopThread, llama_target_dir: Path, llama_heads_dir: Path, llama_draft_dir: Path
) -> Iterator[Stack]:
    stack = medusa_stack(loop, llama_target_dir, llama_heads_dir, llama_draft_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def gpt2_medusa_stack(
    loop: LoopThread, gpt2_target_dir: Path, gpt2_heads_dir: Path, llama_draft_dir: Path
) -> Iterator[Stack]:
    stack = medusa_stack(loop, gpt2_target_dir, gpt2_heads_dir, llama_draft_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def small_heads_dir(small_target_dir: Path, models_dir: Path) -> Path:
    return save_random_heads(small_target_dir, models_dir / "small-medusa", heads=2, seed=7, plausible=True)


@pytest.fixture(scope="session")
def small_medusa_stack(
    loop: LoopThread, small_target_dir: Path, small_heads_dir: Path, small_draft_dir: Path
) -> Iterator[Stack]:
    stack = medusa_stack(loop, small_target_dir, small_heads_dir, small_draft_dir)
    yield stack
    stack.stop()
