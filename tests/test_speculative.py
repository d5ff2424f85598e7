"""The speculative decision functions and the n-gram drafter, without sockets."""

from __future__ import annotations

import gc
import itertools
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from specwire.bench.draft_quality import round_tokens
from specwire.draft_service.ngram import NgramDrafter, NgramSession, ngram_match, ngram_proposal
from specwire.orchestrator.speculative import (
    _MEMORIES,
    SessionSync,
    Speculation,
    accept_greedy,
    acceptance_memory,
    max_sampled_gamma,
    ngram_settings,
    one_hot_probs,
)
from specwire.orchestrator.speedup import (
    SCALE_RECALL,
    TRIAL_WINDOW_S,
    AcceptanceMemory,
    CopyAcceptance,
    LoadTrial,
    RunningEstimates,
    alpha_estimate,
    best_gamma,
    forward_cost_at,
    plan_round,
    time_per_token_ms,
)
from transformers import GenerationConfig

from specwire.acceptance import (
    accept_draft,
    accept_draft_sparse,
    accept_drafts,
    block_end,
    block_ends,
    residual_distribution,
)
from specwire.engine import CausalLM, Engine
from specwire.errors import InvalidArgument
from specwire.processing import ProcessingConfig, sampling_distribution, sampling_probs, scatter_probs
from specwire.session import OpenRequest, ScoreKind, Scoring, ServerTiming, StepRequest, StepResult
from tests.goodness_of_fit import chi_square_pvalue


def random_probs(rows: int, vocab: int, seed: int, sharpness: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * sharpness).softmax(dim=-1)


# -- greedy --------------------------------------------------------------------------------------


def test_greedy_accepts_all_matching_drafts_and_takes_the_bonus() -> None:
    assert accept_greedy(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 9])) == (3, 9)


def test_greedy_stops_at_the_first_mismatch_with_the_target_argmax_as_correction() -> None:
    assert accept_greedy(torch.tensor([5, 6, 7]), torch.tensor([5, 4, 7, 9])) == (1, 4)
    assert accept_greedy(torch.tensor([5, 6, 7]), torch.tensor([1, 6, 7, 9])) == (0, 1)


def test_greedy_without_drafts_is_a_plain_target_step() -> None:
    assert accept_greedy(torch.tensor([], dtype=torch.long), torch.tensor([3])) == (0, 3)


# -- sampled -------------------------------------------------------------------------------------


def test_residual_is_the_normalised_positive_part_of_p_minus_q() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.2, 0.4, 0.2, 0.2]])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.8]])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([[2 / 3, 1 / 3, 0.0]]))


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = random_probs(3, 7, seed=0)
    assert torch.equal(residual_distribution(p, p), p)


def test_everything_is_accepted_when_draft_equals_target_and_the_bonus_comes_from_the_last_row() -> None:
    probs = random_probs(3, 6, seed=1)
    target = torch.cat([probs, torch.nn.functional.one_hot(torch.tensor([4]), 6).float()])  # [4, 6]
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        assert accept_draft(tokens, probs, target, generator) == (3, 4)


def test_a_token_the_target_rules_out_is_rejected_and_never_chosen_as_correction() -> None:
    draft_probs = torch.tensor([[0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    target = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        accepted_len, token = accept_draft(torch.tensor([1, 0]), draft_probs, target, generator)
        assert accepted_len == 0 and token in (0, 2)


def test_without_drafts_the_next_token_is_drawn_from_the_target() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0]])
    assert accept_draft(torch.tensor([], dtype=torch.long), torch.empty(0, 3), target, None) == (0, 2)


def test_single_round_equals_a_batch_of_one_and_a_seed_reproduces_it() -> None:
    """`accept_draft` tries the ends from the last back, `accept_drafts` computes them all: the
    same decision from the same draws, at γ 0 to 5, every round length, zeros in p and q."""
    lengths = set()
    for seed in range(120):
        gamma = seed % 6
        p = random_probs(gamma + 1, 9, seed=2 * seed + 1)
        q = 0.8 * p[:gamma] + 0.2 * random_probs(gamma, 9, seed=2 * seed)
        q[:, seed % 9] = 0.0
        p[:, (seed + 3) % 9] = 0.0
        q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
        tokens = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1) if gamma else torch.zeros(0, dtype=torch.long)
        single = accept_draft(tokens, q, p, torch.Generator().manual_seed(seed))
        accepted_len, next_token = accept_drafts(tokens[None], q[None], p[None], torch.Generator().manual_seed(seed))
        assert single == (int(accepted_len[0]), int(next_token[0]))
        assert single == accept_draft(tokens, q, p, torch.Generator().manual_seed(seed))
        lengths.add((gamma, single[0]))
    assert {kept for gamma, kept in lengths if gamma == 5} >= {0, 1, 2, 3, 5}


