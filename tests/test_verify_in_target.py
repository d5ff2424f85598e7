"""Sampled rounds decided in the target (`Step.verify`): the same decision as the pure function on
the target's own p, for a chain of drafts and for a tree of candidates (Medusa), clear errors for
a malformed q, and kilobytes on the wire at a 262k vocabulary. The distribution tests over gRPC
(tests/test_losslessness.py, tests/test_medusa_sampling.py) run through this path too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from specwire.client import Client
from specwire.orchestrator import speculative
from specwire.orchestrator.speculative import sparse_draft_probs
from specwire.v1 import common_pb2, model_pb2, model_pb2_grpc
from transformers import LlamaConfig, LlamaForCausalLM

from specwire import acceptance
from specwire.acceptance import accept_draft, accept_tree_sampled
from specwire.engine import CausalLM, Engine
from specwire.engine import session as engine_session
from specwire.errors import InvalidArgument
from specwire.medusa import tree_path
from specwire.processing import ProcessingConfig
from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, StepRequest, Verification
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator
from tests.spec_fixtures import build_char_tokenizer

PROMPT = [5, 17, 42, 8]
SAMPLING = ProcessingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def engine(llama_target_dir: Path) -> Engine:
    return Engine(CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32"), "target")


def draft_q(vocab: int, gamma: int, seed: int, top_k: int = 8) -> tuple[list[int], torch.Tensor]:
    """Drafts drawn from a random q on `top_k` tokens per position: ([γ], [γ, V])."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(gamma, vocab, generator=generator) * 3
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    q = logits.masked_fill(logits < kth, -torch.inf).softmax(dim=-1)  # [γ, V]
    return torch.multinomial(q, 1, generator=generator).squeeze(-1).tolist(), q


