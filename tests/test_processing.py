"""Every processor equals transformers' own on random logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specwire import processing
from specwire.processing import ProcessingConfig, draw, sampling_probs
from tests.goodness_of_fit import chi_square_pvalue

VOCAB = 50


@pytest.fixture
def logits() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(6, VOCAB, generator=generator) * 3


@pytest.fixture
def history() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    # Few distinct ids so n-grams repeat.
    return torch.randint(0, 8, (6, 30), generator=generator)


@pytest.mark.parametrize("penalty", [0.7, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> None:
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    assert torch.equal(processing.repetition_penalty(logits, history, penalty), expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    scores = torch.tensor([[2.0, -2.0, 1.0]])
    out = processing.repetition_penalty(scores, torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_transformers(logits: torch.Tensor, history: torch.Tensor, size: int) -> None:
    expected = NoRepeatNGramLogitsProcessor(size)(history, logits.clone())
    actual = processing.no_repeat_ngram(logits, history, size)
    assert torch.equal(actual, expected)
    if size <= 3:  # this history repeats its short n-grams: something was banned
        assert bool(torch.isinf(actual).any())


@pytest.mark.parametrize("value", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(logits: torch.Tensor, history: torch.Tensor, value: float) -> None:
    expected = TemperatureLogitsWarper(value)(history, logits.clone())
    assert torch.equal(processing.temperature(logits, value), expected)


@pytest.mark.parametrize("k", [1, 5, 49, 50, 80])
def test_top_k_matches_transformers(logits: torch.Tensor, history: torch.Tensor, k: int) -> None:
    expected = TopKLogitsWarper(k)(history, logits.clone())
    assert torch.equal(processing.top_k(logits, k), expected)


@pytest.mark.parametrize(("p", "keep"), [(0.05, 1), (0.5, 1), (0.9, 1), (0.9, 3), (1.0, 1)])
def test_top_p_matches_transformers(logits: torch.Tensor, history: torch.Tensor, p: float, keep: int) -> None:
    expected = TopPLogitsWarper(p, min_tokens_to_keep=keep)(history, logits.clone())
    assert torch.equal(processing.top_p(logits, p, keep), expected)


@pytest.mark.parametrize(("p", "keep"), [(0.01, 1), (0.1, 1), (0.5, 2), (1.0, 1)])
def test_min_p_matches_transformers(logits: torch.Tensor, history: torch.Tensor, p: float, keep: int) -> None:
    expected = MinPLogitsWarper(p, min_tokens_to_keep=keep)(history, logits.clone())
    assert torch.equal(processing.min_p(logits, p, keep), expected)


def test_full_pipeline_matches_transformers_in_its_order(logits: torch.Tensor, history: torch.Tensor) -> None:
    config = ProcessingConfig(
        repetition_penalty=1.2, no_repeat_ngram_size=2, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05
    )
    scores = logits.clone()
    for processor in (
        RepetitionPenaltyLogitsProcessor(1.2),
        NoRepeatNGramLogitsProcessor(2),
        TemperatureLogitsWarper(0.8),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.9),
        MinPLogitsWarper(0.05),
    ):
        scores = processor(history, scores)
    assert torch.allclose(processing.sampling_probs(logits, history, config), scores.softmax(-1), atol=0, rtol=0)


def test_beam_logprobs_penalize_log_softmax(logits: torch.Tensor, history: torch.Tensor) -> None:
    config = ProcessingConfig(repetition_penalty=1.5, no_repeat_ngram_size=3)
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = NoRepeatNGramLogitsProcessor(3)(history, RepetitionPenaltyLogitsProcessor(1.5)(history, log_probs))
    assert torch.equal(processing.beam_logprobs(logits, history, config), expected)


def test_truncates_reports_whether_warping_cuts_the_vocabulary() -> None:
    assert not ProcessingConfig().truncates
    assert not ProcessingConfig(temperature=0.5, repetition_penalty=1.3).truncates
    assert ProcessingConfig(top_k=5).truncates
    assert ProcessingConfig(top_p=0.9).truncates
    assert ProcessingConfig(min_p=0.1).truncates


@pytest.mark.parametrize(("k", "p", "keep", "ties"), [(27, 0.9, 1, False), (50, 0.5, 2, False), (1, 0.5, 1, False), (300, 0.95, 1, True)])
def test_top_p_after_top_k_sorts_the_survivors_alone_to_the_full_sorts_bits(
    monkeypatch: pytest.MonkeyPatch, k: int, p: float, keep: int, ties: bool
) -> None:
    generator = torch.Generator().manual_seed(k)
    logits = torch.randn(5, 4096, generator=generator) * 3
    if ties:  # a cut between equal survivors: the whole row is sorted, as transformers sorts it
        logits = (logits * 4).round() / 4
    history = torch.zeros(5, 1, dtype=torch.long)
    expected = TopPLogitsWarper(p, min_tokens_to_keep=keep)(history, TopKLogitsWarper(k)(history, logits.clone()))
    few = processing._top_p_of_few
    outcomes: list[bool] = []  # whether the survivors alone were sorted

    def spy(*args: object) -> torch.Tensor | None:
        result = few(*args)  # type: ignore[arg-type]
        outcomes.append(result is not None)
        return result

    monkeypatch.setattr(processing, "_top_p_of_few", spy)
    assert torch.equal(processing.top_p(processing.top_k(logits, k), p, keep), expected)
    assert outcomes == [not ties]


WIDE = 131_072  # wide enough that `largest` takes its chunks for k ≤ 48


def _transformers_probs(logits: torch.Tensor, history: torch.Tensor, config: ProcessingConfig) -> torch.Tensor:
    processors = [
        RepetitionPenaltyLogitsProcessor(config.repetition_penalty),
        TemperatureLogitsWarper(config.temperature),
        TopKLogitsWarper(config.top_k, min_tokens_to_keep=config.min_tokens_to_keep),
        TopPLogitsWarper(config.top_p, min_tokens_to_keep=config.min_tokens_to_keep),
    ]
    if config.no_repeat_ngram_size:
        processors.insert(1, NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p, min_tokens_to_keep=config.min_tokens_to_keep))
    scores = logits.clone()
    for processor in processors:
        scores = processor(history, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize("kind", ["normal", "bfloat16", "banned"])
@pytest.mark.parametrize(
    "config",
    [
        ProcessingConfig(temperature=0.666, top_k=27, top_p=0.9),
        ProcessingConfig(temperature=1.0, top_k=48),
        ProcessingConfig(temperature=1.7, top_k=5, top_p=0.5, min_tokens_to_keep=2),
        ProcessingConfig(temperature=0.5, top_k=40, min_p=0.05),
        ProcessingConfig(repetition_penalty=1.3, temperature=0.8, top_k=20, top_p=0.95),
    ],
    ids=["bench", "t1", "hot-keep2", "min_p", "penalty"],
)
def test_sampling_from_the_top_k_candidates_alone_gives_transformers_bits(
    monkeypatch: pytest.MonkeyPatch, config: ProcessingConfig, kind: str
) -> None:
    generator = torch.Generator().manual_seed(len(kind) * 31 + config.top_k)
    logits = torch.randn(5, WIDE, generator=generator) * 4
    history = torch.randint(0, WIDE, (5, 40), generator=generator)
    if kind == "bfloat16":  # logits with bfloat16's steps: equal scores among the survivors
        logits = logits.to(torch.bfloat16).float()
    if kind == "banned":  # −inf scores, as no-repeat-n-gram leaves them
        config = ProcessingConfig(**{**config.__dict__, "no_repeat_ngram_size": 2})
        history[:, -1] = logits.topk(3, dim=-1).indices[:, 0]
        history[:, 10] = history[:, -1]
    taken: list[bool] = []
    fast = processing._top_k_sampling_probs

    def spy(*args: object) -> torch.Tensor | None:
        result = fast(*args)  # type: ignore[arg-type]
        taken.append(result is not None)
        return result

    monkeypatch.setattr(processing, "_top_k_sampling_probs", spy)
    assert torch.equal(processing.sampling_probs(logits, history, config), _transformers_probs(logits, history, config))
    assert taken == [True] or kind == "bfloat16"  # there a cut may fall between equal scores


@pytest.mark.parametrize(
    ("case", "config"),
    [
        ("integer logits: the k-th tied past the last candidate", ProcessingConfig(temperature=0.7, top_k=27, top_p=0.9)),
        ("T overflows a score", ProcessingConfig(temperature=1e-38, top_k=27)),
        ("NaN", ProcessingConfig(temperature=0.7, top_k=27)),
        ("+inf", ProcessingConfig(temperature=0.7, top_k=27)),
    ],
)
def test_sampling_warps_the_whole_row_where_the_candidates_cannot_be_sure(case: str, config: ProcessingConfig) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, WIDE, generator=generator) * 3
    if case.startswith("integer"):
        logits = logits.round()
    elif case.startswith("T"):
        logits[1, 7] = -50.0  # / 1e-38 overflows to −inf: `temperature` takes the row to its limit
    elif case == "NaN":
        logits[0, 9] = float("nan")
    else:
        logits[1, 9] = float("inf")
    history = torch.zeros(2, 1, dtype=torch.long)
    assert processing._top_k_sampling_probs(logits, config) is None
    actual = processing.sampling_probs(logits, history, config)
    whole_row = processing.apply_warpers(logits, config).softmax(dim=-1)
    torch.testing.assert_close(actual, whole_row, rtol=0, atol=0, equal_nan=True)
    if case.startswith("integer"):
        assert torch.equal(actual, _transformers_probs(logits, history, config))


def test_largest_finds_topks_values_and_ids_that_hold_them() -> None:
    generator = torch.Generator().manual_seed(5)
    scores = (torch.randn(4, WIDE, generator=generator) * 3).to(torch.bfloat16).float()  # ties too
    values, ids = processing.largest(scores, 43)
    assert torch.equal(values, torch.topk(scores, 43).values)
    assert torch.equal(scores.gather(1, ids), values)
    assert all(len(set(row)) == 43 for row in ids.tolist())


def test_draw_follows_the_distribution_and_never_an_id_without_mass() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).expand(4, -1)
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros(6)
    for _ in range(1000):
        counts += np.bincount(draw(probs, generator).numpy(), minlength=6)
    assert chi_square_pvalue(counts, probs[0].numpy()) > 1e-3
    wrong = np.array([0.0, 0.4, 0.0, 0.4, 0.2, 0.0])  # negative control: the same draws fail another p
    assert chi_square_pvalue(counts, wrong) < 1e-6


def test_draw_over_the_chunks_with_mass_takes_the_ids_the_whole_rows_sum_takes() -> None:
    """`draw` sums only the chunks that hold mass; the oracle is the inverse transform over the
    whole row's float64 cumulative sum, for supports from a few ids to every id, and uniforms at
    0, inside and where u · total rounds up to the total."""
    def whole_row(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        cumulative = probs.double().cumsum(dim=-1)
        ids = torch.searchsorted(cumulative, uniform[:, None] * cumulative[:, -1:], right=True).squeeze(-1)
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(dim=-1)
        return torch.where(ids >= probs.shape[-1], last, ids)

    generator = torch.Generator().manual_seed(11)
    chunked = 0
    for vocab, top_k, top_p in [(WIDE, 27, 0.9), (WIDE, 100, 1.0), (WIDE, 0, 1.0), (16_384, 43, 0.9), (16_384, 8, 1.0),
                                (1_000, 5, 1.0)]:
        logits = torch.randn(5, vocab, generator=generator) * 3
        probs = sampling_probs(logits, torch.zeros((5, 1), dtype=torch.long),
                               ProcessingConfig(temperature=0.7, top_k=top_k, top_p=top_p))
        chunked += processing._cumulative_of_mass(probs)[1] is not None
        for uniform in (torch.rand(5, generator=generator, dtype=torch.float64), torch.zeros(5, dtype=torch.float64),
                        torch.full((5,), 1 - 2**-53, dtype=torch.float64)):
            assert torch.equal(draw(probs, uniform=uniform), whole_row(probs, uniform))
    assert chunked == 3  # rows with mass in few chunks took them; the others, the whole row


def test_draw_gives_the_last_id_with_mass_when_u_times_the_total_rounds_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw["dtype"]))
    assert draw(torch.tensor([[0.3, 0.7, 0.0, 0.0]])).tolist() == [1]


def test_sampling_from_the_candidates_alone_draws_the_ids_the_dense_rows_draw() -> None:
    """`sample_rows` draws among each row's candidates where top-k leaves few, the dense rows
    where it cannot (no top-k, min-p, ties at the cut); either way the ids, the probabilities and
    the largest probability equal `draw(sampling_probs(...))`'s, for uniforms at 0, inside and
    where u · total rounds up to the total."""
    generator = torch.Generator().manual_seed(13)
    history = torch.zeros((6, 1), dtype=torch.long)
    configs = [ProcessingConfig(temperature=0.666, top_k=27, top_p=0.9), ProcessingConfig(temperature=1.3, top_k=5),
               ProcessingConfig(temperature=0.7, top_k=40, top_p=0.5, min_tokens_to_keep=2),
               ProcessingConfig(temperature=0.8), ProcessingConfig(temperature=0.8, top_k=27, min_p=0.05)]
    candidates = 0
    for vocab in (WIDE, 16_384):
        for config in configs:
            logits = torch.randn(6, vocab, generator=generator) * 3
            few = processing._top_k_sampling_probs(logits, config)
            candidates += isinstance(few, tuple)
            probs = sampling_probs(logits, history, config)
            for uniform in (torch.rand(6, generator=generator, dtype=torch.float64), torch.zeros(6, dtype=torch.float64),
                            torch.full((6,), 1 - 2**-53, dtype=torch.float64)):
                ids, dense, largest = processing.sample_rows(logits, history, config, uniform)
                assert torch.equal(ids, draw(probs, uniform=uniform))
                assert dense is not None and torch.equal(dense, probs) and torch.equal(largest, probs.amax(dim=-1))
                # No dense row is filled, nor one held, where it is not wanted.
                assert processing.sample_rows(logits, history, config, uniform, dense=False)[1] is None
    assert candidates == 6  # the first three configs at both widths; no top-k and min-p warp whole rows