def test_a_sparse_round_is_decided_to_the_bit_as_the_dense_one() -> None:
    """`accept_draft_sparse` on each row's warped ids alone (q padded with −1, as it travels)
    equals `accept_draft` on the dense rows: at a 262k vocabulary, γ 1 to 5, every round length."""
    vocab, config, none = 262_144, ProcessingConfig(temperature=0.7, top_k=27, top_p=0.9), torch.zeros(1, 0, dtype=torch.long)
    lengths = set()
    for seed in range(60):
        generator = torch.Generator().manual_seed(seed)
        gamma = 1 + seed % 5
        target_logits = torch.randn(gamma + 1, vocab, generator=generator) * 3
        draft_logits = target_logits[:gamma] + torch.randn(gamma, vocab, generator=generator) * (0.3 + seed % 3)
        p, q = sampling_probs(target_logits, none, config), sampling_probs(draft_logits, none, config)
        few = sampling_distribution(target_logits, none, config)
        assert isinstance(few, tuple) and torch.equal(scatter_probs(*few, vocab), p)
        q_values, q_ids = torch.topk(q, int((q > 0).sum(dim=-1).max()), dim=-1)
        q_ids = q_ids.masked_fill(q_values <= 0, -1)
        drafts = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        dense = accept_draft(drafts, q, p, torch.Generator().manual_seed(seed))
        assert accept_draft_sparse(drafts, q_ids, q_values, *few, torch.Generator().manual_seed(seed)) == dense
        lengths.add(dense[0])
    assert lengths == {0, 1, 2, 3, 4, 5}


class RandomChains:
    """Random next-token distributions of a target p and a draft q over 3 ids, one pair per
    context; about a third of them with an id at 0, so that p and q rule out different ids."""

    def __init__(self, seed: int) -> None:
        self.generator, self.rows = torch.Generator().manual_seed(seed), {}

    def __call__(self, model: str, context: tuple[int, ...]) -> torch.Tensor:
        if (model, context) not in self.rows:
            row = torch.rand(3, generator=self.generator, dtype=torch.float64) ** 2
            if float(torch.rand((), generator=self.generator)) < 0.3:
                row[int(torch.randint(3, (), generator=self.generator))] = 0.0
            self.rows[model, context] = row / row.sum()
        return self.rows[model, context]


def round_outputs(chains: RandomChains, context: tuple[int, ...], gamma: int, residual_weight: bool = True) -> dict[tuple[int, ...], float]:
    """Exact probability of each output of one block-verified round (`block_end`): the kept
    drafts and the next token, over every draft chain q can draw and every end its draws allow.
    `residual_weight` False draws the next token from max(0, p − q) instead (wrong on purpose)."""
    outputs: dict[tuple[int, ...], float] = {}
    for drafts in itertools.product(range(3), repeat=gamma):
        drawn = math.prod(float(chains("q", context + drafts[:i])[x]) for i, x in enumerate(drafts))
        if drawn == 0.0:
            continue
        q = torch.stack([chains("q", context + drafts[:i]) for i in range(gamma)]).unsqueeze(0)
        p = torch.stack([chains("p", context + drafts[:i]) for i in range(gamma + 1)]).unsqueeze(0)
        chain = torch.tensor([drafts])
        ends_h, w = block_ends(chain, q, p)
        h = ends_h[0]
        for kept in range(gamma + 1):
            ends = (float(h[kept]) if kept else 1.0) * float(torch.prod(1 - h[kept + 1 :]))
            draft_row = q[:, kept] if kept < gamma else None
            row = block_end(w[:, kept], p[:, kept], draft_row)[0][0]
            if not residual_weight:
                row = (p[0, kept] - (q[0, kept] if kept < gamma else 0.0)).clamp_min(0.0)
            row = row if float(row.sum()) > 0 else p[0, kept]
            for token in range(3):
                chance = drawn * ends * float(row[token] / row.sum())
                if chance > 0:
                    outputs[drafts[:kept] + (token,)] = outputs.get(drafts[:kept] + (token,), 0.0) + chance
    return outputs


def first_tokens(chains: RandomChains, context: tuple[int, ...], count: int, gamma: int, residual_weight: bool = True) -> dict[tuple[int, ...], float]:
    """Exact distribution of the next `count` tokens of rounds run one after another."""
    result: dict[tuple[int, ...], float] = {}
    for output, chance in round_outputs(chains, context, gamma, residual_weight).items():
        tails = {(): 1.0} if len(output) >= count else first_tokens(chains, context + output, count - len(output), gamma, residual_weight)
        for tail, more in tails.items():
            key = (output + tail)[:count]
            result[key] = result.get(key, 0.0) + chance * more
    return result


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_block_verification_emits_exactly_the_target_distribution_and_never_fewer_tokens(gamma: int) -> None:
    """Exact, not sampled: over every draft chain and end, rounds of block verification emit the
    next 3 tokens with the target's joint probability; each round emits at least as many tokens
    in expectation as token-by-token acceptance (Sun et al. 2024, Thm. 2); and the residual of
    token acceptance, max(0, p − q), in its place emits a different distribution."""
    gaps = []
    for seed in range(4):
        chains = RandomChains(seed)
        emitted = first_tokens(chains, (), 3, gamma)
        for sequence in itertools.product(range(3), repeat=3):
            target = math.prod(float(chains("p", sequence[:i])[x]) for i, x in enumerate(sequence))
            assert emitted.get(sequence, 0.0) == pytest.approx(target, abs=1e-12)
        block = sum(len(output) * chance for output, chance in round_outputs(chains, (), gamma).items())
        token = 1.0
        for drafts in itertools.product(range(3), repeat=gamma):
            drawn = math.prod(float(chains("q", drafts[:i])[x]) for i, x in enumerate(drafts))
            kept = 1.0
            for i, x in enumerate(drafts):
                kept *= min(1.0, float(chains("p", drafts[:i])[x] / chains("q", drafts[:i])[x])) if drawn else 0.0
                token += drawn * kept
        assert block >= token - 1e-12
        wrong = first_tokens(chains, (), 3, gamma, residual_weight=False)
        gaps += [abs(wrong.get(s, 0.0) - math.prod(float(chains("p", s[:i])[x]) for i, x in enumerate(s)))
                 for s in itertools.product(range(3), repeat=3)]
    assert max(gaps) > 1e-3 if gamma > 1 else max(gaps) < 1e-12  # at γ = 1 the two residuals are one


