"""Numerics that cannot fail: every processor and score stays finite over every accepted range,
and degenerate settings behave as their limit (greedy).

Property-based (hypothesis) over the pure functions; then the issue's cases end to end, in-process.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specwire.client.sdk import build_request
from specwire.orchestrator.beam import BeamState, beam_step
from specwire.orchestrator.contrastive import (
    beam_logscores,
    greedy_column,
    li_scores,
    log_partition,
    obrien_scores,
    sample_column,
)
from specwire.orchestrator.generation import Decoder
from specwire.orchestrator.models import LocalModel
from specwire.orchestrator.params import MAX_LENGTH_PENALTY, MIN_AMATEUR_TEMPERATURE

from specwire import processing
from specwire.acceptance import accept_drafts, residual_distribution
from specwire.engine import load_tokenizer
from specwire.processing import ProcessingConfig
from tests.conftest import load_engine

VOCAB = 12
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)

# Logits as a model could produce them, and worse: huge magnitudes, exact ties.
logit_values = st.one_of(st.floats(-30, 30), st.floats(-1e30, 1e30), st.sampled_from([0.0, 1.0, -1.0]))
logit_rows = st.lists(st.lists(logit_values, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=3)
# Positive floats over float32's whole range, subnormals included.
positive = st.one_of(
    st.floats(1e-45, 1e-30), st.floats(1e-30, 1e-3), st.floats(1e-3, 1e3), st.floats(1e3, FLOAT32_MAX)
)


@st.composite
def configs(draw: st.DrawFn) -> ProcessingConfig:
    return ProcessingConfig(
        repetition_penalty=draw(st.one_of(st.just(1.0), positive)),
        no_repeat_ngram_size=draw(st.integers(0, 4)),
        temperature=draw(st.one_of(st.just(0.0), st.just(1.0), positive)),
        top_k=draw(st.integers(0, 2 * VOCAB)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(1e-45, 1.0, exclude_min=False))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    )


def histories(rows: int) -> st.SearchStrategy[list[list[int]]]:
    # Few distinct ids so n-grams repeat; up to the whole vocabulary.
    return st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=20, max_size=20), min_size=rows, max_size=rows)


@SETTINGS
@given(data=st.data(), logits=logit_rows, config=configs())
def test_sampling_probs_are_a_distribution_over_every_accepted_setting(
    data: st.DataObject, logits: list[list[float]], config: ProcessingConfig
) -> None:
    scores = torch.tensor(logits, dtype=torch.float32)
    history = torch.tensor(data.draw(histories(len(logits))), dtype=torch.long)
    probs = processing.sampling_probs(scores, history, config)
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(logits)), atol=1e-5)
    torch.multinomial(probs, 1)  # a draw never fails
    greedy = processing.greedy_scores(scores, history, config)
    assert not bool(greedy.isnan().any()) and bool(torch.isfinite(greedy).any(dim=-1).all())
    beam = processing.beam_logprobs(scores, history, config)
    assert not bool(beam.isnan().any()) and bool(torch.isfinite(beam).any(dim=-1).all())


@SETTINGS
@given(logits=logit_rows, value=st.one_of(st.just(0.0), st.floats(1e-45, 1e-20)))
def test_temperature_towards_zero_is_greedy(logits: list[list[float]], value: float) -> None:
    scores = torch.tensor(logits, dtype=torch.float32)
    probs = processing.temperature(scores, value).softmax(dim=-1)
    maxima = scores == scores.amax(dim=-1, keepdim=True)
    # All the mass on the row's maxima; uniform over them when they tie exactly.
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(logits)), atol=1e-5)
    assert bool((probs[~maxima] < 1e-6).all())


def test_tiny_repetition_penalty_is_greedy_over_the_seen_positive_ids() -> None:
    scores = torch.tensor([[1.0, 3.0, -2.0, 5.0]])
    out = processing.repetition_penalty(scores, torch.tensor([[0, 2]]), 1e-45)
    # id 0 (positive, seen) is pushed to +inf: the limit is all mass on it.
    assert processing.sampling_probs(out, torch.empty((1, 0), dtype=torch.long), ProcessingConfig()).tolist() == [
        [1.0, 0.0, 0.0, 0.0]
    ]


def test_no_repeat_ngram_never_bans_the_whole_vocabulary() -> None:
    history = torch.arange(VOCAB).repeat(2)[None, :]  # every id completes a seen 1-gram
    scores = processing.no_repeat_ngram(torch.zeros(1, VOCAB), history, 1)
    assert bool(torch.isfinite(scores).all())


distributions = st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1.0), st.floats(1e-45, 1e-30)), min_size=VOCAB, max_size=VOCAB).filter(
    lambda row: sum(row) > 0
)


@SETTINGS
@given(p=st.lists(distributions, min_size=1, max_size=3), q=st.lists(distributions, min_size=1, max_size=3))
def test_residual_is_a_distribution(p: list[list[float]], q: list[list[float]]) -> None:
    rows = min(len(p), len(q))
    target = torch.tensor(p[:rows], dtype=torch.float32)
    target = target / target.sum(dim=-1, keepdim=True)
    draft = torch.tensor(q[:rows], dtype=torch.float32)
    draft = draft / draft.sum(dim=-1, keepdim=True)
    residual = residual_distribution(target, draft)
    assert bool(torch.isfinite(residual).all()) and bool((residual >= 0).all())
    assert torch.allclose(residual.sum(dim=-1), torch.ones(rows), atol=1e-5)
    # A draft token's q > 0 (it was drawn from q): the decision never fails.
    tokens = torch.multinomial(draft, 1)  # [rows, 1] as γ = 1 rounds
    accept_drafts(tokens, draft[:, None], torch.stack([target, target], dim=1), torch.Generator().manual_seed(0))


@SETTINGS
@given(
    expert=logit_rows,
    data=st.data(),
    alpha=st.floats(1e-45, 1.0, exclude_min=False),
    beta=st.one_of(st.floats(0, 10), st.floats(0, FLOAT32_MAX)),
    tau=st.one_of(st.floats(MIN_AMATEUR_TEMPERATURE, 10), st.floats(MIN_AMATEUR_TEMPERATURE, FLOAT32_MAX)),
    config=configs(),
)
def test_contrastive_scores_stay_defined(
    expert: list[list[float]], data: st.DataObject, alpha: float, beta: float, tau: float, config: ProcessingConfig
) -> None:
    rows = len(expert)
    amateur = torch.tensor(data.draw(st.lists(st.lists(logit_values, min_size=VOCAB, max_size=VOCAB), min_size=rows, max_size=rows)))
    expert_t = torch.tensor(expert, dtype=torch.float32)
    ids = torch.arange(VOCAB)
    for form, scores in (
        ("obrien", obrien_scores(expert_t, amateur, alpha, beta)),
        ("li", li_scores(expert_t, amateur, alpha, tau, log_partition(expert_t), log_partition(amateur, tau))),
        ("li", li_scores(expert_t, amateur, alpha, tau, torch.zeros(rows, 1), torch.zeros(rows, 1))),
    ):
        assert not bool(scores.isnan().any()) and not bool((scores == math.inf).any())
        assert bool(torch.isfinite(scores).any(dim=-1).all())
        logscores = beam_logscores(form, scores)
        assert not bool(logscores.isnan().any()) and bool(torch.isfinite(logscores).any(dim=-1).all())
        for row in range(rows):
            greedy_column(scores[row], ids)
            sample_column(scores[row], config, torch.Generator().manual_seed(row))


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    length_penalty=st.floats(-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
    early_stopping=st.sampled_from([False, True, "never"]),
    max_new=st.integers(1, 30),
    num_beams=st.integers(1, 4),
)
def test_beam_scores_are_finished_hypotheses_never_masks(
    seed: int, length_penalty: float, early_stopping: bool | str, max_new: int, num_beams: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    state = BeamState.start(num_beams, 1, max_new, length_penalty, early_stopping)
    steps = 0
    while not state.done:
        logprobs = torch.log_softmax(torch.randn(num_beams, 8, generator=generator) * 4, dim=-1)
        top, ids = torch.topk(logprobs, state.beams_to_keep if state.beams_to_keep <= 8 else 8, dim=-1)
        beam_step(state, ids, top, frozenset({0}))
        steps += 1
        assert steps <= max_new
    finished = state.finished_scores[state.finished_flags]
    assert len(finished) >= 1 and bool(torch.isfinite(finished).all())
    assert bool((finished.diff() <= 0).all())  # best first


# --- the cases, end to end (in-process: the same code the servicer runs) ------------

P = "def add(a, b):"


@pytest.fixture(scope="module")
def decoder(llama_target_dir: Path, llama_draft_dir: Path) -> Decoder:
    tokenizer = load_tokenizer(str(llama_target_dir))
    assert tokenizer is not None
    return Decoder(
        LocalModel(load_engine(llama_target_dir, "target"), "target"),
        LocalModel(load_engine(llama_draft_dir, "draft"), "draft"),
        tokenizer,
    )


def run(decoder: Decoder, **kwargs: Any) -> Any:
    return asyncio.run(decoder.generate(build_request(prompt=P, max_new_tokens=12, seed=1, **kwargs)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "sample", "temperature": 1e-38},
        {"strategy": "speculative", "temperature": 1e-38},
        {"strategy": "contrastive", "temperature": 1e-38},
        {"strategy": "sample", "temperature": 1e-45, "top_k": 1},
        {"strategy": "sample", "temperature": 1e-45, "min_p": 1.0},
        {"strategy": "sample", "temperature": 1e-45, "top_p": 1e-45},
    ],
)
def test_tiny_temperature_decodes_as_greedy(decoder: Decoder, kwargs: dict[str, Any]) -> None:
    greedy_strategy = "contrastive" if kwargs["strategy"] == "contrastive" else "greedy"
    assert run(decoder, **kwargs).token_ids == run(decoder, strategy=greedy_strategy).token_ids


@pytest.mark.parametrize("strategy", ["sample", "speculative", "contrastive"])
@pytest.mark.parametrize("penalty", [1e-45, 1e-38])
def test_tiny_repetition_penalty_samples(decoder: Decoder, strategy: str, penalty: float) -> None:
    # The limit itself is `test_tiny_repetition_penalty_is_greedy_over_the_seen_positive_ids`.
    sampled = run(decoder, strategy=strategy, temperature=1.0, repetition_penalty=penalty, ignore_eos=True)
    assert len(sampled.token_ids) == 12


def test_negative_length_penalty_returns_real_hypotheses(decoder: Decoder) -> None:
    result = run(decoder, strategy="beam", length_penalty=-20, num_beams=4, num_return_sequences=2)
    assert len(result.sequences) == 2
    for sequence in result.sequences:
        assert math.isfinite(sequence.score) and sequence.score != -1e9
    assert result.sequences[0].score >= result.sequences[1].score
    assert result.token_ids == result.sequences[0].token_ids


@pytest.mark.parametrize("kwargs", [{"temperature": 1.0}, {"num_beams": 2}, {}])
def test_huge_cd_beta_is_finite(decoder: Decoder, kwargs: dict[str, Any]) -> None:
    result = run(decoder, strategy="contrastive", cd_beta=1e38, **kwargs)
    assert len(result.token_ids) >= 1
    assert all(math.isfinite(s.score) for s in result.sequences)


def test_argmax_rows_equals_torch_argmax_with_ties_infinities_and_nan() -> None:
    """The chunked argmax against torch's on Gemma's vocabulary width: the first index of the
    maximum where it repeats within a chunk and across chunks, rows of −inf, a NaN, float16,
    and the widths it leaves to torch."""
    from specwire.engine.session import ARGMAX_CHUNK, argmax_rows

    torch.manual_seed(0)
    vocab = 64 * ARGMAX_CHUNK
    scores = torch.randn(9, vocab)
    scores[1, [7, 9000, 200_000]] = 50.0  # ties across chunks
    scores[2, [ARGMAX_CHUNK + 5, ARGMAX_CHUNK + 3]] = 50.0  # ties within a chunk
    scores[3] = float("-inf")
    scores[4, 123_456] = float("nan")
    scores[5] = 0.0
    scores[6, -1] = 50.0  # the last id
    for batch in (scores, scores.half(), scores.view(3, 3, vocab), scores[0], scores[:, :1000], scores[:, : vocab - 8]):
        assert torch.equal(argmax_rows(batch), batch.argmax(dim=-1))
    assert argmax_rows(scores)[[1, 2, 6]].tolist() == [7, ARGMAX_CHUNK + 3, vocab - 1]
