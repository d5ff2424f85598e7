"""Greedy decoding and sampling with temperature / top-k / top-p / min-p: one token per round.

The target service warps its logits with the request's processors and returns only what the
choice needs: argmax ids for greedy, the (sparse when truncated) distribution for sampling.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from orchestrator.context import DecodeContext
from orchestrator.sampling import choose
from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest


async def standard(ctx: DecodeContext) -> AsyncIterator[list[int]]:
    scoring = Scoring(ScoreKind.PROBS if ctx.params.do_sample else ScoreKind.ARGMAX)
    target = ctx.target_session()
    with ctx.round():
        result = await target.open(OpenRequest(ctx.prompt_ids, ctx.params.processing, 1, scoring, ctx.trace()))
        assert result.scores is not None
        token = choose(result.scores, 0, ctx.generator)
    while True:
        yield [token]
        with ctx.round():
            result = await target.step(StepRequest(append_ids=[token], scoring=scoring, trace=ctx.trace()))
            assert result.scores is not None
            token = choose(result.scores, 0, ctx.generator)
