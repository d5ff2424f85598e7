"""The serving engine: the lean forward equals transformers', concurrent sessions batch without
changing a token, the slot cache frees its rows however a stream ends, and the tree hooks
(positions, masks, path compaction) equal plain decoding of the path."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from specwire.client import Client
from specwire.client.sdk import GenerateResult, GenerationError, build_request
from specwire.orchestrator.generation import Decoder
from specwire.orchestrator.models import LocalModel

from specwire.engine import COST_POSITIONS, CausalLM, Engine, EngineLimits, SlotKV, kernels, scheduler
from specwire.engine import session as engine_session
from specwire.engine.forward import FUSED_TOP_K, FusedSampling, fused_draw
from specwire.engine.scheduler import FUSED_STEPS, ForwardJob, JobSampling, compute_on, score_selection
from specwire.entropy_metrics import PositionMetrics, token_entropy
from specwire.errors import InvalidArgument, ResourceExhausted
from specwire.processing import ProcessingConfig, draw, sampling_probs
from specwire.session import Extras, OpenRequest, ScoreKind, Scoring, StepRequest
from tests.conftest import hf_model
from tests.harness import Stack
from tests.tiny import save_qwen2


@pytest.fixture(scope="module")
def qwen2_dir(models_dir: Path, tokenizer: Any) -> Path:
    return save_qwen2(models_dir / "qwen2", tokenizer, seed=4)


def engine(path: Path, **limits: Any) -> Engine:
    return Engine(CausalLM.load(str(path), device="cpu", dtype="float32"), "target", EngineLimits(**limits))


@pytest.mark.parametrize("arch", ["llama_target_dir", "gpt2_target_dir", "qwen2_dir"])
def test_lean_forward_logits_equal_transformers(request: pytest.FixtureRequest, arch: str) -> None:
    path = request.getfixturevalue(arch)
    lean = engine(path, max_batch_rows=4, max_cache_len=64)
    assert lean.batches
    reference = hf_model(path)
    ids = [5, 17, 42, 7, 99, 3, 11, 64, 23]
    session = lean.new_session()
    logits = [session.open(OpenRequest(prompt_ids=ids[:5], scoring=Scoring(ScoreKind.LOGITS, positions=5))).scores]
    for token in ids[5:]:  # cached decoding, one token at a time
        logits.append(session.step(StepRequest(append_ids=[token], scoring=Scoring(ScoreKind.LOGITS))).scores)
    ours = torch.cat([scores.dense for scores in logits if scores is not None and scores.dense is not None])
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs", [{"strategy": "greedy"}, {"strategy": "beam", "num_beams": 3, "num_return_sequences": 2}]
)
def test_qwen2_greedy_and_beam_equal_transformers(qwen2_dir: Path, tokenizer: Any, kwargs: dict[str, Any]) -> None:
    decoder = Decoder(LocalModel(engine(qwen2_dir), "target"), None, tokenizer)
    prompt_ids = tokenizer("def add(a, b):").input_ids
    result = asyncio.run(decoder.generate(build_request(input_ids=prompt_ids, max_new_tokens=16, ignore_eos=True, **kwargs)))
    hf_kwargs = {k: v for k, v in kwargs.items() if k != "strategy"}
    with torch.no_grad():
        expected = hf_model(qwen2_dir).generate(
            torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0, **hf_kwargs
        )
    for ours, theirs in zip(result.sequences or [result], expected, strict=False):
        assert ours.token_ids == theirs[len(prompt_ids):].tolist()


def _hf_reference(model: Any, prompt_ids: list[int], kwargs: dict[str, Any]) -> list[int] | None:
    """transformers' tokens for the greedy-equivalent strategies; None where it has no equal."""
    if kwargs["strategy"] in ("contrastive", "entropix"):
        return None
    beams = {"num_beams": kwargs["num_beams"]} if kwargs["strategy"] == "beam" else {}
    penalty = {"repetition_penalty": kwargs["repetition_penalty"]} if "repetition_penalty" in kwargs else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=kwargs["max_new_tokens"], do_sample=False,
            eos_token_id=None, pad_token_id=0, **beams, **penalty,
        )
    return list(out[0, len(prompt_ids):].tolist())


