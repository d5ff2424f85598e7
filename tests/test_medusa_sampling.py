"""Medusa's acceptance rules and trees as pure functions, and lossless tree sampling end to end.

- Trees: `build_tree` lays out the reference's `medusa_choices` (parents, mask, depths, paths).
- Greedy and typical rules on hand-made trees; typical's bound is Medusa-2's formula.
- Lossless, pure: 200k draws through `accept_tree_sampled` on a real small model's distributions
  over a 3-wide, 2-deep tree; the first token, and the first two jointly, follow the target
  (chi-square, p > 0.001) at temperature 1 and with top-p 0.9. Two wrong rules fail it.
- Lossless, over gRPC: 1k generations at T = 0.7 with distinct seeds; the second and third
  tokens (the first two a tree verifies) follow the target's exact marginals.
- Lossless, two rounds in one message (`tree_rounds`): the two tokens after a root follow the
  target jointly; a second round rooted at the wrong token fails the same test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from specwire.client import AsyncClient, Client, GenerationError
from specwire.orchestrator.medusa import accept_tree_greedy, accept_tree_sampled, accept_tree_typical, typical_ok

from specwire.engine import Engine
from specwire.engine.session import EngineSession
from specwire.medusa import build_tree, tree_attention, tree_depths, tree_path
from specwire.processing import ProcessingConfig
from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, StepRequest, Verdict, Verification
from tests.goodness_of_fit import chi_square_pvalue
from tests.harness import Stack
from tests.medusa_tiny import medusa_engine
from tests.test_losslessness import E2E_SAMPLES, TwoStepDistributions

pytest_plugins = ["tests.spec_fixtures", "tests.medusa_fixtures"]

ALPHA = 1e-3
SAMPLES = 200_000


# -- trees -------------------------------------------------------------------------------------


def test_build_tree_lays_out_the_reference_choices() -> None:
    layout = build_tree([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert layout.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert layout.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert layout.position_offsets.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert layout.head_index.tolist() == [0, 0, 1, 1, 1, 2]
    assert layout.topk_index.tolist() == [0, 1, 0, 1, 0, 0]
    assert layout.top_k == 2 and layout.num_heads == 3
    assert layout.retrieve_paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]  # leaves 4, 5, 6
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node in range(7):
        expected[node, tree_path(layout.parents, node)] = True
    assert torch.equal(layout.attention, expected)
    assert torch.equal(tree_attention(layout.parents), expected)


def test_bad_choices_and_parents_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        build_tree([[0, 0]])
    with pytest.raises(ValueError, match="tree_parents"):
        tree_depths([-1, 2, 0])


# -- greedy and typical ------------------------------------------------------------------------

#        0 (root)
#      /   \
#     1:7   2:8
#     |      |
#     3:9   4:5
PARENTS = [-1, 0, 0, 1, 2]
TOKENS = torch.tensor([4, 7, 8, 9, 5])


def test_greedy_follows_the_targets_argmax_down_the_tree() -> None:
    assert accept_tree_greedy(TOKENS, PARENTS, torch.tensor([8, 0, 5, 0, 6])) == ([0, 2, 4], 6)
    assert accept_tree_greedy(TOKENS, PARENTS, torch.tensor([7, 3, 5, 0, 6])) == ([0, 1], 3)
    assert accept_tree_greedy(TOKENS, PARENTS, torch.tensor([2, 9, 5, 0, 6])) == ([0], 2)


def test_typical_bound_is_medusa2s_formula() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.97, 0.01, 0.01, 0.01]])
    entropy = [-(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)), 0.0]
    entropy[1] = -(0.97 * math.log(0.97) + 3 * 0.01 * math.log(0.01))
    bounds = [min(0.09, 0.3 * math.exp(-h)) for h in entropy]
    assert bounds[0] < 0.2 and bounds[1] > 0.01  # one token passes, one fails, by the formula
    got = typical_ok(probs, torch.tensor([2, 1]), 0.09, 0.3)
    assert got.tolist() == [True, False]


def test_typical_takes_the_longest_passing_path() -> None:
    vocab = 10
    probs = torch.full((5, vocab), 0.01)
    probs[0, 7], probs[0, 8] = 0.5, 0.41  # both depth-1 candidates pass at the root
    probs[1, 9] = 0.001  # … but only node 2's child passes below
    probs[2, 5] = 0.8
    probs = probs / probs.sum(dim=-1, keepdim=True)
    path, _ = accept_tree_typical(TOKENS, PARENTS, probs, 0.09, 0.3, torch.Generator().manual_seed(0))
    assert path == [0, 2, 4]


# -- lossless sampling, pure -------------------------------------------------------------------

Rule = Callable[[torch.Tensor, list[int], torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def accept_first_child(
    tokens: torch.Tensor, parents: list[int], node_probs: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: always take the first child, down to a leaf; bonus from the leaf."""
    node = 0
    while node + 1 < len(parents) and node in parents:
        node = parents.index(node)
    rows = torch.arange(node_probs.shape[0])
    last = torch.full((node_probs.shape[0],), node, dtype=torch.long)
    return last, torch.multinomial(node_probs[rows, last], 1, generator=generator).squeeze(-1)