def self_drafts(engine: Engine, gamma: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """Drafts from the target itself truncated to its top 3: a q near p, so rounds end variously."""
    session = engine.new_session()
    session.open(OpenRequest(PROMPT, ProcessingConfig(temperature=1.0, top_k=3)))
    proposed = session.step(StepRequest(propose=gamma, propose_seed=seed))
    session.close()
    assert proposed.proposed_ids is not None and proposed.proposal_scores is not None
    return proposed.proposed_ids[0].tolist(), proposed.proposal_scores.to_dense(engine.info().vocab_size, 0.0)


def test_the_target_decides_a_round_exactly_as_the_pure_function_on_its_p(engine: Engine) -> None:
    vocab = engine.info().vocab_size
    assert "verify" in engine.info().capabilities
    outcomes = set()
    for seed in range(12):
        drafts, q = self_drafts(engine, 4, seed) if seed % 2 else draft_q(vocab, 4, seed)
        scoring = Scoring(ScoreKind.PROBS, positions=len(drafts) + 1)
        scored = engine.new_session()
        scored.open(OpenRequest(PROMPT, SAMPLING))
        scores = scored.step(StepRequest(append_ids=drafts, scoring=scoring)).scores
        assert scores is not None
        p = scores.to_dense(vocab, 0.0)  # [γ+1, V]: what the dense protocol sends
        expected = accept_draft(torch.tensor(drafts), q, p, torch.Generator().manual_seed(1000 + seed))

        verifying = engine.new_session()
        verifying.open(OpenRequest(PROMPT, SAMPLING))
        result = verifying.step(
            StepRequest(append_ids=drafts, scoring=scoring, verify=Verification(sparse_draft_probs(drafts, q), 1000 + seed))
        )
        assert result.scores is None and result.verdict is not None
        assert (result.verdict.accepted_len, result.verdict.next_token) == expected
        outcomes.add(expected[0])
        scored.close()
        verifying.close()
    assert len(outcomes) > 1, "every round ended alike: the comparison would miss a wrong acceptance"


def _verify(engine: Engine, drafts: list[int], q: Scores, scoring: Scoring | None = None) -> None:
    session = engine.new_session()
    session.open(OpenRequest(PROMPT, SAMPLING))
    try:
        scoring = scoring or Scoring(ScoreKind.PROBS, positions=len(drafts) + 1)
        session.step(StepRequest(append_ids=drafts, scoring=scoring, verify=Verification(q, 0)))
    finally:
        session.close()


def test_a_malformed_verification_names_its_field(engine: Engine) -> None:
    vocab = engine.info().vocab_size
    drafts, q = draft_q(vocab, 2, seed=3)
    good = sparse_draft_probs(drafts, q)
    assert good.sparse_ids is not None and good.sparse_values is not None
    cases: list[tuple[Scores, Scoring | None, str]] = [
        # q of a drafted token is 0: it could not have been drawn.
        (sparse_draft_probs(drafts, q.roll(1, dims=-1)), None, "verify.draft_probs"),
        (Scores(ScoreKind.PROBS, sparse_ids=good.sparse_ids.clone().fill_(vocab), sparse_values=good.sparse_values), None, "verify.draft_probs"),
        (Scores(ScoreKind.PROBS, sparse_ids=good.sparse_ids, sparse_values=good.sparse_values * float("nan")), None, "verify.draft_probs"),
        (Scores(ScoreKind.PROBS, dense=q[:, :-1]), None, "verify.draft_probs"),
        (Scores(ScoreKind.PROBS), None, "verify.draft_probs"),
        (good, Scoring(ScoreKind.PROBS, positions=2), "verify"),  # γ + 1 = 3 positions
        (good, Scoring(ScoreKind.ARGMAX, positions=3), "verify"),
    ]
    for scores, scoring, field in cases:
        with pytest.raises(InvalidArgument) as raised:
            _verify(engine, drafts, scores, scoring)
        assert raised.value.field == field, raised.value


# -- a tree of candidates (Medusa's lossless sampling) ------------------------------------------

TREE = [-1, 0, 0, 1, 2, 3]  # the root, two children, a grandchild under each, one more under the first
TREE_SAMPLING = ProcessingConfig(temperature=0.5)  # the target's likely ids are candidates often enough


def likely_tree(engine: Engine, root: int) -> list[int]:
    """Nodes for TREE: each node's children are the best ids of the target's p after it."""
    vocab = engine.info().vocab_size
    nodes = [root]
    for depth in range(1, 4):
        parents = TREE[: len(nodes)]
        session = engine.new_session()
        session.open(OpenRequest(PROMPT, TREE_SAMPLING))
        scores = session.step(StepRequest(append_ids=nodes, tree_parents=parents, scoring=Scoring(ScoreKind.PROBS, positions=len(nodes))))
        session.close()
        assert scores.scores is not None
        p = scores.scores.to_dense(vocab, 0.0)
        for node in range(len(nodes), len(TREE)):
            parent = TREE[node]
            if parent < len(nodes) and len(tree_path(TREE, parent)) == depth:
                rank = sum(1 for other in range(1, node) if TREE[other] == parent)  # 0 for the first child
                nodes.append(int(p[parent].topk(rank + 1).indices[rank]))
    return nodes[: len(TREE)]


def test_the_target_decides_a_tree_exactly_as_the_pure_function_on_its_p(engine: Engine) -> None:
    vocab = engine.info().vocab_size
    assert "verify_tree" in engine.info().capabilities
    scoring = Scoring(ScoreKind.PROBS, positions=len(TREE))
    paths = set()
    for seed in range(12):
        nodes = likely_tree(engine, root=3 + seed)
        scored = engine.new_session()
        scored.open(OpenRequest(PROMPT, TREE_SAMPLING))
        scores = scored.step(StepRequest(append_ids=nodes, tree_parents=TREE, scoring=scoring)).scores
        scored.close()
        assert scores is not None
        p = scores.to_dense(vocab, 0.0)  # [nodes, V]: what the dense protocol sends
        last, next_token = accept_tree_sampled(torch.tensor(nodes), TREE, p[None], torch.Generator().manual_seed(500 + seed))
        expected = (tree_path(TREE, int(last[0])), int(next_token[0]))

        verifying = engine.new_session()
        verifying.open(OpenRequest(PROMPT, TREE_SAMPLING))
        result = verifying.step(
            StepRequest(append_ids=nodes, tree_parents=TREE, scoring=scoring, verify=Verification(Scores(ScoreKind.PROBS), 500 + seed))
        )
        assert result.scores is None and result.verdict is not None and result.tree_ids is not None
        assert result.tree_ids.tolist() == nodes
        assert (list(result.verdict.tree_path), result.verdict.next_token) == expected
        assert result.verdict.accepted_len == len(expected[0]) - 1
        # The session goes on from the accepted path, as after a scored tree.
        kept = verifying.step(StepRequest(tree_keep=list(result.verdict.tree_path), append_ids=[result.verdict.next_token]))
        assert kept.num_tokens == len(PROMPT) + len(expected[0]) + 1
        verifying.close()
        paths.add(tuple(expected[0]))
    assert len(paths) > 2, "every tree ended alike: the comparison would miss a wrong walk"


def test_a_malformed_tree_verification_names_its_field_and_the_session_goes_on(engine: Engine) -> None:
    drafts, q = draft_q(engine.info().vocab_size, 2, seed=3)
    nodes, every = [4, 7, 9], Scoring(ScoreKind.PROBS, positions=3)
    cases: list[tuple[Scores, Scoring, str]] = [
        (sparse_draft_probs(drafts, q), every, "verify.draft_probs"),  # the nodes are the drafts: no q
        (Scores(ScoreKind.PROBS), Scoring(ScoreKind.LOGITS, positions=3), "verify"),  # ARGMAX is greedy
        (Scores(ScoreKind.PROBS), Scoring(ScoreKind.PROBS, positions=3, top_n=2), "verify"),
        (Scores(ScoreKind.PROBS), Scoring(ScoreKind.PROBS, positions=2), "scoring.positions"),
    ]
    session = engine.new_session()
    session.open(OpenRequest(PROMPT, TREE_SAMPLING))
    for q_scores, scoring, field in cases:
        with pytest.raises(InvalidArgument) as raised:
            session.step(StepRequest(append_ids=nodes, tree_parents=[-1, 0, 0], scoring=scoring, verify=Verification(q_scores, 0)))
        assert raised.value.field == field, raised.value
    result = session.step(
        StepRequest(append_ids=nodes, tree_parents=[-1, 0, 0], scoring=every, verify=Verification(Scores(ScoreKind.PROBS), 1))
    )
    assert result.verdict is not None and result.verdict.tree_path[0] == 0
    session.close()


@pytest.mark.parametrize(
    "tensor", [{"dtype": "float32", "shape": [2, 3], "data": b"\0" * 5}, {"dtype": "complex", "shape": [1], "data": b""}]
)
def test_a_malformed_q_on_the_wire_is_invalid_argument(llama_stack: Stack, tensor: dict[str, Any]) -> None:
    verify = model_pb2.Verify(draft_probs=model_pb2.Scores(kind=model_pb2.SCORE_KIND_PROBS, dense=common_pb2.Tensor(**tensor)))
    messages = [
        model_pb2.SessionRequest(open=model_pb2.Open(prompt_ids=PROMPT)),
        model_pb2.SessionRequest(
            step=model_pb2.Step(
                append_ids=[1, 2], scoring=model_pb2.Scoring(kind=model_pb2.SCORE_KIND_PROBS, positions=3), verify=verify
            )
        ),
    ]
    with grpc.insecure_channel(llama_stack.target.address) as channel:
        replies = model_pb2_grpc.ModelServiceStub(channel).Session(iter(messages), timeout=30)
        with pytest.raises(grpc.RpcError) as raised:
            list(replies)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith("verify.draft_probs:"), raised.value.details()


# -- bytes at a 262k vocabulary --------------------------------------------------------------


BIG_VOCAB = 262_144


def save_big_vocab_llama(path: Path, seed: int) -> Path:
    """A one-layer Llama whose only size is its 262,144-token vocabulary. Its tokenizer (the
    20-character one) names few of the ids; the test sends ids and reads ids."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=BIG_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def big_vocab_stack(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("big-vocab")
    target_dir, draft_dir = save_big_vocab_llama(root / "target", 1), save_big_vocab_llama(root / "draft", 2)
    target = loop.run(start_model_server(Engine(CausalLM.load(str(target_dir), device="cpu", dtype="float32"), "target")))
    draft = loop.run(start_model_server(Engine(CausalLM.load(str(draft_dir), device="cpu", dtype="float32"), "draft")))
    orchestrator = loop.run(start_orchestrator(target.address, draft.address, str(target_dir)))
    stack = Stack(loop, target, draft, orchestrator)
    yield stack
    stack.stop()


def test_a_sampled_round_at_gamma_4_with_a_262k_vocabulary_sends_under_64_kb(
    big_vocab_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(max_new_tokens: int, gamma: int = 4) -> Any:
        return Client(big_vocab_stack.address).generate(
            input_ids=[3, 1000, 200_000], strategy="speculative", num_speculative_tokens=gamma, temperature=1.0,
            seed=0, max_new_tokens=max_new_tokens, ignore_eos=True,
        )

    result = run(16)
    stats = result.stats
    assert stats.rounds >= 2 and stats.drafted_tokens > 0 and len(result.token_ids) == 16
    assert stats.bytes_per_round <= 64 * 1024
    # Auto γ with this unrelated pair falls back to target-only rounds: they return ids only.
    auto = run(48, gamma=0).stats
    assert auto.speculation_off_rounds > 0 and auto.bytes_per_round <= 64 * 1024, auto
    # The same rounds in the dense protocol (p sent back, decided in the orchestrator): megabytes.
    monkeypatch.setattr(speculative, "VERIFY_IN_TARGET", False)  # the orchestrator runs in this process
    dense = run(16).stats
    print(f"262k vocabulary, γ=4, bytes per sampled round: {stats.bytes_per_round:.0f} in the target, "
          f"{dense.bytes_per_round:.0f} dense ({dense.bytes_per_round / stats.bytes_per_round:.0f}×); auto γ: "
          f"{auto.bytes_per_round:.0f} ({auto.speculation_off_rounds} target-only rounds of {auto.rounds})")
    assert dense.bytes_per_round > 100 * stats.bytes_per_round and dense.bytes_per_round > BIG_VOCAB * 4


@pytest.fixture(scope="module")
def big_vocab_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    target_dir = save_big_vocab_llama(tmp_path_factory.mktemp("big-vocab-engine") / "target", 1)
    return Engine(CausalLM.load(str(target_dir), device="cpu", dtype="float32"), "target")


def test_a_top_k_round_at_a_262k_vocabulary_is_decided_sparse_exactly_as_the_pure_function_on_dense_p(
    big_vocab_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    warped = ProcessingConfig(temperature=0.8, top_k=20, top_p=0.95)
    prompt = [3, 1000, 200_000, 7]
    sparse_rounds: list[int] = []
    monkeypatch.setattr(engine_session, "accept_draft_sparse",
                        lambda *args: sparse_rounds.append(1) or acceptance.accept_draft_sparse(*args))
    outcomes = set()
    for seed in range(10):
        drafting = big_vocab_engine.new_session()  # q: the model itself at other warpers, near p
        drafting.open(OpenRequest(prompt, ProcessingConfig(temperature=1.0, top_k=2 + seed % 3)))
        proposed = drafting.step(StepRequest(propose=4, propose_seed=seed))
        drafting.close()
        assert proposed.proposed_ids is not None and proposed.proposal_scores is not None
        drafts, q = proposed.proposed_ids[0].tolist(), proposed.proposal_scores
        assert q.sparse_ids is not None  # the draft's q travels sparse
        scoring = Scoring(ScoreKind.PROBS, positions=len(drafts) + 1)
        scored = big_vocab_engine.new_session()
        scored.open(OpenRequest(prompt, warped))
        scores = scored.step(StepRequest(append_ids=drafts, scoring=scoring)).scores
        scored.close()
        assert scores is not None
        p, dense_q = scores.to_dense(BIG_VOCAB, 0.0), q.to_dense(BIG_VOCAB, 0.0)
        expected = accept_draft(torch.tensor(drafts), dense_q, p, torch.Generator().manual_seed(seed))
        verifying = big_vocab_engine.new_session()
        verifying.open(OpenRequest(prompt, warped))
        result = verifying.step(StepRequest(append_ids=drafts, scoring=scoring, verify=Verification(q, seed)))
        verifying.close()
        assert result.verdict is not None
        assert (result.verdict.accepted_len, result.verdict.next_token) == expected
        outcomes.add(expected[0])
    assert len(sparse_rounds) == 10, "the sparse decision was not taken"
    assert len(outcomes) > 1, "every round ended alike: the comparison would miss a wrong acceptance"

    # An id twice in a row of q is read as dense rows read it (the last entry's value stands).
    assert q.sparse_ids is not None and q.sparse_values is not None
    ids, values = q.sparse_ids.clone(), q.sparse_values.clone()
    ids, values = torch.cat([ids, ids[:, :1]], dim=1), torch.cat([values, values[:, :1]], dim=1)
    twice = Scores(ScoreKind.PROBS, sparse_ids=ids, sparse_values=values)
    verifying = big_vocab_engine.new_session()
    verifying.open(OpenRequest(prompt, warped))
    result = verifying.step(StepRequest(append_ids=drafts, scoring=scoring, verify=Verification(twice, 3)))
    verifying.close()
    assert result.verdict is not None and len(sparse_rounds) == 10
    expected = accept_draft(torch.tensor(drafts), twice.to_dense(BIG_VOCAB, 0.0), p, torch.Generator().manual_seed(3))
    assert (result.verdict.accepted_len, result.verdict.next_token) == expected


def test_a_proposal_asked_for_ids_only_draws_the_same_tokens_without_their_probabilities(engine: Engine) -> None:
    results = []
    for ids_only in (False, True):
        session = engine.new_session()
        session.open(OpenRequest(PROMPT, SAMPLING))
        results.append(session.step(StepRequest(propose=6, propose_seed=5, propose_ids_only=ids_only)))
        session.close()
    full, lean = results
    assert full.proposal_scores is not None and lean.proposal_scores is None
    assert full.proposed_ids is not None and lean.proposed_ids is not None
    assert torch.equal(full.proposed_ids, lean.proposed_ids)
