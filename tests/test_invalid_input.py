"""Every bad field gets INVALID_ARGUMENT naming it; the servers keep serving and leak nothing."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from specwire.client import Client, GenerationError
from specwire.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from tests.harness import Stack

CASES: list[tuple[dict[str, Any], str]] = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "input_ids": [1]}, "prompt"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": -3}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 100_000}, "max_new_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "min_p": 2.0}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"prompt": "x", "no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
    ({"prompt": "x", "strategy": "beam", "num_beams": 0}, "num_beams"),
    ({"prompt": "x", "strategy": "beam", "num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ({"prompt": "x", "strategy": "beam", "early_stopping": "sometimes"}, "early_stopping"),
    ({"prompt": "x", "strategy": "nucleus"}, "strategy"),
    ({"input_ids": [1, 2, 10_000]}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": [1] * 500, "max_new_tokens": 100}, "max_new_tokens"),  # over the 512-token context
    ({"prompt": "x", "strategy": "speculative", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"prompt": "x", "stop_strings": [""]}, "stop_strings"),
    ({"prompt": "x", "stop_strings": ["a"] * 17}, "stop_strings"),
    ({"prompt": "x", "strategy": "beam", "stop_strings": ["a"]}, "stop_strings"),
    ({"prompt": "x", "strategy": "beam", "length_penalty": 400.0}, "length_penalty"),
    ({"prompt": "x", "strategy": "contrastive", "cd_form": "li", "amateur_temperature": 1e-45}, "amateur_temperature"),
    # A sampling warper with beams is blamed on the warper that was set.
    ({"prompt": "x", "strategy": "beam", "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "strategy": "beam", "top_k": 5}, "top_k"),
    ({"prompt": "x", "strategy": "beam", "min_p": 0.1}, "min_p"),
    ({"prompt": "x", "strategy": "contrastive", "num_beams": 2, "top_k": 5}, "top_k"),
    # Long values are echoed cut short, so the status fits its metadata.
    ({"prompt": "x", "strategy": "x" * 100_000}, "strategy"),
    ({"prompt": "x", "strategy": "contrastive", "cd_form": "x" * 100_000}, "cd_form"),
    ({"prompt": "x", "strategy": "beam", "early_stopping": "x" * 100_000}, "early_stopping"),
    ({"prompt": "a" * 1_000_000}, "prompt"),
    ({"input_ids": [1] * 512}, "input_ids"),
]


@pytest.mark.parametrize(("kwargs", "field"), CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(CASES)])
def test_bad_field_is_invalid_argument_naming_it(llama_stack: Stack, kwargs: dict[str, Any], field: str) -> None:
    client = Client(llama_stack.address)
    with pytest.raises(GenerationError) as caught:
        client.generate(**kwargs)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith(f"{field}:"), caught.value.message
    assert len(caught.value.message) < 300


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"strategy": 99}, "strategy"), ({"early_stopping": 7}, "early_stopping"), ({"cd_form": 5}, "cd_form")],
)
def test_enum_numbers_this_build_does_not_know_are_invalid_argument(llama_stack: Stack, fields: dict[str, int], field: str) -> None:
    # The SDK only sends names it knows; another client can send any number (proto3 enums are open).
    with grpc.insecure_channel(llama_stack.address) as channel, pytest.raises(grpc.RpcError) as caught:
        orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(orchestrator_pb2.GenerateRequest(prompt="x", **fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: unknown value"), caught.value.details()


def test_bad_fields_on_the_stream_too(llama_stack: Stack) -> None:
    with pytest.raises(GenerationError) as caught:
        list(Client(llama_stack.address).stream(prompt="x", top_k=-1))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.message.startswith("top_k:")


def wait_for_no_sessions(stack: Stack, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while stack.target.servicer.active_sessions or stack.draft.servicer.active_sessions:
        assert time.monotonic() < deadline, "sessions were not freed"
        time.sleep(0.05)


def test_hundred_invalid_requests_then_a_valid_one_succeeds(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    for index in range(100):
        kwargs, field = CASES[index % len(CASES)]
        with pytest.raises(GenerationError) as caught:
            client.generate(**kwargs)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.message.startswith(f"{field}:")
    result = client.generate(prompt="def add(a, b):", max_new_tokens=8, ignore_eos=True)
    assert len(result.token_ids) == 8
    wait_for_no_sessions(llama_stack)


def test_cancelled_stream_frees_the_kv_cache(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    stream = client.stream(prompt="def", max_new_tokens=200, ignore_eos=True)
    next(stream)
    assert llama_stack.target.servicer.active_sessions == 1
    stream.close()  # the client goes away mid-generation
    wait_for_no_sessions(llama_stack)
    assert len(client.generate(prompt="def", max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_other_sessions_go_on_while_one_fails(llama_stack: Stack) -> None:
    client = Client(llama_stack.address)
    running = client.stream(prompt="import os", max_new_tokens=30, ignore_eos=True)
    first = next(running)
    with pytest.raises(GenerationError):
        client.generate(prompt="x", top_p=7.0)
    rest = [t for d in running for t in d.token_ids]
    assert len(first.token_ids) + len(rest) == 30


MALFORMED = b"\x0a\xff\xff\xff\xff"  # field 1, length-delimited, with a length past the end


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Info"])
def test_malformed_request_bytes_are_invalid_argument(llama_stack: Stack, method: str) -> None:
    with grpc.insecure_channel(llama_stack.address) as channel:
        path = f"/specwire.v1.Orchestrator/{method}"
        if method == "GenerateStream":
            call: Any = channel.unary_stream(path)
            with pytest.raises(grpc.RpcError) as caught:
                list(call(MALFORMED, timeout=10))
        else:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(path)(MALFORMED, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert caught.value.details().startswith("request: malformed")
    assert len(Client(llama_stack.address).generate(prompt="def", max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_malformed_session_message_is_invalid_argument(llama_stack: Stack) -> None:
    with grpc.insecure_channel(llama_stack.target.address) as channel:
        session: Any = channel.stream_stream("/specwire.v1.ModelService/Session")
        with pytest.raises(grpc.RpcError) as caught:
            list(session(iter([MALFORMED]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    wait_for_no_sessions(llama_stack)
