"""Speculative decoding keeps the target's output: token for token when greedy, in distribution
when sampled (DESIGN.md, principle 5; Leviathan et al. 2023, Theorem 1).

- Greedy: speculative output over gRPC equals the target-only greedy output, for model and
  n-gram drafters, γ ∈ {1, 3, 8}, Llama and GPT-2 targets, and the demo pair once trained.
- Sampled, pure: 200k draws through `accept_drafts` fed a real (small-vocabulary) draft's and
  target's distributions; the first token, and the first two jointly, follow the target
  (chi-square, p > 0.001) at temperature 1 and with top-p 0.9. Wrong rules fail the same test.
- Sampled, end to end: 1k generations over gRPC with distinct seeds (1k more with the n-gram
  drafter); the first and second tokens' histograms follow the target's exact marginals. With
  pipelined drafting and with auto γ, the first three tokens' histograms do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from specwire.client import AsyncClient, Client
from specwire.orchestrator import speculative

from specwire.acceptance import accept_drafts
from specwire.processing import ProcessingConfig, sampling_probs
from tests.conftest import hf_model
from tests.goodness_of_fit import chi_square_pvalue
from tests.harness import Stack

pytest_plugins = ["tests.spec_fixtures"]  # its fixtures: stacks and the small-vocabulary pair

ALPHA = 1e-3
GREEDY_PROMPTS = ["def add(a, b):", "the quick brown fox", "for i in range(10):\n    print(i"]
GREEDY_STACKS = ["llama_stack", "gpt2_stack", "self_draft_stack", "llama_ngram_stack", "gpt2_ngram_stack"]


# -- greedy: token for token --------------------------------------------------------------------


@pytest.fixture(scope="module", params=[*GREEDY_STACKS, "demo_stack", "demo_ngram_stack"])
def greedy_stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def greedy_references(greedy_stack: Stack) -> dict[str, list[int]]:
    client = Client(greedy_stack.address)
    return {
        prompt: client.generate(prompt, strategy="greedy", max_new_tokens=40, ignore_eos=True).token_ids
        for prompt in GREEDY_PROMPTS
    }


@pytest.mark.parametrize(
    ("gamma", "pipeline"), [(1, True), (3, True), (8, True), (3, False), (0, True)], ids=["1", "3", "8", "3-sequential", "auto"]
)
def test_greedy_speculative_equals_target_greedy(
    greedy_stack: Stack, greedy_references: dict[str, list[int]], gamma: int, pipeline: bool
) -> None:
    """Fixed γ with and without pipelined drafting, and auto γ (0) with its target-only rounds."""
    client = Client(greedy_stack.address)
    for prompt, expected in greedy_references.items():
        result = client.generate(
            prompt, strategy="speculative", num_speculative_tokens=gamma, speculative_pipeline=pipeline,
            max_new_tokens=40, ignore_eos=True,
        )
        assert result.token_ids == expected, prompt
        assert result.stats.new_tokens == 40


# -- sampled, pure: the acceptance rule on real models' distributions ---------------------------


Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def always_accept(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: every draft token is kept, so the output follows the draft."""
    batch, gamma = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, gamma], 1, generator=generator).squeeze(-1)
    return torch.full((batch,), gamma, dtype=torch.long), bonus


