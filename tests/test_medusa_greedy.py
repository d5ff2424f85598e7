"""Greedy Medusa over gRPC equals target-only greedy token for token (Llama and GPT-2 with random
heads; processors included), and a round is one message with one forward."""

from __future__ import annotations

import pytest
from specwire.client import Client

from tests.harness import Stack

pytest_plugins = ["tests.medusa_fixtures"]

PROMPTS = ["def add(a, b):", "the quick brown fox", "for i in range(10):\n    print(i"]


@pytest.fixture(scope="module", params=["llama_medusa_stack", "gpt2_medusa_stack"])
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
        assert stats.target_forwards == stats.rounds  # one message, one forward per round
        assert sum(stats.accepted_length_histogram) == stats.rounds - 1  # every round after the opening
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
