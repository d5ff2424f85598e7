"""Strategies run the same against in-process models as over gRPC; the async SDK agrees too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from specwire.client import AsyncClient, Client
from specwire.client.sdk import build_request
from specwire.orchestrator.generation import Decoder
from specwire.orchestrator.models import LocalModel

from specwire.engine import load_tokenizer
from tests.conftest import load_engine
from tests.harness import Stack


@pytest.fixture(scope="module")
def local_decoder(llama_target_dir: Path, llama_draft_dir: Path) -> Decoder:
    tokenizer = load_tokenizer(str(llama_target_dir))
    assert tokenizer is not None
    return Decoder(
        LocalModel(load_engine(llama_target_dir, "target"), "target"),
        LocalModel(load_engine(llama_draft_dir, "draft"), "draft"),
        tokenizer,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "greedy", "repetition_penalty": 1.2},
        {"strategy": "sample", "seed": 3, "top_p": 0.9},
        {"strategy": "beam", "num_beams": 3, "num_return_sequences": 2},
    ],
)
def test_in_process_strategy_equals_grpc(local_decoder: Decoder, llama_stack: Stack, kwargs: dict[str, Any]) -> None:
    request = build_request(prompt="for i in range(10):", max_new_tokens=16, **kwargs)
    local = asyncio.run(local_decoder.generate(request))
    remote = Client(llama_stack.address).generate(prompt="for i in range(10):", max_new_tokens=16, **kwargs)
    assert local.token_ids == remote.token_ids and local.text == remote.text
    assert [s.token_ids for s in local.sequences] == [s.token_ids for s in remote.sequences]


def test_async_client_matches_sync(llama_stack: Stack) -> None:
    async def run() -> tuple[Any, list[int], str, str]:
        async with AsyncClient(llama_stack.address) as client:
            result = await client.generate(prompt="import os", max_new_tokens=10, ignore_eos=True)
            streamed = [t async for d in client.stream(prompt="import os", max_new_tokens=10, ignore_eos=True) for t in d.token_ids]
            return result, streamed, await client.health(), (await client.info()).target_model

    result, streamed, health, target_model = asyncio.run(run())
    sync = Client(llama_stack.address)
    assert result.token_ids == streamed == sync.generate(prompt="import os", max_new_tokens=10, ignore_eos=True).token_ids
    assert health == "SERVING" == sync.health()
    assert target_model.endswith("llama-target")


def test_multi_step_rounds_decide_the_same_greedy_tokens(llama_target_dir: Path) -> None:
    """One token per round and up to 8 per round give the same output; only the trips differ."""
    tokenizer = load_tokenizer(str(llama_target_dir))
    assert tokenizer is not None
    target = LocalModel(load_engine(llama_target_dir, "target"), "target")
    request = build_request(prompt="def add(a, b):", max_new_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    one = asyncio.run(Decoder(target, None, tokenizer, max_tokens_per_round=1).generate(request))
    eight = asyncio.run(Decoder(target, None, tokenizer, max_tokens_per_round=8).generate(request))
    assert one.token_ids == eight.token_ids
    assert one.stats.rounds == 40
    assert eight.stats.rounds == 8  # 1, 2, 4, 8, 8, 8, 8 and the last 1
    assert one.stats.target.forward_calls == eight.stats.target.forward_calls == 40


def test_multi_step_sampling_reproduces_from_the_seed(llama_target_dir: Path) -> None:
    tokenizer = load_tokenizer(str(llama_target_dir))
    assert tokenizer is not None
    decoder = Decoder(LocalModel(load_engine(llama_target_dir, "target"), "target"), None, tokenizer)
    def run(seed: int) -> list[int]:
        request = build_request(prompt="import", strategy="sample", seed=seed, top_k=50, max_new_tokens=30, ignore_eos=True)
        return asyncio.run(decoder.generate(request)).token_ids
    assert run(4) == run(4)
    assert run(4) != run(5)


def test_concurrent_in_process_sessions_equal_their_solo_runs(local_decoder: Decoder) -> None:
    """Sessions of one event loop meet in the engines' schedulers (one alone runs on the forward
    thread, the others from threads of their own) and get their solo tokens."""
    prompts = ["def add(a, b):", "import os", "class Point:", "for i in range(10):"]
    kinds: list[dict[str, Any]] = [{"strategy": "greedy"}, {"strategy": "speculative", "num_speculative_tokens": 3},
                                   {"strategy": "sample", "seed": 7, "top_k": 20}, {"strategy": "speculative"}]
    requests = [build_request(prompt=p, max_new_tokens=24, ignore_eos=True, **k) for p, k in zip(prompts, kinds, strict=True)]
    solo = [asyncio.run(local_decoder.generate(r)).token_ids for r in requests]

    async def together() -> list[list[int]]:
        results = await asyncio.gather(*(local_decoder.generate(r) for r in requests))
        return [result.token_ids for result in results]

    assert asyncio.run(together()) == solo
    assert all(len(tokens) == 24 for tokens in solo)
