"""Token trees from the draft (`draft_alternatives`): the draft returns its runners-up at each
drafted position (`Step.propose_alternatives`), the target verifies them beside the chain in one
tree forward, and greedy output stays target-only greedy's.

- The runners-up are the draft's next-best ids, as its own teacher-forced logits rank them
  (trimmed drafts too: target ids), and asking for them changes no drafted token.
- `DraftTree`: layout and the greedy rule from the root, a runner-up taken where the chain missed.
- Where runners-up stand: E of a tree round against its exact enumeration, and the depths chosen
  from the verification's cost curve (all where extra positions are free, none where dear).
- Over gRPC, runners-up at every depth (`all_depths`): greedy equality at fixed and auto γ, with
  penalties, near the context's end, and for concurrent sessions; bad values are
  INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from specwire.client import Client, GenerationError
from specwire.draft_service.ngram import NgramDrafter
from specwire.orchestrator.speculative import DraftTree, Proposal
from specwire.orchestrator.speedup import (
    RunningEstimates,
    best_tree_depths,
    expected_tokens_per_round,
    tree_tokens_per_round,
)

from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.errors import InvalidArgument
from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest
from tests.harness import Stack
from tests.test_speculative_integration import PROMPT, check_stats_add_up
from tests.test_trimmed_vocab import trimmed_draft_dir, trimmed_stack  # noqa: F401 (fixtures)

pytest_plugins = ["tests.spec_fixtures"]

PROMPTS = [PROMPT, "def add(a, b):\n    return", "import os\nimport sys\n"]


@pytest.fixture
def all_depths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runners-up at every depth, whatever the costs (the orchestrators here run in this process)."""
    monkeypatch.setattr(RunningEstimates, "tree_depths", lambda self, gamma, alternatives: gamma)


def draft_engine(path: Path) -> Engine:
    return Engine(CausalLM.load(str(path), device="cpu", dtype="float32"), "draft", EngineLimits(compile="off"))


@pytest.mark.parametrize("draft", ["llama_draft_dir", "trimmed_draft_dir"])
def test_runners_up_are_the_drafts_next_best_ids_and_change_no_draft(request: pytest.FixtureRequest, draft: str) -> None:
    engine = draft_engine(request.getfixturevalue(draft))
    prompt = [3, 5, 7, 2, 9]

    def propose(alternatives: int) -> tuple[list[int], torch.Tensor | None]:
        session = engine.new_session()
        try:
            session.open(OpenRequest(prompt_ids=prompt))
            result = session.step(StepRequest(propose=5, propose_greedy=True, propose_alternatives=alternatives))
        finally:
            session.close()
        assert result.proposed_ids is not None
        return result.proposed_ids[0].tolist(), result.alternative_ids

    chain, none = propose(0)
    drafted, alternatives = propose(3)
    assert none is None and drafted == chain
    assert alternatives is not None and alternatives.shape == (1, 5, 3)
    session = engine.new_session()  # the oracle: the same draft's logits, teacher-forced over the chain
    try:
        sequence = prompt + drafted
        opened = session.open(OpenRequest(prompt_ids=sequence, scoring=Scoring(ScoreKind.LOGITS, positions=len(sequence))))
    finally:
        session.close()
    assert opened.scores is not None and opened.scores.dense is not None
    logits = opened.scores.dense[len(prompt) - 1 : -1]  # [5, V]: the positions that drew the chain
    ranked = logits.topk(4, dim=-1).indices  # the drawn id, then its runners-up
    assert ranked[:, 0].tolist() == drafted
    assert alternatives[0].tolist() == ranked[:, 1:].tolist()


def test_runners_up_need_greedy_proposals_and_a_bound(llama_draft_dir: Path) -> None:
    engine = draft_engine(llama_draft_dir)
    session = engine.new_session()
    try:
        session.open(OpenRequest(prompt_ids=[3, 5, 7]))
        for step in (StepRequest(propose=2, propose_alternatives=1),  # sampled proposals
                     StepRequest(propose=2, propose_greedy=True, propose_alternatives=9),
                     StepRequest(propose=2, propose_greedy=True, propose_alternatives=-1)):
            with pytest.raises(InvalidArgument, match="propose_alternatives"):
                session.step(step)
        assert session.step(StepRequest(propose=2, propose_greedy=True, propose_alternatives=8)).alternative_ids is not None
    finally:
        session.close()


