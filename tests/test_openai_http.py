"""The OpenAI-compatible front, spoken to with the real `openai` client: `specwire up --http-port`
on tiny models (one stack for the module), its answers compared with the gRPC API's for the same
request, its errors in OpenAI's shape, and cancellation on disconnect leaving nothing held."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from specwire.client import Client
from specwire.client.launcher import free_base_port
from specwire.v1 import model_pb2, model_pb2_grpc
from transformers import PreTrainedTokenizerFast

from tests.test_metrics import Samples, scrape, value

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "team-token"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES: Any = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@dataclass
class Front:
    """A `specwire up --http-port` stack: orchestrator on `port`, draft +1, target +2, metrics of
    the three on `metrics_port` +0, +1, +2, the HTTP front on `http_port`."""

    port: int
    http_port: int
    metrics_port: int
    model: str

    def openai(self, api_key: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=api_key, max_retries=0, timeout=120)

    def grpc(self) -> Client:
        return Client(f"127.0.0.1:{self.port}", timeout=120, token=TOKEN)


def _read_until(process: subprocess.Popen[str], prefix: str) -> list[str]:
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"exited ({process.wait()}) before a {prefix!r} line: {lines}")


def _stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def front(llama_target_dir: Path, llama_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    where = tmp_path_factory.mktemp("openai-http")
    (where / "chat.jinja").write_text(TEMPLATE)
    (where / "tokens").write_text(f"{TOKEN}\n")
    port = free_base_port(9)
    stack = Front(port, port + 5, port + 6, str(llama_target_dir))
    with open(where / "up.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "specwire", "up", "--target-model", str(llama_target_dir), "--draft-model",
             str(llama_draft_dir), "--port", str(port), "--device", "cpu", "--http-port", str(stack.http_port),
             "--chat-template", str(where / "chat.jinja"), "--metrics-port", str(stack.metrics_port),
             "--auth-token-file", str(where / "tokens")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
        )
        try:
            lines = _read_until(process, "Ctrl-C")
            assert f"openai http   http://127.0.0.1:{stack.http_port}/v1\n" in lines, lines
            yield stack
        finally:
            _stop(process)


def _chat_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> list[int]:
    encoded: Any = tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def test_models_lists_the_target_and_health_is_open(front: Front) -> None:
    assert [model.id for model in front.openai().models.list()] == [front.model]
    with urllib.request.urlopen(f"http://127.0.0.1:{front.http_port}/health", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read()) == {"status": "serving"}


def test_completion_equals_the_grpc_generation(front: Front) -> None:
    request = {"prompt": "def add(a, b):", "max_tokens": 12, "seed": 5, "temperature": 0.8}
    completion = front.openai().completions.create(model=front.model, **request)
    with front.grpc() as client:
        expected = client.generate(prompt="def add(a, b):", strategy="sample", max_new_tokens=12, seed=5, temperature=0.8)
    (choice,) = completion.choices
    assert completion.object == "text_completion" and completion.model == front.model
    assert choice.text == expected.text and choice.index == 0
    assert choice.finish_reason == {"eos": "stop", "length": "length"}[expected.finish_reason]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == expected.stats.prompt_tokens
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.usage.total_tokens == expected.stats.prompt_tokens + len(expected.token_ids)
    stats = (choice.model_extra or {})["stats"]
    assert stats["new_tokens"] == len(expected.token_ids) and stats["rounds"] >= 1


def test_chat_stream_equals_the_grpc_stream_for_the_same_seed(front: Front, tokenizer: PreTrainedTokenizerFast) -> None:
    request: dict[str, Any] = {"max_tokens": 24, "seed": 11, "temperature": 0.9, "extra_body": {"ignore_eos": True}}
    chunks = list(front.openai().chat.completions.create(
        model=front.model, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **request
    ))
    with front.grpc() as client:
        deltas = list(client.stream(input_ids=_chat_ids(tokenizer, MESSAGES), strategy="sample", max_new_tokens=24,
                                    seed=11, temperature=0.9, ignore_eos=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "".join(d.text for d in deltas)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    *with_choices, usage_chunk = chunks
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert (with_choices[-1].choices[0].model_extra or {})["stats"]["new_tokens"] == 24
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 24 and usage_chunk.usage.prompt_tokens == deltas[-1].stats.prompt_tokens
    whole = front.openai().chat.completions.create(model=front.model, messages=MESSAGES, **request)
    assert whole.choices[0].message.content == streamed and whole.choices[0].message.role == "assistant"


def test_a_seed_reproduces_and_n_samples_are_seeded_in_turn(front: Front) -> None:
    client = front.openai()

    def complete(**extra: Any) -> list[str]:
        completion = client.completions.create(model=front.model, prompt="import os\n", max_tokens=16, temperature=1.0,
                                               extra_body={"ignore_eos": True}, **extra)
        return [choice.text for choice in sorted(completion.choices, key=lambda c: c.index)]

    once = complete(seed=123)
    assert complete(seed=123) == once
    three = complete(seed=123, n=3)
    assert three[0] == once[0] and three[1] == complete(seed=124)[0] and three[2] == complete(seed=125)[0]
    assert len(set(three)) > 1


def test_stop_ends_the_text_before_the_stop_string(front: Front) -> None:
    client = front.openai()
    request: dict[str, Any] = {"model": front.model, "prompt": "class Point:", "max_tokens": 40, "temperature": 0,
                               "extra_body": {"ignore_eos": True}}
    free = client.completions.create(**request).choices[0].text
    stop = free[10:13]
    stopped = client.completions.create(stop=[stop], **request).choices[0]
    assert stopped.text == free[: free.index(stop)] and stopped.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **request))
    assert streamed == stopped.text


def test_specwire_parameters_ride_as_extra_body_fields(front: Front) -> None:
    extra = {"strategy": "speculative", "num_speculative_tokens": 3, "ignore_eos": True}
    completion = front.openai().completions.create(model=front.model, prompt="for i in", max_tokens=20, extra_body=extra)
    with front.grpc() as client:
        greedy = client.generate(prompt="for i in", max_new_tokens=20, ignore_eos=True)
    assert completion.choices[0].text == greedy.text  # greedy speculation is lossless
    assert (completion.choices[0].model_extra or {})["stats"]["drafted_tokens"] > 0


def _post(front: Front, path: str, body: object, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {token}"} if token else {})
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{front.http_port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


ERRORS: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens", "invalid_argument"),
    ("/v1/completions", {"prompt": [1, 2, 99_999]}, 400, "prompt", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "nucleus": 0.9}, 400, "nucleus", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "stream": True, "top_p": 2.0}, 400, "top_p", "invalid_argument"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "not_found"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens", "invalid_argument"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "invalid_argument"),
    ("/v1/chat/completions", {"messages": MESSAGES, "strategy": "entropix", "entropix": {"argmax_entropy": -1}}, 400, "entropix.argmax_entropy",
     "invalid_argument"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), ERRORS, ids=[case[3] or "none" for case in ERRORS])
def test_errors_come_in_openai_shape_with_the_mapped_status(
    front: Front, path: str, body: dict[str, Any], status: int, param: str | None, code: str
) -> None:
    answered, payload = _post(front, path, {"model": front.model} | body)
    error = payload["error"]
    assert (answered, error["param"], error["code"]) == (status, param, code), payload
    assert error["message"].startswith(f"{param}: ") and error["type"].endswith("_error")


def test_the_openai_client_raises_its_own_errors(front: Front) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        front.openai().chat.completions.create(model=front.model, messages=MESSAGES, temperature=-2)
    assert bad.value.status_code == 400 and isinstance(bad.value.body, dict) and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        front.openai(api_key="wrong").completions.create(model=front.model, prompt="x", max_tokens=2)
    assert _post(front, "/v1/completions", {"prompt": "x"}, token=None)[0] == 401
    status, payload = _post(front, "/v1/nowhere", {})
    assert status == 404 and set(payload["error"]) == {"message", "type", "param", "code"}


def _held(front: Front) -> dict[str, float]:
    """What the stack holds now, as its services report it: sessions, KV rows and tokens."""
    held: dict[str, float] = {}
    for role, offset in (("draft", 1), ("target", 2)):
        with grpc.insecure_channel(f"127.0.0.1:{front.port + offset}") as channel:
            cache = model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest(), timeout=10).cache
        metrics = scrape(f"http://127.0.0.1:{front.metrics_port + offset}/metrics")
        held |= {f"{role} rows": cache.rows_in_use, f"{role} tokens": cache.tokens_in_use,
                 f"{role} sessions": value(metrics, "specwire_active_sessions"),
                 f"{role} kv tokens": value(metrics, "specwire_kv_cache_tokens")}
    with front.grpc() as client:
        held["orchestrator sessions"] = sum(r.active_sessions for r in client.info().replicas)
    held["orchestrator requests"] = value(_orchestrator_metrics(front), "specwire_requests_in_flight")
    return held


def _orchestrator_metrics(front: Front) -> Samples:
    return scrape(f"http://127.0.0.1:{front.metrics_port}/metrics")


def _ended(front: Front, strategy: str, status: str) -> float:
    return value(_orchestrator_metrics(front), "specwire_requests_total", strategy=strategy, status=status)


def _wait_until_nothing_is_held(front: Front) -> dict[str, float]:
    deadline = time.monotonic() + 20
    while any((held := _held(front)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def _open_and_drop(client: openai.OpenAI, model: str, index: int) -> None:
    """A stream of 400 tokens read to its first chunk, then dropped: the connection closes."""
    extra = {"ignore_eos": True} | ({"strategy": "speculative", "num_speculative_tokens": 3} if index % 2 else {})
    if index % 4 < 2:
        stream: Any = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=400, stream=True, extra_body=extra)
    else:
        stream = client.completions.create(model=model, prompt="def", max_tokens=400, stream=True, extra_body=extra)
    next(iter(stream))
    stream.close()


def test_a_disconnected_stream_cancels_its_generation(front: Front) -> None:
    before = _ended(front, "speculative", "cancelled")
    client = front.openai()
    _open_and_drop(client, front.model, 1)
    held = _wait_until_nothing_is_held(front)
    assert not any(held.values()), held
    assert _ended(front, "speculative", "cancelled") == before + 1  # cancelled, not run to its 400 tokens


def test_a_hundred_disconnected_streams_leave_no_session_and_no_kv_tokens(front: Front) -> None:
    """Speculative streams take ~2 s for their 400 tokens here, so all 50 must be cancelled. Sampled
    ones take ~0.25 s: on a loaded machine a few may end before the server reads the disconnect,
    and then count ok; every one must end one way or the other, most by cancellation."""
    outcomes = [(s, status) for s in ("sample", "speculative") for status in ("cancelled", "ok")]
    before = {outcome: _ended(front, *outcome) for outcome in outcomes}
    client = front.openai()
    for index in range(100):
        _open_and_drop(client, front.model, index)
    held = _wait_until_nothing_is_held(front)
    assert held == dict.fromkeys(held, 0), held
    moved = {outcome: _ended(front, *outcome) - before[outcome] for outcome in outcomes}
    assert moved[("speculative", "cancelled")] == 50 and moved[("speculative", "ok")] == 0, moved
    assert moved[("sample", "cancelled")] + moved[("sample", "ok")] == 50 and moved[("sample", "cancelled")] >= 25, moved
    assert len(client.completions.create(model=front.model, prompt="def", max_tokens=4,
                                         extra_body={"ignore_eos": True}).choices[0].text) > 0


def test_serve_http_alone_takes_the_orchestrators_tokenizer_and_refuses_chat_without_a_template(
    front: Front, tmp_path: Path
) -> None:
    (tmp_path / "tokens").write_text(f"{TOKEN}\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire", "serve", "http", "--orchestrator", f"127.0.0.1:{front.port}", "--port", "0",
         "--orchestrator-token-file", str(tmp_path / "tokens")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        ready = _read_until(process, "READY http ")[-1]
        alone = openai.OpenAI(base_url=f"http://{ready.split()[-1]}/v1", api_key="unchecked", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as refused:
            alone.chat.completions.create(model=front.model, messages=MESSAGES, max_tokens=4)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "messages"
        assert "--chat-template" in refused.value.body["message"]
        text = alone.completions.create(model=front.model, prompt="def", max_tokens=6, temperature=0).choices[0].text
        with front.grpc() as client:
            assert text == client.generate(prompt="def", max_new_tokens=6).text
    finally:
        _stop(process)
