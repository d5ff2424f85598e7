"""Beam search with transformers' semantics, over per-beam candidates from the target service.

Each step the service returns, per running beam, the top-K processed log-probabilities
(K = beams_to_keep = max(2, 1 + n_eos) · num_beams): the global top-K over beams × vocabulary
lies within their union, so nothing else needs to cross the wire. `beam_step` is the decision,
as in `GenerationMixin._beam_search`:

- candidates: the top K of running_score + log p over all beams;
- a candidate that hits a stop (eos, or the length limit) becomes a hypothesis only at rank
  < num_beams, scored sum(log p) / (generated length incl. eos)^length_penalty; the best
  num_beams hypotheses are kept;
- the best num_beams candidates that did not stop continue;
- `early_stopping`: True stops once num_beams hypotheses exist; False stops when the best
  running beam at its current length cannot beat the worst hypothesis; "never" (with
  length_penalty > 0) assumes the running beam could reach max length.

Masks are −inf (transformers uses −1e9, which a strongly negative length penalty can undercut),
applied with `torch.where`, and hypothesis scores are float64, so |length_penalty| up to the
request bound (`params.MAX_LENGTH_PENALTY`) neither overflows nor lets a mask win: a request
gets back only hypotheses that really finished.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import torch
from specwire.orchestrator.context import BeamSequence, DecodeContext

from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, StepRequest

MASKED = float("-inf")


def beams_to_keep(num_beams: int, n_eos: int) -> int:
    """Candidates each step keeps per beam: enough that num_beams of them do not stop."""
    return max(2, 1 + n_eos) * num_beams


def length_normalized(sum_logprobs: torch.Tensor, length: int, length_penalty: float) -> torch.Tensor:
    """sum log p / length^length_penalty (transformers' BeamHypotheses), in float64. [n] → [n]."""
    return sum_logprobs.double() / torch.tensor(float(length), dtype=torch.float64).pow(length_penalty)


@dataclass
class BeamState:
    num_beams: int
    beams_to_keep: int
    max_new_tokens: int
    length_penalty: float
    early_stopping: bool | str
    running_scores: torch.Tensor  # [num_beams] float32
    running_tokens: torch.Tensor  # [num_beams, generated] int64
    finished_scores: torch.Tensor  # [num_beams] float32
    finished_tokens: list[list[int]]
    finished_flags: torch.Tensor  # [num_beams] bool
    improvable: bool = True
    generated: int = 0
    done: bool = False
    # What the service must do to follow: new branch i continues old branch order[i] + token i.
    branch_order: list[int] = field(default_factory=list)
    appended: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, num_beams: int, n_eos: int, max_new_tokens: int, length_penalty: float, early_stopping: bool | str) -> BeamState:
        running = torch.full((num_beams,), MASKED, dtype=torch.float32)
        running[0] = 0.0  # every beam starts as the prompt: only one may expand at first
        return cls(
            num_beams=num_beams,
            beams_to_keep=beams_to_keep(num_beams, n_eos),
            max_new_tokens=max_new_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            running_scores=running,
            running_tokens=torch.empty((num_beams, 0), dtype=torch.long),
            finished_scores=torch.full((num_beams,), MASKED, dtype=torch.float64),
            finished_tokens=[[] for _ in range(num_beams)],
            finished_flags=torch.zeros(num_beams, dtype=torch.bool),
        )


