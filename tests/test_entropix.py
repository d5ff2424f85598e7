"""Entropix: constructed logits drive every policy state; the warpers implement the reference's
intent; the strategy is seeded, traced, and its trace over gRPC equals an eager forward's metrics."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
import torch
from specwire.client import Client
from specwire.client.sdk import GenerationError, build_request
from specwire.orchestrator.entropix import (
    Decision,
    EntropixConfig,
    Metrics,
    adaptive_decision,
    candidate_score,
    choose_column,
    classify,
    decide,
    policy_distribution,
    warp,
)
from specwire.orchestrator.entropix_strategy import EXTRAS, policy_row
from specwire.orchestrator.generation import Decoder
from specwire.orchestrator.models import LocalModel

from specwire.engine import load_tokenizer
from specwire.entropy_metrics import token_entropy
from specwire.session import OpenRequest, ScoreKind, Scoring
from tests.conftest import load_engine
from tests.harness import Stack
from tests.test_entropy_metrics import eager_model, reference_metrics

CONFIG = EntropixConfig()
VOCAB = 32000  # a vocabulary wider than any top-k below


def spread(top_mass: float, rest: int) -> torch.Tensor:
    """Logits of one token of mass `top_mass` and `rest` tokens sharing the remainder evenly."""
    probs = torch.full((rest + 1,), (1 - top_mass) / rest)
    probs[0] = top_mass
    return probs.log()


def metrics_of(logits: torch.Tensor, attn_entropy: float = 2.0, attn_varentropy: float = 0.1,
               agreement: float = 0.2, interaction: float = 1.0) -> Metrics:
    entropy, varentropy = token_entropy(logits)
    return Metrics(float(entropy), float(varentropy), attn_entropy, attn_varentropy, agreement, interaction)


def test_constructed_logits_drive_every_state() -> None:
    peaked = metrics_of(torch.tensor([30.0] + [0.0] * 99))  # H ≈ 0, V ≈ 0
    flat16 = metrics_of(torch.zeros(16))  # H = 4 bits, V = 0
    one_strong = metrics_of(spread(0.9, 2**15))  # H ≈ 2.0, V ≈ 30
    half_and_mist = metrics_of(spread(0.5, 2**16))  # H ≈ 9, V ≈ 64
    middling = metrics_of(torch.tensor([3.0, 2.0, 1.0, 0.0]))  # H ≈ 1.37, V ≈ 1.28
    assert peaked.entropy < 0.1 and flat16.entropy == pytest.approx(4.0) and flat16.varentropy < 1e-6
    assert one_strong.entropy < 5 < one_strong.varentropy and half_and_mist.entropy > 5 and half_and_mist.varentropy > 5
    states = {name: classify(m, CONFIG) for name, m in
              [("peaked", peaked), ("flat16", flat16), ("one_strong", one_strong), ("mist", half_and_mist), ("mid", middling)]}
    assert states == {"peaked": "argmax", "flat16": "clarify", "one_strong": "branch", "mist": "resample", "mid": "adaptive"}

    t0, p0, k0 = CONFIG.temperature, CONFIG.top_p, CONFIG.top_k
    branch = decide(one_strong, CONFIG, 0, VOCAB)  # T raised by interaction strength, k widened by disagreement
    assert branch.temperature == pytest.approx(min(1.5, t0 * (1.2 + 0.3 * 1.0)))
    assert branch.top_k == max(5, int(k0 * (1 + 0.5 * (1 - 0.2)))) == 37
    resample = decide(half_and_mist, CONFIG, 0, VOCAB)  # T raised by attention varentropy, p lowered by attention entropy
    assert resample.temperature == pytest.approx(max(2.0, t0 * (2.0 + 0.5 * 0.1)))
    assert resample.top_p == pytest.approx(max(0.5, p0 - 0.2 * 2.0))
    clarify = decide(flat16, CONFIG, 0, VOCAB)  # no clarifying token configured: T raised by attention entropy
    assert not clarify.clarify and clarify.temperature == pytest.approx(min(1.5, t0 * (1.3 + 0.2 * 2.0)))
    adaptive = decide(middling, CONFIG, 0, VOCAB)
    u = middling.entropy + middling.varentropy
    assert adaptive.temperature == pytest.approx(t0 * (1 + 0.3 * u + 0.2 * 2.1 - 0.2 * 0.2))
    assert adaptive.top_p == pytest.approx(min(1.0, p0 * (1 + 0.1 * 0.1)))
    assert adaptive.top_k == round(k0 * (1 + 0.3 * 1.0 - 0.2 * 0.2)) and adaptive.samples == 5
    assert adaptive.min_p == pytest.approx(min(0.5, max(0.01, 0.03 * (1 - 0.5 * u))))


def test_clarifying_token_inserted_once() -> None:
    config = EntropixConfig(clarifying_token=7)
    flat16 = metrics_of(torch.zeros(16))
    assert decide(flat16, config, last_token=3, vocab_size=VOCAB).clarify
    assert not decide(flat16, config, last_token=7, vocab_size=VOCAB).clarify  # just inserted: sample instead


def test_huge_coefficients_widen_top_k_only_to_the_vocabulary() -> None:
    one_strong = metrics_of(spread(0.9, 2**15))  # the branch state
    huge = EntropixConfig(branch_top_k_coefficient=3.4e38, adaptive_top_k_interaction=3.4e38, top_k=1024)
    assert decide(one_strong, huge, 0, 320).top_k == 320  # not ⌊1024 · 3.4e38⌋, which int32 cannot hold
    assert huge.columns(320) == 320 and huge.columns(50_000) == 50_000
    assert adaptive_decision(one_strong, huge).top_k == huge.adaptive_max_top_k
    shrinking = EntropixConfig(adaptive_top_k_agreement=3.4e38)  # k₀ · (1 − huge · agreement) < 1
    assert adaptive_decision(metrics_of(torch.tensor([3.0, 2.0, 1.0, 0.0])), shrinking).top_k == 1


def test_thresholds_are_parameters() -> None:
    middling = metrics_of(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    assert classify(middling, EntropixConfig(argmax_entropy=2.0, argmax_varentropy=2.0)) == "argmax"


def test_nucleus_keeps_the_most_likely_tokens() -> None:
    # The reference masks after an ascending sort, which would keep the *least* likely tokens.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = warp(logits, Decision("x", 1.0, top_p=0.7, top_k=4, min_p=0.0))
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert warp(logits, Decision("x", 1.0, top_p=0.4, top_k=4, min_p=0.0)).tolist() == pytest.approx([1, 0, 0, 0])


def test_min_p_and_top_k_remove_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # min-p 0.2: p ≥ 0.1 stays (the reference's torch port computes this mask and then ignores it).
    assert warp(logits, Decision("x", 1.0, top_p=1.0, top_k=4, min_p=0.2)).tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert warp(logits, Decision("x", 1.0, top_p=1.0, top_k=2, min_p=0.0)).tolist() == pytest.approx([0.625, 0.375, 0, 0])


@pytest.mark.parametrize(("temperature", "expected"), [(1e-45, [1, 0, 0, 0]), (3e38, [1 / 3, 1 / 3, 1 / 3, 0]),
                                                       (math.inf, [1 / 3, 1 / 3, 1 / 3, 0])])
def test_extreme_temperatures_warp_to_a_distribution(temperature: float, expected: list[float]) -> None:
    """T → 0 is the argmax and T → ∞ the uniform over present tokens (−inf: absent), never NaN,
    for one draw and for best-of-n (a policy's T may overflow: T₀ = 3e38 times a raise)."""
    logits = torch.tensor([3.0, 2.0, 1.0, -math.inf])
    for samples in (1, 5):
        decision = Decision("adaptive", temperature, top_p=1.0, top_k=4, min_p=0.0, samples=samples)
        assert warp(logits, decision).tolist() == pytest.approx(expected)
        policy = policy_distribution(logits, decision)
        assert torch.isfinite(policy).all() and float(policy.sum()) == pytest.approx(1.0)


def test_draws_follow_the_warped_distribution() -> None:
    """An exact draw (the reference's uniform noise in argmax(p/u) would over-pick the top token)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    decision = Decision("branch", 1.0, 1.0, 4, 0.0)
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.bincount(torch.tensor([choose_column(logits, decision, None, CONFIG, generator)  # type: ignore[arg-type]
                                          for _ in range(draws)]), minlength=4).double()
    expected = torch.tensor([0.4, 0.3, 0.2, 0.1]) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    # Negative control: argmax(p / u), u uniform, is far off.
    u = torch.rand(draws, 4, generator=generator)
    biased = torch.bincount((torch.tensor([0.4, 0.3, 0.2, 0.1]) / u).argmax(-1), minlength=4).double()
    assert float(((biased - expected) ** 2 / expected).sum()) > 100


def test_adaptive_keeps_the_best_scored_candidate() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5])
    m = metrics_of(logits)
    decision = Decision("adaptive", 5.0, 1.0, 4, 0.0, samples=5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        state = generator.get_state()
        column = choose_column(logits, decision, m, CONFIG, generator)
        generator.set_state(state)
        draws = torch.multinomial(warp(logits, decision), 5, replacement=True, generator=generator).tolist()
        assert column == min(draws)  # the highest log p among the drawn (columns are sorted)
    assert candidate_score(-1.0, m, CONFIG) - candidate_score(-2.0, m, CONFIG) == pytest.approx(1.0)


@pytest.mark.parametrize(("stack", "target_dir"), [("llama_stack", "llama_target_dir"), ("gpt2_stack", "gpt2_target_dir")])
def test_entropix_seeded_traced_and_equal_to_an_eager_forward(stack: str, target_dir: str,
                                                               request: pytest.FixtureRequest) -> None:
    served: Stack = request.getfixturevalue(stack)
    path: Path = request.getfixturevalue(target_dir)
    client = Client(served.address)
    kwargs = {"input_ids": [5, 17, 42, 8, 99, 23], "strategy": "entropix", "max_new_tokens": 12, "ignore_eos": True}
    first = client.generate(seed=11, **kwargs)  # type: ignore[arg-type]
    again = client.generate(seed=11, **kwargs)  # type: ignore[arg-type]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 12
    assert first.decisions == again.decisions and len(first.decisions) == 12
    assert sum(first.stats.entropix_states.values()) == 12
    assert first.stats.entropix_states == {s: sum(d.state == s for d in first.decisions) for s in first.stats.entropix_states}
    streamed = list(client.stream(seed=11, **kwargs))  # type: ignore[arg-type]
    assert [t for d in streamed for t in d.token_ids] == first.token_ids and streamed[-1].decisions == first.decisions
    want = reference_metrics(eager_model(path), [5, 17, 42, 8, 99, 23] + first.token_ids)
    names = {"entropy": "entropy", "varentropy": "varentropy", "attn_entropy": "attn_entropy",
             "attn_varentropy": "attn_varentropy", "agreement": "agreement", "interaction_strength": "interaction"}
    for i, decision in enumerate(first.decisions):
        for field, ref in names.items():
            expected = want[ref][5 + i]  # the position before token i
            assert math.isclose(getattr(decision, field), expected, rel_tol=1e-4, abs_tol=1e-4), (i, field)
    assert first.to_dict()["decisions"][0]["state"] == first.decisions[0].state


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"entropix": {"argmax_entropy": -1.0}}, "entropix.argmax_entropy"),
        ({"entropix": {"adaptive_samples": 0}}, "entropix.adaptive_samples"),
        ({"entropix": {"branch_varentropy": math.nan}}, "entropix.branch_varentropy"),
        ({"entropix": {"clarifying_token": 10**6}}, "entropix.clarifying_token"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_entropix_parameters_are_invalid_argument(llama_stack: Stack, params: dict, field: str) -> None:
    with pytest.raises(GenerationError) as caught:
        Client(llama_stack.address).generate(prompt="x", strategy="entropix", max_new_tokens=2, **params)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith(field)


def chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """Pearson's statistic over bins expecting ≥ 5 draws (the rest pooled) and its degrees of freedom."""
    expected = probs.double() * draws
    big = expected >= 5
    observed = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    return float(((observed - wanted) ** 2 / wanted).sum()), int(keep.sum()) - 1


# χ² critical values at p = 0.001 by degrees of freedom (Wilson–Hilferty for the larger ones).
def chi_square_critical(dof: int) -> float:
    z = 3.0902  # the normal's 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("samples", [1, 5])
def test_policy_distribution_is_what_choose_column_draws(samples: int) -> None:
    logits = torch.linspace(3.0, -3.0, 12)
    decision = Decision("adaptive" if samples > 1 else "branch", 1.3, 0.95, 10, 0.02, samples=samples)
    m = metrics_of(logits)
    generator = torch.Generator().manual_seed(5)
    draws = 20000
    counts = torch.bincount(torch.tensor([choose_column(logits, decision, m, CONFIG, generator) for _ in range(draws)]),
                            minlength=12)
    policy = policy_distribution(logits, decision)
    assert float(policy.sum()) == pytest.approx(1.0, abs=1e-6)
    statistic, dof = chi_square(counts, policy, draws)
    assert statistic < chi_square_critical(dof)
    if samples > 1:  # negative control: best-of-n is not the warped distribution itself
        wrong, dof = chi_square(counts, warp(logits, decision), draws)
        assert wrong > chi_square_critical(dof)


@pytest.fixture(scope="module")
def pair_decoder(llama_target_dir: Path, llama_draft_dir: Path) -> Decoder:
    tokenizer = load_tokenizer(str(llama_target_dir))
    assert tokenizer is not None
    return Decoder(LocalModel(load_engine(llama_target_dir, "target"), "target"),
                   LocalModel(load_engine(llama_draft_dir, "draft"), "draft"), tokenizer)


PAIR_PROMPT = [5, 17, 42, 8]


def test_speculative_entropix_all_argmax_equals_greedy(pair_decoder: Decoder) -> None:
    always_argmax = {"argmax_entropy": 1000.0, "argmax_varentropy": 1000.0}
    common = {"input_ids": PAIR_PROMPT, "max_new_tokens": 16, "ignore_eos": True}
    greedy = asyncio.run(pair_decoder.generate(build_request(strategy="greedy", **common)))  # type: ignore[arg-type]
    speculative = asyncio.run(pair_decoder.generate(build_request(
        strategy="entropix", num_speculative_tokens=3, entropix=always_argmax, seed=1, **common)))  # type: ignore[arg-type]
    assert speculative.token_ids == greedy.token_ids
    assert speculative.stats.drafted_tokens > 0 and speculative.stats.entropix_states == {"argmax": 16}


def test_speculative_entropix_is_seeded_and_traced(pair_decoder: Decoder) -> None:
    request = build_request(input_ids=PAIR_PROMPT, strategy="entropix", num_speculative_tokens=3, max_new_tokens=12,
                            ignore_eos=True, seed=4)
    first, again = (asyncio.run(pair_decoder.generate(request)) for _ in range(2))
    assert first.token_ids == again.token_ids and first.stats.decisions == again.stats.decisions
    assert len(first.stats.decisions) == len(first.token_ids) == 12 and first.stats.drafted_tokens > 0


def test_speculative_entropix_keeps_the_policys_distribution(pair_decoder: Decoder, llama_target_dir: Path) -> None:
    """The first token of γ = 1 rounds (an accepted draft or a correction) follows the policy's
    distribution at the prompt's last position, computed target-only."""
    session = pair_decoder.target.backend.new_session()  # type: ignore[attr-defined]
    config = EntropixConfig()
    vocab = pair_decoder.target.info.vocab_size
    scoring = Scoring(ScoreKind.LOGITS, top_n=config.columns(vocab), extras=EXTRAS)
    opened = session.open(OpenRequest(PAIR_PROMPT, scoring=scoring))
    policy, decision, _ = policy_row(config, opened, 0, PAIR_PROMPT[-1], vocab)
    assert decision.state == "adaptive" and decision.samples == 5  # best-of-n: the hardest case
    draws = 1500
    firsts = []
    for seed in range(draws):
        request = build_request(input_ids=PAIR_PROMPT, strategy="entropix", num_speculative_tokens=1,
                                max_new_tokens=2, ignore_eos=True, seed=seed)
        firsts.append(asyncio.run(pair_decoder.generate(request)).token_ids[0])
    counts = torch.bincount(torch.tensor(firsts), minlength=vocab)
    statistic, dof = chi_square(counts, policy, draws)
    assert statistic < chi_square_critical(dof)
    # Negative control: the same draws against the single-draw warped distribution.
    ids = opened.scores.sparse_ids[0].long()  # type: ignore[union-attr]
    single = torch.zeros(vocab)
    single[ids] = warp(opened.scores.sparse_values[0], decision)  # type: ignore[union-attr]
    wrong, dof = chi_square(counts, single, draws)
    assert wrong > chi_square_critical(dof)


def test_speculative_entropix_over_grpc_equals_in_process(pair_decoder: Decoder, llama_stack: Stack) -> None:
    kwargs = {"input_ids": PAIR_PROMPT, "strategy": "entropix", "num_speculative_tokens": 2, "max_new_tokens": 10,
              "ignore_eos": True, "seed": 9}
    local = asyncio.run(pair_decoder.generate(build_request(**kwargs)))  # type: ignore[arg-type]
    remote = Client(llama_stack.address).generate(**kwargs)  # type: ignore[arg-type]
    assert remote.token_ids == local.token_ids
    assert [d.state for d in remote.decisions] == [d.state for d in local.stats.decisions]
