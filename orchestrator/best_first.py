"""Best-first beam search (Meister, Vieira and Cotterell, "Best-First Beam Search", TACL 2020).

Hypotheses wait in a queue ordered by score, the sum of log-probabilities. The best is popped:
a finished one (eos, or max_new_tokens reached) is kept when it ranks below num_beams among the
hypotheses of its length popped so far; any other is expanded, its children queued, while its
length has had fewer than num_beams expansions. Those are `beam`'s rules (`beam.beam_step`), met
in score order. A child never scores above its parent, so pops come best first and the search
ends when the num_return_sequences-th finished hypothesis is popped: nothing left can beat it.
With length_penalty 0 and early_stopping false or never, the result is `beam`'s
(docs/best-first-beam.md has the argument and the conditions).

Pops are decided one at a time. A forward only supplies distributions: when a pop needs an
unscored hypothesis, the forward scores with it the best other unscored hypotheses of its length
that the length's budget could still expand, so a search whose order runs length by length costs
one forward per length, as beam's does. An extra row may go unused; it never changes a decision.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import AsyncGenerator

import torch
from specwire.orchestrator.beam import beams_to_keep, candidates, return_sequences
from specwire.orchestrator.context import BeamSequence, DecodeContext

from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest

Hypothesis = tuple[int, ...]  # the generated tokens; () is the prompt alone


class BestFirstSearch:
    """The queue and its rules, without sockets: `next_rows` says what to score, `supply` gives it."""

    def __init__(self, num_beams: int, num_return: int, max_new_tokens: int, eos_ids: frozenset[int]) -> None:
        self.num_beams = num_beams
        self.num_return = num_return
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.finished: list[BeamSequence] = []  # best first
        self._arrival = itertools.count()  # breaks ties between equal scores: first queued, first popped
        self._queue: list[tuple[float, int, Hypothesis]] = [(-0.0, next(self._arrival), ())]  # a min-heap on −score
        # Scored hypotheses: their children and the children's scores (float32 sums, as beam's).
        self._children: dict[Hypothesis, list[tuple[Hypothesis, float]]] = {}
        self._scored_at: defaultdict[int, list[Hypothesis]] = defaultdict(list)  # by length
        self._popped: Counter[int] = Counter()  # by length
        self._expanded: Counter[int] = Counter()  # by length
        self._waiting: Hypothesis | None = None  # expanded, its scores not yet supplied
        self._deepest: BeamSequence | None = None  # the first expanded at the greatest length

    def is_finished(self, hypothesis: Hypothesis) -> bool:
        return len(hypothesis) >= self.max_new_tokens or bool(hypothesis) and hypothesis[-1] in self.eos_ids

    def next_rows(self) -> list[Hypothesis]:
        """Pop until a pop needs an unscored hypothesis; return the hypotheses the next forward
        scores, that one first. [] once the search is over."""
        while self._queue and len(self.finished) < self.num_return:
            negative_score, _, hypothesis = heapq.heappop(self._queue)
            length = len(hypothesis)
            rank = self._popped[length]
            self._popped[length] += 1
            if self.is_finished(hypothesis):
                if rank < self.num_beams:
                    self.finished.append(BeamSequence(list(hypothesis), -negative_score))
                continue
            if self._expanded[length] == self.num_beams:
                continue
            self._expanded[length] += 1
            if self._deepest is None or length > len(self._deepest.token_ids):
                self._deepest = BeamSequence(list(hypothesis), -negative_score)
            if hypothesis not in self._children:
                self._waiting = hypothesis
                return [hypothesis, *self._companions(hypothesis)]
            self._queue_children(hypothesis)
        return []

    def _companions(self, hypothesis: Hypothesis) -> list[Hypothesis]:
        """The best unscored, unfinished children of scored hypotheses one token shorter, as many
        as the length may still expand: the rows a length-by-length order scores next."""
        length = len(hypothesis)
        room = self.num_beams - self._expanded[length]
        pending = [
            (score, child)
            for parent in self._scored_at[length - 1]
            for child, score in self._children[parent]
            if child != hypothesis and child not in self._children and not self.is_finished(child)
        ]
        return [child for _, child in heapq.nlargest(room, pending)]

    def supply(self, rows: list[Hypothesis], ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Scores for `rows` (as `next_rows` gave them): ids, logprobs [rows, K], each row's top K
        candidates; padding (id < 0) and masked (−inf) candidates are dropped."""
        scores = {hypothesis: self._score_of(hypothesis) for hypothesis in rows}
        parent_scores = torch.tensor([scores[hypothesis] for hypothesis in rows], dtype=torch.float32)
        child_scores = logprobs.float() + parent_scores[:, None]  # [rows, K], float32 as in beam_step
        for hypothesis, row_ids, row_scores in zip(rows, ids.tolist(), child_scores.tolist(), strict=True):
            self._children[hypothesis] = [
                ((*hypothesis, token), score)
                for token, score in zip(row_ids, row_scores, strict=True)
                if token >= 0 and score > float("-inf")
            ]
            self._scored_at[len(hypothesis)].append(hypothesis)
        if self._waiting is not None:
            self._queue_children(self._waiting)
            self._waiting = None

    def _score_of(self, hypothesis: Hypothesis) -> float:
        if not hypothesis:
            return 0.0
        parent = hypothesis[:-1]
        return next(score for child, score in self._children[parent] if child == hypothesis)

    def _queue_children(self, hypothesis: Hypothesis) -> None:
        for child, score in self._children[hypothesis]:
            heapq.heappush(self._queue, (-score, next(self._arrival), child))

    def result(self) -> list[BeamSequence]:
        """The finished hypotheses, best first; if every continuation was masked before any
        finished, the deepest expanded hypothesis stands in (as beam's best running beam does)."""
        if self.finished or self._deepest is None:
            return list(self.finished)
        return [self._deepest]