def test_concurrent_sessions_equal_their_solo_runs_and_transformers(
    llama_stack: Stack, llama_target_dir: Path, tokenizer: Any
) -> None:
    """Ten interleaved generations of five strategies and different prompt lengths, plus
    streams cut off by random deadlines: each output equals its solo run and transformers (and
    entropix's decision trace, whose attention statistics come from the shared forwards, its
    solo trace); the forwards were shared; every row is free afterwards."""
    prompts = ["def add(a, b):", "for i in range(10):\n    print(i * i)\n", "the", "import os\nimport sys\n"]
    jobs: list[tuple[str, dict[str, Any]]] = [
        (prompts[0], {"strategy": "greedy"}),
        (prompts[1], {"strategy": "greedy", "repetition_penalty": 1.3}),
        (prompts[2], {"strategy": "beam", "num_beams": 3}),
        (prompts[3], {"strategy": "speculative", "num_speculative_tokens": 3}),
        (prompts[1], {"strategy": "contrastive"}),
        (prompts[2], {"strategy": "greedy"}),
        (prompts[3], {"strategy": "beam", "num_beams": 2}),
        (prompts[0], {"strategy": "speculative", "num_speculative_tokens": 5}),
        (prompts[1], {"strategy": "entropix", "seed": 3}),
        (prompts[2], {"strategy": "entropix", "seed": 4, "num_speculative_tokens": 3}),
    ]
    for _, kwargs in jobs:
        kwargs.update(max_new_tokens=24, ignore_eos=True)
    client = Client(llama_stack.address)

    def run(job: tuple[str, dict[str, Any]]) -> GenerateResult:
        prompt, kwargs = job
        return client.generate(input_ids=tokenizer(prompt).input_ids, **kwargs)

    solo_results = [run(job) for job in jobs]
    solo = [result.token_ids for result in solo_results]
    reference = hf_model(llama_target_dir)
    for (prompt, kwargs), tokens in zip(jobs, solo, strict=True):
        expected = _hf_reference(reference, tokenizer(prompt).input_ids, kwargs)
        assert expected is None or tokens == expected, kwargs

    backend = llama_stack.target.servicer.backend
    assert isinstance(backend, Engine) and backend.scheduler is not None and backend.cache is not None
    backend.scheduler.stats.max_rows = 0
    rng = random.Random(7)

    def cut_off(index: int) -> None:  # a stream cancelled at a random point by its deadline
        prompt, kwargs = jobs[index % len(jobs)]
        impatient = Client(llama_stack.address, timeout=rng.uniform(0.01, 0.2))
        try:
            impatient.generate(input_ids=tokenizer(prompt).input_ids, **(kwargs | {"max_new_tokens": 200}))
        except GenerationError as error:
            assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED

    with ThreadPoolExecutor(max_workers=len(jobs) + 3) as pool:
        cancelled = [pool.submit(cut_off, i) for i in range(3)]
        together_results = list(pool.map(run, jobs))
        for future in cancelled:
            future.result()
    assert [result.token_ids for result in together_results] == solo
    for alone, shared in zip(solo_results, together_results, strict=True):
        assert len(alone.decisions) == len(shared.decisions)
        for a, b in zip(alone.decisions, shared.decisions, strict=True):
            assert a.state == b.state and (a.top_k, a.clarified) == (b.top_k, b.clarified)
            for name in ("entropy", "varentropy", "attn_entropy", "attn_varentropy", "agreement", "interaction_strength",
                         "temperature", "top_p", "min_p"):
                assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-5, abs=1e-5), name
    assert sum(len(result.decisions) for result in together_results) == 48  # the two entropix runs
    assert backend.scheduler.stats.max_rows > 1  # the sessions did share forwards
    deadline = time.monotonic() + 10
    while backend.cache.usage().rows_in_use and time.monotonic() < deadline:
        time.sleep(0.05)  # a cancelled stream's rows free when its in-flight forward ends
    assert backend.cache.usage().rows_in_use == 0


def test_rows_run_out_with_resource_exhausted_naming_the_limit(llama_target_dir: Path) -> None:
    small = engine(llama_target_dir, max_batch_rows=3, max_cache_len=64, queue_timeout_s=0.2)
    open_two = OpenRequest(prompt_ids=[1, 2, 3], num_branches=2)
    with pytest.raises(ResourceExhausted, match="max-batch-rows"):
        small.new_session().open(OpenRequest(prompt_ids=[1, 2, 3], num_branches=4))
    holder = small.new_session()
    holder.open(open_two)
    waiter = small.new_session()
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="max-batch-rows"):
        waiter.open(open_two)  # one row free, two wanted: waits out the queue timeout
    assert time.monotonic() - started >= 0.2
    hurried = small.new_session()
    hurried.set_deadline(0.01)  # the caller's deadline cuts the wait short
    started = time.monotonic()
    with pytest.raises(ResourceExhausted):
        hurried.open(open_two)
    assert time.monotonic() - started < 0.2
    holder.close()
    waiter.open(open_two)  # freed rows are handed out again
    assert small.cache is not None and small.cache.usage().rows_in_use == 2
    waiter.close()
    assert small.cache.usage().rows_in_use == 0


