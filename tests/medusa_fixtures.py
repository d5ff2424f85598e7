"""Fixtures: random Medusa heads beside the tiny target models, and stacks serving them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import LoopThread, Stack
from tests.medusa_tiny import medusa_stack, save_random_heads


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