def test_draft_quality_round_tokens_are_the_exact_expectations_of_both_rules() -> None:
    """`round_tokens` averaged over every chain q draws equals the round length that exact
    enumeration of block verification gives, and token acceptance's 1 + Σ_t Π min(1, p/q)."""
    chains, gamma = RandomChains(5), 3
    block = sum(len(output) * chance for output, chance in round_outputs(chains, (), gamma).items())
    averaged = torch.zeros(2, dtype=torch.float64)
    for drafts in itertools.product(range(3), repeat=gamma):
        drawn = math.prod(float(chains("q", drafts[:i])[x]) for i, x in enumerate(drafts))
        if drawn:
            q = torch.stack([chains("q", drafts[:i]) for i in range(gamma)])
            p = torch.stack([chains("p", drafts[:i]) for i in range(gamma + 1)])
            averaged += drawn * torch.tensor(round_tokens(torch.tensor(drafts), q, p), dtype=torch.float64)
    assert float(averaged[1]) == pytest.approx(block, abs=1e-12)
    assert 1.0 < float(averaged[0]) < float(averaged[1])


def test_acceptance_rate_is_one_minus_total_variation() -> None:
    """Leviathan et al. 2023, §3.1: P(accept) = Σ_x min(p(x), q(x)) = 1 − TV(p, q)."""
    samples, vocab = 100_000, 12
    q, p = random_probs(1, vocab, seed=4), random_probs(2, vocab, seed=5)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(q[0], samples, replacement=True, generator=generator)[:, None]  # [B, 1]
    accepted_len, next_token = accept_drafts(
        tokens, q.expand(samples, 1, vocab), p.expand(samples, 2, vocab), generator
    )
    expected = float(torch.minimum(p[0], q[0]).sum())
    observed = float(accepted_len.float().mean())
    assert abs(observed - expected) < 5 * (expected * (1 - expected) / samples) ** 0.5
    first = torch.where(accepted_len == 1, tokens[:, 0], next_token)
    assert chi_square_pvalue(np.bincount(first.numpy(), minlength=vocab), p[0].numpy()) > 1e-3


def test_one_hot_draft_is_accepted_with_the_target_probability_of_the_token() -> None:
    samples, vocab = 50_000, 5
    p = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    tokens = torch.full((samples, 1), 1)
    q = one_hot_probs(torch.tensor([1]), vocab)  # [1, V]
    generator = torch.Generator().manual_seed(0)
    accepted_len, next_token = accept_drafts(
        tokens, q.expand(samples, 1, vocab), p.expand(samples, 2, vocab), generator
    )
    assert abs(float(accepted_len.float().mean()) - 0.6) < 5 * (0.24 / samples) ** 0.5
    corrections = next_token[accepted_len == 0]
    assert not bool((corrections == 1).any())  # the residual is p without the proposed token


# -- session bookkeeping -------------------------------------------------------------------------


def test_session_sync_rolls_back_to_the_valid_prefix_and_appends_the_rest() -> None:
    history = [1, 2, 3, 4, 5, 6]
    assert SessionSync(held=4, valid=4).catch_up(history) == (None, [5, 6])
    assert SessionSync(held=8, valid=5).catch_up(history) == (5, [6])
    assert SessionSync(held=6, valid=6).catch_up(history) == (None, [])


# -- n-gram drafter ------------------------------------------------------------------------------


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_ngram_copies_what_followed_the_latest_longest_match() -> None:
    #                   the suffix (1, 2) occurs at 0 and 4; the latest is followed by 3, 9, 9
    history = ids(1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2)
    assert ngram_proposal(history, 3, ngram_max=3, ngram_min=1) == [3, 9, 9]
    # the longest n wins: (7, 1, 2) occurs once, followed by 5, though (1, 2) occurs later
    history = ids(7, 1, 2, 5, 1, 2, 6, 7, 1, 2)
    assert ngram_proposal(history, 1, ngram_max=3, ngram_min=1) == [5]
    assert ngram_proposal(history, 1, ngram_max=2, ngram_min=1) == [6]
    # the match's length comes with it: copied rounds keep an α per n
    assert ngram_match(history, 1, ngram_max=3, ngram_min=1) == (3, [5])
    assert ngram_match(history, 2, ngram_max=2, ngram_min=1) == (2, [6, 7])
    assert ngram_match(ids(1, 2, 3), 2, ngram_max=3, ngram_min=1) == (0, [])