def plan_rows(rows: list[Hypothesis], batch: list[Hypothesis]) -> tuple[int, list[int], list[int]]:
    """How a session whose rows hold `rows` comes to hold `batch` (hypotheses of one length), one
    per row: cut every row to its first `kept` generated tokens, take row `order[i]` for batch[i]
    (forking a row taken twice), and append `append_ids` (batch[i][kept:], row after row). Each
    batch hypothesis takes the row it shares the longest prefix with; a child of a row costs its
    last token, anything else is recomputed past the shortest prefix kept."""

    def shared(row: Hypothesis, hypothesis: Hypothesis) -> int:
        return next((i for i, (a, b) in enumerate(zip(row, hypothesis, strict=False)) if a != b), min(len(row), len(hypothesis)))

    assert len({len(hypothesis) for hypothesis in batch}) == 1, "one length per forward"
    order = [max(range(len(rows)), key=lambda r: shared(rows[r], hypothesis)) for hypothesis in batch]
    kept = min(shared(rows[r], hypothesis) for r, hypothesis in zip(order, batch, strict=True))
    return kept, order, [token for hypothesis in batch for token in hypothesis[kept:]]


async def best_first_beam(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    eos_ids: frozenset[int] = frozenset() if params.ignore_eos else ctx.eos_token_ids
    search = BestFirstSearch(params.num_beams, params.num_return_sequences, params.max_new_tokens, eos_ids)
    scoring = Scoring(ScoreKind.LOGPROBS, top_n=beams_to_keep(params.num_beams, len(eos_ids)))
    target = ctx.target_session()
    rows = search.next_rows()  # the prompt alone, scored by the open
    with ctx.round(rows=1, length=0):
        result = await target.open(OpenRequest(ctx.prompt_ids, params.processing, 1, scoring, ctx.trace()))
        assert result.scores is not None
        ctx.stats.expansions += result.scores.rows
        search.supply(rows, *candidates(result.scores, 1))
    while batch := search.next_rows():
        kept, order, append_ids = plan_rows(rows, batch)
        keep_tokens = len(ctx.prompt_ids) + kept if kept < len(rows[0]) else None
        with ctx.round(rows=len(batch), length=len(batch[0])):
            request = StepRequest(
                keep_tokens=keep_tokens, branch_order=order, append_ids=append_ids, scoring=scoring, trace=ctx.trace()
            )
            result = await target.step(request)
            assert result.scores is not None
            ctx.stats.expansions += result.scores.rows
            search.supply(batch, *candidates(result.scores, len(batch)))
        rows = batch
    yield return_sequences(ctx, search.result())
