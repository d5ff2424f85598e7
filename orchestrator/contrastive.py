"""Contrastive decoding: the target service is the expert, the draft service the amateur.

References: Li et al. 2022, "Contrastive Decoding: Open-ended Text Generation as Optimization"
(ACL 2023, arXiv:2210.15097); O'Brien & Lewis 2023, "Contrastive Decoding Improves Reasoning in
Large Language Models" (arXiv:2309.09117). Both keep only the tokens the expert finds plausible
and, among those, prefer the ones the expert likes much more than the amateur:

- "obrien" (default): V_valid = {x : s_e(x) ≥ log α + max_w s_e(w)},
  score(x) = (1 + β) · s_e(x) − β · s_a(x) on V_valid, −inf elsewhere;
- "li": V_head = {x : p_e(x) ≥ α · max_w p_e(w)} (the same set: log-softmax only shifts a row),
  score(x) = log p_e(x) − log p_a,τ(x) on V_head, −inf elsewhere. We read the paper's
  "log p_a / τ" as the amateur's log-softmax at temperature τ: log p_a,τ = log_softmax(s_a / τ).

s_e, s_a are the services' logits after the penalty processors (repetition penalty,
no-repeat-n-gram), which both services apply from the ProcessingConfig sent at open; α = cd_alpha,
β = cd_beta, τ = amateur_temperature.

Search: greedy by default (ties go to the lowest id, as argmax over the vocabulary does);
sampling from softmax(score / T) after top-k / top-p / min-p when the request asks for sampling;
beam search with `orchestrator.beam`'s semantics (transformers') over per-step log-scores:
log_softmax of the O'Brien & Lewis scores (they are the logits of a distribution), Li et al.'s
score as it is (its sum over the continuation is the paper's objective; they used 5 beams).

Wire (`WirePlan`). Every step asks both services about the same history concurrently, so a step
costs about the slower call. The expert's plausible set is usually small: the expert sends its top
`expert_top_n` logits per row, sparse; when a row's n-th logit still clears the threshold the set
may reach further, so the step re-scores that position densely and `expert_top_n` doubles. The
amateur sends dense logits in the same round ("same", the default: faster, e.g. 36 vs 56 ms a
step with a 32k vocabulary on loopback, `python -m specwire.bench.contrastive_bench`; float32, since
float16 saved no measurable time and would move near-ties), or — "second" — answers after the expert for the
plausible ids only (`Scoring.score_ids`). Li et al.'s beam scores need every row's normaliser
log Σ exp s, so Li + beams fetches both distributions dense.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import torch
from specwire.orchestrator.beam import beam_step, finish_beams, start_beams
from specwire.orchestrator.context import DecodeContext
from specwire.orchestrator.params import GenerationParams

from specwire.errors import FailedPrecondition
from specwire.processing import NEG_INF, ProcessingConfig, apply_warpers, overflow_limit
from specwire.processing import temperature as scale
from specwire.session import ModelSession, OpenRequest, ScoreKind, Scores, Scoring, StepRequest

# --- the decision: pure functions over [rows, n] score columns ------------------------------


def plausible(expert_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """V_valid = {x : s_e(x) ≥ log α + max_w s_e(w)}, i.e. p_e(x) ≥ α · max_w p_e(w).

    expert_logits: [rows, n], n = the vocabulary or columns holding each row's maximum.
    Returns [rows, n] bool.
    """
    threshold = expert_logits.amax(dim=-1, keepdim=True) + math.log(alpha)  # [rows, 1]
    return expert_logits >= threshold


def obrien_scores(expert_logits: torch.Tensor, amateur_logits: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """O'Brien & Lewis 2023: (1 + β) · s_e(x) − β · s_a(x) for x in V_valid, −inf elsewhere.

    Computed as s_e + β · (s_e − s_a), which has no ∞ − ∞; where a huge β overflows, the row
    takes its limit (`overflow_limit`: the largest s_e − s_a wins).
    expert_logits, amateur_logits: [rows, n] on the same columns. Returns [rows, n].
    """
    contrast = expert_logits + beta * (expert_logits - amateur_logits)  # [rows, n]
    return overflow_limit(contrast.masked_fill(~plausible(expert_logits, alpha), NEG_INF))


def log_partition(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log Z_T = log Σ_w exp(s(w) / T) per row, of the scaled scores `processing.temperature`
    gives (shifted by the row's maximum where s / T would overflow). logits: [rows, vocab] → [rows, 1]."""
    return torch.logsumexp(scale(logits.float(), temperature), dim=-1, keepdim=True)


