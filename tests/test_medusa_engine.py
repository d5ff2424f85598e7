"""Tree verification in the engine: every node's logits equal a plain forward over its own path,
and keeping a path compacts its KV so later steps equal a fresh prefill (Llama and GPT-2, on the
batching engine and on `--engine hf`); greedy rounds decided in the service, several to a
message (`tree_rounds`), continue target greedy within their budget and the context."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.errors import InvalidArgument
from specwire.medusa import build_tree, cut_tree, tree_path, tree_tokens
from specwire.session import Extras, OpenRequest, ScoreKind, Scores, Scoring, StepRequest, Verification
from tests.conftest import hf_model
from tests.medusa_tiny import medusa_engine

pytest_plugins = ["tests.medusa_fixtures"]

PROMPT = [5, 17, 42, 9, 33, 71]
TREE = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
NODES = [11, 12, 13, 14, 15, 16, 17, 18]  # any tokens: the root then one per choice


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_and_heads(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return request.getfixturevalue(f"{request.param}_target_dir"), request.getfixturevalue(f"{request.param}_heads_dir")


@pytest.fixture(params=[True, False], ids=["batched", "hf"])
def batching(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_tree_logits_equal_each_paths_plain_forward(model_and_heads: tuple[Path, Path], batching: bool) -> None:
    model_dir, heads_dir = model_and_heads
    engine = medusa_engine(model_dir, heads_dir, batching)
    assert engine.batches == batching
    reference: Any = hf_model(model_dir)
    session = engine.new_session()
    session.open(OpenRequest(PROMPT))
    result = session.step(
        StepRequest(
            append_ids=NODES,
            tree_parents=TREE.parents,
            scoring=Scoring(ScoreKind.LOGITS, positions=len(NODES), medusa_top_k=3),
        )
    )
    assert result.scores is not None and result.scores.dense is not None and result.medusa_ids is not None
    assert result.timing.forward_calls == 1  # the uncached prompt as a chain, then the tree: one forward
    assert result.medusa_ids.shape == (len(NODES), 3, 3)
    for node in range(len(NODES)):
        path = [NODES[i] for i in tree_path(TREE.parents, node)]
        with torch.no_grad():
            hidden = reference.base_model(torch.tensor([PROMPT + path])).last_hidden_state[0, -1]
            expected = reference.get_output_embeddings()(hidden)
            heads = engine.lm.medusa(hidden).topk(3, dim=-1).indices  # type: ignore[misc]
        torch.testing.assert_close(result.scores.dense[node], expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(result.medusa_ids[node].long(), heads)


@pytest.mark.parametrize("kept_node", [7, 6, 0])  # root → (0) → (0, 0) → (0, 0, 0); root → (1) → (1, 0); root
@pytest.mark.parametrize("scored", [True, False], ids=["scored", "unscored"])
def test_kept_path_continues_like_a_fresh_prefill(
    model_and_heads: tuple[Path, Path], batching: bool, scored: bool, kept_node: int
) -> None:
    model_dir, heads_dir = model_and_heads
    engine = medusa_engine(model_dir, heads_dir, batching)
    session = engine.new_session()
    session.open(OpenRequest(PROMPT))
    scoring = Scoring(ScoreKind.ARGMAX, positions=len(NODES)) if scored else Scoring(ScoreKind.NONE)
    session.step(StepRequest(append_ids=NODES, tree_parents=TREE.parents, scoring=scoring))
    kept = tree_path(TREE.parents, kept_node)
    after = session.step(
        StepRequest(tree_keep=kept, append_ids=[3, 4], scoring=Scoring(ScoreKind.LOGITS, positions=2))
    )
    fresh = engine.new_session()
    expected = fresh.open(
        OpenRequest(PROMPT + [NODES[i] for i in kept] + [3, 4], scoring=Scoring(ScoreKind.LOGITS, positions=2))
    )
    assert after.num_tokens == len(PROMPT) + len(kept) + 2
    assert after.timing.forward_calls == 1  # the kept nodes stayed cached
    assert after.scores is not None and expected.scores is not None
    torch.testing.assert_close(after.scores.dense, expected.scores.dense, atol=1e-4, rtol=1e-4)


def test_bad_trees_are_refused(llama_target_dir: Path, llama_heads_dir: Path) -> None:
    session = medusa_engine(llama_target_dir, llama_heads_dir).new_session()
    session.open(OpenRequest(PROMPT))
    with pytest.raises(InvalidArgument, match="tree_parents"):
        session.step(StepRequest(append_ids=[1, 2], tree_parents=[-1, 1]))
    with pytest.raises(InvalidArgument, match="tree_parents"):
        session.step(StepRequest(append_ids=[1, 2], tree_parents=[-1]))
    with pytest.raises(InvalidArgument, match="tree_keep"):
        session.step(StepRequest(tree_keep=[0]))
    session.step(StepRequest(append_ids=NODES, tree_parents=TREE.parents))
    with pytest.raises(InvalidArgument, match="tree_keep"):
        session.step(StepRequest(tree_keep=[0, 2, 4]))  # 4's parent is 1, not 2


def test_tree_topk_builds_the_heads_tree_at_the_kept_node(model_and_heads: tuple[Path, Path], batching: bool) -> None:
    """Heads applied by the service at the last committed token (one row) give the tree the
    orchestrator would build from `medusa_ids` of every node."""
    engine = medusa_engine(*model_and_heads, batching)
    reference = engine.new_session().open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, 1, medusa_top_k=3)))
    assert reference.medusa_ids is not None
    session = engine.new_session()
    session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    topk = TREE.topk_index.tolist()
    first = session.step(
        StepRequest(
            append_ids=[11],
            tree_parents=TREE.parents,
            tree_topk=topk,
            scoring=Scoring(ScoreKind.ARGMAX, positions=TREE.size, medusa_top_k=3),
        )
    )
    assert first.tree_ids is not None and first.medusa_ids is not None
    assert first.tree_ids.tolist() == tree_tokens(TREE, 11, reference.medusa_ids[0])
    kept = tree_path(TREE.parents, 4)  # root → (0) → (0, 1)
    second = session.step(
        StepRequest(tree_keep=kept, append_ids=[7], tree_parents=TREE.parents, tree_topk=topk, scoring=Scoring(ScoreKind.ARGMAX, positions=TREE.size))
    )
    assert second.tree_ids is not None
    assert second.tree_ids.tolist() == tree_tokens(TREE, 7, first.medusa_ids[4])


def test_tree_topk_needs_heads_and_a_scored_last_token(
    llama_target_dir: Path, llama_heads_dir: Path
) -> None:
    engine = medusa_engine(llama_target_dir, llama_heads_dir)
    session = engine.new_session()
    session.open(OpenRequest(PROMPT))  # not scored: no hidden state kept
    tree = {"append_ids": [11], "tree_parents": TREE.parents, "tree_topk": TREE.topk_index.tolist()}
    with pytest.raises(InvalidArgument, match="^tree_topk: no hidden state"):
        session.step(StepRequest(**tree))  # type: ignore[arg-type]
    session.step(StepRequest(scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    with pytest.raises(InvalidArgument, match="^tree_topk: needs the root alone"):
        session.step(StepRequest(**(tree | {"append_ids": [11, 12]})))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="^tree_parents: one root"):
        session.step(StepRequest(append_ids=[11], tree_parents=[-1, 0, 1, 2, 3], tree_topk=[0, 0, 0, 0]))
    plain = Engine(CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32"), "target").new_session()
    plain.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    with pytest.raises(InvalidArgument, match="^tree_topk: this service has no Medusa heads"):
        plain.step(StepRequest(**tree))  # type: ignore[arg-type]


def test_entropix_metrics_on_a_service_with_heads_equal_a_plain_service(
    model_and_heads: tuple[Path, Path], batching: bool
) -> None:
    """A one-branch step on a service with heads takes the hidden-keeping forward (for
    `tree_topk`); the entropix metrics it returns must equal those of the same model without heads."""
    model_dir, heads_dir = model_and_heads
    with_heads = medusa_engine(model_dir, heads_dir, batching)
    plain = Engine(CausalLM.load(str(model_dir), device="cpu", dtype="float32"), "target",
                   EngineLimits(batching=batching))
    steps = [
        (PROMPT, Scoring(ScoreKind.PROBS, positions=2, extras=Extras(entropy=True, varentropy=True))),
        ([7, 8, 9], Scoring(ScoreKind.ARGMAX, positions=3, extras=Extras(entropy=True, varentropy=True))),
        ([4], Scoring(ScoreKind.ARGMAX, positions=2, extras=Extras(True, True, attention_stats=True))),
    ]
    results = []
    for engine in (with_heads, plain):
        session = engine.new_session()
        ids, scoring = steps[0]
        replies = [session.open(OpenRequest(ids, scoring=scoring))]
        replies += [session.step(StepRequest(append_ids=ids, scoring=scoring)) for ids, scoring in steps[1:]]
        results.append(replies)
    for ours, theirs in zip(*results, strict=True):
        assert ours.scores is not None and theirs.scores is not None
        mine, reference = ours.scores.metrics, theirs.scores.metrics
        assert mine is not None and reference is not None
        torch.testing.assert_close(mine.entropy, reference.entropy, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.varentropy, reference.varentropy, atol=1e-4, rtol=1e-4)
        assert (mine.attention is None) == (reference.attention is None)
        if mine.attention is not None and reference.attention is not None:
            torch.testing.assert_close(mine.attention.entropy, reference.attention.entropy, atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidArgument, match="scoring.extras.attention_stats"):
        session = with_heads.new_session()
        session.open(OpenRequest(PROMPT))
        session.step(
            StepRequest(append_ids=[3], scoring=Scoring(ScoreKind.ARGMAX, positions=1, medusa_top_k=2,
                                                        extras=Extras(attention_stats=True)))
        )


def _greedy_reference(engine: Engine, prompt: list[int], count: int) -> list[int]:
    """`count` tokens of plain greedy decoding on the same engine (`propose`)."""
    session = engine.new_session()
    first = session.open(OpenRequest(prompt, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    assert first.scores is not None and first.scores.argmax_ids is not None
    token = int(first.scores.argmax_ids[0])
    rest = session.step(StepRequest(append_ids=[token], propose=count - 1, propose_greedy=True, propose_ids_only=True))
    assert rest.proposed_ids is not None
    return [token, *rest.proposed_ids[0].tolist()]


@pytest.mark.parametrize("plan", [[(1, 29), (2, 29), (4, 7), (64, 5), (64, 20)], [(64, 29)]], ids=["doubling", "one"])
def test_tree_rounds_decide_target_greedy_within_their_budget(
    model_and_heads: tuple[Path, Path], batching: bool, plan: list[tuple[int, int]]
) -> None:
    """Greedy rounds decided in the service, several to a message, continue target greedy
    exactly; a message decides at most `tree_max_tokens`, its later trees cut to what is left,
    each rooted at the token decided before it; the next message keeps the last round's path."""
    engine = medusa_engine(*model_and_heads, batching)
    total = 30
    expected = _greedy_reference(engine, PROMPT, total)
    session = engine.new_session()
    first = session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    assert first.scores is not None and first.scores.argmax_ids is not None
    decided, kept, topk = [int(first.scores.argmax_ids[0])], list[int](), TREE.topk_index.tolist()
    for rounds, most in plan:
        budget = min(most, total - len(decided))
        if budget <= 0:
            break
        parents, cut = cut_tree(TREE.parents, topk, min(3, budget - 1))
        result = session.step(
            StepRequest(
                tree_keep=kept, append_ids=[decided[-1]], tree_parents=parents, tree_topk=cut,
                scoring=Scoring(ScoreKind.ARGMAX, positions=len(parents)), verify=Verification(Scores(ScoreKind.PROBS), 0),
                tree_rounds=rounds, tree_max_tokens=budget,
            )
        )
        verdicts = result.round_verdicts
        assert result.verdict is None and 1 <= len(verdicts) <= rounds
        assert result.timing.forward_calls == len(verdicts)
        assert result.tree_ids is not None
        ids, offset, new = result.tree_ids.tolist(), 0, list[int]()
        for verdict in verdicts:
            assert verdict.tree_nodes == len(cut_tree(TREE.parents, topk, min(3, budget - len(new) - 1))[0])
            nodes = ids[offset : offset + verdict.tree_nodes]
            offset += verdict.tree_nodes
            assert nodes[0] == (decided + new)[-1]
            new += [nodes[i] for i in verdict.tree_path[1:]] + [verdict.next_token]
        assert offset == len(ids)
        assert len(new) <= budget and (len(verdicts) == rounds or len(new) == budget)
        decided += new
        kept = list(verdicts[-1].tree_path)
    assert decided == expected


