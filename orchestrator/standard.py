"""Greedy decoding and sampling with temperature / top-k / top-p / min-p, target only.

The first round opens the session with the prompt; the target returns what the first choice
needs (argmax ids for greedy, the warped distribution — sparse when truncated — for sampling)
and the orchestrator chooses. Every later round is *multi-step*: the target runs the request's
own rule for up to k tokens in one message (`propose`: the same warping code, argmax or a draw
from a seed the orchestrator takes from the request's generator), so a round trip buys k tokens
instead of one. k doubles each round from 1 up to the orchestrator's `max_tokens_per_round`,
which keeps the first tokens prompt while later rounds amortize the network. Tokens past an eos
or stop string in a round are computed and dropped; `max_new_tokens` is never overshot.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from specwire.orchestrator.context import DecodeContext
from specwire.orchestrator.sampling import choose

from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest


async def standard(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    scoring = Scoring(ScoreKind.PROBS if params.do_sample else ScoreKind.ARGMAX)
    target = ctx.target_session()
    with ctx.round(tokens=1):
        result = await target.open(OpenRequest(ctx.prompt_ids, params.processing, 1, scoring, ctx.trace()))
        assert result.scores is not None
        decided = [choose(result.scores, 0, ctx.generator)]
    produced, pending, chunk = 0, decided, 1
    while True:
        yield decided
        produced += len(decided)
        chunk = min(2 * chunk, ctx.max_tokens_per_round)
        count = min(chunk, params.max_new_tokens - produced)
        if count <= 0:
            return
        with ctx.round(tokens=count) as current:
            request = StepRequest(
                append_ids=pending,
                propose=count,
                propose_greedy=not params.do_sample,
                propose_seed=ctx.draw_seed() if params.do_sample else 0,
                propose_ids_only=True,
                trace=ctx.trace(),
            )
            result = await target.step(request)
            assert result.proposed_ids is not None
            decided = result.proposed_ids.reshape(-1).tolist()
            current.set(tokens=len(decided))
        pending = []  # the session already holds what it proposed