def li_scores(
    expert_logits: torch.Tensor,
    amateur_logits: torch.Tensor,
    alpha: float,
    tau: float,
    expert_log_z: torch.Tensor,
    amateur_log_z: torch.Tensor,
) -> torch.Tensor:
    """Li et al. 2022: log p_e(x) − log p_a,τ(x) for x in V_head, −inf elsewhere, where
    log p_e(x) = s_e(x) − log Z_e and log p_a,τ(x) = s_a(x) / τ − log Z_a,τ (`log_partition`).

    Logits: [rows, n] on the same columns; log Z: [rows, 1]. Zeros for the log Z shift each row
    by a constant, which leaves its argmax and its softmax (greedy, sampling) unchanged.
    """
    contrast = (expert_logits - expert_log_z) - (scale(amateur_logits, tau) - amateur_log_z)  # [rows, n]
    return overflow_limit(contrast.masked_fill(~plausible(expert_logits, alpha), NEG_INF))


def beam_logscores(form: str, scores: torch.Tensor) -> torch.Tensor:
    """What a beam adds per step: log_softmax(score) for "obrien" (scores are logits), Li's score as is.

    scores: [rows, n] with every finite entry of each row among the n columns.
    """
    return torch.log_softmax(scores, dim=-1) if form == "obrien" else scores


def greedy_column(scores: torch.Tensor, ids: torch.Tensor) -> int:
    """argmax_x score(x), ties to the lowest id. scores, ids: [n]. Returns a column index."""
    best = scores == scores.max()  # [n]
    return int(torch.where(best, ids, torch.iinfo(torch.int64).max).argmin())


def sample_column(scores: torch.Tensor, config: ProcessingConfig, generator: torch.Generator) -> int:
    """x ~ softmax(warp(score)), warp = temperature → top-k → top-p → min-p. scores: [n]."""
    probs = apply_warpers(scores[None, :].float(), config).softmax(dim=-1)  # [1, n]
    return int(torch.multinomial(probs[0], 1, generator=generator))


@dataclass
class Columns:
    """One step's expert and amateur logits on a common set of token columns per row."""

    ids: torch.Tensor  # [rows, n] int64 token ids
    expert: torch.Tensor  # [rows, n] float32
    amateur: torch.Tensor  # [rows, n] float32
    expert_log_z: torch.Tensor  # [rows, 1]: log Z_e when the rows came dense, else 0
    amateur_log_z: torch.Tensor  # [rows, 1]: log Z_a,τ when dense, else 0


def contrastive_scores(params: GenerationParams, columns: Columns) -> torch.Tensor:
    """The request's form on `columns`: [rows, n], −inf off the plausible set."""
    if params.cd_form == "li":
        return li_scores(
            columns.expert,
            columns.amateur,
            params.cd_alpha,
            params.amateur_temperature,
            columns.expert_log_z,
            columns.amateur_log_z,
        )
    return obrien_scores(columns.expert, columns.amateur, params.cd_alpha, params.cd_beta)


# --- the wire: what each step asks the two services for -----------------------------------


@dataclass(frozen=True)
class WirePlan:
    """How a step's scores travel."""

    # "same": the amateur sends dense logits concurrently with the expert;
    # "second": the amateur answers after the expert, for the plausible ids only.
    amateur_round: str = "same"
    amateur_dtype: str = "float32"  # dense amateur logits: "float32" (exact) or "float16"
    expert_top_n: int = 64  # sparse expert logits per row; doubles whenever a row's set reaches past it


