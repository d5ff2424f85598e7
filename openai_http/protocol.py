"""OpenAI's HTTP API in specwire's terms: request bodies to Generate calls, results to OpenAI's
JSON, gRPC statuses to OpenAI's error objects. Pure functions over dicts and the SDK's types.

Shapes follow OpenAI's API reference (Completions, Chat Completions, their streamed chunks and
the error object); specwire's own parameters ride as extra body fields, as in vLLM's server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import grpc
from specwire.client.sdk import GenerateResult, GenerationError, stats_as_dict
from specwire.v1 import orchestrator_pb2

from specwire.errors import echo

_FIELDS = orchestrator_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
_ENTROPIX_FIELDS = orchestrator_pb2.EntropixParams.DESCRIPTOR.fields_by_name

# Generate's fields a body may set by their own names (vLLM's "extra parameters"): all but the
# ones an OpenAI parameter sets, and num_return_sequences (choices come from `n`).
SPECWIRE_PARAMS = frozenset(_FIELDS) - {"prompt", "input_ids", "max_new_tokens", "stop_strings", "num_return_sequences"}
OPENAI_PARAMS = frozenset({"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "stop", "seed"})
CHAT_PARAMS = OPENAI_PARAMS | {"messages", "max_completion_tokens"}
COMPLETION_PARAMS = OPENAI_PARAMS | {"prompt"}
# Accepted and without effect on the output.
IGNORED_PARAMS = frozenset({"user", "metadata", "store", "service_tier"})
# OpenAI parameters with no counterpart in Generate: accepted only at their "off" values.
UNSUPPORTED_PARAMS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
MAX_CHOICES = 16  # generations one request may fan out to (prompts × n)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}

# gRPC status → (HTTP status, OpenAI error type).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_FIELD_PREFIX = re.compile(r"([A-Za-z_][\w.\[\]]*): (.*)", re.DOTALL)


def invalid(param: str, problem: str) -> GenerationError:
    """INVALID_ARGUMENT whose message starts with the OpenAI parameter's name, as the orchestrator's do."""
    return GenerationError(grpc.StatusCode.INVALID_ARGUMENT, f"{param}: {problem}")


@dataclass(frozen=True)
class Choice:
    index: int  # OpenAI's choice index: prompt index × n + sample index
    params: dict[str, Any]  # the SDK keywords of its Generate call


@dataclass(frozen=True)
class Plan:
    """One OpenAI request as Generate calls, one per choice."""

    model: str | None
    stream: bool
    include_usage: bool
    n: int
    choices: list[Choice] = field(default_factory=list)


def param_names(body: object, chat: bool) -> dict[str, str]:
    """Generate's field → the OpenAI parameter it came from, so an error names what the caller wrote."""
    prompt = "messages" if chat else "prompt"
    given = body if isinstance(body, dict) else {}
    max_tokens = "max_completion_tokens" if given.get("max_completion_tokens") is not None else "max_tokens"
    return {"prompt": prompt, "input_ids": prompt, "stop_strings": "stop", "max_new_tokens": max_tokens}