def test_the_ngram_drafter_refuses_runners_up(llama_target_dir: Path) -> None:
    session = NgramDrafter.load(str(llama_target_dir), 3, 1).new_session()
    session.open(OpenRequest(prompt_ids=[3, 5, 7, 3, 5]))
    with pytest.raises(InvalidArgument, match="propose_alternatives"):
        session.step(StepRequest(propose=2, propose_greedy=True, propose_alternatives=1))


def test_a_draft_tree_keeps_a_runner_up_where_the_chain_missed() -> None:
    # Trunk [40, 41] (41 the root); chain 10, 11, 12; runners-up 20 | 21 | 22, 23.
    proposal = Proposal([10, 11, 12], alternatives=[[20], [21], [22, 23]])
    assert DraftTree.build([41], proposal, depths=1).tokens == [41, 10, 11, 12, 20]  # runners-up at depth 1 only
    tree = DraftTree.build([40, 41], proposal, depths=3)
    assert tree.tokens == [40, 41, 10, 11, 12, 20, 21, 22, 23]
    assert tree.parents == [-1, 0, 1, 2, 3, 1, 2, 3, 3]
    assert (tree.root, tree.chain_end) == (1, 5)
    argmax = torch.full((9,), 99)
    argmax[0] = 7  # the trunk is decided: its own argmax does not matter
    argmax[1], argmax[2] = 10, 21  # the chain's 10, then the runner-up 21 beside 11
    argmax[6] = 55  # the next token after 21
    assert tree.decide(argmax) == ([0, 1, 2, 6], 1, 55)
    argmax[2], argmax[3], argmax[4] = 11, 12, 66  # the whole chain, then the bonus
    assert tree.decide(argmax) == ([0, 1, 2, 3, 4], 3, 66)
    argmax[1] = 5  # nothing at depth 1: the correction
    assert tree.decide(argmax) == ([0, 1], 0, 5)


def test_tree_tokens_per_round_is_the_enumerated_expectation() -> None:
    alpha, gamma, rescue = 0.7, 4, 0.3
    for depths in range(gamma + 1):
        expected = 0.0  # enumerate: the chain accepts j drafts, then misses at depth j + 1 or ends
        for accepted in range(gamma + 1):
            chance = alpha**accepted * ((1 - alpha) if accepted < gamma else 1.0)
            rescued = rescue if accepted < min(depths, gamma) else 0.0
            expected += chance * (accepted + 1 + rescued)
        assert tree_tokens_per_round(alpha, gamma, rescue, depths) == pytest.approx(expected)
    assert tree_tokens_per_round(alpha, gamma, rescue, 0) == pytest.approx(expected_tokens_per_round(alpha, gamma))


def test_runners_up_stand_where_their_positions_pay() -> None:
    def flat(positions: int) -> float:
        return 10.0

    def dear(positions: int) -> float:
        return 10.0 * positions

    assert best_tree_depths(0.7, 4, 0.3, 2, 5.0, flat) == 4  # extra positions cost nothing: every depth
    assert best_tree_depths(0.7, 4, 0.3, 2, 5.0, dear) == 0  # each costs what a decode step does: none
    assert best_tree_depths(0.7, 4, 0.0, 2, 5.0, flat) == 0  # runners-up never taken: none

    def knee(positions: int) -> float:  # a CPU's curve: cheap up to 7 positions, dear past them
        return 10.0 + 0.2 * min(positions, 7) + 3.0 * max(0, positions - 7)

    assert best_tree_depths(0.7, 4, 0.4, 1, 5.0, knee) == 2  # the shallow depths, which most rounds reach


def generate(stack: Stack, prompt: str, **params: Any) -> Any:
    return Client(stack.address).generate(prompt, max_new_tokens=40, ignore_eos=True, **params)


