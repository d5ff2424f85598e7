"""A feature drafter served as the target's heads: the trees the service drafts equal the drafter
run directly over the target's own features, greedy Medusa rounds with it equal target greedy,
bad trees are refused by name, and `train-medusa --kind feature` learns one that loads back."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from specwire.client.cli import main
from specwire.client.sdk import Client
from specwire.target_service.train_feature_drafter import served_tree
from transformers import AutoConfig, AutoModelForCausalLM

from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.errors import InvalidArgument
from specwire.feature_drafter import FeatureDrafter, FeatureDrafterConfig, FeatureDrafterState, Slots
from specwire.medusa import CHOICES_NAME, build_tree
from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest
from tests.conftest import hf_model
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator
from tests.tiny import CORPUS

PROMPT = [5, 17, 42, 9, 33, 71, 8]
DEPTH = 3


def save_random_drafter(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A drafter over 96 of the target's ids, its head the target's rows for them (as training
    starts), the rest random; its tuned tree the chain of DEPTH."""
    config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    ids = torch.randperm(int(config.vocab_size))[:96].sort().values
    drafter = FeatureDrafter(FeatureDrafterConfig.for_target(int(config.hidden_size), int(config.vocab_size), 96, DEPTH), ids)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0.0, 0.2)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        drafter.head.weight.copy_(model.get_output_embeddings().weight[ids])
    drafter.save(out)
    (out / CHOICES_NAME).write_text(json.dumps([[0] * depth for depth in range(1, DEPTH + 1)]))
    return out


@pytest.fixture(scope="module")
def drafter_dir(llama_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_drafter(llama_target_dir, tmp_path_factory.mktemp("feature-drafter"))


def engine_with(model_dir: Path, drafter: Path, batching: bool) -> Engine:
    lm = CausalLM.load(str(model_dir), device="cpu", dtype="float32")
    lm.attach_medusa(str(drafter))
    return Engine(lm, "target", EngineLimits(batching=batching))


def direct_chain(reference: Any, drafter: FeatureDrafter, committed: list[int], root: int, top_k: int) -> torch.Tensor:
    """[DEPTH, top_k]: the drafter run from scratch over the target's features of `committed`."""
    with torch.no_grad():
        features = reference.base_model(torch.tensor([committed])).last_hidden_state  # [1, n, H]
        following = torch.tensor([committed[1:] + [root]])
        predicted, slots = drafter(features, following, torch.arange(len(committed)))
        chain, best = predicted[:, -1:], []
        for level in range(DEPTH):
            top = drafter.vocab_ids[drafter.scores(chain[0, -1]).topk(top_k).indices]
            best.append(top)
            chain, slots = drafter(chain, top[:1][None], torch.tensor([len(committed) + level]), slots)
    return torch.stack(best)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "hf"])
def test_the_service_drafts_what_the_drafter_computes_from_the_targets_features(
    llama_target_dir: Path, drafter_dir: Path, batching: bool
) -> None:
    engine = engine_with(llama_target_dir, drafter_dir, batching)
    drafter = engine.lm.medusa
    assert isinstance(drafter, FeatureDrafter) and engine.info().medusa_heads == DEPTH
    reference = hf_model(llama_target_dir)
    tree = build_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])  # runners-up hang from the chain
    session = engine.new_session()
    opened = session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    assert opened.scores is not None and opened.scores.argmax_ids is not None
    committed, root, kept = list(PROMPT), int(opened.scores.argmax_ids[0]), list[int]()
    for _ in range(4):  # rounds: each keeps the last round's path, then drafts from the new features
        result = session.step(StepRequest(tree_keep=kept, append_ids=[root], tree_parents=tree.parents,
                                          tree_topk=tree.topk_index.tolist(),
                                          scoring=Scoring(ScoreKind.ARGMAX, positions=tree.size)))
        assert result.tree_ids is not None and result.scores is not None and result.scores.argmax_ids is not None
        expected = direct_chain(reference, drafter, committed, root, 2)
        assert result.tree_ids.tolist() == [root, *expected[tree.head_index, tree.topk_index].tolist()]
        # Keep the path greedy acceptance keeps, as the orchestrator would.
        node, argmax = 0, result.scores.argmax_ids.tolist()
        kept = [0]
        while True:
            child = next((c for c in range(tree.size) if tree.parents[c] == node and result.tree_ids[c] == argmax[node]), None)
            if child is None:
                break
            kept.append(child)
            node = child
        committed += [int(result.tree_ids[i]) for i in kept]
        root = argmax[node]