def test_tree_verification_hooks_equal_decoding_the_path(llama_target_dir: Path) -> None:
    """Two branches of two tokens verified in one forward (positions = depth, ancestor mask),
    then the accepted branch kept and compacted: logits equal plain decoding of that path."""
    lean = engine(llama_target_dir, max_batch_rows=4, max_cache_len=64)
    prompt = torch.tensor([[5, 17, 42, 7, 99]])
    start = prompt.shape[1]

    def prefilled() -> SlotKV:
        kv = lean.new_session().kv
        assert isinstance(kv, SlotKV)
        kv.open(1)
        kv.run(ForwardJob([], prompt, 0, 1))
        return kv

    tree = prefilled()
    nodes = torch.tensor([[3, 11, 64, 23]])  # 3 → 11 and 64 → 23: two paths of depth 2
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    depth = torch.tensor([[0, 1, 0, 1]])
    job = tree.run(ForwardJob([], nodes, start, 4, positions=start + depth, tree_mask=ancestors, want_hidden=True))
    assert job.hidden is not None and job.hidden.shape[:2] == (1, 4)
    tree.keep_path(start, [2, 3])  # accept 64 → 23
    after = tree.run(ForwardJob([], torch.tensor([[8]]), start + 2, 1)).logits

    linear = prefilled()
    path = linear.run(ForwardJob([], torch.tensor([[64, 23, 8]]), start, 3)).logits
    assert job.logits is not None and path is not None and after is not None
    torch.testing.assert_close(job.logits[:, 2:], path[:, :2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[:, 0], path[:, 2], atol=1e-5, rtol=1e-5)


def _metric_tensors(metrics: PositionMetrics | None) -> list[torch.Tensor]:
    assert metrics is not None and metrics.attention is not None
    attention = metrics.attention
    return [metrics.entropy, metrics.varentropy, attention.entropy, attention.varentropy,
            attention.agreement, attention.interaction_strength]


def test_forward_metrics_cover_the_kept_tokens(llama_target_dir: Path) -> None:
    """A job's entropix metrics come from the forward, [rows, keep] each: the token metrics are
    those of its logits, and a job keeping one token gets the last column of one keeping three."""
    lean = engine(llama_target_dir, max_batch_rows=2, max_cache_len=64)
    kv = lean.new_session().kv
    assert isinstance(kv, SlotKV)
    kv.open(1)
    job = kv.run(ForwardJob([], torch.tensor([[5, 17, 42]]), 0, 3, want_metrics=True))
    every = _metric_tensors(job.metrics)
    assert all(t.shape == (1, 3) for t in every) and job.logits is not None
    entropy, varentropy = token_entropy(job.logits.flatten(0, 1))
    torch.testing.assert_close(every[0].flatten(), entropy)
    torch.testing.assert_close(every[1].flatten(), varentropy)
    assert every[2][0, 0] == 0 and (every[2][0, 1:] > 0).all()  # the first token attends to itself alone
    last = kv.run(ForwardJob([], torch.tensor([[5, 17, 42]]), 0, 1, want_metrics=True))
    for one, three in zip(_metric_tensors(last.metrics), every, strict=True):
        assert one.shape == (1, 1)
        torch.testing.assert_close(one[:, 0], three[:, 2])


def test_forward_metrics_are_computed_for_the_asking_rows_only(llama_target_dir: Path) -> None:
    """One forward over a session that asks for metrics (entropix) and one that does not: only the
    asking job's rows and kept tokens are scored, and they equal that job's solo metrics."""
    lean = engine(llama_target_dir, max_batch_rows=4, max_cache_len=64)
    assert lean.scheduler is not None
    asking, other = lean.new_session().kv, lean.new_session().kv
    assert isinstance(asking, SlotKV) and isinstance(other, SlotKV)
    asking.open(1)
    other.open(2)
    solo = asking.run(ForwardJob([], torch.tensor([[5, 17, 42]]), 0, 2, want_metrics=True)).metrics
    wants = ForwardJob(list(asking.rows), torch.tensor([[5, 17, 42]]), 0, 2, want_metrics=True)
    plain = ForwardJob(list(other.rows), torch.tensor([[9, 8, 7, 6], [1, 2, 3, 4]]), 0, 1)
    rows, tokens = score_selection([plain, wants], torch.device("cpu"))
    assert rows is not None and tokens is not None
    assert rows.tolist() == [2] and tokens.tolist() == [[1, 2]]  # the asking row, its 2 kept tokens
    lean.scheduler._forward([plain, wants])
    assert plain.metrics is None
    for batched, alone in zip(_metric_tensors(wants.metrics), _metric_tensors(solo), strict=True):
        assert batched.shape == (1, 2)
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_the_cache_takes_the_rows_a_tenth_of_free_memory_holds_besides_its_scratch_row(
    llama_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row costs its own keys and values, not two rows' (Gemma-3-270M on 20 GiB free: 12 rows, not 6)."""
    from specwire.engine import cache_size, core

    lean = engine(llama_target_dir, max_batch_rows=1, max_cache_len=64)
    assert lean.cache is not None
    per_row = lean.cache.shape.bytes_per_row
    assert lean.cache.shape.bytes == 2 * per_row  # its one row and the scratch row
    monkeypatch.setattr(core, "_available_memory", lambda device: 10 * 9 * per_row)
    assert cache_size(lean.scheduler.model, lean.lm, EngineLimits(max_cache_len=64)) == (8, 64)


def test_cache_use_is_reported_in_info_and_metrics(llama_target_dir: Path) -> None:
    from specwire import wire
    from specwire.metrics import ModelServiceMetrics

    lean = engine(llama_target_dir, max_batch_rows=4, max_cache_len=64)
    assert lean.cache is not None
    metrics = ModelServiceMetrics("target", process_metrics=False)
    metrics.watch_cache(lean.cache.usage)
    metrics.watch_batches(lambda: lean.scheduler.stats)
    session = lean.new_session()
    session.open(OpenRequest(prompt_ids=[1, 2, 3, 4, 5], num_branches=2, scoring=Scoring(ScoreKind.ARGMAX)))
    info = wire.info_from_pb(wire.info_to_pb(lean.info()))  # what a caller of Info sees
    assert info.cache is not None and "batching" in info.capabilities
    assert (info.cache.rows, info.cache.rows_in_use, info.cache.max_len, info.cache.tokens_in_use) == (4, 2, 64, 10)
    assert info.cache.bytes_in_use == 10 * lean.cache.shape.bytes_per_token
    sample = metrics.registry.get_sample_value
    assert sample("specwire_kv_cache_rows", {"state": "in_use"}) == 2
    assert sample("specwire_kv_cache_rows", {"state": "free"}) == 2
    assert sample("specwire_kv_cache_slot_tokens") == 10
    stats = lean.scheduler.stats  # the open's prefill: one forward of its two branches
    assert stats.forwards >= 1 and stats.max_rows == 2
    assert (sample("specwire_engine_forwards"), sample("specwire_engine_forward_rows")) == (stats.forwards, stats.rows)
    assert sample("specwire_engine_widest_forward_rows") == 2 and sample("specwire_engine_busy_seconds") > 0
    session.close()
    assert sample("specwire_kv_cache_rows", {"state": "in_use"}) == 0


def test_a_reply_names_the_rows_of_the_batch_it_rode_in_and_what_that_batch_costs(llama_target_dir: Path) -> None:
    """`ServerTiming.batch_rows` and `batch_costs`: one row alone, with no curves; two when two
    sessions' decode rounds share forwards, with the curves at two rows and at one by width."""
    lean = engine(llama_target_dir, max_batch_rows=4, max_cache_len=96)
    sessions = [lean.new_session() for _ in range(2)]
    for session in sessions:
        session.open(OpenRequest(prompt_ids=[1, 2, 3, 4, 5]))
    alone = sessions[0].step(StepRequest(append_ids=[6], propose=4, propose_greedy=True))
    assert (alone.timing.batch_rows, alone.timing.batch_costs) == (1, [])  # one row: no load to tell
    start = threading.Barrier(2)

    def decode(session: Any) -> tuple[float, Any]:
        start.wait()
        result = session.step(StepRequest(append_ids=[7], propose=48, propose_greedy=True))
        return time.monotonic(), result

    with ThreadPoolExecutor(max_workers=2) as pool:
        finished = sorted(pool.map(decode, sessions), key=lambda pair: pair[0])
    together = [result for _, result in finished]
    assert max(result.timing.batch_rows for result in together) == 2
    # Only the last reply's curves are still the table's: forwards after a reply change it.
    shared = together[-1]
    assert shared.timing.batch_rows == 2
    assert [n for n, _ in shared.timing.batch_costs] == list(COST_POSITIONS)
    assert dict(shared.timing.batch_costs)[1] == lean.scheduler.costs.curve(2, (1,))[0][1]  # type: ignore[union-attr]
    assert [n for n, _ in shared.timing.one_row_costs] == list(COST_POSITIONS)
    assert all(ms > 0 for _, ms in shared.timing.batch_costs + shared.timing.one_row_costs)
    for session in sessions:
        session.close()
    unbatched = engine(llama_target_dir, batching=False).new_session()
    unbatched.open(OpenRequest(prompt_ids=[1, 2, 3]))
    reply = unbatched.step(StepRequest(append_ids=[4], scoring=Scoring(ScoreKind.ARGMAX)))
    assert (reply.timing.batch_rows, reply.timing.batch_costs, reply.timing.one_row_costs) == (0, [], [])
    unbatched.close()


def test_a_forward_that_fails_to_compile_is_served_eagerly(
    llama_target_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_compile(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken_compile)
    with caplog.at_level("WARNING", logger="specwire"):
        lean = engine(llama_target_dir, max_batch_rows=2, max_cache_len=64, compile="on")
    assert "serving eagerly" in caplog.text and "no compiler here" in caplog.text
    session = lean.new_session()
    result = session.open(OpenRequest(prompt_ids=[5, 17, 42], scoring=Scoring(ScoreKind.ARGMAX)))
    assert result.scores is not None and result.scores.rows == 1


def test_a_re_timing_that_fails_after_the_compiler_still_ends_compiling(
    llama_target_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`_when_gone`: whatever `on_ready` raises, `compiling` ends (the bench waits on it)."""
    scheduler = engine(llama_target_dir, max_batch_rows=2, max_cache_len=64, compile="off").scheduler
    assert scheduler is not None
    gone = threading.Thread(target=lambda: None)
    gone.start()
    scheduler._compiler = threading.current_thread()  # as `_compile_requested` hands over to `_when_gone`

    def timing_fails() -> None:
        raise RuntimeError("timing failed")

    with caplog.at_level("ERROR", logger="specwire"):
        scheduler._when_gone(gone, timing_fails)
    assert not scheduler.compiling and "timing failed" in caplog.text


@pytest.mark.timeout(1500)  # compiling every common shape takes minutes on a busy machine
def test_compiled_forward_serves_concurrent_sessions_like_the_eager_one(
    llama_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--compile on` (CPU: one set of graphs over symbolic shapes), compiling in the background
    as a service does: six sessions at once — greedy and seeded sampling rounds, a repetition
    penalty, two branches, and entropix's attention statistics — choose the tokens their solo
    runs on the eager engine choose, with logits and statistics equal to 1e-5 (compiled
    reductions are not bit-identical), both while the shapes are being compiled (each forward
    eager or compiled as its shape is) and once they all are. The one-layer draft: dynamo's
    tracing, most of a compile's time, grows with the layers."""
    compiled = engine(llama_draft_dir, max_batch_rows=8, max_cache_len=96, compile="on", compile_in_background=True)
    others_compiling: list[list[str]] = []  # when the compiled costs are timed
    remeasure = compiled._remeasure

    def timed_once_the_compiler_is_gone() -> None:
        here = threading.current_thread()
        others_compiling.append([t.name for t in threading.enumerate() if t.name == "specwire-compile" and t is not here])
        remeasure()

    compiled._remeasure = timed_once_the_compiler_is_gone  # type: ignore[method-assign]
    compiled.warmup()  # then it starts compiling, as a service does
    eager = engine(llama_draft_dir, max_batch_rows=8, max_cache_len=96, compile="off")
    assert compiled.scheduler is not None
    measured = Scoring(ScoreKind.LOGITS, extras=Extras(True, True, True))

    def run(backend: Engine, index: int) -> tuple[list[int], torch.Tensor, list[float]]:
        session = backend.new_session()
        prompt = [(7 * index + 3 * i) % 500 + 1 for i in range(3 + 4 * index)]
        # Sampled at index 1 with warpers fused steps draw for (`fused_draw`), at 3 over whole rows.
        processing = {1: ProcessingConfig(temperature=0.8, top_k=20, top_p=0.9),
                      2: ProcessingConfig(repetition_penalty=1.3)}.get(index, ProcessingConfig())
        branches = 2 if index == 3 else 1
        opened = session.open(OpenRequest(prompt, processing, branches, Scoring(ScoreKind.LOGITS, positions=2)))
        assert opened.scores is not None and opened.scores.dense is not None
        tokens: list[int] = []
        stats: list[float] = []
        for round_ in range(4):
            if index == 5:  # entropix: one scored step at a time, with the attention statistics
                step = session.step(StepRequest(append_ids=[round_ + 11], scoring=measured))
                assert step.scores is not None and step.scores.metrics is not None
                metrics = step.scores.metrics
                assert metrics.attention is not None
                stats += [*metrics.entropy.tolist(), *metrics.attention.entropy.tolist()]
                continue
            step = session.step(StepRequest(propose=2 + round_, propose_greedy=index % 2 == 0,
                                            propose_seed=100 * index + round_, propose_ids_only=True))
            assert step.proposed_ids is not None
            tokens += step.proposed_ids.reshape(-1).tolist()
        session.close()
        return tokens, opened.scores.dense, stats

    solo = [run(eager, index) for index in range(6)]
    scheduler = compiled.scheduler
    for _ in range(2):  # while compiling, then compiled
        with ThreadPoolExecutor(max_workers=6) as pool:
            together = list(pool.map(lambda index: run(compiled, index), range(6)))
        for (tokens, logits, stats), (alone_tokens, alone_logits, alone_stats) in zip(together, solo, strict=True):
            assert tokens == alone_tokens
            torch.testing.assert_close(logits, alone_logits, atol=1e-5, rtol=1e-5)
            assert stats == pytest.approx(alone_stats, rel=1e-5, abs=1e-5)
        deadline = time.monotonic() + 1200
        while not (scheduler.compiled and scheduler._requests.empty()) and time.monotonic() < deadline:
            time.sleep(1.0)
        assert scheduler.compiled and compiled.info().compiled
    while scheduler.compiling and time.monotonic() < deadline:
        time.sleep(0.2)
    # Info's costs are the compiled ones, timed with no compile thread (and its OpenMP pool) alive.
    assert others_compiling == [[]] and not scheduler.compiling and compiled.info().forward_costs
    assert scheduler.compile_failures == []  # a failed shape would serve eagerly, with the same outputs
    assert compiled.cache is not None and compiled.cache.usage().rows_in_use == 0

    # Plain greedy and fusable sampled rounds run up to FUSED_STEPS steps per compiled call (alone,
    # and two sessions together): the same tokens as the eager engine's one step at a time.
    fused_calls: list[tuple[int, bool]] = []  # each compiled call's steps, and whether it drew
    forward_steps = compiled.scheduler._forward_steps

    def counted(jobs: list[ForwardJob], count: int = FUSED_STEPS, *args: Any) -> torch.Tensor:
        fused_calls.append((count, any(job.sampling is not None for job in jobs)))
        return forward_steps(jobs, count, *args)

    compiled.scheduler._forward_steps = counted  # type: ignore[method-assign]
    warped = ProcessingConfig(temperature=0.8, top_k=20, top_p=0.9)

    def decode(backend: Engine, index: int, warpers: ProcessingConfig | None = None) -> list[int]:
        session = backend.new_session()
        session.open(OpenRequest([(11 * index + 5 * i) % 500 + 1 for i in range(4 + 3 * index)],
                                 warpers or ProcessingConfig()))
        tokens: list[int] = []
        # Fused calls of 4 steps, a lone step, and rounds ending in fused calls of 2 and of 3.
        counts = (13, 6) if warpers else (13, 1, 9, 6, 3)
        for seed, count in enumerate(counts):
            step = session.step(StepRequest(propose=count, propose_greedy=warpers is None, propose_seed=seed,
                                            propose_ids_only=True))
            assert step.proposed_ids is not None
            tokens += step.proposed_ids.reshape(-1).tolist()
        session.close()
        return tokens

    for _ in range(2):  # while the shorter and the sampled calls compile, then compiled
        assert decode(compiled, 0) == decode(eager, 0)
        assert decode(compiled, 3, warped) == decode(eager, 3, warped)
        while not scheduler._requests.empty() or scheduler.compiling:
            time.sleep(0.2)
    with ThreadPoolExecutor(max_workers=2) as pool:
        pair = list(pool.map(lambda index: decode(compiled, index), (1, 2)))
    assert pair == [decode(eager, 1), decode(eager, 2)]
    assert {(4, False), (3, False), (2, False), (4, True), (2, True)} <= set(fused_calls)
    assert compiled.cache.usage().rows_in_use == 0

    # A fused call's steps warped and drawn at once (`JobSampling.ahead`): each step's tokens and
    # probabilities to the bit as one step at a time gives them, on the same compiled logits.
    ahead_steps: list[int] = []

    @dataclass(frozen=True)
    class Counted(JobSampling):
        def __post_init__(self) -> None:
            inner = self.ahead
            assert inner is not None

            def counted(logits: torch.Tensor | None) -> None:
                if logits is not None:
                    ahead_steps.append(int(logits.shape[1]))
                inner(logits)

            object.__setattr__(self, "ahead", counted)

    @dataclass(frozen=True)
    class OneByOne(JobSampling):
        def __post_init__(self) -> None:
            object.__setattr__(self, "ahead", None)

    def sampled(kind: type[JobSampling]) -> tuple[list[int], list[torch.Tensor]]:
        monkeypatch.setattr(engine_session, "JobSampling", kind)
        session = compiled.new_session()
        session.open(OpenRequest([(5 * i) % 500 + 1 for i in range(9)], warped))
        tokens, probs = [], []
        for seed, count in enumerate((13, 6)):
            step = session.step(StepRequest(propose=count, propose_greedy=False, propose_seed=seed))
            assert step.proposed_ids is not None and step.proposal_scores is not None
            tokens += step.proposed_ids.reshape(-1).tolist()
            probs.append(step.proposal_scores.to_dense(compiled.info().vocab_size, 0.0))
        session.close()
        return tokens, probs

    together, one_by_one = sampled(Counted), sampled(OneByOne)
    assert together[0] == one_by_one[0] and len(together[0]) == 19
    assert all(torch.equal(a, b) for a, b in zip(together[1], one_by_one[1], strict=True))
    assert ahead_steps and max(ahead_steps) == FUSED_STEPS


def test_rounds_near_their_end_ride_along_fused_steps_of_longer_ones() -> None:
    """Fused steps run when every job is a fusable step (plain greedy, or sampled with warpers
    `fused_draw` applies), as many as half of the rows have to go, up to FUSED_STEPS and at least
    2; never for a round of penalised sampling, metrics or several new tokens, nor with no such
    half to carry the others."""
    fused, most = scheduler._fused, scheduler.FUSED_STEPS
    drawn = JobSampling(ProcessingConfig(temperature=0.7, top_k=27, top_p=0.9), torch.rand(8, 1))

    def job(left: int, rows: int = 1, tokens: int = 1, greedy: bool = True, metrics: bool = False,
            sampling: JobSampling | None = None) -> ForwardJob:
        return ForwardJob(list(range(rows)), torch.zeros((rows, tokens), dtype=torch.long), 4, 1, steps=left,
                          pick=lambda logits: None, fuse_greedy=greedy, want_metrics=metrics, sampling=sampling)

    full, ending = job(most), job(1)
    assert fused([full]) == most and fused([ending]) == 0
    assert fused([job(3)]) == 3 and fused([job(2)]) == 2  # a round's last steps, fused too
    assert fused([full, ending]) == most and fused([full, job(2), job(3), job(8)]) == most
    assert fused([full, job(1), job(2)]) == 2  # most rows near their end: the steps half have left
    assert fused([job(8, rows=2), job(1, rows=2)]) == most and fused([job(8), job(1, rows=2)]) == 0
    assert fused([full, job(8, greedy=False, sampling=drawn)]) == most
    for other in (job(8, greedy=False), job(8, tokens=5), job(8, metrics=True)):
        assert fused([full, other]) == 0
    assert not JobSampling.fusable(ProcessingConfig(temperature=0.7))  # no top-k: the whole row
    assert not JobSampling.fusable(ProcessingConfig(top_k=27, repetition_penalty=1.2))


def test_fused_draws_are_the_draws_sampling_makes_with_the_same_uniforms() -> None:
    """`fused_draw` (in compiled fused steps) picks the token `draw(sampling_probs(...))` picks with
    the same uniform, over warpers of every kind (temperature, top-k up to FUSED_TOP_K, top-p,
    min-p); an argmax in its place would not."""
    torch.manual_seed(0)
    rows, vocab = 64, 1024
    logits = torch.randn(rows, vocab) * torch.linspace(0.5, 6.0, rows)[:, None]  # flat to peaked
    configs = [ProcessingConfig(temperature=t, top_k=k, top_p=p, min_p=m)
               for t, k, p, m in zip(torch.rand(rows).mul(1.5).add(0.2).tolist(),
                                     torch.randint(1, FUSED_TOP_K + 1, (rows,)).tolist(),
                                     [1.0, 0.9, 0.5, 0.95] * (rows // 4), [0.0, 0.0, 0.1, 0.0] * (rows // 4),
                                     strict=True)]
    uniforms = torch.rand(rows, 3, dtype=torch.float64)
    sampling = FusedSampling(
        sampled=torch.tensor([True] * rows), temperature=torch.tensor([c.temperature for c in configs]),
        top_k=torch.tensor([c.top_k for c in configs]), top_p=torch.tensor([c.top_p for c in configs]),
        min_p=torch.tensor([c.min_p for c in configs]), uniforms=uniforms,
    )
    history = torch.zeros((1, 0), dtype=torch.long)
    for step in range(3):
        fused = fused_draw(logits, sampling, step)[:, 0]
        drawn = torch.stack([draw(sampling_probs(logits[i : i + 1], history, c), uniform=uniforms[i, step])[0]
                             for i, c in enumerate(configs)])
        assert torch.equal(fused, drawn)
        assert not torch.equal(logits.argmax(dim=-1), drawn)


def _w8a8_product() -> None:
    from specwire.engine.quantize import W8A8Linear

    W8A8Linear(torch.nn.Linear(64, 64, bias=False))(torch.randn(1, 64))


@pytest.mark.parametrize("first_loop", ["aten", "kernel"])
def test_a_thread_set_to_one_torch_thread_stays_there_when_another_sets_more(first_loop: str) -> None:
    """torch sets a thread's count at its first parallel loop to the count set last by any
    thread, and each library calling `at::parallel_for` does so once more, at its own first loop
    (a session thread's first Medusa head, through the w8a8 kernel); `compute_on` must hold
    against both, or the thread grows an OpenMP pool of its own."""
    if first_loop == "kernel":
        if not kernels.available("w4a8"):
            pytest.skip("the w4a8 kernel does not build here")
        _w8a8_product()  # built before the threads set their counts, as a service's model is
    loop = _w8a8_product if first_loop == "kernel" else lambda: torch.randn(1 << 20).mul(2).sum()
    before = torch.get_num_threads()
    counts: dict[str, int] = {}
    ready, other_done = threading.Event(), threading.Event()

    def session_thread() -> None:
        compute_on(1)
        ready.set()
        other_done.wait()
        loop()  # its first parallel loop (of that library)
        counts["session"] = torch.get_num_threads()

    def forward_thread() -> None:
        ready.wait()
        compute_on(2)
        counts["forward"] = torch.get_num_threads()
        other_done.set()

    threads = [threading.Thread(target=session_thread), threading.Thread(target=forward_thread)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(before)
    assert counts == {"session": 1, "forward": 2}


@pytest.mark.skipif(scheduler._libgomp() is None, reason="torch's OpenMP runtime here is not libgomp")
def test_a_thread_set_to_one_torch_thread_gives_back_its_openmp_workers() -> None:
    """A thread that ran parallel loops on two threads (a model loaded on the main thread) keeps
    an OpenMP worker, whose idle spinning slows every other thread's loops; `compute_on(1)` ends it."""
    code = (
        "import os, time, torch\n"
        "from specwire.engine.scheduler import compute_on\n"
        "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
        "torch.set_num_threads(2)\n"
        "torch.ones(1 << 22).add_(1)\n"
        "with_pool = tasks()\n"
        "compute_on(1)\n"
        "deadline = time.monotonic() + 5\n"
        "while tasks() >= with_pool and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print(with_pool - tasks())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == 1  # the pool's one worker


def test_calls_run_on_the_forward_thread_between_forwards(llama_target_dir: Path) -> None:
    """`Scheduler.call` (a feature drafter's steps): the work runs on the forward thread, never
    during a forward, and its result or error comes back to the caller; sessions decoding
    meanwhile are not disturbed."""
    backend = engine(llama_target_dir, batching=True)
    scheduler = backend.scheduler
    assert scheduler is not None
    forwarding = threading.Event()
    execute = scheduler._execute

    def marked(jobs: list[ForwardJob]) -> None:
        forwarding.set()
        try:
            execute(jobs)
        finally:
            forwarding.clear()

    scheduler._execute = marked  # type: ignore[method-assign]
    seen: list[tuple[str, bool]] = []

    def work() -> int:
        seen.append((threading.current_thread().name, forwarding.is_set()))
        return len(seen)

    def decode(seed: int) -> list[int]:
        session = backend.new_session()
        session.open(OpenRequest(prompt_ids=[seed + 1, 5, 9], scoring=Scoring(ScoreKind.ARGMAX)))
        ids = session.step(StepRequest(append_ids=[3], propose=12, propose_greedy=True, propose_ids_only=True))
        session.close()
        assert ids.proposed_ids is not None
        return [int(t) for t in ids.proposed_ids.flatten()]

    alone = [decode(seed) for seed in range(3)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        decoding = [pool.submit(decode, seed) for seed in range(3)]
        results = [pool.submit(scheduler.call, work) for _ in range(20)]
        assert sorted(call.result() for call in results) == list(range(1, 21))
        assert [run.result() for run in decoding] == alone
    assert seen and all(name == "specwire-forward" and not during for name, during in seen)

    def fails() -> None:
        raise ValueError("drafting failed")

    with pytest.raises(ValueError, match="drafting failed"):
        scheduler.call(fails)
    assert decode(0) == alone[0]  # the forward thread goes on


def test_a_lone_sessions_posted_step_runs_on_the_forward_thread(llama_target_dir: Path) -> None:
    """`EngineSession.post` (a service's lone step): the step runs on the forward thread and its
    result, or its error, reaches the continuation there; a continuation that raises leaves that
    thread serving. Beside another session's rows it posts nothing."""
    backend = engine(llama_target_dir, batching=True)
    request = StepRequest(append_ids=[3], propose=6, propose_greedy=True, propose_ids_only=True)
    solo = backend.new_session()
    solo.open(OpenRequest(prompt_ids=[4, 5, 9]))
    expected = solo.step(request).proposed_ids
    solo.close()

    def posted(session: Any, work: Any) -> tuple[Any, BaseException | None, str]:
        outcome: list[tuple[Any, BaseException | None, str]] = []
        done = threading.Event()

        def then(result: Any, error: BaseException | None) -> None:
            outcome.append((result, error, threading.current_thread().name))
            done.set()

        assert session.post(work, then)
        assert done.wait(60)
        return outcome[0]

    session = backend.new_session()
    session.open(OpenRequest(prompt_ids=[4, 5, 9]))
    result, error, thread = posted(session, lambda: session.step(request))
    assert error is None and thread == "specwire-forward"
    assert torch.equal(result.proposed_ids, expected)
    bad = StepRequest(keep_tokens=99)
    result, error, _ = posted(session, lambda: session.step(bad))
    assert result is None and isinstance(error, InvalidArgument) and error.field == "keep_tokens"

    def raising(result: Any, error: BaseException | None) -> None:
        raise RuntimeError("a broken continuation")

    assert session.post(lambda: None, raising)
    other = backend.new_session()  # the forward thread still serves
    other.open(OpenRequest(prompt_ids=[4, 5, 9]))
    assert not session.post(lambda: None, raising)  # beside other's rows: the caller runs it
    assert torch.equal(other.step(request).proposed_ids, expected)
    other.close()
    session.close()


def test_a_forward_waits_for_the_sessions_due_back_and_no_others(llama_target_dir: Path) -> None:
    """`Scheduler._due`: an owner away for its usual time ± its slack (a tenth of that time, or
    half a forward) is waited for, until the end of its slack; one not yet due, one long
    overdue, and one never seen back are not."""
    lean = engine(llama_target_dir, max_batch_rows=4, max_cache_len=64)
    s = lean.scheduler
    now = time.perf_counter()
    s._last_forward_s = 0.010  # half a forward: 5 ms
    s._served_at = {1: now - 0.040, 2: now - 0.010, 3: now - 0.100, 4: now - 0.001}
    s._return_s = {1: 0.041, 2: 0.040, 3: 0.040}  # 1 due in 1 ms; 2 in 30 ms; 3 60 ms late; 4 unknown
    due, wait_s = s._due()
    assert due == {1}
    assert abs(wait_s - (0.001 + max(0.005, scheduler.DUE_SHARE * 0.041))) < 1e-3  # to the end of its slack
    s._served_at, s._return_s = {}, {}
