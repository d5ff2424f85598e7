"""Best-first beam search returns beam's hypotheses (length_penalty 0, early_stopping false or
never): the queue alone against `beam_step` on random models, and the strategy against `beam` and
transformers' `generate(num_beams=k)` on tiny models; outside those conditions it refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specwire.client import Client, GenerationError
from specwire.client.sdk import build_request
from specwire.orchestrator.beam import BeamState, beam_step, beams_to_keep
from specwire.orchestrator.best_first import BestFirstSearch, Hypothesis, plan_rows
from specwire.orchestrator.generation import Decoder, Result
from specwire.orchestrator.models import LocalModel

from specwire.engine import load_tokenizer
from tests.conftest import hf_model, load_engine
from tests.harness import Stack

# -- the queue, on random models ------------------------------------------------------------------


def toy_logprobs(hypothesis: Hypothesis, vocab: int, seed: int, eos_bias: float) -> torch.Tensor:
    """A fixed random next-token distribution per hypothesis: [vocab] log-probabilities; id 0 is
    eos, `eos_bias` added to its logit."""
    generator = torch.Generator().manual_seed(hash((seed, *hypothesis)) & 0xFFFF_FFFF)
    logits = torch.randn(vocab, generator=generator) * 2
    logits[0] += eos_bias
    return torch.log_softmax(logits, dim=-1)


def reference_beam(k: int, n: int, max_new: int, eos: frozenset[int], model: Any) -> list[tuple[list[int], float]]:
    """transformers' beam search (`beam_step`, length_penalty 0, early_stopping false), row by row."""
    state = BeamState.start(k, len(eos), max_new, 0.0, False)
    rows: list[Hypothesis] = [()] * k
    while True:
        top = torch.stack([model(row) for row in rows]).topk(state.beams_to_keep, dim=-1)
        beam_step(state, top.indices, top.values, eos)
        if state.done:
            break
        rows = [(*rows[source], token) for source, token in zip(state.branch_order, state.appended, strict=True)]
    finished = zip(state.finished_tokens, state.finished_scores.tolist(), state.finished_flags.tolist(), strict=True)
    return [(tokens, score) for tokens, score, done in finished if done][:n]


def run_search(k: int, n: int, max_new: int, eos: frozenset[int], model: Any) -> tuple[BestFirstSearch, list[int]]:
    """The queue driven as the strategy drives it, over a simulated session whose rows must follow
    `plan_rows`' instructions; returns the search and the rows of each forward."""
    search = BestFirstSearch(k, n, max_new, eos)
    session: list[Hypothesis] = []
    forwards = []
    while batch := search.next_rows():
        if session:
            kept, order, append_ids = plan_rows(session, batch)
            per_row = len(batch[0]) - kept
            appended = [tuple(append_ids[i * per_row : (i + 1) * per_row]) for i in range(len(batch))]
            session = [session[r][:kept] + extra for r, extra in zip(order, appended, strict=True)]
        else:
            session = list(batch)  # the open: the prompt alone
        assert session == batch
        top = torch.stack([model(row) for row in batch]).topk(beams_to_keep(k, len(eos)), dim=-1)
        search.supply(batch, top.indices, top.values)
        forwards.append(len(batch))
    return search, forwards


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(1, 4),
    returned=st.integers(1, 4),
    max_new=st.integers(1, 9),
    eos=st.sampled_from([frozenset(), frozenset({0}), frozenset({0, 1})]),
    eos_bias=st.floats(-3.0, 3.0),
)
def test_queue_returns_beams_hypotheses_and_scores(
    seed: int, k: int, returned: int, max_new: int, eos: frozenset[int], eos_bias: float
) -> None:
    n = min(returned, k)

    def model(hypothesis: Hypothesis) -> torch.Tensor:
        return toy_logprobs(hypothesis, 12, seed, eos_bias)

    expected = reference_beam(k, n, max_new, eos, model)
    search, forwards = run_search(k, n, max_new, eos, model)
    # Same float32 sums in the same order: the scores agree exactly, not just the tokens.
    assert [(s.token_ids, s.score) for s in search.result()] == expected
    assert all(rows <= k for rows in forwards)
    assert sum(forwards) <= k * len(forwards)


def test_queue_stops_at_the_first_finished_pop_that_nothing_can_beat() -> None:
    """eos all but certain after the prompt: one row scored, where beam keeps going until it holds
    num_beams hypotheses."""

    def model(hypothesis: Hypothesis) -> torch.Tensor:
        return toy_logprobs(hypothesis, 12, 0, 12.0 if not hypothesis else 0.0)

    search, forwards = run_search(4, 1, 10, frozenset({0}), model)
    assert forwards == [1]
    assert [s.token_ids for s in search.result()] == [[0]] == [t for t, _ in reference_beam(4, 1, 10, frozenset({0}), model)]


def test_plan_rows_forks_parents_and_appends_one_token() -> None:
    kept, order, append_ids = plan_rows([(1,), (2,)], [(2, 7), (1, 5), (1, 6)])
    assert (kept, order, append_ids) == (1, [1, 0, 0], [7, 5, 6])