def test_a_feature_drafters_tree_must_hang_from_its_chain(llama_target_dir: Path, drafter_dir: Path) -> None:
    engine = engine_with(llama_target_dir, drafter_dir, True)
    session = engine.new_session()
    session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    tree = build_tree([[0], [1], [1, 0]])  # (1, 0) follows a runner-up the drafter never continued
    with pytest.raises(InvalidArgument, match="tree_topk"):
        session.step(StepRequest(append_ids=[3], tree_parents=tree.parents, tree_topk=tree.topk_index.tolist(),
                                 scoring=Scoring(ScoreKind.ARGMAX, positions=tree.size)))
    with pytest.raises(InvalidArgument, match="scoring.medusa_top_k"):  # per-position heads it has not
        session.step(StepRequest(append_ids=[3], scoring=Scoring(ScoreKind.ARGMAX, positions=1, medusa_top_k=2)))
    session.step(StepRequest(keep_tokens=len(PROMPT), scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    chain = build_tree([[0], [0, 0]])  # the session goes on
    result = session.step(StepRequest(append_ids=[3], tree_parents=chain.parents, tree_topk=[0, 0],
                                      scoring=Scoring(ScoreKind.ARGMAX, positions=chain.size)))
    assert result.tree_ids is not None and len(result.tree_ids) == 3


@pytest.fixture(scope="module")
def drafter_stack(loop: LoopThread, llama_target_dir: Path, drafter_dir: Path, llama_draft_dir: Path) -> Any:
    target = loop.run(start_model_server(engine_with(llama_target_dir, drafter_dir, True)))
    draft = loop.run(start_model_server(Engine(CausalLM.load(str(llama_draft_dir), device="cpu", dtype="float32"), "draft")))
    orchestrator = loop.run(start_orchestrator(target.address, draft.address, str(llama_target_dir), max_new_tokens_limit=256))
    stack = Stack(loop, target, draft, orchestrator)
    yield stack
    stack.stop()


def test_greedy_medusa_rounds_with_a_feature_drafter_equal_target_greedy(drafter_stack: Stack) -> None:
    client = Client(drafter_stack.address)
    for prompt in ("the quick brown", "def f(x):", "import os\nimport"):
        expected = client.generate(prompt, strategy="greedy", max_new_tokens=40, ignore_eos=True)
        result = client.generate(prompt, strategy="medusa", max_new_tokens=40, ignore_eos=True)
        assert result.token_ids == expected.token_ids, prompt
        assert 1 < result.stats.medusa_tree_size <= DEPTH + 1  # the drafter's chain (its choices.json), shorter at the end
        assert result.stats.target_forwards == sum(result.stats.accepted_length_histogram) + 1  # a forward a tree round
        # The tree `train-medusa` writes: runners-up beside the chain's first drafts.
        wide = client.generate(prompt, strategy="medusa", max_new_tokens=40, ignore_eos=True,
                               medusa_choices=json.dumps(served_tree(DEPTH)))
        assert wide.token_ids == expected.token_ids, prompt
        assert wide.stats.medusa_tree_size > result.stats.medusa_tree_size


def test_train_medusa_kind_feature_learns_a_drafter_that_loads_back(llama_target_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("".join(CORPUS) * 40)
    reports = []
    for name in ("a", "b"):
        argv = ["train-medusa", "--kind", "feature", "--model", str(llama_target_dir), "--out", str(tmp_path / name),
                "--data", str(text), "--teacher-cache", str(tmp_path / "cache"), "--windows", "16",
                "--held-out-windows", "16", "--seq-len", "32", "--top-k", "16", "--vocab-top", "64", "--steps", "30",
                "--heads", "3", "--batch-size", "4", "--lr", "3e-3"]
        assert main(argv) == 0
        reports.append(json.loads((tmp_path / name / "train_report.json").read_text()))
    assert reports[0]["held_out_depth_agreement"] == reports[1]["held_out_depth_agreement"]  # deterministic
    assert len(reports[0]["held_out_depth_agreement"]) == 3
    (regression_first, kl_first), (regression_last, kl_last) = reports[0]["loss_first"], reports[0]["loss_last"]
    assert regression_last + 0.1 * kl_last < regression_first + 0.1 * kl_first  # the loss it minimises
    drafter = FeatureDrafter.load(tmp_path / "a")
    assert drafter.config.head_vocab == 64 and drafter.config.max_depth == 3
    # Its chain, and the runner-up beside each of the first two drafts.
    assert json.loads((tmp_path / "a" / CHOICES_NAME).read_text()) == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    engine = engine_with(llama_target_dir, tmp_path / "a", True)  # serves
    assert engine.info().medusa_heads == 3


def test_slots_drafted_step_by_step_equal_one_pass(llama_target_dir: Path, drafter_dir: Path) -> None:
    """Slots appended a few at a time give the outputs of one causal pass over all of them."""
    drafter = FeatureDrafter.load(drafter_dir)
    drafter.bind(hf_model(llama_target_dir).get_input_embeddings().weight)
    torch.manual_seed(3)
    features, tokens = torch.randn(1, 9, drafter.config.hidden_size), torch.randint(0, 320, (1, 9))
    with torch.no_grad():
        whole, _ = drafter(features, tokens, torch.arange(9))
        first, slots = drafter(features[:, :4], tokens[:, :4], torch.arange(4))
        second, slots = drafter(features[:, 4:], tokens[:, 4:], torch.arange(4, 9), slots)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)
    assert slots.keys.shape[1] == 9 and slots.before(6).keys.shape[1] == 6


def test_the_compiled_chain_drafts_what_the_eager_one_does(llama_target_dir: Path, drafter_dir: Path) -> None:
    """`compile_steps` (what a compiling target service runs once its forward is compiled): a
    round's drafts and slots, any count of new and past slots, any depth and width, as eager."""
    drafter = FeatureDrafter.load(drafter_dir)
    drafter.bind(hf_model(llama_target_dir).get_input_embeddings().weight)
    torch.manual_seed(4)
    features, tokens = torch.randn(1, 12, drafter.config.hidden_size), torch.randint(0, 320, (1, 12))
    rounds = [(n, depth, top_k) for n in (1, 2, 4) for depth, top_k in ((3, 2), (1, 1), (4, 3))]

    def drafts() -> list[tuple[torch.Tensor, Slots]]:
        with torch.inference_mode():
            _, past = drafter(features[:, :5], tokens[:, :5], torch.arange(5))
            return [drafter.chain(features[:, 5:5 + n], tokens[:, 5:5 + n], torch.arange(5, 5 + n), past, depth, top_k)
                    for n, depth, top_k in rounds]

    eager = drafts()
    assert drafter.compile_steps([(3, 2)])
    for (best, slots), (expected, expected_slots) in zip(drafts(), eager, strict=True):
        assert torch.equal(best, expected)
        torch.testing.assert_close(slots.keys, expected_slots.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(slots.values, expected_slots.values, atol=1e-4, rtol=1e-4)
        assert torch.equal(slots.positions, expected_slots.positions)

    # Sessions draft on threads of their own: eight at once draft what each drafts alone. (Dynamo's
    # guard checks raced between threads on Gemma-3-270M's quantised drafter, an AssertionError in
    # torch without the step's lock; this tiny one does not race.)
    def session(seed: int) -> torch.Tensor:
        state, width = FeatureDrafterState(), drafter.config.hidden_size
        generator = torch.Generator().manual_seed(seed)
        state.commit(0, torch.randn(6 + seed, width, generator=generator))
        committed = torch.randint(0, 320, (60,), generator=generator)
        length, drafts = 6 + seed, []
        for accepted in (1, 3, 2, 1, 2) * 2:
            drafts.append(state.draft(drafter, committed[:length], int(committed[length]), 3, 2))
            state.commit(length, torch.randn(accepted, width, generator=generator))
            length += accepted
        return torch.stack(drafts)

    alone = [session(seed) for seed in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(session, range(8)))
    for solo, concurrent in zip(alone, together, strict=True):
        assert torch.equal(solo, concurrent)


def test_a_bfloat16_target_drafts_with_its_drafter_in_bfloat16(llama_target_dir: Path, drafter_dir: Path) -> None:
    """The drafter takes the target's dtype (`attach_medusa`), and the features it is fed too."""
    lm = CausalLM.load(str(llama_target_dir), device="cpu", dtype="bfloat16")
    lm.attach_medusa(str(drafter_dir))
    engine = Engine(lm, "target", EngineLimits(batching=True))
    session = engine.new_session()
    session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=1)))
    chain = build_tree([[0], [0, 0], [0, 0, 0]])
    for kept in ([], [0, 1]):
        result = session.step(StepRequest(tree_keep=kept, append_ids=[3], tree_parents=chain.parents, tree_topk=[0, 0, 0],
                                          scoring=Scoring(ScoreKind.ARGMAX, positions=chain.size)))
        assert result.tree_ids is not None and len(result.tree_ids) == chain.size
        assert all(0 <= int(token) < lm.vocab_size for token in result.tree_ids)