def error_body(error: GenerationError, names: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """OpenAI's error object and HTTP status for a gRPC status; `param` names the field a 4xx
    message starts with, in the caller's terms (`names`)."""
    status, kind = HTTP_STATUS.get(error.code, (500, "server_error"))
    message, param = error.message, None
    match = _FIELD_PREFIX.fullmatch(message)
    if match and 400 <= status < 500 and error.code != grpc.StatusCode.UNAUTHENTICATED:
        param = names.get(match.group(1), match.group(1))
        message = f"{param}: {match.group(2)}"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": error.code.name.lower()}}


def _kind(descriptor: Any) -> str:
    if descriptor.cpp_type == descriptor.CPPTYPE_BOOL:
        return "a boolean"
    if descriptor.cpp_type in (descriptor.CPPTYPE_FLOAT, descriptor.CPPTYPE_DOUBLE):
        return "a number"
    return "a string" if descriptor.cpp_type == descriptor.CPPTYPE_STRING else "an integer"


def _check_scalar(message: Any, name: str, value: Any, param: str) -> None:
    """INVALID_ARGUMENT naming `param` unless protobuf takes `value` for `message.name`: its type
    and its range (a negative seed, an int32 overflow). The orchestrator checks the bounds."""
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    if isinstance(value, bool) and descriptor.cpp_type != descriptor.CPPTYPE_BOOL:
        raise invalid(param, f"expected {_kind(descriptor)}, got {echo(value)}")
    try:
        setattr(message, name, value)
    except (TypeError, ValueError):
        raise invalid(param, f"expected {_kind(descriptor)}, got {echo(value)}") from None


def _check_specwire(name: str, value: Any) -> None:
    if name == "entropix":
        if not isinstance(value, dict):
            raise invalid(name, f"expected an object of entropix settings, got {echo(value)}")
        for key, setting in value.items():
            if key not in _ENTROPIX_FIELDS:
                raise invalid(f"entropix.{key}", "unknown entropix setting")
            _check_scalar(orchestrator_pb2.EntropixParams(), key, setting, f"entropix.{key}")
    elif _FIELDS[name].enum_type is not None:  # the SDK names the values it takes
        if not isinstance(value, str | bool):
            raise invalid(name, f"expected a string, got {echo(value)}")
    elif name == "medusa_choices" and isinstance(value, list):
        return  # the SDK encodes a list of paths as JSON; the orchestrator checks it
    else:
        _check_scalar(orchestrator_pb2.GenerateRequest(), name, value, name)


def _stop_strings(value: Any) -> list[str]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise invalid("stop", f"expected a string or a list of strings, got {echo(value)}")
    return strings


def _generation_params(body: dict[str, Any], allowed: frozenset[str]) -> tuple[dict[str, Any], int]:
    """The SDK keywords every choice shares, and `n`."""
    for name, value in body.items():
        if name in UNSUPPORTED_PARAMS:
            if value not in UNSUPPORTED_PARAMS[name]:
                raise invalid(name, f"not supported by specwire (accepted only as {echo(UNSUPPORTED_PARAMS[name][1])} or null)")
        elif name not in allowed | IGNORED_PARAMS | SPECWIRE_PARAMS:
            raise invalid(name, "unknown parameter")
    params: dict[str, Any] = {"strategy": "sample"}  # OpenAI samples unless told otherwise (temperature 1)
    for name in sorted(SPECWIRE_PARAMS | {"temperature", "top_p", "seed"}):
        if body.get(name) is not None:
            _check_specwire(name, body[name])
            params[name] = body[name]
    max_tokens = param_names(body, chat=False)["max_new_tokens"]
    if body.get(max_tokens) is not None:
        _check_scalar(orchestrator_pb2.GenerateRequest(), "max_new_tokens", body[max_tokens], max_tokens)
        params["max_new_tokens"] = body[max_tokens]
    if body.get("stop") is not None:
        params["stop_strings"] = _stop_strings(body["stop"])
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"expected an integer in [1, {MAX_CHOICES}], got {echo(n)}")
    return params, n


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream, options = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise invalid("stream", f"expected a boolean, got {echo(stream)}")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "only with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options", f"expected {{\"include_usage\": true|false}}, got {echo(options)}")
    return stream, bool(options.get("include_usage"))


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"expected a string, got {echo(model)}")
    return model