def test_ngram_continues_a_repeating_pattern_past_the_end_of_the_history() -> None:
    assert ngram_proposal(ids(4, 5, 4, 5, 4), 5, ngram_max=2, ngram_min=1) == [5, 4, 5, 4, 5]
    assert ngram_proposal(ids(8, 8, 8), 4, ngram_max=3, ngram_min=1) == [8, 8, 8, 8]


def test_ngram_proposes_nothing_without_a_match() -> None:
    assert ngram_proposal(ids(1, 2, 3, 4), 4, ngram_max=3, ngram_min=1) == []
    assert ngram_proposal(ids(1, 2, 3, 1, 2, 4), 4, ngram_max=3, ngram_min=2) == []
    assert ngram_proposal(ids(7), 4, ngram_max=3, ngram_min=1) == []


def test_ngram_session_rolls_back_appends_and_keeps_its_proposals() -> None:
    session = NgramSession(NgramDrafter(vocab_size=10, eos_token_ids=[0], fingerprint=""))
    assert session.open(OpenRequest([1, 2, 3, 1, 2])).num_tokens == 5
    result = session.step(StepRequest(propose=2, propose_seed=3))
    assert result.proposed_ids is not None and result.proposed_ids.tolist() == [[3, 1]]
    assert result.proposal_scores is None and result.num_tokens == 7
    result = session.step(StepRequest(keep_tokens=6, append_ids=[4], propose=3))  # 3 accepted, 1 → 4
    assert session.tokens[:7] == [1, 2, 3, 1, 2, 3, 4] and result.proposed_ids is not None
    assert result.proposed_ids.shape == (1, 0)  # (3, 4) and 4 never occurred before
    assert session.step(StepRequest(keep_tokens=2)).num_tokens == 2


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (StepRequest(scoring=Scoring(ScoreKind.PROBS)), "scoring.kind"),
        (StepRequest(append_ids=[10]), "append_ids"),
        (StepRequest(keep_tokens=0), "keep_tokens"),
        (StepRequest(branch_order=[0, 0]), "branch_order"),
        (StepRequest(propose=65), "propose"),
    ],
)
def test_ngram_session_refuses_what_it_cannot_do(request_: StepRequest, field: str) -> None:
    session = NgramSession(NgramDrafter(vocab_size=10, eos_token_ids=[0], fingerprint=""))
    session.open(OpenRequest([1, 2, 3]))
    with pytest.raises(InvalidArgument) as error:
        session.step(request_)
    assert error.value.field == field