@pytest.mark.parametrize("stack_name", ["llama_stack", "demo_stack", "trimmed_stack"])
@pytest.mark.parametrize("gamma", [4, None], ids=["gamma4", "auto"])
@pytest.mark.usefixtures("all_depths")
def test_draft_trees_keep_greedy_output(request: pytest.FixtureRequest, stack_name: str, gamma: int | None) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    # Copied rounds (`lookup_min_ngram`) are chains: off, so that every round is the draft's.
    fixed = {"num_speculative_tokens": gamma, "lookup_min_ngram": 0} if gamma else {}
    trees = 0
    for prompt in PROMPTS:
        expected = generate(stack, prompt, strategy="greedy").token_ids
        for alternatives in (1, 3):
            result = generate(stack, prompt, strategy="speculative", draft_alternatives=alternatives, **fixed)
            assert result.token_ids == expected, (prompt, alternatives)
            check_stats_add_up(result.stats, untrimmed=True)
            trees += result.stats.medusa_tree_size > 0
    if gamma:  # at a fixed γ every round drafts, so every round is a tree
        assert trees == 2 * len(PROMPTS)


@pytest.mark.parametrize("gamma", [4, None], ids=["gamma4", "auto"])
def test_runners_up_placed_by_the_costs_keep_greedy_output(demo_stack: Stack, gamma: int | None) -> None:
    fixed = {"num_speculative_tokens": gamma} if gamma else {}
    for prompt in PROMPTS:
        expected = generate(demo_stack, prompt, strategy="greedy").token_ids
        result = generate(demo_stack, prompt, strategy="speculative", draft_alternatives=2, **fixed)
        assert result.token_ids == expected
        check_stats_add_up(result.stats, untrimmed=True)


@pytest.mark.usefixtures("all_depths")
def test_draft_trees_take_more_tokens_a_round_than_the_chain(demo_stack: Stack) -> None:
    """The demo draft's runners-up are often the target's token where its first choice is not."""
    chain = tree = 0.0
    for prompt in PROMPTS:
        chain += generate(demo_stack, prompt, strategy="speculative", num_speculative_tokens=4).stats.tokens_per_target_forward
        tree += generate(demo_stack, prompt, strategy="speculative", num_speculative_tokens=4,
                         draft_alternatives=3).stats.tokens_per_target_forward
    assert tree > chain


@pytest.mark.parametrize("processors", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}])
@pytest.mark.usefixtures("all_depths")
def test_draft_trees_with_penalties_keep_greedy_output(llama_stack: Stack, processors: dict[str, Any]) -> None:
    expected = generate(llama_stack, PROMPT, strategy="greedy", **processors).token_ids
    result = generate(llama_stack, PROMPT, strategy="speculative", num_speculative_tokens=3, draft_alternatives=2,
                      **processors)
    assert result.token_ids == expected


@pytest.mark.usefixtures("all_depths")
def test_a_tree_past_the_context_falls_back_to_the_chain(small_stack: Stack) -> None:
    prompt = "abcdefghijklmnopqr" * 6 + "abcd"  # 112 of the 128 positions
    expected = Client(small_stack.address).generate(prompt, strategy="greedy", max_new_tokens=16, ignore_eos=True)
    result = Client(small_stack.address).generate(
        prompt, strategy="speculative", num_speculative_tokens=8, draft_alternatives=8, max_new_tokens=16, ignore_eos=True
    )
    assert result.token_ids == expected.token_ids
    check_stats_add_up(result.stats, untrimmed=True)


def test_sampled_rounds_verify_a_chain(llama_stack: Stack) -> None:
    params = {"strategy": "speculative", "num_speculative_tokens": 4, "temperature": 0.8, "seed": 5}
    chain = generate(llama_stack, PROMPT, **params)
    result = generate(llama_stack, PROMPT, draft_alternatives=2, **params)
    assert result.token_ids == chain.token_ids and result.stats.medusa_tree_size == 0


@pytest.mark.usefixtures("all_depths")
def test_concurrent_draft_trees_equal_their_solo_runs(demo_stack: Stack) -> None:
    params = {"strategy": "speculative", "num_speculative_tokens": 4, "draft_alternatives": 2}
    solo = [generate(demo_stack, prompt, **params).token_ids for prompt in PROMPTS * 2]
    with ThreadPoolExecutor(len(solo)) as pool:
        together = list(pool.map(lambda prompt: generate(demo_stack, prompt, **params).token_ids, PROMPTS * 2))
    assert together == solo


@pytest.mark.parametrize("params", [{"draft_alternatives": 9}, {"draft_alternatives": -1}])
def test_bad_draft_alternatives_are_invalid_arguments_naming_the_field(llama_stack: Stack, params: dict[str, Any]) -> None:
    with pytest.raises(GenerationError) as error:
        generate(llama_stack, PROMPT, strategy="speculative", **params)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "draft_alternatives" in error.value.message
