"""The `entropix` strategy: one target round per token, decided by `orchestrator.entropix`'s policy.

Each round appends the previous token and asks the target, in the same forward pass, for the
position's top logits (after the penalty processors) and its metrics (`Scoring.extras`). The
target sends only the `EntropixConfig.columns()` best logits: every state keeps at most that many
tokens (its top-k), and softmax over a top-k set equals the full softmax renormalised on it, so
the draw is the one the full distribution would give. Entropy and varentropy come from the full
raw distribution, on the target. Every random choice uses the request's generator, so a seed
reproduces the whole generation. Each token's decision goes into the trace, the round's span
and the per-state counts.

With speculation (`num_speculative_tokens` given): the draft proposes γ tokens from its own
distribution at the base warpers, q; the target scores the γ+1 positions in one forward with
their metrics; at each position the policy's decision gives the distribution it would draw
from, P = `policy_distribution` (one-hot on the clarifying token when it inserts one), and
speculative sampling's rule (accept x with probability min(1, P(x)/q(x)), correct from
norm(max(0, P − q)), bonus from P) keeps the output distributed exactly as the policy's
target-only draws (Leviathan et al. 2023, Thm. 1): the trace is the same policy, per position.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import replace

import torch
from specwire.orchestrator.context import DecodeContext, Round
from specwire.orchestrator.entropix import (
    Decision,
    DecisionRecord,
    EntropixConfig,
    Metrics,
    choose_column,
    decide,
    policy_distribution,
)
from specwire.orchestrator.speculative import SessionSync, _count

from specwire.acceptance import accept_draft
from specwire.session import Extras, OpenRequest, ScoreKind, Scoring, StepRequest, StepResult

EXTRAS = Extras(entropy=True, varentropy=True, attention_stats=True)


def position_metrics(result: StepResult, row: int = 0) -> Metrics:
    """One scored row's metrics, as plain floats."""
    assert result.scores is not None and result.scores.metrics is not None, "the target sent no metrics"
    m = result.scores.metrics
    a = m.attention
    assert a is not None, "the target sent no attention statistics"
    return Metrics(
        float(m.entropy[row]), float(m.varentropy[row]), float(a.entropy[row]), float(a.varentropy[row]),
        float(a.agreement[row]), float(a.interaction_strength[row]),
    )


def ranked_logits(result: StepResult, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's token ids and logits, best first: [n] each (sparse top-n, or dense sorted)."""
    scores = result.scores
    assert scores is not None
    if scores.sparse_ids is not None and scores.sparse_values is not None:
        return scores.sparse_ids[row], scores.sparse_values[row].float()
    assert scores.dense is not None
    logits, ids = scores.dense[row].float().sort(descending=True)
    return ids, logits


def decide_token(
    ctx: DecodeContext, config: EntropixConfig, result: StepResult, last_token: int, current: Round
) -> int:
    """The next token by the policy, from a target-only step's one scored row; recorded."""
    metrics = position_metrics(result)
    decision = decide(metrics, config, last_token, ctx.target.info.vocab_size)
    if decision.clarify:
        token = config.clarifying_token
    else:
        ids, logits = ranked_logits(result)
        token = int(ids[choose_column(logits, decision, metrics, config, ctx.generator)])
    record_decision(ctx, DecisionRecord.of(metrics, decision), current)
    return token


def record_decision(ctx: DecodeContext, record: DecisionRecord, current: Round) -> None:
    """Into the trace, the per-state counts and (the round's last) onto the round's span."""
    ctx.stats.decisions.append(record)
    ctx.stats.entropix_states[record.state] = ctx.stats.entropix_states.get(record.state, 0) + 1
    current.set(**{f"entropix.{name}": value for name, value in vars(record).items()})


async def entropix(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    config = params.entropix
    assert config is not None
    if params.entropix_speculative:
        async for decided in entropix_speculative(ctx, config):
            yield decided
        return
    columns = config.columns(ctx.target.info.vocab_size)
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


def policy_row(
    config: EntropixConfig, verified: StepResult, row: int, last_token: int, vocab: int
) -> tuple[torch.Tensor, Decision, Metrics]:
    """The policy's distribution at one verified position, dense [vocab], with its decision."""
    metrics = position_metrics(verified, row)
    decision = decide(metrics, config, last_token, vocab)
    dense = torch.zeros(vocab)
    if decision.clarify:
        dense[config.clarifying_token] = 1.0
    else:
        ids, logits = ranked_logits(verified, row)
        dense[ids.long()] = policy_distribution(logits, decision)
    return dense, decision, metrics


async def entropix_speculative(ctx: DecodeContext, config: EntropixConfig) -> AsyncGenerator[list[int], None]:
    """Rounds as in `orchestrator.speculative`, verified against the policy's distribution."""
    params = ctx.params
    vocab = ctx.target.info.vocab_size
    draft, target = ctx.draft_session(), ctx.target_session()
    assert ctx.draft is not None
    # The draft proposes at the policy's base warpers; the target's LOGITS ignore warpers.
    processing = replace(params.processing, temperature=config.temperature, top_k=config.top_k,
                         top_p=config.top_p, min_p=config.min_p)
    history = list(ctx.prompt_ids)
    draft_sync, target_sync = SessionSync(len(history), len(history)), SessionSync(len(history), len(history))
    produced = 0
    while produced < params.max_new_tokens:
        remaining = params.max_new_tokens - produced
        gamma = max(0, min(params.num_speculative_tokens, remaining - 1, ctx.draft.info.max_context - len(history)))
        with ctx.round() as current:
            if produced == 0:
                opening = OpenRequest(history, processing, 1, Scoring(ScoreKind.NONE), ctx.trace())
                await asyncio.gather(draft.open(opening), target.open(opening))
            drafts: list[int] = []
            draft_probs = torch.zeros(0, vocab)
            if gamma > 0:
                keep, append = draft_sync.catch_up(history)
                proposal = await draft.step(StepRequest(keep_tokens=keep, append_ids=append, propose=gamma,
                                                        propose_seed=ctx.draw_seed(), trace=ctx.trace()))
                assert proposal.proposed_ids is not None and proposal.proposal_scores is not None
                drafts = proposal.proposed_ids.reshape(-1).tolist()
                draft_probs = proposal.proposal_scores.to_dense(vocab, 0.0)  # [γ, vocab]
            keep, append = target_sync.catch_up(history)
            scoring = Scoring(ScoreKind.LOGITS, positions=len(drafts) + 1, top_n=config.columns(vocab),
                              extras=EXTRAS)
            verified = await target.step(StepRequest(keep_tokens=keep, append_ids=append + drafts, scoring=scoring,
                                                     trace=ctx.trace()))
            previous = [history[-1], *drafts]
            rows = [policy_row(config, verified, i, previous[i], vocab) for i in range(len(drafts) + 1)]
            policy = torch.stack([dense for dense, _, _ in rows])  # [γ+1, vocab]
            accepted_len, next_token = accept_draft(torch.tensor(drafts, dtype=torch.long), draft_probs, policy,
                                                    ctx.generator)
            for _, decision, metrics in rows[: accepted_len + 1]:
                record_decision(ctx, DecisionRecord.of(metrics, decision), current)
            target_sync = SessionSync(len(history) + len(drafts), len(history) + accepted_len)
            draft_sync = SessionSync(len(history) + len(drafts), len(history) + accepted_len)
            _count(ctx, len(drafts), accepted_len)
            current.set(gamma=gamma, drafted=len(drafts), accepted=accepted_len)
        decided = drafts[:accepted_len] + [next_token]
        history += decided
        produced += len(decided)
        yield decided