def test_ngram_drafter_reports_the_target_vocabulary_and_fingerprint(llama_target_dir: Path) -> None:
    drafter = NgramDrafter.load(str(llama_target_dir), ngram_max=4, ngram_min=2)
    target = Engine(CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32"), "target").info()
    info = drafter.info()
    assert (info.vocab_size, info.tokenizer_fingerprint, info.eos_token_ids) == (
        target.vocab_size,
        target.tokenizer_fingerprint,
        target.eos_token_ids,
    )
    assert "ngram" in info.capabilities and info.role == "draft" and info.tokenizer_fingerprint
    with pytest.raises(InvalidArgument):
        NgramDrafter.load(str(llama_target_dir), ngram_max=1, ngram_min=2)


def test_ngram_drafter_takes_eos_from_the_generation_config_as_the_target_does(
    llama_target_dir: Path, tmp_path: Path
) -> None:
    """Gemma-3's generation config stops at [1, 106] while its config.json says 1."""
    model_dir = shutil.copytree(llama_target_dir, tmp_path / "two-eos")
    GenerationConfig(bos_token_id=0, eos_token_id=[0, 7]).save_pretrained(model_dir)
    target = Engine(CausalLM.load(str(model_dir), device="cpu", dtype="float32"), "target").info()
    assert NgramDrafter.load(str(model_dir)).info().eos_token_ids == target.eos_token_ids == [0, 7]


# -- auto γ: the latency model's plan ------------------------------------------------------------


def test_plan_speculates_at_the_gamma_that_minimises_time_per_token() -> None:
    # α = 0.8, a draft token costs a tenth of a verify, a 2 ms round trip per message.
    plan = plan_round(0.8, 1.0, 10.0, 2.0, 10.0, 1.0, tokens_per_round=8, max_gamma=16)
    assert plan.speculate and plan.gamma > 1
    times = {g: time_per_token_ms(g, 0.8, 1.0, 10.0, 2.0) for g in range(1, 17)}
    assert plan.gamma == min(times, key=times.__getitem__)
    assert plan.speculative_ms_per_token == pytest.approx(times[plan.gamma])
    assert plan.speculative_ms_per_token < plan.target_only_ms_per_token


@pytest.mark.parametrize(
    ("alpha", "draft_ms"),
    [(0.1, 1.0), (0.9, 10.0)],  # drafts rarely accepted; a draft as slow as the target
    ids=["low-alpha", "costly-draft"],
)
def test_plan_turns_speculation_off_when_target_only_rounds_are_faster(alpha: float, draft_ms: float) -> None:
    plan = plan_round(alpha, draft_ms, 10.0, 2.0, 10.0, 1.0, tokens_per_round=8, max_gamma=16)
    assert not plan.speculate
    assert plan.target_only_ms_per_token == pytest.approx(10.0 + 1.0 / 8)
    assert plan.target_only_ms_per_token < plan.speculative_ms_per_token


def test_running_estimates_track_acceptance_and_costs() -> None:
    estimates = RunningEstimates()
    assert not estimates.ready and estimates.alpha == pytest.approx(0.6)  # the prior
    for _ in range(40):  # every draft accepted
        estimates.record_acceptance(drafted=4, accepted=4)
    assert estimates.alpha > 0.97
    estimates.record_draft(compute_ms=4.0, tokens=4, trip_ms=0.5)
    estimates.record_verify(compute_ms=10.0, positions=5, trip_ms=0.5)
    assert estimates.ready and estimates.plan(8, 16, draft_trip=True).speculate
    for _ in range(80):  # now every first draft is rejected (decay 0.95: a memory of ~20 rounds)
        estimates.record_acceptance(drafted=4, accepted=0)
    assert estimates.alpha < 0.1 and not estimates.plan(8, 16, draft_trip=True).speculate


def test_forward_cost_interpolates_between_measured_points_and_extrapolates_the_last_slope() -> None:
    costs = [(1, 0.6), (2, 0.8), (4, 1.2), (8, 1.6)]
    assert forward_cost_at(costs, 1) == forward_cost_at(costs, 0) == 0.6
    assert forward_cost_at(costs, 3) == pytest.approx(1.0)
    assert forward_cost_at(costs, 6) == pytest.approx(1.4)
    assert forward_cost_at(costs, 16) == pytest.approx(2.4)  # 0.1 ms a position past 8
    with pytest.raises(ValueError, match="no forward costs"):
        forward_cost_at([], 3)


def test_a_verification_that_grows_with_its_positions_moves_the_best_gamma_down() -> None:
    """On a GPU a verification costs about what a decode step does, whatever γ; on a CPU each
    position adds to it. The plan must see that: with the flat cost it drafts long, with the
    growing one (the demo target's measured curve, roughly) shorter, and it may stop speculating."""
    flat = plan_round(0.9, 0.15, 0.6, 0.4, 0.42, 0.2, tokens_per_round=16, max_gamma=16)
    curve = [(1, 0.6), (2, 0.84), (4, 1.11), (5, 1.35), (8, 1.5), (16, 2.25)]
    growing = plan_round(0.9, 0.15, lambda g: forward_cost_at(curve, g + 1), 0.4, 0.42, 0.2, 16, 16)
    assert flat.speculate and growing.gamma < flat.gamma
    assert growing.speculative_ms_per_token == pytest.approx(
        time_per_token_ms(growing.gamma, 0.9, 0.15, forward_cost_at(curve, growing.gamma + 1), 0.4)
    )
    assert not growing.speculate  # 0.42 ms a token target-only beats every γ here


def test_seeded_estimates_plan_the_first_round_and_scale_the_curve_by_what_they_measure() -> None:
    estimates = RunningEstimates.seeded([(1, 1.0), (5, 2.0)], target_ms_per_token=1.0, draft_ms_per_token=0.1)
    assert estimates.ready and estimates.verify_at(4) == pytest.approx(2.0)
    estimates.plan(16, 8, draft_trip=True)  # no measurement needed before the first round
    for _ in range(30):  # verifications now take twice what the curve says
        estimates.record_verify(compute_ms=4.0, positions=5, trip_ms=0.3)
    assert estimates.verify_scale == pytest.approx(2.0, rel=1e-3)
    assert estimates.verify_at(0) == pytest.approx(2.0, rel=1e-3)
    assert not RunningEstimates.seeded([], 0.0, 0.0).ready  # nothing timed: measure first


def test_a_draft_message_with_a_fixed_cost_does_not_talk_the_plan_into_a_short_gamma() -> None:
    """A draft message costs a + γ·b (it appends the kept tokens, then drafts): measured at γ 2,
    the plan must still choose the γ those true costs make best, not price every token at
    (a + 2b) / 2 and shrink γ. Oracle: `best_gamma` on the true costs (Gemma-3-270M's curve,
    roughly, and its int4 draft)."""
    curve = [(1, 8.2), (2, 9.0), (3, 9.3), (4, 9.4), (5, 9.9), (6, 10.1), (8, 10.8), (12, 16.9)]
    fixed, step, trip = 1.6, 1.1, 1.0
    estimates = RunningEstimates.seeded(curve, target_ms_per_token=8.2, draft_ms_per_token=step)
    for round_index in range(40):
        estimates.record_acceptance(drafted=4, accepted=3 if round_index % 4 else 1)
        estimates.record_draft(compute_ms=fixed + 2 * step, tokens=2, trip_ms=trip)
        estimates.record_verify(compute_ms=9.3, positions=3, trip_ms=trip)
    alpha = estimates.alpha
    true_best = best_gamma(alpha, step, lambda g: forward_cost_at(curve, g + 1), 2 * trip + fixed, max_gamma=8)
    per_token_only = best_gamma(alpha, (fixed + 2 * step) / 2, lambda g: forward_cost_at(curve, g + 1), 2 * trip, 8)
    assert per_token_only < true_best  # the old estimate's bias, which this guards against
    assert estimates.draft_fixed_ms == pytest.approx(fixed) and estimates.draft_ms_per_token == pytest.approx(step)
    assert estimates.plan(16, 8, draft_trip=True).gamma == true_best


def test_one_early_rejection_turns_a_good_pair_off_only_without_its_memory() -> None:
    """A generation's first round is a few trials. On Gemma-3-270M's costs (its served curve,
    roughly, and its int4 draft), one rejection from the fixed prior (3 of 5) puts α under the
    break-even and the next rounds target-only; from what the pair accepted before (α 5/7), the
    plan still speculates. Oracle: `plan_round` on the same costs."""
    curve = [(1, 8.2), (2, 9.0), (3, 9.3), (4, 9.4), (5, 9.9), (6, 10.1), (8, 10.8), (12, 16.9)]

    def after_one_rejection(prior: tuple[float, float]) -> RunningEstimates:
        estimates = RunningEstimates.seeded(curve, target_ms_per_token=8.2, draft_ms_per_token=1.1, prior=prior)
        estimates.record_acceptance(drafted=4, accepted=0)
        estimates.record_draft(compute_ms=1.3 + 4 * 1.1, tokens=4, trip_ms=1.1)
        estimates.record_verify(compute_ms=9.9, positions=5, trip_ms=1.1)
        return estimates

    memory = AcceptanceMemory()
    assert memory.prior() == (3.0, 2.0)
    fresh = after_one_rejection(memory.prior())
    assert fresh.alpha < 0.5 and not fresh.plan(16, 8, draft_trip=True).speculate
    for round_index in range(300):  # 3 or 2 of 4 drafts accepted: α = 5 / 7
        memory.record(drafted=4, accepted=3 if round_index % 2 else 2)
    accepted, rejected = memory.prior()
    assert accepted + rejected == pytest.approx(20.0) and alpha_estimate(accepted, rejected) == pytest.approx(5 / 7, abs=1e-3)
    remembered = after_one_rejection(memory.prior())
    assert remembered.alpha > 0.67 and remembered.plan(16, 8, draft_trip=True).speculate


def test_a_sampled_generation_plans_on_the_target_only_cost_its_rule_measured_not_the_greedy_seed() -> None:
    """The target service times a greedy step (8.1 ms a token, Gemma-3-270M's served one); a
    sampled token there also warps and draws (9.2 ms). On the greedy seed, at α 0.6 with the
    pair's served round costs (a sampled verification of 5 positions 12.1 ms), target-only
    rounds look faster and the plan turns speculation off; once a target-only round measured
    9.2, the plan speculates, and the pair's memory of the rule starts the next generation
    there. Oracle: `plan_round` on each figure."""
    curve = [(1, 8.1), (2, 8.6), (3, 9.3), (4, 9.8), (5, 10.4), (8, 12.4), (16, 20.0)]

    def generation(target_ms: float) -> RunningEstimates:
        estimates = RunningEstimates.seeded(curve, target_ms_per_token=target_ms, draft_ms_per_token=1.47,
                                            prior=(6.0, 4.0))
        estimates.record_draft(compute_ms=0.6 + 4 * 1.47, tokens=4, trip_ms=0.9)
        for _ in range(10):
            estimates.record_verify(compute_ms=12.1, positions=5, trip_ms=1.0)
        return estimates

    seeded = generation(8.1)
    assert not seeded.plan(16, 8, draft_trip=True).speculate
    expected = plan_round(seeded.alpha, 1.47, seeded.verify_at, 1.0 + 0.9 + 0.6, 9.2, 1.0, 16, 8)
    seeded.record_target_only(compute_ms=16 * 9.2, tokens=16, trip_ms=1.0)
    assert seeded.target_ms_per_token == pytest.approx(9.2) and seeded.plan(16, 8, draft_trip=True) == expected
    assert expected.speculate
    memory = AcceptanceMemory(target_ms_per_token=seeded.target_one_row_ms)
    assert generation(memory.target_ms_per_token or 8.1).plan(16, 8, draft_trip=True).speculate


def test_a_draft_handle_remembers_acceptance_per_target_and_rule_for_as_long_as_it_lives() -> None:
    class Handle:  # an orchestrator's draft `ModelHandle`, as far as the memory sees it
        pass

    def context(draft: Handle, target: str, sample: bool, temperature: float = 1.0) -> Any:
        return SimpleNamespace(
            draft=draft, target=SimpleNamespace(info=SimpleNamespace(model_name=target)),
            params=SimpleNamespace(do_sample=sample, processing=ProcessingConfig(temperature=temperature)),
        )

    draft = Handle()
    greedy = acceptance_memory(context(draft, "t", False))
    assert acceptance_memory(context(draft, "t", False)) is greedy
    others = [context(draft, "t", True), context(draft, "t", True, 0.7), context(draft, "u", False), context(Handle(), "t", False)]
    assert all(acceptance_memory(other) is not greedy for other in others)
    del draft, others
    gc.collect()  # the handle is gone, and its memories with it
    assert not any(memory is greedy for memories in _MEMORIES.values() for memory in memories.values())


def test_under_load_the_plan_prices_gamma_on_what_the_batch_adds_at_each_width() -> None:
    """Alone, a verification of 4 drafts costs 1.2 decode steps and speculation pays. In a batch
    of 8 rows, where each position is 8 more rows through every matrix product, a forward costs
    4× one row's at one position, 7× at two and 13× at five: at α ≈ 0.66 no γ yields enough
    tokens, and the plan runs target-only rounds, until the batch is gone. At one row the
    factors are 1, whatever the learnt curve says a fused step costs: the plan is the solo one."""
    solo = [(1, 10.0), (2, 10.5), (5, 12.0), (8, 14.0), (16, 20.0)]
    estimates = RunningEstimates.seeded(solo, target_ms_per_token=10.0, draft_ms_per_token=0.1)
    for _ in range(10):
        estimates.record_acceptance(drafted=4, accepted=2)
    alone = estimates.plan(16, 8, draft_trip=False)
    assert alone.speculate
    one_row = [(1, 8.0), (2, 10.5), (5, 12.0), (8, 14.0), (16, 20.0)]  # a fused greedy step: 8 ms
    estimates.record_load(1, one_row, one_row)
    assert estimates.plan(16, 8, draft_trip=False) == alone
    batch = [(1, 32.0), (2, 73.5), (5, 156.0), (8, 238.0), (16, 440.0)]
    estimates.record_load(8, batch, one_row)
    assert estimates.batch_rows == 8 and estimates.load_at(2) == pytest.approx(7.0)
    assert estimates.verify_at(1) == pytest.approx(73.5) and estimates.target_step_ms() == pytest.approx(40.0)
    assert not estimates.plan(16, 8, draft_trip=False).speculate
    estimates.record_target_only(compute_ms=16 * 44.0, tokens=16, trip_ms=0.5)  # measured in the batch
    assert estimates.target_one_row_ms == pytest.approx(11.0)  # ÷ 4: a one-row figure, in the seed's place
    estimates.record_target_only(compute_ms=16 * 48.0, tokens=16, trip_ms=0.5)
    assert estimates.target_one_row_ms == pytest.approx(0.7 * 11.0 + 0.3 * 12.0)  # measured ones average
    estimates.record_load(0, [], [])  # a service that does not batch says nothing: the last load holds
    estimates.record_load(8, [], [])  # the same rows: the service sends the curves again later
    assert estimates.batch_rows == 8 and estimates.load_at(2) == pytest.approx(7.0)
    estimates.record_load(1, one_row, one_row)
    assert estimates.plan(16, 8, draft_trip=False).speculate


def test_a_generation_starts_from_the_verify_scale_the_pair_measured_at_its_batch_rows() -> None:
    """At 8 rows the curve's guess at a verification fell short by 2.7× (Gemma-3-270M, 2 cores):
    a generation that starts from 1 speculates until it has measured that again. From the pair's
    memory it starts target-only; alone (1 row) it starts from 1, the target's own curve. A
    remembered scale moves back toward 1 at each reading, so one that keeps speculation off is
    measured again. Oracle: `plan_round` through `RunningEstimates.plan` at each scale."""
    solo = [(1, 10.0), (2, 10.5), (5, 12.0), (8, 14.0), (16, 20.0)]
    batch = [(1, 20.0), (2, 22.0), (5, 28.0), (8, 36.0), (16, 60.0)]
    memory = AcceptanceMemory()

    def generation() -> RunningEstimates:
        estimates = RunningEstimates.seeded(solo, target_ms_per_token=10.0, draft_ms_per_token=0.5, prior=(16.0, 4.0))
        reply = StepResult(timing=ServerTiming(batch_rows=8, batch_costs=batch, one_row_costs=solo))
        Speculation._record_load(SimpleNamespace(estimates=estimates, memory=memory), reply)  # type: ignore[arg-type]
        return estimates

    first = generation()
    assert first.verify_scale == 1.0 and first.plan(16, 8, draft_trip=True).speculate
    for _ in range(20):  # what its verifications took: 2.7× the curve
        first.record_verify(compute_ms=2.7 * 28.0, positions=5, trip_ms=1.0)
        memory.record_verify_scale(first.batch_rows, first.verify_scale)
    assert memory.verify_scales[8] == pytest.approx(2.7, rel=1e-3)
    second = generation()
    assert second.verify_scale == pytest.approx(2.7, rel=1e-3) and not second.plan(16, 8, draft_trip=True).speculate
    assert memory.verify_scales[8] == pytest.approx(1.0 + SCALE_RECALL * 1.7, rel=1e-3)
    memory.record_verify_scale(1, 3.0)  # alone, nothing is remembered: the curve is the cost
    assert memory.verify_scale(1) is None and 1 not in memory.verify_scales


def test_probing_is_worth_a_round_only_while_alpha_might_still_make_speculation_pay() -> None:
    """The prior (3 accepted, 2 rejected) leaves α up to ~0.86 plausible. With a CPU-like
    verification that grows with its positions, no γ pays even there: no probe. With a flat
    (GPU-like) one it pays at that α, and after many rejections it no longer does."""
    growing = RunningEstimates.seeded([(1, 0.6), (2, 0.84), (5, 1.35), (8, 1.5), (16, 2.25)], 0.42, 0.15)
    assert 0.8 < growing.alpha_upper < 0.9
    assert not growing.plan(16, 16, draft_trip=True, optimistic=True).speculate
    flat = RunningEstimates.seeded([(1, 10.0), (16, 10.5)], 10.0, 3.0)
    assert flat.plan(16, 16, draft_trip=True, optimistic=True).speculate
    for _ in range(60):
        flat.record_acceptance(drafted=4, accepted=0)
    assert flat.alpha_upper < 0.3 and not flat.plan(16, 16, draft_trip=True, optimistic=True).speculate


def _epoch(trial: LoadTrial, start: float, rates: dict[bool, int], generations: int = 2) -> bool:
    """One epoch of `generations` running generations from `start`, each round yielding the
    tokens its mode earns (`rates`); the mode the epoch ran in."""
    mode = trial.allows(0, start)
    for generation in range(1, generations):
        assert trial.allows(generation, start) == mode
    for tick in range(1, 10):  # rounds every tenth of the epoch, all in this epoch's mode
        now = start + tick * trial.epoch_s / 10
        for generation in range(generations):
            assert trial.allows(generation, now) == mode
            trial.record(rates[mode])
    return mode


def test_concurrent_generations_speculate_only_in_the_mode_their_joint_rate_favours() -> None:
    """Epochs on, then off, then the faster mode for `exploit_epochs` epochs and one epoch of the
    other, which loses again: the faster then runs twice as long. When the other becomes the
    faster, its next try finds it and the trial follows, from the short span again."""
    trial = LoadTrial(epoch_s=1.0, exploit_epochs=3)
    slower_on = {True: 2, False: 5}  # eight Gemma-3-270M streams on 2 cores: speculation loses
    modes = [_epoch(trial, float(epoch), slower_on) for epoch in range(12)]
    assert modes == [True, False, False, False, False, True] + [False] * 6
    assert trial.rates[False] > trial.rates[True]
    faster_on = {True: 9, False: 5}  # the load fell, or the host verifies for free
    modes = [_epoch(trial, float(epoch), faster_on) for epoch in range(12, 18)]
    assert modes == [True, True, True, True, False, True]
    assert trial.rates[True] > trial.rates[False]


def test_a_lone_generation_plans_alone_and_one_that_left_stops_counting() -> None:
    trial = LoadTrial(epoch_s=1.0)
    trial.speculate = False  # what the trial would have the pair's concurrent generations do
    assert all(trial.allows(0, 0.1 * tick) for tick in range(30))  # alone: its own plan decides
    trial.record(100)
    assert trial.started is None and not trial.rates  # nor does it count toward an epoch
    assert not trial.allows(1, 3.0) and not trial.allows(0, 3.0)  # two now: the trial's mode
    trial.leave(1)
    assert trial.allows(0, 3.1)
    assert not trial.allows(2, 3.2)
    assert trial.allows(0, 3.2 + TRIAL_WINDOW_S + 0.1)  # 2 started no round since: not running


def test_the_ngram_drafters_settings_reach_the_orchestrator(llama_target_dir: Path) -> None:
    assert ngram_settings(NgramDrafter.load(str(llama_target_dir), ngram_max=5, ngram_min=2).info()) == (5, 2)


def test_sampled_gamma_keeps_a_dense_262k_vocabulary_p_under_the_message_limit() -> None:
    gamma = max_sampled_gamma(262_144)
    assert gamma == 31 and (gamma + 1) * 262_144 * 4 <= 64 * 1024 * 1024 // 2
    assert max_sampled_gamma(4096) > 64  # the demo vocabulary: no cap below the γ bound


def test_copies_are_priced_as_a_chain_that_goes_on_once_entered() -> None:
    copies = CopyAcceptance(first=(0.0, 0.0), later=(0.0, 0.0))
    # a round of 4 copies, 2 accepted; one of 4, none; one of 3, all: a = 2/3, c = 3/4
    for drafted, accepted in ((4, 2), (4, 0), (3, 3)):
        copies.record(drafted, accepted, decay=1.0)
    assert copies.first == (2.0, 1.0) and copies.later == (3.0, 1.0)
    a, c = 2 / 3, 3 / 4
    assert copies.tokens(1) == pytest.approx(1 + a)
    assert copies.tokens(4) == pytest.approx(1 + a * (1 - c**4) / (1 - c))
    # a flat verification cost: the longest copy; one that doubles past 4 positions: no longer
    flat = copies.best(lambda gamma: 10.0, trip_ms=1.0, most=8)
    steep = copies.best(lambda gamma: 10.0 if gamma < 4 else 20.0, trip_ms=1.0, most=8)
    assert flat[0] == 8 and steep[0] == 3
    assert flat[1] == pytest.approx(11.0 / copies.tokens(8))
