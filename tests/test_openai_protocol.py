"""The OpenAI front's translation, without sockets: request bodies to Generate keywords, gRPC
statuses to OpenAI's errors, streamed chunk shapes, and chat templates."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from specwire.client import GenerationError
from specwire.openai_http import protocol
from specwire.openai_http.chat import ChatTemplate
from transformers import PreTrainedTokenizerFast

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
])
def test_grpc_statuses_map_to_http_statuses(code: grpc.StatusCode, status: int) -> None:
    answered, body = protocol.error_body(GenerationError(code, "top_k: must be ≥ 0"), {})
    assert answered == status
    assert body["error"]["code"] == code.name.lower()
    # Only a refusal of the request names a parameter; an outage or a bad token does not.
    assert body["error"]["param"] == ("top_k" if status in (400, 404, 429) else None)


def test_an_error_names_the_parameter_the_caller_wrote() -> None:
    chat = protocol.param_names({"max_completion_tokens": 5}, chat=True)
    for field, param in [("max_new_tokens", "max_completion_tokens"), ("input_ids", "messages"), ("stop_strings", "stop")]:
        _, body = protocol.error_body(GenerationError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: out of bounds"), chat)
        assert body["error"]["param"] == param and body["error"]["message"] == f"{param}: out of bounds"
    completion = protocol.param_names({"max_tokens": 5}, chat=False)
    _, body = protocol.error_body(GenerationError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty"), completion)
    assert body["error"]["param"] == "prompt"


def test_a_completion_plan_fans_prompts_and_n_out_with_seeds_in_turn() -> None:
    plan = protocol.completion_plan({"prompt": ["a", [5, 6]], "n": 2, "seed": 2**64 - 1, "max_tokens": 9, "stop": "\n",
                                     "top_k": 4, "user": "ignored"})
    assert [c.index for c in plan.choices] == [0, 1, 2, 3]
    assert [c.params.get("prompt", c.params.get("input_ids")) for c in plan.choices] == ["a", "a", [5, 6], [5, 6]]
    assert [c.params["seed"] for c in plan.choices] == [2**64 - 1, 0, 2**64 - 1, 0]  # seed + i, mod 2⁶⁴
    assert plan.choices[0].params | {"seed": None} == {
        "prompt": "a", "strategy": "sample", "seed": None, "max_new_tokens": 9, "stop_strings": ["\n"], "top_k": 4,
    }


def test_defaults_are_openais_sampling_and_sixteen_completion_tokens() -> None:
    (choice,) = protocol.completion_plan({"prompt": "x"}).choices
    assert choice.params == {"prompt": "x", "strategy": "sample", "max_new_tokens": 16}
    (choice,) = protocol.chat_plan({"messages": [], "strategy": "beam"}, [1, 2], default_max_tokens=300).choices
    assert choice.params == {"input_ids": [1, 2], "strategy": "beam", "max_new_tokens": 300}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "num_return_sequences": 2}, "num_return_sequences"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": ["a", "b", "c"], "n": 6}, "n"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "entropix": {"warmth": 1.0}}, "entropix.warmth"),
    ({"prompt": "x", "strategy": 3}, "strategy"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "model": 4}, "model"),
])
def test_a_bad_body_is_refused_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GenerationError) as refused:
        protocol.completion_plan(body)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.message.startswith(f"{param}: ")


def test_off_values_of_unsupported_parameters_are_accepted() -> None:
    body = {"prompt": "x", "logprobs": None, "echo": False, "best_of": 1, "frequency_penalty": 0, "logit_bias": {}}
    assert len(protocol.completion_plan(body).choices) == 1


def test_chat_messages_join_text_parts_and_refuse_others() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert protocol.chat_messages({"messages": [{"role": "user", "content": parts, "name": "x"}]}) == [
        {"role": "user", "content": "ab", "name": "x"}
    ]
    with pytest.raises(GenerationError, match=r"^INVALID_ARGUMENT: messages\[0\]\.content\[1\]: only text"):
        protocol.chat_messages({"messages": [{"role": "user", "content": [parts[0], {"type": "image_url"}]}]})


def test_streamed_chunks_open_with_the_role_and_close_with_the_finish_reason() -> None:
    assert protocol.chunk_choice(True, 2, None)["delta"] == {"role": "assistant", "content": ""}
    assert protocol.chunk_choice(True, 2, "ab") == {"index": 2, "delta": {"content": "ab"}, "logprobs": None, "finish_reason": None}
    assert protocol.chunk_choice(True, 0, "", "eos")["delta"] == {}
    assert protocol.chunk_choice(False, 0, "", "stop") == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    assert protocol.chunk_choice(False, 0, "z", "length")["finish_reason"] == "length"


def test_chat_renders_with_the_tokenizers_template_or_the_one_given(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "def add(a, b):"}]
    with pytest.raises(GenerationError, match="messages: the model's tokenizer has no chat template"):
        ChatTemplate(tokenizer, "here").render(messages)
    given = ChatTemplate(tokenizer, "here", TEMPLATE).render(messages)
    assert tokenizer.decode(given) == "[user] def add(a, b):\n[assistant] "
    own = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, chat_template="<{{ messages[0]['content'] }}>")
    assert own.decode(ChatTemplate(own, "here").render(messages)) == "<def add(a, b):>"


def test_a_template_that_refuses_the_messages_is_a_bad_request(tokenizer: PreTrainedTokenizerFast) -> None:
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be the system prompt') }}{% endif %}"
    with pytest.raises(GenerationError, match="messages: the chat template refused them: the first message must be"):
        ChatTemplate(tokenizer, "here", strict).render([{"role": "user", "content": "hi"}])