DEFAULT_PLAN = WirePlan()
_DENSE = Scoring(ScoreKind.LOGITS)


class _Side:
    """One service's session; its first call opens it with the prompt."""

    def __init__(self, ctx: DecodeContext, session: ModelSession, rows: int) -> None:
        self.ctx = ctx
        self.session = session
        self.rows = rows
        self.opened = False

    async def call(self, scoring: Scoring, append: list[int], order: list[int]) -> Scores:
        ctx = self.ctx
        if self.opened:
            request = StepRequest(branch_order=order, append_ids=append, scoring=scoring, trace=ctx.trace())
            result = await self.session.step(request)
        else:
            opening = OpenRequest(ctx.prompt_ids, ctx.params.processing, self.rows, scoring, ctx.trace())
            result = await self.session.open(opening)
            self.opened = True
        assert result.scores is not None
        return result.scores


def _expert_columns(scores: Scores, alpha: float, vocab: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, logits) [rows, n]; None when a sparse row's plausible set may reach past its n ids."""
    if scores.dense is not None:
        logits = scores.dense.float()  # [rows, vocab]
        return torch.arange(vocab).expand_as(logits), logits
    assert scores.sparse_ids is not None and scores.sparse_values is not None
    ids, logits = scores.sparse_ids.long(), scores.sparse_values.float()  # [rows, n]
    threshold = logits.amax(dim=-1) + math.log(alpha)  # [rows]
    if ids.shape[1] < vocab and bool((logits.amin(dim=-1) >= threshold).any()):
        return None
    return ids, logits


class ContrastivePair:
    """The expert (target) and amateur (draft) sessions, moved in lockstep, scored per step."""

    def __init__(self, ctx: DecodeContext, plan: WirePlan, rows: int, min_top_n: int = 1) -> None:
        self.ctx = ctx
        self.plan = plan
        self.vocab = ctx.target.info.vocab_size
        self.expert = _Side(ctx, ctx.target_session(), rows)
        self.amateur = _Side(ctx, ctx.draft_session(), rows)
        # Li et al.'s beams compare rows, so each row's normalisers matter: both dense.
        self.dense_both = ctx.params.cd_form == "li" and rows > 1
        self.top_n = self.vocab if self.dense_both else min(self.vocab, max(plan.expert_top_n, min_top_n))
        self.dense_fallbacks = 0

    async def step(self, append: list[int], order: list[int]) -> Columns:
        """Append `append` (after `order`) on both services and score every row's next token."""
        alpha = self.ctx.params.cd_alpha
        expert_scoring = _DENSE if self.top_n >= self.vocab else Scoring(ScoreKind.LOGITS, top_n=self.top_n)
        amateur_scores: Scores | None = None
        if self.dense_both or self.plan.amateur_round == "same":
            dtype = "float32" if self.dense_both else self.plan.amateur_dtype
            expert_scores, amateur_scores = await asyncio.gather(
                self.expert.call(expert_scoring, append, order),
                self.amateur.call(Scoring(ScoreKind.LOGITS, logits_dtype=dtype), append, order),
            )
        else:
            expert_scores = await self.expert.call(expert_scoring, append, order)
        columns = _expert_columns(expert_scores, alpha, self.vocab)
        if columns is None:  # re-score the same position densely (the append is already done)
            self.dense_fallbacks += 1
            self.top_n = min(self.vocab, 2 * self.top_n)
            columns = _expert_columns(await self.expert.call(_DENSE, [], []), alpha, self.vocab)
            assert columns is not None
        ids, expert = columns
        if amateur_scores is None:
            wanted = torch.unique(ids[plausible(expert, alpha)]).tolist()  # the union over rows
            amateur_scores = await self.amateur.call(Scoring(ScoreKind.LOGITS, score_ids=tuple(wanted)), append, order)
        # Columns the amateur did not send are off the plausible set: their value never counts.
        amateur_full = amateur_scores.to_dense(self.vocab, 0.0)  # [rows, vocab]
        zeros = torch.zeros(ids.shape[0], 1)
        return Columns(
            ids=ids,
            expert=expert,
            amateur=amateur_full.gather(1, ids),
            expert_log_z=log_partition(expert) if self.dense_both else zeros,
            amateur_log_z=log_partition(amateur_full, self.ctx.params.amateur_temperature) if self.dense_both else zeros,
        )


