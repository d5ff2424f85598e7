"""Medusa on the batching engine: a tree round shares forwards with other sessions' decode and
verification steps, and every output equals its solo run (greedy Medusa also equals greedy)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specwire.client import Client

from specwire.engine import Engine
from specwire.engine.scheduler import ForwardJob
from tests.harness import Stack

pytest_plugins = ["tests.medusa_fixtures"]

PROMPTS = [[5, 17, 42, 9], [33, 71, 8, 120, 64, 3, 77], [200, 13], [90, 91, 92, 93, 94]]


def test_medusa_sessions_batched_with_others_equal_their_solo_runs(llama_medusa_stack: Stack) -> None:
    jobs: list[tuple[list[int], dict[str, Any]]] = [
        (PROMPTS[0], {"strategy": "medusa"}),
        (PROMPTS[1], {"strategy": "medusa", "medusa_choices": [[0], [1], [0, 0], [0, 0, 0]]}),
        (PROMPTS[2], {"strategy": "medusa", "temperature": 0.8, "seed": 3}),  # lossless sampling
        (PROMPTS[3], {"strategy": "medusa", "temperature": 0.8, "seed": 4, "medusa_acceptance": "typical"}),
        (PROMPTS[0], {"strategy": "greedy"}),
        (PROMPTS[1], {"strategy": "speculative", "num_speculative_tokens": 3}),
        (PROMPTS[2], {"strategy": "beam", "num_beams": 2}),
        (PROMPTS[3], {"strategy": "medusa", "repetition_penalty": 1.3}),
    ]
    client = Client(llama_medusa_stack.address)

    def run(job: tuple[list[int], dict[str, Any]]) -> list[int]:
        prompt, kwargs = job
        return list(client.generate(input_ids=prompt, max_new_tokens=24, ignore_eos=True, **kwargs).token_ids)

    solo = [run(job) for job in jobs]
    assert solo[0] == solo[4]  # greedy Medusa = greedy
    backend = llama_medusa_stack.target.servicer.backend
    assert isinstance(backend, Engine) and backend.scheduler is not None and backend.cache is not None
    scheduler = backend.scheduler
    mixed = []  # forwards that ran a tree beside another session's job
    plain_forward = scheduler._forward

    def watched(batch: list[ForwardJob]) -> int:
        if len(batch) > 1 and any(job.tree_mask is not None for job in batch):
            mixed.append(len(batch))
        return plain_forward(batch)

    scheduler._forward = watched  # type: ignore[method-assign, assignment]
    try:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            together = list(pool.map(run, jobs))
    finally:
        del scheduler._forward
    assert together == solo
    assert mixed  # tree verification shared forwards with the other sessions
    deadline = time.monotonic() + 10
    while backend.cache.usage().rows_in_use and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.cache.usage().rows_in_use == 0


def test_a_lone_sessions_rounds_on_the_forward_thread_serve_newcomers_too(llama_medusa_stack: Stack) -> None:
    """A session alone runs a message's Medusa rounds on the forward thread (`Scheduler._run_here`);
    sessions that open meanwhile are served by those same forwards, and every output equals its
    solo run."""
    client = Client(llama_medusa_stack.address)
    first: tuple[list[int], dict[str, Any]] = (PROMPTS[0], {"strategy": "medusa", "max_new_tokens": 200})
    newcomers: list[tuple[list[int], dict[str, Any]]] = [
        (PROMPTS[1], {"strategy": "greedy", "max_new_tokens": 24}),
        (PROMPTS[2], {"strategy": "medusa", "max_new_tokens": 24}),
        (PROMPTS[3], {"strategy": "medusa", "temperature": 0.8, "seed": 5, "max_new_tokens": 24}),
    ]

    def run(job: tuple[list[int], dict[str, Any]]) -> list[int]:
        prompt, kwargs = job
        return list(client.generate(input_ids=prompt, ignore_eos=True, **kwargs).token_ids)

    solo = [run(job) for job in [first, *newcomers]]
    backend = llama_medusa_stack.target.servicer.backend
    assert isinstance(backend, Engine) and backend.scheduler is not None
    scheduler = backend.scheduler
    inside, deep, shared, entered = threading.Event(), threading.Event(), [], [0]
    plain_here, plain_batch = scheduler._run_here, scheduler._execute_batch

    def here(job: ForwardJob) -> ForwardJob:
        inside.set()
        entered[0] += 1
        if entered[0] == 16:  # the fifth message's first round (1, 2, 4, 8 rounds before it)
            deep.set()
        try:
            return plain_here(job)
        finally:
            inside.clear()

    def batch(jobs: list[ForwardJob]) -> None:
        if inside.is_set() and len({id(job.owner) for job in jobs}) > 1:
            shared.append(len(jobs))
        plain_batch(jobs)

    scheduler._run_here, scheduler._execute_batch = here, batch  # type: ignore[method-assign]
    try:
        for _ in range(3):  # the newcomers must open while the first session's rounds run there
            entered[0] = 0
            deep.clear()
            with ThreadPoolExecutor(max_workers=1 + len(newcomers)) as pool:
                lone = pool.submit(run, first)
                assert deep.wait(timeout=30)
                later = [pool.submit(run, job) for job in newcomers]
                together = [lone.result()] + [future.result() for future in later]
            assert together == solo
            if shared:
                break
    finally:
        del scheduler._run_here, scheduler._execute_batch
    assert shared  # a forward of the lone session's rounds carried a newcomer's job too
