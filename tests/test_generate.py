"""Greedy and beam over gRPC equal transformers' `generate` token for token; sampling reproduces;
streaming equals unary; stop conditions trim exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from specwire.client import Client

from tests.conftest import hf_model
from tests.harness import Stack

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "the quick brown", "import os"]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def arch(request: pytest.FixtureRequest) -> tuple[Stack, Path]:
    if request.param == "llama":
        return request.getfixturevalue("llama_stack"), request.getfixturevalue("llama_target_dir")
    return request.getfixturevalue("gpt2_stack"), request.getfixturevalue("gpt2_target_dir")


@pytest.fixture(scope="module")
def reference(arch: tuple[Stack, Path]) -> Any:
    return hf_model(arch[1])


def hf_generate(model: Any, prompt_ids: list[int], **kwargs: Any) -> Any:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt_ids]), pad_token_id=0, **kwargs)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(
    "processors",
    [{}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"repetition_penalty": 0.8, "no_repeat_ngram_size": 3}],
)
def test_greedy_equals_transformers(arch: tuple[Stack, Path], reference: Any, tokenizer: Any, prompt: str, processors: dict[str, float]) -> None:
    stack, _ = arch
    prompt_ids = tokenizer(prompt).input_ids
    result = Client(stack.address).generate(
        input_ids=prompt_ids, strategy="greedy", max_new_tokens=24, ignore_eos=True, **processors
    )
    expected = hf_generate(reference, prompt_ids, max_new_tokens=24, do_sample=False, eos_token_id=None, **processors)
    assert result.token_ids == expected[0, len(prompt_ids):].tolist()
    assert result.finish_reason == "length"


def test_greedy_stops_at_eos_like_transformers(arch: tuple[Stack, Path], reference: Any, tokenizer: Any) -> None:
    stack, _ = arch
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        result = Client(stack.address).generate(input_ids=prompt_ids, max_new_tokens=40)
        expected = hf_generate(reference, prompt_ids, max_new_tokens=40, do_sample=False, eos_token_id=0)[0, len(prompt_ids):]
        assert result.token_ids == expected.tolist()[: len(result.token_ids)]
        if result.finish_reason == "eos":
            assert result.token_ids[-1] == 0 and len(result.token_ids) <= 40
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == 40


@pytest.mark.parametrize(
    "beam",
    [
        {"num_beams": 2},
        {"num_beams": 4, "num_return_sequences": 3},
        {"num_beams": 3, "length_penalty": 0.0, "early_stopping": True},
        {"num_beams": 3, "length_penalty": 2.0, "early_stopping": "never", "num_return_sequences": 2},
        {"num_beams": 4, "length_penalty": -1.0, "early_stopping": False},
        {"num_beams": 3, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "num_return_sequences": 3},
    ],
)
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beam_search_equals_transformers(arch: tuple[Stack, Path], reference: Any, tokenizer: Any, beam: dict[str, Any], ignore_eos: bool) -> None:
    stack, _ = arch
    client = Client(stack.address)
    for prompt in PROMPTS[:2]:
        prompt_ids = tokenizer(prompt).input_ids
        result = client.generate(input_ids=prompt_ids, strategy="beam", max_new_tokens=16, ignore_eos=ignore_eos, **beam)
        expected = hf_generate(
            reference, prompt_ids, max_new_tokens=16, do_sample=False, eos_token_id=None if ignore_eos else 0,
            output_scores=True, return_dict_in_generate=True, **beam,
        )
        assert len(result.sequences) == beam.get("num_return_sequences", 1)
        for ours, theirs, score in zip(result.sequences, expected.sequences, expected.sequences_scores, strict=True):
            theirs_new = theirs[len(prompt_ids):].tolist()
            assert ours.token_ids == theirs_new[: len(ours.token_ids)]
            assert all(t == 0 for t in theirs_new[len(ours.token_ids):])  # transformers pads with pad id 0
            assert ours.score == pytest.approx(float(score), rel=1e-4, abs=1e-5)
        assert result.token_ids == result.sequences[0].token_ids


def test_seeded_sampling_reproduces(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    kwargs: dict[str, Any] = {"prompt": "def", "strategy": "sample", "max_new_tokens": 24, "ignore_eos": True}
    for warpers in ({}, {"temperature": 0.7, "top_k": 20}, {"top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.2}):
        first = client.generate(seed=11, **kwargs, **warpers)
        assert client.generate(seed=11, **kwargs, **warpers).token_ids == first.token_ids
        others = {tuple(client.generate(seed=seed, **kwargs, **warpers).token_ids) for seed in (12, 13, 14)}
        assert others != {tuple(first.token_ids)}


def test_sampling_at_temperature_zero_is_greedy(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    greedy = client.generate(prompt="import os", max_new_tokens=16, ignore_eos=True)
    sampled = client.generate(prompt="import os", strategy="sample", temperature=0.0, max_new_tokens=16, ignore_eos=True)
    assert sampled.token_ids == greedy.token_ids


def test_truncated_distributions_travel_sparse(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    kwargs: dict[str, Any] = {"prompt": "def", "strategy": "sample", "max_new_tokens": 16, "ignore_eos": True, "seed": 1}
    dense = client.generate(**kwargs)
    sparse = client.generate(top_k=8, **kwargs)
    assert sparse.stats.target_bytes_received < dense.stats.target_bytes_received / 5
    greedy = client.generate(prompt="def", max_new_tokens=16, ignore_eos=True)
    # Greedy needs ids only: a few dozen bytes a round.
    assert greedy.stats.target_bytes_received / greedy.stats.rounds < 64


@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_stream_yields_the_same_tokens_as_unary(llama_stack: Stack, strategy: str) -> None:
    client = Client(llama_stack.address)
    kwargs: dict[str, Any] = {"prompt": "class Point:", "strategy": strategy, "max_new_tokens": 20, "seed": 5}
    unary = client.generate(**kwargs)
    deltas = list(client.stream(**kwargs))
    assert [t for d in deltas for t in d.token_ids] == unary.token_ids
    assert "".join(d.text for d in deltas) == unary.text
    assert deltas[-1].finish_reason == unary.finish_reason and deltas[-1].stats is not None
    assert all(not d.finish_reason for d in deltas[:-1])


def test_stop_string_ends_the_text_before_it(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    full = client.generate(prompt="def add(a, b):", max_new_tokens=30, ignore_eos=True)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop
    cut = client.generate(prompt="def add(a, b):", max_new_tokens=30, ignore_eos=True, stop_strings=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    # The last kept token completes the stop string; one fewer does not.
    decode = llama_stack.orchestrator.decoder.tokenizer.decode
    assert stop in decode(cut.token_ids) and stop not in decode(cut.token_ids[:-1])


def test_stats_describe_the_request(llama_stack: Stack) -> None:
    result = Client(llama_stack.address).generate(input_ids=[5, 6, 7], max_new_tokens=10, ignore_eos=True)
    s = result.stats
    # Rounds of 1, 2, 4 and the last 3 tokens (multi-step rounds double up to 8 per round).
    assert s.prompt_tokens == 3 and s.new_tokens == 10 and s.rounds == 4
    assert s.target_forwards == 10 and s.draft_forwards == 0
    assert s.wall_ms > 0 and 0 < s.ttft_ms <= s.wall_ms
    assert s.target_compute_ms > 0 and s.target_bytes_sent > 0 and s.target_bytes_received > 0
