"""Fixtures for the speculative tests: n-gram and self-draft stacks, a small-vocabulary model pair,
and the demo pair when it has been trained.

A test module loads the fixtures with `pytest_plugins = ["tests.spec_fixtures"]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from specwire.draft_service.ngram import NgramDrafter
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specwire.demo import demo_draft_dir, demo_target_dir
from tests.conftest import load_engine, make_stack
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator
from tests.tiny import save_llama

SMALL_ALPHABET = "abcdefghijklmnopqr"  # with <eos> and <unk>: a 20-token vocabulary


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character: `<eos>` = 0, `<unk>` = 1, then the letters a…r."""
    vocab = {"<eos>": 0, "<unk>": 1} | {c: i + 2 for i, c in enumerate(SMALL_ALPHABET)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<eos>", unk_token="<unk>", pad_token="<eos>"
    )


def save_small_llama(
    path: Path, tokenizer: PreTrainedTokenizerFast, seed: int, layers: int, hidden: int, sharpen: float
) -> Path:
    """A random Llama over the 20-token vocabulary; `sharpen` scales the head (peakier p)."""
    return save_llama(path, tokenizer, seed, layers, hidden, heads=2, kv_heads=1, max_positions=128, sharpen=sharpen)


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def small_target_dir(models_dir: Path, char_tokenizer: PreTrainedTokenizerFast) -> Path:
    return save_small_llama(models_dir / "small-target", char_tokenizer, seed=11, layers=2, hidden=32, sharpen=6.0)


@pytest.fixture(scope="session")
def small_draft_dir(models_dir: Path, char_tokenizer: PreTrainedTokenizerFast) -> Path:
    """Deliberately different from the target: another seed, one layer, a flatter head."""
    return save_small_llama(models_dir / "small-draft", char_tokenizer, seed=12, layers=1, hidden=16, sharpen=3.0)


def make_ngram_stack(
    loop: LoopThread, target_dir: Path, ngram_max: int = 3, ngram_min: int = 1, **limits: object
) -> Stack:
    """A target model with the n-gram drafter, which reads its vocabulary from the target's dir."""
    target = loop.run(start_model_server(load_engine(target_dir, "target")))
    draft = loop.run(start_model_server(NgramDrafter.load(str(target_dir), ngram_max, ngram_min)))
    orchestrator = loop.run(start_orchestrator(target.address, draft.address, str(target_dir), **limits))
    return Stack(loop, target, draft, orchestrator)


@pytest.fixture(scope="session")
def llama_ngram_stack(loop: LoopThread, llama_target_dir: Path) -> Iterator[Stack]:
    stack = make_ngram_stack(loop, llama_target_dir, max_new_tokens_limit=256)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def gpt2_ngram_stack(loop: LoopThread, gpt2_target_dir: Path) -> Iterator[Stack]:
    stack = make_ngram_stack(loop, gpt2_target_dir, max_new_tokens_limit=256)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def self_draft_stack(loop: LoopThread, llama_target_dir: Path) -> Iterator[Stack]:
    """The target drafting for itself: greedy drafts are always accepted (bonus path, no roll-back)."""
    stack = make_stack(loop, llama_target_dir, llama_target_dir, max_new_tokens_limit=256)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def small_stack(loop: LoopThread, small_target_dir: Path, small_draft_dir: Path) -> Iterator[Stack]:
    stack = make_stack(loop, small_target_dir, small_draft_dir, max_new_tokens_limit=64)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def small_untimed_stack(loop: LoopThread, small_target_dir: Path, small_draft_dir: Path) -> Iterator[Stack]:
    """The small pair on services that did not time their forwards: auto γ's first round
    speculates (to measure), whatever the timings would have said."""
    stack = make_stack(loop, small_target_dir, small_draft_dir, warm=False, max_new_tokens_limit=64)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def small_ngram_stack(loop: LoopThread, small_target_dir: Path) -> Iterator[Stack]:
    stack = make_ngram_stack(loop, small_target_dir, max_new_tokens_limit=64)
    yield stack
    stack.stop()


def _require_demo_pair() -> None:
    for path in (demo_target_dir(), demo_draft_dir()):
        if not (path / "config.json").exists():
            pytest.skip(f"the demo pair is not trained yet ({path} has no config.json)")


@pytest.fixture(scope="session")
def demo_stack(loop: LoopThread) -> Iterator[Stack]:
    _require_demo_pair()
    stack = make_stack(loop, demo_target_dir(), demo_draft_dir(), max_new_tokens_limit=256)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def demo_ngram_stack(loop: LoopThread) -> Iterator[Stack]:
    _require_demo_pair()
    stack = make_ngram_stack(loop, demo_target_dir(), max_new_tokens_limit=256)
    yield stack
    stack.stop()