def resample_from_target(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: a rejected token is replaced by a draw from p instead of the residual."""
    accepted_len, _ = accept_drafts(draft_tokens, draft_probs, target_probs, generator)
    rows = torch.arange(draft_tokens.shape[0])
    return accepted_len, torch.multinomial(target_probs[rows, accepted_len], 1, generator=generator).squeeze(-1)


class TwoStepDistributions:
    """A model's warped next-token distributions after a prompt, after one and after two more tokens."""

    def __init__(self, model_dir: Path, prompt_ids: list[int], config: ProcessingConfig) -> None:
        model: Any = hf_model(model_dir)
        vocab = int(model.config.vocab_size)
        prompt = torch.tensor(prompt_ids)
        firsts = torch.arange(vocab)
        pairs = torch.cartesian_prod(firsts, firsts)  # [V², 2]
        seqs = torch.cat([prompt.expand(vocab * vocab, -1), pairs], dim=1)  # [V², L+2]
        with torch.no_grad():
            logits = model(seqs).logits.float()  # [V², L+2, V]
        self.first = sampling_probs(logits[:1, -3], seqs[:1, :-2], config)[0]  # [V]
        by_first = logits[::vocab, -2]  # [V, V]: rows for pairs (x, 0)
        self.second = sampling_probs(by_first, seqs[::vocab, :-1], config)  # [V, V]: p(· | x1)
        self.third = sampling_probs(logits[:, -1], seqs, config).view(vocab, vocab, vocab)  # p(· | x1, x2)


def speculate_two_tokens(
    target: TwoStepDistributions, draft: TwoStepDistributions, rule: Rule, samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """One γ = 2 round per sample, vectorised: drafts from q, decision by `rule`; the first two tokens out.

    When the round yields one token only, the second comes from the next round, which (as the
    first-token test shows) draws from the target's conditional: here drawn from it directly.
    """
    generator = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(draft.first, samples, replacement=True, generator=generator)  # [B]
    x2 = torch.multinomial(draft.second[x1], 1, generator=generator).squeeze(-1)  # [B]
    draft_probs = torch.stack([draft.first.expand(samples, -1), draft.second[x1]], dim=1)  # [B, 2, V]
    target_probs = torch.stack(
        [target.first.expand(samples, -1), target.second[x1], target.third[x1, x2]], dim=1
    )  # [B, 3, V]
    accepted_len, next_token = rule(torch.stack([x1, x2], dim=1), draft_probs, target_probs, generator)
    y1 = torch.where(accepted_len >= 1, x1, next_token)
    next_round = torch.multinomial(target.second[y1], 1, generator=generator).squeeze(-1)
    y2 = torch.where(accepted_len >= 2, x2, torch.where(accepted_len == 1, next_token, next_round))
    return y1.numpy(), y2.numpy()


@pytest.fixture(scope="module", params=[1.0, 0.9], ids=["temperature-1", "top-p-0.9"])
def model_pair(
    request: pytest.FixtureRequest, small_target_dir: Path, small_draft_dir: Path, char_tokenizer: Any
) -> tuple[TwoStepDistributions, TwoStepDistributions]:
    config = ProcessingConfig(top_p=request.param)
    prompt_ids = char_tokenizer("abcab").input_ids
    return TwoStepDistributions(small_target_dir, prompt_ids, config), TwoStepDistributions(
        small_draft_dir, prompt_ids, config
    )


SAMPLES = 200_000


def test_speculative_sampling_follows_target_distribution(
    model_pair: tuple[TwoStepDistributions, TwoStepDistributions],
) -> None:
    target, draft = model_pair
    vocab = target.first.shape[0]
    assert float((target.first - draft.first).abs().sum()) > 0.2, "the draft must differ from the target"
    y1, y2 = speculate_two_tokens(target, draft, accept_drafts, SAMPLES, seed=0)
    first = np.bincount(y1, minlength=vocab)
    joint = np.bincount(y1 * vocab + y2, minlength=vocab * vocab)
    expected_joint = (target.first[:, None] * target.second).numpy()  # [V, V]
    p_first = chi_square_pvalue(first, target.first.numpy())
    p_joint = chi_square_pvalue(joint, expected_joint)
    print(f"first token p={p_first:.4f}, first two tokens p={p_joint:.4f}")
    assert p_first > ALPHA and p_joint > ALPHA


@pytest.mark.parametrize("rule", [always_accept, resample_from_target])
def test_wrong_acceptance_rules_fail_the_same_test(
    model_pair: tuple[TwoStepDistributions, TwoStepDistributions], rule: Rule
) -> None:
    target, draft = model_pair
    vocab = target.first.shape[0]
    y1, _ = speculate_two_tokens(target, draft, rule, SAMPLES, seed=0)
    p_first = chi_square_pvalue(np.bincount(y1, minlength=vocab), target.first.numpy())
    print(f"{rule.__name__}: first token p={p_first:.3g}")
    assert p_first < ALPHA


# -- sampled, end to end over gRPC ---------------------------------------------------------------

E2E_CONCURRENCY = 32
# Generations per end-to-end test: the expected count of every token the target gives ≥ 1% is
# ≥ 10, and what these tests guard (what crosses the wire, whose q, which rows roll back) breaks
# the distribution grossly; the rules' fine detail is the 200k-draw tests' above.
E2E_SAMPLES = 1000


async def _first_tokens(
    address: str, prompt: str, samples: int, count: int, **params: Any
) -> tuple[list[list[int]], int]:
    """The first `count` tokens of `samples` generations, and how many rounds were pipelined and
    how many copied from the history, all generations together."""
    async with AsyncClient(address) as client:
        gate = asyncio.Semaphore(E2E_CONCURRENCY)

        async def one(seed: int) -> tuple[list[int], int]:
            async with gate:
                result = await client.generate(prompt, strategy="speculative", seed=seed, ignore_eos=True, **params)
                return result.token_ids[:count], (result.stats.pipelined_rounds, result.stats.lookup_rounds)

        runs = await asyncio.gather(*(one(seed) for seed in range(samples)))
        return [tokens for tokens, _ in runs], tuple(int(sum(column)) for column in zip(*(rounds for _, rounds in runs), strict=True))


@pytest.mark.parametrize(
    ("stack_name", "prompt", "gamma", "samples", "count"),
    [
        # γ = 2 and three tokens: token 1 is an accepted draft or a correction; token 2 an accepted
        # draft, a correction, a bonus, or the next round's after both sessions rolled back.
        ("small_stack", "abcab", 2, E2E_SAMPLES, 2),
        # The n-gram drafter's proposals carry no q: the orchestrator's one-hot q must stay exact.
        ("small_ngram_stack", "abcabcab", 1, E2E_SAMPLES, 2),
        # γ = 1, four tokens: when token 1 is accepted and the bonus equals the draft's guess,
        # token 3 comes from the round proposed during the first verification (pipelined).
        ("small_stack", "abcab", 1, E2E_SAMPLES, 3),
        # Auto γ (0): its γ, and its target-only rounds, follow timings; the output must not.
        # Untimed services, so that the first round speculates.
        ("small_untimed_stack", "abcab", 0, E2E_SAMPLES, 3),
        # A model draft with rounds copied from the history (`lookup_min_ngram`, on by default):
        # "ab" recurs, so the first round's drafts are copies with a one-hot q.
        ("small_stack", "abcab", 2, E2E_SAMPLES, 3),
    ],
    ids=["model-draft", "ngram-draft", "pipelined", "auto-gamma", "model-and-lookup"],
)
def test_speculative_generation_follows_target_distribution_over_grpc(
    request: pytest.FixtureRequest,
    stack_name: str,
    prompt: str,
    gamma: int,
    samples: int,
    count: int,
    small_target_dir: Path,
    char_tokenizer: Any,
) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    params = {"temperature": 1.0, "num_speculative_tokens": gamma, "max_new_tokens": max(gamma, 1) + count}
    if request.node.callspec.id != "model-and-lookup":
        params["lookup_min_ngram"] = 0  # every round the model's (or the n-gram drafter's)
    tokens, (pipelined, copied) = asyncio.run(_first_tokens(stack.address, prompt, samples, count, **params))
    outputs = np.array(tokens)
    if request.node.callspec.id == "pipelined":
        assert pipelined > 0, "no round came from a pipelined proposal"
    assert (copied > 0) == (request.node.callspec.id == "model-and-lookup"), copied
    target = TwoStepDistributions(small_target_dir, char_tokenizer(prompt).input_ids, ProcessingConfig())
    vocab = target.first.shape[0]
    marginals = [target.first, target.first @ target.second]  # p(x1), Σ_x1 p(x1) p(· | x1)
    joint = target.first[:, None] * target.second  # [V, V]: p(x1, x2)
    marginals.append(torch.einsum("ab,abc->c", joint, target.third))  # Σ p(x1, x2) p(· | x1, x2)
    pvalues = [
        chi_square_pvalue(np.bincount(outputs[:, i], minlength=vocab), marginals[i].numpy()) for i in range(count)
    ]
    print(f"{stack_name} γ={gamma}: {samples} generations, per-position p = {[round(p, 4) for p in pvalues]}")
    assert min(pvalues) > ALPHA


def _assert_first_two_tokens_follow_the_target(
    stack: Stack, target_dir: Path, char_tokenizer: Any, label: str, **params: Any
) -> None:
    """E2E_SAMPLES seeded generations from "abcab": the first token and the second token's marginal
    each pass the chi-square test against the target's own distributions."""
    tokens, _ = asyncio.run(_first_tokens(stack.address, "abcab", E2E_SAMPLES, 2, **params))
    outputs = np.array(tokens)
    target = TwoStepDistributions(target_dir, char_tokenizer("abcab").input_ids, ProcessingConfig())
    vocab = target.first.shape[0]
    p_first = chi_square_pvalue(np.bincount(outputs[:, 0], minlength=vocab), target.first.numpy())
    p_second = chi_square_pvalue(np.bincount(outputs[:, 1], minlength=vocab), (target.first @ target.second).numpy())
    print(f"{label}: first token p={p_first:.4f}, second token p={p_second:.4f}")
    assert p_first > ALPHA and p_second > ALPHA


def test_a_draft_proposing_from_its_top_k_keeps_the_target_distribution(
    small_stack: Stack, small_target_dir: Path, char_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled rounds draw drafts from the draft's top k, renormalised (sent sparse); with k = 4 of
    20 tokens, q is far from the draft's full distribution, and the output must still be p's."""
    monkeypatch.setattr(speculative, "DRAFT_TOP_K", 4)  # the orchestrator runs in this process
    params = {"temperature": 1.0, "num_speculative_tokens": 2, "max_new_tokens": 3}
    _assert_first_two_tokens_follow_the_target(small_stack, small_target_dir, char_tokenizer, "draft top-4", **params)


def test_the_dense_protocol_keeps_the_target_distribution(
    small_stack: Stack, small_target_dir: Path, char_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a target without `Step.verify`, p comes back and the orchestrator decides: the
    same rule, so the same distribution (the other gRPC tests decide in the target)."""
    monkeypatch.setattr(speculative, "VERIFY_IN_TARGET", False)  # the orchestrator runs in this process
    params = {"temperature": 1.0, "num_speculative_tokens": 2, "max_new_tokens": 3}
    _assert_first_two_tokens_follow_the_target(small_stack, small_target_dir, char_tokenizer, "dense protocol", **params)