def beam_step(state: BeamState, cand_ids: torch.Tensor, cand_logprobs: torch.Tensor, eos_ids: frozenset[int]) -> None:
    """Advance `state` by one token. cand_ids, cand_logprobs: [num_beams, K] per-beam top-K."""
    nb, keep = state.num_beams, state.beams_to_keep
    accumulated = (cand_logprobs.float() + state.running_scores[:, None]).flatten()  # [nb·K]
    top_scores, top_index = torch.topk(accumulated, keep)  # [keep]
    source = top_index // cand_ids.shape[1]  # beam each candidate extends
    tokens = cand_ids.flatten()[top_index].long()  # [keep]
    candidate_tokens = torch.cat([state.running_tokens[source], tokens[:, None]], dim=1)  # [keep, generated+1]
    length = state.generated + 1
    hits = torch.tensor([int(t) in eos_ids for t in tokens]) | (length >= state.max_new_tokens)

    # Hypotheses: only candidates ranked < num_beams that just stopped.
    just_finished = hits & (torch.arange(keep) < nb) & torch.isfinite(top_scores)
    if bool(state.finished_flags.all()) and state.early_stopping is True or not state.improvable:
        just_finished = torch.zeros_like(just_finished)
    hypothesis = torch.where(just_finished, length_normalized(top_scores, length, state.length_penalty), MASKED)
    merged_scores = torch.cat([state.finished_scores, hypothesis])
    best = torch.topk(merged_scores, nb).indices.tolist()
    merged_flags = torch.cat([state.finished_flags, just_finished])
    state.finished_tokens = [
        state.finished_tokens[i] if i < nb else candidate_tokens[i - nb].tolist() for i in best
    ]
    state.finished_scores = merged_scores[best]
    state.finished_flags = merged_flags[best]

    # Running beams: the best candidates that did not stop.
    running = torch.where(hits, MASKED, top_scores)
    chosen = torch.topk(running, nb).indices
    state.running_scores = running[chosen]
    state.running_tokens = candidate_tokens[chosen]
    state.branch_order = source[chosen].tolist()
    state.appended = tokens[chosen].tolist()
    state.generated = length

    # Could a running beam still beat the worst hypothesis?
    if state.early_stopping == "never" and state.length_penalty > 0.0:
        best_length = state.max_new_tokens
    else:
        best_length = state.generated
    best_possible = length_normalized(state.running_scores[:1], best_length, state.length_penalty)[0]
    worst = state.finished_scores.min() if bool(state.finished_flags.all()) else torch.tensor(MASKED)
    alive = bool(torch.isfinite(state.running_scores[0]))
    state.improvable = state.improvable and alive and bool(best_possible > worst)
    all_full = bool(state.finished_flags.all()) and state.early_stopping is True
    state.done = not state.improvable or all_full or bool(hits.all())


def candidates(scores: Scores, num_beams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's candidate ids and log-probabilities: [num_beams, K] each."""
    if scores.sparse_ids is not None and scores.sparse_values is not None:
        return scores.sparse_ids.view(num_beams, -1), scores.sparse_values.view(num_beams, -1)
    assert scores.dense is not None
    dense = scores.dense.view(num_beams, -1).float()
    ids = torch.arange(dense.shape[1]).expand_as(dense)
    return ids, dense


def start_beams(ctx: DecodeContext) -> tuple[BeamState, frozenset[int]]:
    """The request's beam state, and the eos ids that end a hypothesis (none with ignore_eos)."""
    params = ctx.params
    eos_ids: frozenset[int] = frozenset() if params.ignore_eos else ctx.eos_token_ids
    state = BeamState.start(
        params.num_beams, len(eos_ids), params.max_new_tokens, params.length_penalty, params.early_stopping
    )
    return state, eos_ids


def return_sequences(ctx: DecodeContext, ranked: list[BeamSequence]) -> list[int]:
    """Leave the best `num_return_sequences` of `ranked` (best first) in `ctx.sequences`, scores
    clamped to float32's range (the wire's type); return the best one's tokens."""
    lowest = -torch.finfo(torch.float32).max
    kept = ranked[: ctx.params.num_return_sequences]
    ctx.sequences = [BeamSequence(sequence.token_ids, max(lowest, sequence.score)) for sequence in kept]
    return ctx.sequences[0].token_ids


def finish_beams(ctx: DecodeContext, state: BeamState) -> list[int]:
    """The finished hypotheses into `ctx.sequences` (`return_sequences`); the best one's tokens."""
    ranked = [
        BeamSequence(tokens, float(score))
        for tokens, score, finished in zip(
            state.finished_tokens, state.finished_scores.tolist(), state.finished_flags.tolist(), strict=True
        )
        if finished
    ]
    if not ranked:  # no candidate ever had a finite score: the best running beam stands in
        score = length_normalized(state.running_scores[:1], max(1, state.generated), state.length_penalty)
        ranked = [BeamSequence(state.running_tokens[0].tolist(), float(score[0]))]
    return return_sequences(ctx, ranked)


async def beam_search(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    state, eos_ids = start_beams(ctx)
    scoring = Scoring(ScoreKind.LOGPROBS, top_n=state.beams_to_keep)
    target = ctx.target_session()
    with ctx.round(num_beams=params.num_beams):
        result = await target.open(OpenRequest(ctx.prompt_ids, params.processing, params.num_beams, scoring, ctx.trace()))
        assert result.scores is not None
        ctx.stats.expansions += result.scores.rows
        beam_step(state, *candidates(result.scores, params.num_beams), eos_ids)
    while not state.done:
        with ctx.round(num_beams=params.num_beams):
            request = StepRequest(
                branch_order=state.branch_order, append_ids=state.appended, scoring=scoring, trace=ctx.trace()
            )
            result = await target.step(request)
            assert result.scores is not None
            ctx.stats.expansions += result.scores.rows
            beam_step(state, *candidates(result.scores, params.num_beams), eos_ids)
    yield finish_beams(ctx, state)