def test_plan_rows_recomputes_past_the_prefix_a_jump_back_shares() -> None:
    # A shorter hypothesis: every row is cut to the one token it shares, then extended.
    assert plan_rows([(1, 2, 3), (4, 5, 6)], [(1, 9)]) == (1, [0], [9])
    # Nothing shared: back to the prompt, both tokens again.
    assert plan_rows([(1, 2)], [(3, 4), (1, 5)]) == (0, [0, 0], [3, 4, 1, 5])


# -- the strategy, on tiny models -------------------------------------------------------------------

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def target_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_target_dir")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def decoder(target_dir: Path) -> Decoder:
    tokenizer = load_tokenizer(str(target_dir))
    assert tokenizer is not None
    return Decoder(LocalModel(load_engine(target_dir, "target"), "target"), None, tokenizer, max_new_tokens_limit=256)


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> Any:
    return hf_model(target_dir)


def prompts(vocab_size: int, count: int = 16) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 9, (count,), generator=generator).tolist()
    return [torch.randint(1, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def generate(decoder: Decoder, prompt_ids: list[int], **kwargs: Any) -> Result:
    return asyncio.run(decoder.generate(build_request(input_ids=prompt_ids, max_new_tokens=MAX_NEW, **kwargs)))


@pytest.mark.parametrize(
    "beam",
    [
        {"num_beams": 2},
        {"num_beams": 4, "num_return_sequences": 2},
        {"num_beams": 3, "num_return_sequences": 3, "early_stopping": "never"},
        {"num_beams": 4, "repetition_penalty": 1.4, "no_repeat_ngram_size": 2},
    ],
)
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_best_first_equals_beam_and_transformers(
    decoder: Decoder, reference: Any, beam: dict[str, Any], ignore_eos: bool
) -> None:
    for prompt_ids in prompts(decoder.limits.vocab_size):
        ours = generate(decoder, prompt_ids, strategy="best_first_beam", ignore_eos=ignore_eos, **beam)
        theirs = generate(decoder, prompt_ids, strategy="beam", length_penalty=0.0, ignore_eos=ignore_eos, **beam)
        assert [s.token_ids for s in ours.sequences] == [s.token_ids for s in theirs.sequences]
        assert [s.score for s in ours.sequences] == pytest.approx([s.score for s in theirs.sequences], rel=1e-4, abs=1e-4)
        assert ours.token_ids == theirs.token_ids and ours.finish_reason == theirs.finish_reason
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False, length_penalty=0.0,
                eos_token_id=None if ignore_eos else 0, pad_token_id=0, **beam,
            )
        for sequence, hf_sequence in zip(ours.sequences, expected, strict=True):
            hf_new = hf_sequence[len(prompt_ids):].tolist()
            assert sequence.token_ids == hf_new[: len(sequence.token_ids)]
            assert all(t == 0 for t in hf_new[len(sequence.token_ids):])  # transformers pads with pad id 0


def test_both_beam_strategies_count_the_rows_they_score(decoder: Decoder) -> None:
    for prompt_ids in prompts(decoder.limits.vocab_size, count=4):
        beam = generate(decoder, prompt_ids, strategy="beam", num_beams=4, length_penalty=0.0)
        best_first = generate(decoder, prompt_ids, strategy="best_first_beam", num_beams=4)
        assert beam.stats.expansions == 4 * beam.stats.target.forward_calls
        assert best_first.stats.target.forward_calls == best_first.stats.rounds
        assert best_first.stats.target.forward_calls <= best_first.stats.expansions
        assert best_first.stats.expansions <= 4 * best_first.stats.target.forward_calls
        assert best_first.stats.to_pb().expansions == best_first.stats.expansions


# -- over gRPC: the API, and what it refuses ------------------------------------------------------------


def test_best_first_over_grpc_equals_beam_with_its_stats(llama_stack: Stack, tokenizer: Any) -> None:
    client = Client(llama_stack.address)
    for prompt in ("def add(a, b):", "import os", "the quick brown"):
        ours = client.generate(prompt=prompt, strategy="best_first_beam", num_beams=3, num_return_sequences=2, max_new_tokens=16)
        theirs = client.generate(prompt=prompt, strategy="beam", num_beams=3, num_return_sequences=2, max_new_tokens=16, length_penalty=0.0)
        assert [s.token_ids for s in ours.sequences] == [s.token_ids for s in theirs.sequences]
        assert [s.text for s in ours.sequences] == [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in ours.sequences]
        assert theirs.stats.expansions == 3 * theirs.stats.target_forwards
        assert 0 < ours.stats.expansions <= 3 * ours.stats.target_forwards


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"length_penalty": 1.0}, "length_penalty"),
        ({"length_penalty": -0.5, "early_stopping": "never"}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
        ({"temperature": 0.7}, "temperature"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ],
)
def test_outside_beams_equivalence_it_refuses_naming_the_field(llama_stack: Stack, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationError) as caught:
        Client(llama_stack.address).generate(prompt="x", strategy="best_first_beam", **kwargs)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith(f"{field}:"), caught.value.message