def _choices(prompts: list[dict[str, Any]], shared: dict[str, Any], n: int) -> list[Choice]:
    """Choice p·n + i: prompt p, sample i. With a seed, sample i is seeded seed + i (mod 2⁶⁴), so
    the n samples differ and each is reproducible."""
    if len(prompts) * n > MAX_CHOICES:
        raise invalid("n", f"prompts × n must be at most {MAX_CHOICES}, got {len(prompts)} × {n}")
    choices = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            params = shared | prompt
            if "seed" in params and i:
                params["seed"] = (params["seed"] + i) % 2**64
            choices.append(Choice(p * n + i, params))
    return choices


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def completion_prompts(value: Any) -> list[dict[str, Any]]:
    """OpenAI's `prompt` (a string, token ids, or a list of either) as SDK keywords per prompt."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if _is_ids(value):
        return [{"input_ids": value}]
    if isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value):
        return [{"prompt": p} if isinstance(p, str) else {"input_ids": p} for p in value]
    raise invalid("prompt", f"expected a string, a list of token ids, or a non-empty list of either; got {echo(value)}")


def completion_plan(body: dict[str, Any]) -> Plan:
    """POST /v1/completions."""
    shared, n = _generation_params(body, COMPLETION_PARAMS)
    shared.setdefault("max_new_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    prompts = completion_prompts(body.get("prompt"))
    stream, include_usage = _stream_flags(body)
    return Plan(_model(body), stream, include_usage, n, _choices(prompts, shared, n))


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The `messages` of a chat body, text parts joined into each message's `content`, ready for
    a chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", f"expected a non-empty list of messages, got {echo(messages)}")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}].role", f"expected a message with a string role, got {echo(message)}")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content[{j}]", f"only text parts are supported, got {echo(part)}")
            content = "".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise invalid(f"messages[{i}].content", f"expected a string or a list of text parts, got {echo(content)}")
        rendered.append({**message, "content": content or ""})
    return rendered


def chat_plan(body: dict[str, Any], prompt_ids: list[int], default_max_tokens: int) -> Plan:
    """POST /v1/chat/completions, the messages already rendered to `prompt_ids`."""
    shared, n = _generation_params(body, CHAT_PARAMS)
    shared.setdefault("max_new_tokens", default_max_tokens)
    stream, include_usage = _stream_flags(body)
    return Plan(_model(body), stream, include_usage, n, _choices([{"input_ids": prompt_ids}], shared, n))


# -- responses ---------------------------------------------------------------------------------


def usage(plan: Plan, stats: dict[int, Any]) -> dict[str, int]:
    """Tokens counted as OpenAI does: each prompt once, every choice's completion."""
    prompt = sum(s.prompt_tokens for index, s in stats.items() if index % plan.n == 0)
    completion = sum(s.new_tokens for s in stats.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(plan: Plan, results: list[GenerateResult], head: dict[str, Any]) -> dict[str, Any]:
    """A `text_completion` object; `head` holds id, created and model."""
    choices = [
        {"index": c.index, "text": r.text, "logprobs": None, "finish_reason": FINISH_REASONS[r.finish_reason],
         "stats": stats_as_dict(r.stats)}
        for c, r in zip(plan.choices, results, strict=True)
    ]
    stats = {c.index: r.stats for c, r in zip(plan.choices, results, strict=True)}
    return {**head, "object": "text_completion", "choices": choices, "usage": usage(plan, stats)}


def chat_response(plan: Plan, results: list[GenerateResult], head: dict[str, Any]) -> dict[str, Any]:
    """A `chat.completion` object."""
    choices = [
        {"index": c.index, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
         "finish_reason": FINISH_REASONS[r.finish_reason], "stats": stats_as_dict(r.stats)}
        for c, r in zip(plan.choices, results, strict=True)
    ]
    stats = {c.index: r.stats for c, r in zip(plan.choices, results, strict=True)}
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(plan, stats)}


def chunk_choice(chat: bool, index: int, text: str | None, finish_reason: str = "", stats: Any = None) -> dict[str, Any]:
    """One choice of a streamed chunk: `text` new text (None: the chat's opening role delta);
    the last one of a choice carries the finish reason and the statistics."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
    else:
        choice["text"] = text or ""
    choice["logprobs"] = None
    choice["finish_reason"] = FINISH_REASONS[finish_reason] if finish_reason else None
    if stats is not None:
        choice["stats"] = stats_as_dict(stats)
    return choice
