"""The `entropix` strategy: one target round per token, decided by `orchestrator.entropix`'s policy.

Each round appends the previous token and asks the target, in the same forward pass, for the
position's top logits (after the penalty processors) and its metrics (`Scoring.extras`). The
target sends only the `EntropixConfig.columns()` best logits: every state keeps at most that many
tokens (its top-k), and softmax over a top-k set equals the full softmax renormalised on it, so
the draw is the one the full distribution would give. Entropy and varentropy come from the full
raw distribution, on the target. Every random choice uses the request's generator, so a seed
reproduces the whole generation. Each token's decision goes into the trace, the round's span
and the per-state counts.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import torch
from specwire.orchestrator.context import DecodeContext, Round
from specwire.orchestrator.entropix import DecisionRecord, EntropixConfig, Metrics, choose_column, decide

from specwire.session import Extras, OpenRequest, ScoreKind, Scoring, StepRequest, StepResult

EXTRAS = Extras(entropy=True, varentropy=True, attention_stats=True)


def position_metrics(result: StepResult) -> Metrics:
    """The one scored row's metrics, as plain floats."""
    assert result.scores is not None and result.scores.metrics is not None, "the target sent no metrics"
    m = result.scores.metrics
    a = m.attention
    assert a is not None, "the target sent no attention statistics"
    return Metrics(
        float(m.entropy[0]), float(m.varentropy[0]), float(a.entropy[0]), float(a.varentropy[0]),
        float(a.agreement[0]), float(a.interaction_strength[0]),
    )


def ranked_logits(result: StepResult) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's token ids and logits, best first: [n] each (sparse top-n, or dense sorted)."""
    scores = result.scores
    assert scores is not None
    if scores.sparse_ids is not None and scores.sparse_values is not None:
        return scores.sparse_ids[0], scores.sparse_values[0].float()
    assert scores.dense is not None
    logits, ids = scores.dense[0].float().sort(descending=True)
    return ids, logits


def decide_token(ctx: DecodeContext, config: EntropixConfig, result: StepResult, last_token: int, current: Round) -> int:
    metrics = position_metrics(result)
    decision = decide(metrics, config, last_token)
    if decision.clarify:
        token = config.clarifying_token
    else:
        ids, logits = ranked_logits(result)
        token = int(ids[choose_column(logits, decision, metrics, config, ctx.generator)])
    record = DecisionRecord.of(metrics, decision)
    ctx.stats.decisions.append(record)
    ctx.stats.entropix_states[decision.state] = ctx.stats.entropix_states.get(decision.state, 0) + 1
    current.set(**{f"entropix.{name}": value for name, value in vars(record).items()})
    return token


async def entropix(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    config = params.entropix
    assert config is not None
    columns = min(config.columns(), ctx.target.info.vocab_size)
    scoring = Scoring(ScoreKind.LOGITS, top_n=columns, extras=EXTRAS)
    target = ctx.target_session()
    with ctx.round(tokens=1) as current:
        result = await target.open(OpenRequest(ctx.prompt_ids, params.processing, 1, scoring, ctx.trace()))
        token = decide_token(ctx, config, result, ctx.prompt_ids[-1], current)
    for _ in range(params.max_new_tokens - 1):
        yield [token]
        with ctx.round(tokens=1) as current:
            result = await target.step(StepRequest(append_ids=[token], scoring=scoring, trace=ctx.trace()))
            token = decide_token(ctx, config, result, token, current)
    yield [token]