def test_tree_rounds_stop_at_the_context(llama_target_dir: Path, llama_heads_dir: Path) -> None:
    session = medusa_engine(llama_target_dir, llama_heads_dir, max_cache_len=len(PROMPT) + 12).new_session()
    first = session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    assert first.scores is not None and first.scores.argmax_ids is not None
    result = session.step(
        StepRequest(
            append_ids=[int(first.scores.argmax_ids[0])], tree_parents=TREE.parents, tree_topk=TREE.topk_index.tolist(),
            scoring=Scoring(ScoreKind.ARGMAX, positions=TREE.size), verify=Verification(Scores(ScoreKind.PROBS), 0),
            tree_rounds=64,
        )
    )
    # Up to the context's last position, whose logits decide one token more (as `max_context` allows).
    assert 1 + sum(len(verdict.tree_path) for verdict in result.round_verdicts) == 12 + 1
    assert result.round_verdicts[-1].tree_nodes < TREE.size  # cut to the room left


def test_bad_tree_rounds_are_refused(llama_target_dir: Path, llama_heads_dir: Path) -> None:
    session = medusa_engine(llama_target_dir, llama_heads_dir).new_session()
    session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    greedy = Verification(Scores(ScoreKind.PROBS), 0)
    tree = StepRequest(
        append_ids=[11], tree_parents=TREE.parents, tree_topk=TREE.topk_index.tolist(),
        scoring=Scoring(ScoreKind.ARGMAX, positions=TREE.size), verify=greedy, tree_rounds=2,
    )
    cases = [
        (replace(tree, tree_rounds=65), "^tree_rounds: must be in"),
        (replace(tree, tree_rounds=-1), "^tree_rounds: must be in"),
        (replace(tree, verify=None), "^tree_rounds: more than one round needs"),
        (replace(tree, tree_topk=[], append_ids=NODES), "^tree_rounds: more than one round needs"),
        (replace(tree, tree_max_tokens=-3), "^tree_max_tokens"),
        (replace(tree, scoring=Scoring(ScoreKind.LOGITS, positions=TREE.size)), "^verify: a tree's verification"),
    ]
    for request, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            session.step(request)
    assert len(session.step(tree).round_verdicts) == 2  # the session still serves
