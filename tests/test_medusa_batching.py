"""Medusa on the batching engine: a tree round shares forwards with other sessions' decode and
verification steps, and every output equals its solo run (greedy Medusa also equals greedy)."""

from __future__ import annotations

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

    def watched(batch: list[ForwardJob]) -> None:
        if len(batch) > 1 and any(job.tree_mask is not None for job in batch):
            mixed.append(len(batch))
        plain_forward(batch)

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
