"""Speculative sampling across the draft/target split: lossless, γ draft tokens per target forward.

References: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML, arXiv:2211.17192), Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv:2302.01318), Algorithm 2.

A round (DESIGN.md, "Round of speculative sampling"):

1. draft: roll back to the tokens it still agrees on (`keep_tokens`), append the decided tokens it
   has not seen (the previous round's correction or bonus), propose up to γ tokens — one message;
2. target: the same roll-back and append, plus the proposals, scoring the γ+1 positions — one
   message, one forward pass;
3. the orchestrator decides with the pure functions below; the roll-backs ride on the next
   round's messages, so a round is exactly one trip to each service.

Greedy rounds carry argmax ids only; sampled rounds the warped distributions (float32, see
`SCORE_PROBS` in protos/model.proto). A deterministic drafter (the n-gram drafter) sends no
probabilities: its q is one-hot on the proposed token, which keeps the rule exact.

Statistics. Every round yields `accepted + 1` tokens: the accepted draft tokens, then either a
correction (a draft token was rejected) or a bonus (every drafted token — possibly none — was
accepted). So, before the output is trimmed, tokens out = accepted + corrections + bonuses, and
`accepted_length_histogram` sums to `rounds`. The strategy never drafts past `max_new_tokens`
(γ is capped by the tokens still wanted), so only an eos or a stop string trims a round's tokens;
with `ignore_eos` and no stop strings, `new_tokens` = accepted + corrections + bonuses exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specwire.orchestrator.context import DecodeContext

from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest, StepResult


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """p'(x) = norm(max(0, p(x) − q(x))) (Leviathan et al. 2023, §2.3); p itself where that is all 0.

    The residual is all zeros only when p ≤ q everywhere, i.e. p = q, where no rejection can
    happen in exact arithmetic; falling back to p keeps the function total.
    target_probs, draft_probs: [..., vocab] → [..., vocab], rows summing to 1.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)  # [..., vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), target_probs)