def _check(ctx: DecodeContext) -> None:
    if ctx.draft is None:
        raise FailedPrecondition("strategy 'contrastive' needs a draft service as the amateur; none is configured")
    if "ngram" in ctx.draft.info.capabilities:
        raise FailedPrecondition("strategy 'contrastive' needs a model as the amateur; the draft service is an n-gram drafter")


def _record(ctx: DecodeContext, valid_set_size: int, differs: bool) -> None:
    ctx.stats.contrastive_steps += 1
    ctx.stats.valid_set_sizes += valid_set_size
    ctx.stats.differs_from_expert += int(differs)


# --- the strategy -------------------------------------------------------------------------


async def contrastive(ctx: DecodeContext, plan: WirePlan = DEFAULT_PLAN) -> AsyncGenerator[list[int], None]:
    """Greedy or sampled contrastive decoding, or contrastive beam search when num_beams > 1."""
    _check(ctx)
    if ctx.params.num_beams > 1:
        async for ids in _beam(ctx, plan):
            yield ids
        return
    params = ctx.params
    pair = ContrastivePair(ctx, plan, rows=1)
    append: list[int] = []
    while True:
        with ctx.round(form=params.cd_form) as r:
            columns = await pair.step(append, [])
            scores = contrastive_scores(params, columns)[0]  # [n]
            row_ids = columns.ids[0]  # [n]
            if params.do_sample:
                column = sample_column(scores, params.processing, ctx.generator)
            else:
                column = greedy_column(scores, row_ids)
            token = int(row_ids[column])
            expert_choice = int(row_ids[greedy_column(columns.expert[0], row_ids)])
            valid_set_size = int(torch.isfinite(scores).sum())
            _record(ctx, valid_set_size, token != expert_choice)
            r.set(token=token, expert_token=expert_choice, valid_set_size=valid_set_size, dense_fallbacks=pair.dense_fallbacks)
        append = [token]
        yield append


async def _beam(ctx: DecodeContext, plan: WirePlan) -> AsyncGenerator[list[int], None]:
    """Contrastive beam search: `beam_step` over per-beam top-K contrastive log-scores."""
    params = ctx.params
    state, eos_ids = start_beams(ctx)
    pair = ContrastivePair(ctx, plan, rows=params.num_beams, min_top_n=state.beams_to_keep)
    while not state.done:
        with ctx.round(form=params.cd_form, num_beams=params.num_beams) as r:
            columns = await pair.step(state.appended, state.branch_order)
            step_scores = beam_logscores(params.cd_form, contrastive_scores(params, columns))  # [beams, n]
            top_scores, top_columns = torch.topk(step_scores, min(state.beams_to_keep, step_scores.shape[1]), dim=-1)
            candidates = columns.ids.gather(1, top_columns)  # [beams, K]
            # The best continuation overall, against its own beam's expert argmax.
            best = int((top_scores + state.running_scores[:, None]).flatten().argmax())
            beam, rank = divmod(best, top_scores.shape[1])
            expert_choice = int(columns.ids[beam, columns.expert[beam].argmax()])
            valid_set_size = round(float(torch.isfinite(step_scores).sum(dim=-1).float().mean()))
            _record(ctx, valid_set_size, int(candidates[beam, rank]) != expert_choice)
            beam_step(state, candidates, top_scores, eos_ids)
            r.set(valid_set_size=valid_set_size, dense_fallbacks=pair.dense_fallbacks)
    yield finish_beams(ctx, state)