def correction_from_p(
    tokens: torch.Tensor, parents: list[int], node_probs: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: after the children are rejected, the correction comes from p, not the residual."""
    last, _ = accept_tree_sampled(tokens, parents, node_probs, generator)
    rows = torch.arange(node_probs.shape[0])
    return last, torch.multinomial(node_probs[rows, last], 1, generator=generator).squeeze(-1)


def tree_two_tokens(target: TwoStepDistributions, rule: Rule, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One tree round per sample: the root is the prompt's last token, depth 1 holds the target's
    top-3 (in the order 2nd, 1st, 3rd), depth 2 the top-2 under the first two; the first two
    tokens out. A round yielding one token is followed by a draw from the target's conditional."""
    generator = torch.Generator().manual_seed(seed)
    ranked = target.first.argsort(descending=True).tolist()
    level1 = [ranked[1], ranked[0], ranked[2]]
    tokens, parents, node_probs = [0], [-1], [target.first]
    for token in level1:
        tokens.append(token)
        parents.append(0)
        node_probs.append(target.second[token])
    for parent in (1, 2):
        for token in target.second[tokens[parent]].argsort(descending=True)[:2].tolist():
            tokens.append(token)
            parents.append(parent)
            node_probs.append(target.third[tokens[parent], token])
    probs = torch.stack(node_probs)  # [n, V]
    node_tokens = torch.tensor(tokens)
    last, next_token = rule(node_tokens, parents, probs.expand(samples, -1, -1), generator)
    depth = torch.tensor(tree_depths(parents))[last]  # [B]
    first_of = torch.tensor([tree_path(parents, n)[1] if n else 0 for n in range(len(parents))])
    y1 = torch.where(depth >= 1, node_tokens[first_of[last]], next_token)
    next_round = torch.multinomial(target.second[y1], 1, generator=generator).squeeze(-1)
    y2 = torch.where(depth >= 2, node_tokens[last], torch.where(depth == 1, next_token, next_round))
    return y1.numpy(), y2.numpy()


@pytest.fixture(scope="module", params=[1.0, 0.9], ids=["temperature-1", "top-p-0.9"])
def target(request: pytest.FixtureRequest, small_target_dir: Path, char_tokenizer: Any) -> TwoStepDistributions:
    return TwoStepDistributions(small_target_dir, char_tokenizer("abcab").input_ids, ProcessingConfig(top_p=request.param))


def test_lossless_tree_sampling_follows_the_target(target: TwoStepDistributions) -> None:
    vocab = target.first.shape[0]
    y1, y2 = tree_two_tokens(target, accept_tree_sampled, SAMPLES, seed=0)
    p_first = chi_square_pvalue(np.bincount(y1, minlength=vocab), target.first.numpy())
    expected_joint = (target.first[:, None] * target.second).numpy()  # [V, V]
    p_joint = chi_square_pvalue(np.bincount(y1 * vocab + y2, minlength=vocab * vocab), expected_joint)
    print(f"first token p={p_first:.4f}, first two tokens p={p_joint:.4f}")
    assert p_first > ALPHA and p_joint > ALPHA


@pytest.mark.parametrize("rule", [accept_first_child, correction_from_p])
def test_wrong_tree_rules_fail_the_same_test(target: TwoStepDistributions, rule: Rule) -> None:
    vocab = target.first.shape[0]
    y1, _ = tree_two_tokens(target, rule, SAMPLES, seed=0)
    p_first = chi_square_pvalue(np.bincount(y1, minlength=vocab), target.first.numpy())
    print(f"{rule.__name__}: first token p={p_first:.3g}")
    assert p_first < ALPHA


# -- over gRPC -------------------------------------------------------------------------------


async def _first_tokens(address: str, prompt: str, samples: int, **params: Any) -> list[tuple[list[int], int]]:
    """Each generation's tokens and how many tree nodes it accepted."""
    async with AsyncClient(address) as client:
        gate = asyncio.Semaphore(32)

        async def one(seed: int) -> tuple[list[int], int]:
            async with gate:
                result = await client.generate(prompt, strategy="medusa", seed=seed, ignore_eos=True, **params)
                return result.token_ids, result.stats.accepted_tokens

        return list(await asyncio.gather(*(one(seed) for seed in range(samples))))


def test_lossless_medusa_follows_the_target_over_grpc(
    small_medusa_stack: Stack, small_target_dir: Path, char_tokenizer: Any
) -> None:
    prompt, samples = "abcab", E2E_SAMPLES
    wide = [[0], [1], [2], [3], [4], [5], [0, 0], [0, 1], [1, 0], [1, 1], [2, 0]]  # most of the mass is a candidate
    params = {"temperature": 0.7, "max_new_tokens": 3, "medusa_choices": wide}
    runs = asyncio.run(_first_tokens(small_medusa_stack.address, prompt, samples, **params))
    outputs = np.array([tokens for tokens, _ in runs])
    accepted = sum(count for _, count in runs)
    assert accepted > samples / 4  # candidates are often accepted, so the rule is exercised
    target = TwoStepDistributions(small_target_dir, char_tokenizer(prompt).input_ids, ProcessingConfig(temperature=0.7))
    vocab = target.first.shape[0]
    second = target.first @ target.second  # [V]: Σ_x p(x) p(· | x)
    third = torch.einsum("x,xy,xyz->z", target.first, target.second, target.third)  # [V]
    p_second = chi_square_pvalue(np.bincount(outputs[:, 1], minlength=vocab), second.numpy())
    p_third = chi_square_pvalue(np.bincount(outputs[:, 2], minlength=vocab), third.numpy())
    print(f"{samples} generations, {accepted} tree nodes accepted: second token p={p_second:.4f}, third p={p_third:.4f}")
    assert p_second > ALPHA and p_third > ALPHA


def test_typical_acceptance_runs_and_bad_requests_are_refused(small_medusa_stack: Stack, llama_stack: Stack) -> None:
    client = Client(small_medusa_stack.address)
    result = client.generate("abcab", strategy="medusa", temperature=0.7, medusa_acceptance="typical", seed=1,
                             max_new_tokens=20, ignore_eos=True)
    assert len(result.token_ids) == 20 and result.stats.accepted_tokens > 0
    cases: list[tuple[dict[str, Any], str]] = [
        ({"medusa_choices": "[[0, 0]]"}, "medusa_choices"),
        ({"medusa_choices": "not json"}, "medusa_choices"),
        ({"medusa_acceptance": "greedy"}, "medusa_acceptance"),
        ({"posterior_threshold": 0.0}, "posterior_threshold"),
    ]
    for params, field in cases:
        with pytest.raises(GenerationError, match=f"INVALID_ARGUMENT: {field}"):
            client.generate("abcab", strategy="medusa", **params)
    with pytest.raises(GenerationError, match="FAILED_PRECONDITION.*Medusa heads"):
        Client(llama_stack.address).generate("abc", strategy="medusa")


# -- rounds decided in the service, several to a message ---------------------------------------


def _two_tokens_in_one_message(engine: Engine, prompt: list[int], root: int, samples: int) -> np.ndarray:
    """[samples, 2]: the two tokens after `root` from one `tree_rounds` message each: a one-node
    tree (the heads' runner-up) at temperature 0.7 and a budget of two tokens, so a rejection is
    followed by a second round in the service, rooted at the token the first one drew."""
    tree = build_tree([[1]])
    out = []
    for seed in range(samples):
        session = engine.new_session()
        session.open(OpenRequest(prompt, ProcessingConfig(temperature=0.7), scoring=Scoring(ScoreKind.PROBS, positions=1)))
        result = session.step(
            StepRequest(
                append_ids=[root], tree_parents=tree.parents, tree_topk=tree.topk_index.tolist(),
                scoring=Scoring(ScoreKind.PROBS, positions=tree.size), verify=Verification(Scores(ScoreKind.PROBS), seed),
                tree_rounds=2, tree_max_tokens=2,
            )
        )
        assert result.tree_ids is not None
        ids, offset, tokens = result.tree_ids.tolist(), 0, []
        for verdict in result.round_verdicts:
            tokens += [ids[offset + i] for i in verdict.tree_path[1:]] + [verdict.next_token]
            offset += verdict.tree_nodes
        session.close()
        out.append(tokens)
    return np.array(out)


@pytest.fixture(scope="module")
def rounds_case(small_target_dir: Path, small_heads_dir: Path, char_tokenizer: Any) -> tuple[Engine, list[int], int, np.ndarray]:
    engine = medusa_engine(small_target_dir, small_heads_dir)
    prompt = char_tokenizer("abcab").input_ids
    root = int(TwoStepDistributions(small_target_dir, prompt, ProcessingConfig(temperature=0.7)).first.argmax())
    given_root = TwoStepDistributions(small_target_dir, [*prompt, root], ProcessingConfig(temperature=0.7))
    expected = (given_root.first[:, None] * given_root.second).numpy()  # [V, V]: p(x, y | prompt, root)
    return engine, prompt, root, expected


def test_sampled_rounds_in_one_message_follow_the_target(rounds_case: tuple[Engine, list[int], int, np.ndarray]) -> None:
    engine, prompt, root, expected = rounds_case
    vocab = expected.shape[0]
    tokens = _two_tokens_in_one_message(engine, prompt, root, E2E_SAMPLES)
    pvalue = chi_square_pvalue(np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab), expected)
    print(f"two tokens after the root from one message: p={pvalue:.4f}")
    assert pvalue > ALPHA


def test_a_second_round_at_the_wrong_root_fails_the_same_test(
    rounds_case: tuple[Engine, list[int], int, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the second round rooted at the first round's root, not at its draw."""
    engine, prompt, root, expected = rounds_case
    vocab = expected.shape[0]
    right = EngineSession._next_tree

    def wrong_root(self: EngineSession, request: StepRequest, verdict: Verdict, decided: int) -> bool:
        return right(self, request, dataclasses.replace(verdict, next_token=request.append_ids[0]), decided)

    monkeypatch.setattr(EngineSession, "_next_tree", wrong_root)
    tokens = _two_tokens_in_one_message(engine, prompt, root, E2E_SAMPLES)
    pvalue = chi_square_pvalue(np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab), expected)
    print(f"second round at the wrong root: p={pvalue:.3g}")
    assert pvalue < ALPHA
