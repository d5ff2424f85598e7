"""Prefix caching: a released row keeps its keys, and a later prompt that begins with its tokens
starts from them and computes only the rest. With row-invariant (activation-quantised) forwards
the reused keys have the bits a fresh prefill writes, so logits and tokens equal a run without the
cache; float forwards, whose bits depend on what is computed together, keep nothing. Beams,
sharing, eviction and `--prefix-cache off` included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specwire.engine import Engine
from specwire.engine.cache import MIN_REUSE, CacheShape, SlotCache
from specwire.session import OpenRequest, ScoreKind, Scoring
from tests.test_architectures import PROMPTS, generate
from tests.test_architectures import engine as arch_engine
from tests.tiny import save_gemma3

# Longer than one prefill chunk (64 tokens), so a hit also changes how the rest is chunked.
LONG = "\n".join(PROMPTS) * 3


def engine(path: Path, mode: str, **limits: Any) -> Engine:
    return arch_engine(path, mode, max_cache_len=320, **limits)


@pytest.fixture(scope="module")
def gemma3_dir(models_dir: Path, tokenizer: Any) -> Path:
    path = models_dir / "arch-gemma3"
    return path if path.exists() else save_gemma3(path, tokenizer, seed=11)


def last_logits(backend: Engine, prompt_ids: list[int]) -> torch.Tensor:
    session = backend.new_session()
    try:
        opened = session.open(OpenRequest(prompt_ids, scoring=Scoring(ScoreKind.LOGITS)))
    finally:
        session.close()
    assert opened.scores is not None and opened.scores.dense is not None
    return opened.scores.dense


@pytest.mark.parametrize("mode", ["int8", "w4a8"])
def test_a_prompt_that_begins_as_a_released_session_did_gets_a_fresh_prefills_outputs(
    gemma3_dir: Path, tokenizer: Any, mode: str
) -> None:
    cached, fresh = engine(gemma3_dir, mode), engine(gemma3_dir, mode, prefix_cache=False)
    assert cached.cache is not None and fresh.cache is not None
    base = tokenizer(LONG).input_ids
    assert len(base) > 64
    first = generate(cached, base)[0]
    other = tokenizer("x = [1, 2, 3]").input_ids
    for ids, reused in [
        (base, len(base) - 1),  # all of it but the token whose logits are asked for
        (base + first[:6], len(base)),  # a conversation's next turn
        (base[:40] + other, 40),
        (base[:MIN_REUSE - 2] + other, 0),  # too short a match while rows are free
    ]:
        before = cached.cache.reused_tokens
        ours, theirs = last_logits(cached, ids), last_logits(fresh, ids)
        assert cached.cache.reused_tokens - before >= reused
        if reused == 0:
            assert cached.cache.reused_tokens == before
        assert torch.equal(ours, theirs)  # a token's bits do not depend on the tokens computed with it
        assert generate(cached, ids) == generate(fresh, ids)
    assert fresh.cache.reused_tokens == 0
    assert cached.cache.usage().rows_in_use == 0


def test_a_float_forward_keeps_no_keys(gemma3_dir: Path, tokenizer: Any) -> None:
    """float32 computes a token's keys with other bits in a forward of another shape: a kept key
    would make a request's output depend on what the service saw before."""
    backend = engine(gemma3_dir, "none")
    assert backend.cache is not None and not backend.cache.prefix_cache
    ids = tokenizer(LONG).input_ids
    generate(backend, ids)
    generate(backend, ids)
    assert backend.cache.reused_tokens == 0 and backend.cache.usage().rows_kept == 0


def test_beams_start_from_a_kept_prompt_and_end_as_without_it(gemma3_dir: Path, tokenizer: Any) -> None:
    cached, fresh = engine(gemma3_dir, "w4a8"), engine(gemma3_dir, "w4a8", prefix_cache=False)
    assert cached.cache is not None
    ids = tokenizer(LONG).input_ids
    beam = {"strategy": "beam", "num_beams": 3, "num_return_sequences": 2}
    generate(cached, ids)
    before = cached.cache.reused_tokens
    assert generate(cached, ids, **beam) == generate(fresh, ids, **beam)
    assert cached.cache.reused_tokens > before
    assert cached.cache.usage().rows_in_use == 0


def small_cache(rows: int = 3, prefix_cache: bool = True) -> SlotCache:
    return SlotCache(CacheShape(1, 1, 2, rows, 64, torch.float32), torch.device("cpu"), prefix_cache=prefix_cache)


def test_a_hit_copies_the_kept_keys_into_a_free_row_and_the_kept_row_stays() -> None:
    cache = small_cache()
    a, b = cache.allocate(2, timeout_s=0.0)
    for store in cache.keys + cache.values:
        store[a, :, :20] = torch.arange(20.0)[None, :, None]
    cache.release([a, b], [list(range(20)), list(range(100, 120))])
    assert cache.usage().rows_in_use == 0 and cache.usage().rows_kept == 2
    (hit,) = cache.allocate(1, timeout_s=0.0, prompt=list(range(18)) + [7])
    assert hit not in (a, b) and cache.lengths[hit] == 18 and cache.usage().rows_kept == 2
    for store in cache.keys + cache.values:
        assert torch.equal(store[hit, :, :18], store[a, :, :18])
    (again,) = cache.allocate(1, timeout_s=0.0, prompt=list(range(20)))  # no free row left: a itself
    assert again == a and cache.lengths[a] == 20 and cache.usage().rows_kept == 1


def test_without_free_rows_kept_rows_go_least_recently_released_first() -> None:
    cache = small_cache()
    a, b, c = cache.allocate(3, timeout_s=0.0)
    cache.release([a], [list(range(20))])
    cache.release([b], [list(range(100, 120))])
    (taken,) = cache.allocate(1, timeout_s=0.0)
    assert taken == a and cache.lengths[a] == 0
    # A short match is still worth the last row.
    (short,) = cache.allocate(1, timeout_s=0.0, prompt=[100, 101, 5])
    assert short == b and cache.lengths[b] == 2
    cache.release([a, b, c])
    assert cache.usage().rows_in_use == 0 and all(cache.lengths[row] == 0 for row in (a, b, c))


def test_a_row_holding_a_kept_rows_tokens_and_more_replaces_it() -> None:
    cache = small_cache()
    a, b, c = cache.allocate(3, timeout_s=0.0)
    turn = list(range(30))
    cache.release([a], [turn])
    cache.release([b], [turn + [1, 2, 3]])  # the conversation's next turn covers the first
    cache.release([c], [turn[:20]])  # covered by b: kept nowhere
    assert cache.usage().rows_kept == 1 and cache.lengths[a] == 0 and cache.lengths[c] == 0
    (row,) = cache.allocate(1, timeout_s=0.0, prompt=turn + [9])
    assert cache.lengths[row] == 30


def test_rows_written_outside_sessions_or_released_without_tokens_keep_nothing() -> None:
    cache = small_cache()
    rows = cache.allocate(2, timeout_s=0.0)
    cache.release(rows, [[1, 2, 3] * 10, [4, 5, 6] * 10])
    cache.forget_kept(rows[:1])
    (row,) = cache.allocate(1, timeout_s=0.0, prompt=[1, 2, 3] * 10)
    assert cache.lengths[row] == 0
    off = small_cache(prefix_cache=False)
    rows = off.allocate(1, timeout_s=0.0)
    off.release(rows, [[1, 2, 3] * 10])
    assert off.allocate(1, timeout_s=0.0, prompt=[1, 2, 3] * 10) == rows and off.lengths[rows[0]] == 0