def accept_drafts(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's decision for a batch of independent rounds.

    Accept x_i while u_i < min(1, p_i(x_i) / q_i(x_i)), u_i ~ U[0, 1); at the first rejection
    draw the correction from norm(max(0, p_i − q_i)); if all γ are accepted, draw the bonus token
    from p_{γ+1}. The tokens out are then distributed exactly as p (Leviathan et al. 2023, Thm. 1).

    draft_tokens: [B, γ] int; draft_probs q: [B, γ, V]; target_probs p: [B, γ+1, V].
    Returns accepted_len [B] int64 in [0, γ] and next_token [B] int64.
    """
    batch, gamma = draft_tokens.shape
    index = draft_tokens.long().unsqueeze(-1)  # [B, γ, 1]
    p_drafted = target_probs[:, :gamma].gather(-1, index).squeeze(-1)  # [B, γ]
    q_drafted = draft_probs.gather(-1, index).squeeze(-1)  # [B, γ]
    uniform = torch.rand((batch, gamma), generator=generator)  # [B, γ]
    accepted = uniform * q_drafted < p_drafted  # u < p/q without dividing; q(x) > 0 for a drawn x
    accepted_len = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    rows = torch.arange(batch)
    # A zero q row after the last draft makes the residual there p_{γ+1}: the bonus distribution.
    padded_q = F.pad(draft_probs, (0, 0, 0, 1))  # [B, γ+1, V]
    next_dist = residual_distribution(target_probs[rows, accepted_len], padded_q[rows, accepted_len])  # [B, V]
    next_token = torch.multinomial(next_dist, 1, generator=generator).squeeze(-1)  # [B]
    return accepted_len, next_token


def accept_draft(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """One round of `accept_drafts`. draft_tokens: [γ]; draft_probs: [γ, V]; target_probs: [γ+1, V]."""
    accepted_len, next_token = accept_drafts(
        draft_tokens.unsqueeze(0), draft_probs.unsqueeze(0), target_probs.unsqueeze(0), generator
    )
    return int(accepted_len[0]), int(next_token[0])


def accept_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: accept while x_i = argmax p_i; the next token is argmax p_{k+1}.

    draft_tokens: [γ]; target_argmax: [γ+1]. Returns (accepted_len k, next_token).
    """
    gamma = draft_tokens.shape[0]
    matches = draft_tokens.long() == target_argmax[:gamma].long()  # [γ]
    accepted_len = int(matches.long().cumprod(dim=0).sum())
    return accepted_len, int(target_argmax[accepted_len])


def one_hot_probs(draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a deterministic drafter: all mass on the proposed token. [γ] → [γ, V] float32."""
    return F.one_hot(draft_tokens.long(), vocab_size).float()


@dataclass
class SessionSync:
    """How much of the authoritative history one service session holds, and how much of it is right."""

    held: int  # tokens the session holds (history it was sent plus its own proposals)
    valid: int  # leading tokens of those that equal the history

    def catch_up(self, history: list[int]) -> tuple[int | None, list[int]]:
        """keep_tokens (None when nothing to drop) and append_ids that bring the session to `history`."""
        keep = self.valid if self.valid < self.held else None
        return keep, history[self.valid :]


async def speculative(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    score_kind = ScoreKind.PROBS if params.do_sample else ScoreKind.ARGMAX
    draft, target = ctx.draft_session(), ctx.target_session()
    assert ctx.draft is not None  # draft_session() refused otherwise
    draft_context = ctx.draft.info.max_context
    history = list(ctx.prompt_ids)
    draft_sync = SessionSync(len(history), len(history))
    target_sync = SessionSync(len(history), len(history))
    produced = 0
    while True:
        remaining = params.max_new_tokens - produced
        # Never draft tokens the output cannot take, nor past the draft model's context.
        gamma = max(0, min(params.num_speculative_tokens, remaining - 1, draft_context - len(history)))
        with ctx.round() as current:
            if produced == 0:
                opening = OpenRequest(history, params.processing, 1, Scoring(ScoreKind.NONE), ctx.trace())
                await asyncio.gather(draft.open(opening), target.open(opening))
            proposal: StepResult | None = None
            drafts: list[int] = []
            if gamma > 0:
                keep, append = draft_sync.catch_up(history)
                proposal = await draft.step(
                    StepRequest(
                        keep_tokens=keep,
                        append_ids=append,
                        propose=gamma,
                        propose_greedy=not params.do_sample,
                        propose_seed=ctx.draw_seed() if params.do_sample else 0,
                        propose_min_confidence=params.draft_confidence_threshold,
                        trace=ctx.trace(),
                    )
                )
                assert proposal.proposed_ids is not None
                drafts = proposal.proposed_ids.reshape(-1).tolist()  # may be fewer than γ, or none
            keep, append = target_sync.catch_up(history)
            verified = await target.step(
                StepRequest(
                    keep_tokens=keep,
                    append_ids=append + drafts,
                    scoring=Scoring(score_kind, positions=len(drafts) + 1),
                    trace=ctx.trace(),
                )
            )
            accepted_len, next_token = _decide(ctx, drafts, proposal, verified)
            # Both sessions now hold history + drafts; the roll-back travels with the next round.
            target_sync = SessionSync(held=len(history) + len(drafts), valid=len(history) + accepted_len)
            if proposal is not None:
                draft_sync = SessionSync(held=len(history) + len(drafts), valid=len(history) + accepted_len)
            _count(ctx, len(drafts), accepted_len)
            current.set(gamma=gamma, drafted=len(drafts), accepted=accepted_len)
        decided = drafts[:accepted_len] + [next_token]
        history = history + decided
        produced += len(decided)
        yield decided


def _decide(
    ctx: DecodeContext, drafts: list[int], proposal: StepResult | None, verified: StepResult
) -> tuple[int, int]:
    """Accepted length and next token from the target's scores and the draft's proposal."""
    scores = verified.scores
    assert scores is not None
    draft_tokens = torch.tensor(drafts, dtype=torch.long)  # [γ']
    if not ctx.params.do_sample:
        assert scores.argmax_ids is not None
        return accept_greedy(draft_tokens, scores.argmax_ids)
    vocab_size = ctx.target.info.vocab_size
    target_probs = scores.to_dense(vocab_size, 0.0)  # [γ'+1, V]
    if proposal is not None and proposal.proposal_scores is not None:
        draft_probs = proposal.proposal_scores.to_dense(vocab_size, 0.0)  # [γ', V]
    else:
        draft_probs = one_hot_probs(draft_tokens, vocab_size)  # a deterministic drafter: [γ', V]
    return accept_draft(draft_tokens, draft_probs, target_probs, ctx.generator)


def _count(ctx: DecodeContext, drafted: int, accepted_len: int) -> None:
    stats = ctx.stats
    stats.drafted_tokens += drafted
    stats.accepted_tokens += accepted_len
    if accepted_len < drafted:
        stats.corrections += 1
    else:
        stats.bonus_tokens += 1
    stats.record_accepted(accepted_len)
