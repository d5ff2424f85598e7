"""Greedy Medusa over gRPC equals target-only greedy token for token (Llama and GPT-2 with random
heads; processors included), one forward a tree round and several rounds to a message."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from specwire.client import Client
from specwire.v1 import model_pb2, model_pb2_grpc

from specwire.demo import demo_draft_dir, demo_medusa_dir, demo_target_dir
from specwire.engine import CausalLM
from specwire.medusa import CHOICES_NAME
from tests.harness import LoopThread, Stack
from tests.medusa_tiny import medusa_stack
from tests.test_cli import specwire

pytest_plugins = ["tests.medusa_fixtures"]

PROMPTS = ["def add(a, b):", "the quick brown fox", "for i in range(10):\n    print(i"]





@pytest.fixture(scope="session")
def demo_medusa_stack(loop: LoopThread) -> Iterator[Stack]:
    if not (demo_medusa_dir() / "medusa_config.json").exists():
        pytest.skip("the demo target's heads are not built")
    stack = medusa_stack(loop, demo_target_dir(), demo_medusa_dir(), demo_draft_dir())
    yield stack
    stack.stop()


@pytest.fixture(scope="module", params=["llama_medusa_stack", "gpt2_medusa_stack", "demo_medusa_stack"])
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "processors",
    [{}, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}],
    ids=["plain", "penalties"],
)
def test_greedy_medusa_equals_target_greedy(stack: Stack, processors: dict[str, float]) -> None:
    client = Client(stack.address)
    for prompt in PROMPTS:
        expected = client.generate(prompt, strategy="greedy", max_new_tokens=40, ignore_eos=True, **processors)
        result = client.generate(prompt, strategy="medusa", max_new_tokens=40, ignore_eos=True, **processors)
        assert result.token_ids == expected.token_ids, prompt
        stats = result.stats
        assert stats.new_tokens == 40
        tree_rounds = sum(stats.accepted_length_histogram)  # every round after the opening
        assert stats.target_forwards == tree_rounds + 1  # one forward a tree round
        assert stats.rounds < tree_rounds + 1  # several tree rounds to a message (`tree_rounds`)
        assert stats.medusa_tree_size > 1


def test_custom_tree_and_short_outputs(llama_medusa_stack: Stack) -> None:
    client = Client(llama_medusa_stack.address)
    for max_new in (1, 2, 5):
        expected = client.generate("the quick", strategy="greedy", max_new_tokens=max_new, ignore_eos=True)
        for choices in ([[0]], [[0], [1], [0, 0], [0, 0, 0]]):
            result = client.generate(
                "the quick", strategy="medusa", max_new_tokens=max_new, ignore_eos=True, medusa_choices=choices
            )
            assert result.token_ids == expected.token_ids


def test_the_heads_tuned_tree_is_the_default_a_request_can_override(
    loop: LoopThread, llama_target_dir: Path, llama_heads_dir: Path, llama_draft_dir: Path, tmp_path: Path
) -> None:
    heads = shutil.copytree(llama_heads_dir, tmp_path / "heads")
    (heads / CHOICES_NAME).write_text("[[0], [1], [0, 0]]\n")
    stack = medusa_stack(loop, llama_target_dir, heads, llama_draft_dir)
    try:
        with grpc.insecure_channel(stack.target.address) as channel:
            info = model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest())
        assert json.loads(info.medusa_choices) == [[0], [1], [0, 0]]
        client = Client(stack.address)
        expected = client.generate("def add", strategy="greedy", max_new_tokens=12, ignore_eos=True).token_ids
        tuned = client.generate("def add", strategy="medusa", max_new_tokens=12, ignore_eos=True)
        chosen = client.generate("def add", strategy="medusa", max_new_tokens=12, ignore_eos=True, medusa_choices=[[0]])
        assert tuned.token_ids == chosen.token_ids == expected
        # Nodes a round: the root and the paths (fewer where the output's end prunes the tree;
        # the default tree has 25).
        assert 3 < tuned.stats.medusa_tree_size <= 4 and chosen.stats.medusa_tree_size <= 2
    finally:
        stack.stop()
    (heads / CHOICES_NAME).write_text("[[0, 0]]\n")  # a path without its prefix
    lm = CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="prefix"):
        lm.attach_medusa(str(heads))


def test_info_lists_medusa_with_the_head_count(llama_medusa_stack: Stack, llama_stack: Stack) -> None:
    with grpc.insecure_channel(llama_medusa_stack.target.address) as channel:
        info = model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest())
    assert "medusa" in info.capabilities and "tree" in info.capabilities and info.medusa_heads == 3
    with grpc.insecure_channel(llama_stack.target.address) as channel:
        plain = model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest())
    assert "medusa" not in plain.capabilities and plain.medusa_heads == 0
    assert "medusa" in Client(llama_medusa_stack.address).info().strategies
    assert "medusa" not in Client(llama_stack.address).info().strategies  # no heads, no medusa


def test_round_statistics_add_up(llama_medusa_stack: Stack) -> None:
    result = Client(llama_medusa_stack.address).generate("def add", strategy="medusa", max_new_tokens=12, ignore_eos=True)
    stats = result.stats
    tree_rounds = sum(stats.accepted_length_histogram)
    assert stats.target_forwards == tree_rounds + 1 and stats.rounds <= tree_rounds + 1
    assert stats.accepted_tokens == sum(k * n for k, n in enumerate(stats.accepted_length_histogram))
    assert len(stats.medusa_head_acceptance) == 3
    assert stats.medusa_head_acceptance[0] == pytest.approx(sum(stats.accepted_length_histogram[1:]) / tree_rounds)
    assert stats.new_tokens == 1 + stats.accepted_tokens + stats.corrections + stats.bonus_tokens


def test_trees_shrink_at_the_end_of_the_context(llama_medusa_stack: Stack) -> None:
    client = Client(llama_medusa_stack.address)
    prompt_ids = [(7 * i) % 300 + 2 for i in range(500)]  # 500 + 12 = the model's 512 positions
    expected = client.generate(input_ids=prompt_ids, strategy="greedy", max_new_tokens=12, ignore_eos=True)
    result = client.generate(input_ids=prompt_ids, strategy="medusa", max_new_tokens=12, ignore_eos=True)
    assert result.token_ids == expected.token_ids and len(result.token_ids) == 12


def test_cli_takes_a_tree_file_and_the_acceptance_flags(llama_medusa_stack: Stack, tmp_path: Path) -> None:
    tree = tmp_path / "tree.json"
    tree.write_text("[[0], [1], [0, 0]]")
    base = ["generate", "--address", llama_medusa_stack.address, "--input-ids", "5,6,7", "--max-new-tokens", "6",
            "--ignore-eos", "--json", "--strategy", "medusa", "--medusa-choices", str(tree)]
    greedy = specwire(*base)
    assert greedy.returncode == 0, greedy.stderr
    assert 1 < json.loads(greedy.stdout)["stats"]["medusa_tree_size"] <= 4  # trees shrink near the end
    typical = specwire(*base, "--temperature", "0.7", "--medusa-acceptance", "typical", "--posterior-alpha", "0.2")
    assert typical.returncode == 0, typical.stderr
    assert len(json.loads(typical.stdout)["token_ids"]) == 6
