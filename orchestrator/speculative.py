"""Speculative sampling across the draft/target split: lossless, γ draft tokens per target forward.

References: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML, arXiv:2211.17192), Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv:2302.01318), Algorithm 2.

A round is one message to each service: the draft rolls back, appends and proposes γ tokens; the
target rolls back, appends them and scores γ+1 positions; the acceptance rule
(`specwire.acceptance`) decides, here or, for sampled rounds, in the target where p is
(`Step.verify`). Around that: auto γ from the latency model in `speedup` with target-only rounds
when speculation is predicted slower, pipelined drafting, and the n-gram drafter run on the
orchestrator's own history. docs/speculative.md and docs/architecture.md give the message flow.

Statistics: every speculative round yields accepted + 1 tokens (a correction or a bonus), so
before trimming, tokens out = accepted + corrections + bonuses + target-only tokens, and
`accepted_length_histogram` sums to `rounds` − `speculation_off_rounds`. γ never drafts past
`max_new_tokens`, so only an eos or a stop string trims a round.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from specwire.draft_service.ngram import ngram_match, ngram_proposal
from specwire.orchestrator.context import DecodeContext, Round
from specwire.orchestrator.params import LOOKUP_MAX_NGRAM, MAX_SPECULATIVE_TOKENS
from specwire.orchestrator.speedup import (
    AcceptanceMemory,
    CopyAcceptance,
    LoadTrial,
    RunningEstimates,
)

from specwire.acceptance import accept_draft, accept_tree_greedy
from specwire.processing import ProcessingConfig
from specwire.serving import MAX_MESSAGE_BYTES
from specwire.session import ModelInfo, OpenRequest, ScoreKind, Scores, Scoring, StepRequest, StepResult, Verification

FIRST_GAMMA = 4  # auto γ until the first costs are measured
MAX_AUTO_GAMMA = 16
# Target-only rounds between two probes of speculation: a probe pays the draft's trip, so the
# first wait is already a few rounds; each failed probe doubles it.
MIN_BACKOFF = 4
MAX_BACKOFF = 16
# Rounds that ask a draft the plan would rule out on its published cost, to measure it; bounded,
# as a draft that proposes nothing (its confidence threshold) is never measured.
DRAFT_PROBES = 4
# Sampled rounds: the draft proposes from (and sends) its top k only, renormalised. Any q the
# drafts are drawn from keeps the rule exact; this one crosses the wire in k·8 bytes a position.
DRAFT_TOP_K = 128
# Sampled rounds are decided in a target that has the "verify" capability; False keeps the dense
# protocol (p sent back, decided here), as against a target without it.
VERIFY_IN_TARGET = True


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


@dataclass
class Proposal:
    """One round's draft tokens and their q as the draft sent it (sparse from a trimmed or
    truncating draft); `scores` None for a deterministic drafter (one-hot q)."""

    tokens: list[int]
    scores: Scores | None = None  # PROBS, a row per token
    alternatives: list[list[int]] = field(default_factory=list)  # greedy: each token's runners-up

    def rest(self) -> Proposal:
        """The proposal after its first token."""
        return Proposal(self.tokens[1:], self.scores.rows_from(1) if self.scores is not None else None,
                        self.alternatives[1:])

    def probs(self, vocab_size: int) -> torch.Tensor:
        """q dense: [len(tokens), V] float32."""
        if self.scores is None:
            return one_hot_probs(torch.tensor(self.tokens, dtype=torch.long), vocab_size)
        return self.scores.to_dense(vocab_size, 0.0)

    def wire_probs(self) -> Scores:
        """q as it travels to a verifying target: sparse rows, as the draft sent them where it could."""
        if self.scores is None:
            return sparse_draft_probs(self.tokens, None)
        if self.scores.dense is not None:
            return sparse_draft_probs(self.tokens, self.scores.dense.float())
        return self.scores


@dataclass(frozen=True)
class DraftTree:
    """A greedy round's token tree (`Step.tree_parents`): a trunk of the tokens the target lacks,
    ending at the last decided token (the root), then the drafted chain below it, then the
    runners-up of the first `depths` drafts as siblings of those drafts."""

    tokens: list[int]
    parents: list[int]
    root: int  # the trunk's last node
    chain_end: int  # nodes root + 1 … chain_end − 1 are the drafted chain

    @classmethod
    def build(cls, trunk: list[int], proposal: Proposal, depths: int) -> DraftTree:
        root, drafts = len(trunk) - 1, proposal.tokens
        parents = list(range(-1, root))  # the trunk: each node the child of the one before
        parents += [root + depth for depth in range(len(drafts))]  # the chain
        tokens = trunk + drafts
        for depth, others in enumerate(proposal.alternatives[: min(depths, len(drafts))]):
            tokens += others
            parents += [root + depth] * len(others)  # beside the chain's node at this depth
        return cls(tokens, parents, root, root + 1 + len(drafts))

    def decide(self, target_argmax: torch.Tensor) -> tuple[list[int], int, int]:
        """The accepted path (node indices from the trunk's first), how many chain drafts it
        holds, and the next token: the greedy rule from the root (`accept_tree_greedy`)."""
        path, next_token = accept_tree_greedy(torch.tensor(self.tokens), self.parents, target_argmax, start=self.root)
        chained = sum(1 for node in path[self.root + 1 :] if node < self.chain_end)
        return path, chained, next_token


def sparse_draft_probs(tokens: list[int], probs: torch.Tensor | None) -> Scores:
    """q as it travels to a verifying target: each row's nonzero entries only (exact), or the
    one-hot q of a deterministic drafter. probs: [γ, V] or None → sparse rows [γ, k]."""
    if probs is None:
        ids = torch.tensor(tokens, dtype=torch.int32).reshape(-1, 1)  # [γ, 1]
        return Scores(ScoreKind.PROBS, sparse_ids=ids, sparse_values=torch.ones(ids.shape))
    support = max(1, int((probs > 0).sum(dim=-1).max())) if probs.shape[0] else 1
    values, ids = torch.topk(probs, support, dim=-1)  # [γ, k]
    return Scores(ScoreKind.PROBS, sparse_ids=ids.to(torch.int32).masked_fill(values <= 0, -1), sparse_values=values)


def max_sampled_gamma(vocab_size: int, message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """The largest γ whose dense float32 p, (γ+1)·V·4 bytes, fills at most half a message."""
    return max(1, message_bytes // 2 // (4 * vocab_size) - 1)


# What each draft handle's rounds accepted in earlier generations, by target and request rule
# (α depends on both). Weak: an orchestrator's handles go, their memories with them.
_MEMORIES: weakref.WeakKeyDictionary[object, dict[object, AcceptanceMemory]] = weakref.WeakKeyDictionary()


def acceptance_memory(ctx: DecodeContext) -> AcceptanceMemory:
    """The memory of this generation's pair and rule (`AcceptanceMemory`)."""
    assert ctx.draft is not None
    key = (ctx.target.info.model_name, ctx.params.do_sample, ctx.params.processing)
    return _MEMORIES.setdefault(ctx.draft, {}).setdefault(key, AcceptanceMemory())


# The generations of each draft handle that plan their own γ, trying speculation under load together.
_TRIALS: weakref.WeakKeyDictionary[object, LoadTrial] = weakref.WeakKeyDictionary()


def ngram_settings(info: ModelInfo) -> tuple[int, int] | None:
    """(ngram_max, ngram_min) when the draft service is the n-gram drafter, else None."""
    if "ngram" not in info.capabilities:
        return None
    settings = dict(c.split("=", 1) for c in info.capabilities if c.startswith("ngram_") and "=" in c)
    return int(settings.get("ngram_max", 3)), int(settings.get("ngram_min", 1))


async def speculative(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    run = Speculation(ctx)
    produced = 0
    try:
        while produced < ctx.params.max_new_tokens:
            decided = await run.round(ctx.params.max_new_tokens - produced)
            produced += len(decided)
            yield decided
    finally:
        if run.trial is not None:
            run.trial.leave(id(run))


class Speculation:
    """One generation's speculative rounds: sessions, their sync, the running estimates, γ."""

    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        if ctx.draft is None:
            ctx.draft_session()  # refuses: FAILED_PRECONDITION
        assert ctx.draft is not None
        self.target = ctx.target_session()
        # Prompt lookup needs only the history, which is here: drafting it costs no message.
        self.ngram = ngram_settings(ctx.draft.info)
        self.draft = None if self.ngram is not None else ctx.draft_session()
        self.draft_context = ctx.draft.info.max_context
        # Sampled rounds are decided in the target when it can (`Step.verify`): p stays there and
        # only q (k ≤ DRAFT_TOP_K entries a row) travels. Otherwise p travels dense unless the
        # request truncates: keep it under the message limit.
        self.verify_remotely = ctx.params.do_sample and VERIFY_IN_TARGET and "verify" in ctx.target.info.capabilities
        dense_p = ctx.params.do_sample and not self.verify_remotely
        self.wire_gamma = max_sampled_gamma(ctx.target.info.vocab_size) if dense_p else MAX_SPECULATIVE_TOKENS
        self.history = list(ctx.prompt_ids)
        self.target_sync = SessionSync(len(self.history), len(self.history))
        self.draft_sync = SessionSync(len(self.history), len(self.history))
        self.target_opened = self.draft_opened = False
        # The services' warm-up timings and the pair's earlier rounds let the first round be
        # planned, not guessed.
        self.memory = acceptance_memory(ctx)
        # A service times itself once its compiler is done, which may be while another service
        # on the same cores still compiles (Gemma-3-270M's draft: 20.6 ms a token against 1.1):
        # the plan trusts that figure only until the pair's memory holds a measured one.
        self.draft_probes = 0
        draft_ms = 0.0 if self.draft is None else self.memory.draft_ms_per_token or ctx.draft.info.decode_ms_per_token
        target_ms = self.memory.target_ms_per_token or ctx.target.info.decode_ms_per_token
        self.estimates = RunningEstimates.seeded(ctx.target.info.forward_costs, target_ms, draft_ms, self.memory.prior())
        self.pending: Proposal | None = None  # proposed during the previous verification
        # Greedy rounds with a draft model may verify its runners-up too, as a token tree; the
        # target's next step then keeps the tree's accepted path (`tree_keep`).
        self.alternatives = ctx.params.draft_alternatives if self.draft is not None and not ctx.params.do_sample else 0
        self.tree_keep: list[int] = []
        self.off_left = 0  # target-only rounds to run before probing speculation again
        self.off_chunk = 1  # the last target-only round's k
        self.off_rows = 0  # the batch's rows when the target-only rounds began
        self.backoff = MIN_BACKOFF
        self.probing = False
        # Rounds copied from the history beside the draft model's (`lookup_min_ngram`), with
        # their own acceptance by the match's length n.
        self.lookup_min = ctx.params.lookup_min_ngram if self.draft is not None else 0
        self.copies = {n: CopyAcceptance() for n in range(1, LOOKUP_MAX_NGRAM + 1)}
        # Auto γ under load: whether the pair's concurrent generations speculate at all (`LoadTrial`).
        auto = ctx.params.num_speculative_tokens is None
        self.trial = _TRIALS.setdefault(ctx.draft, LoadTrial()) if auto else None

    async def round(self, remaining: int) -> list[int]:
        ctx = self.ctx
        with ctx.round() as current:
            if not self.target_opened:
                before = replace(ctx.stats.target)
                opened = await self.target.open(self._opening())
                self.target_opened = True
                spent = ctx.stats.target.since(before)
                # The batch the prefill rode in: the first round's guess at the load it will meet
                # (planned as one row, eight Gemma-3-270M streams opened at γ 7, 64 positions a forward).
                self._record_load(opened)
                self.estimates.record_target_trip(spent.client_ms - spent.compute_ms)
            allowed = self.trial is None or self.trial.allows(id(self), time.monotonic())
            if self.trial is not None and self.trial.started is not None:  # concurrent: the trial's mode
                current.set(load_trial="on" if allowed else "off")
            if allowed:
                lookup = self._lookup(remaining)
                gamma = len(lookup[1].tokens) if lookup is not None else self._choose_gamma(remaining)
            else:
                lookup, gamma = None, None
                if self.pending is not None:
                    self._discard_pending()
            if gamma is None:
                decided = await self._target_only(remaining, current)
            else:
                decided = await self._speculate(gamma, remaining, current, lookup)
            current.set(**self.estimates.span_attributes())
            self._publish_estimates()
        if self.trial is not None:
            self.trial.record(len(decided))
        self.history += decided
        return decided

    # -- γ ------------------------------------------------------------------------------------

    def _gamma_cap(self, remaining: int, held: int) -> int:
        """Never draft tokens the output cannot take, nor past the draft model's context."""
        return max(0, min(remaining - 1, self.draft_context - held, self.wire_gamma))

    def _choose_gamma(self, remaining: int) -> int | None:
        """This round's γ, or None for a target-only round (auto γ only)."""
        params = self.ctx.params
        cap = self._gamma_cap(remaining, len(self.history))
        if self.pending is not None:
            if len(self.pending.tokens) <= cap:
                return len(self.pending.tokens)
            self._discard_pending()
        if params.num_speculative_tokens is not None or cap == 0:
            return min(params.num_speculative_tokens or 0, cap)
        if not self.estimates.ready:
            return min(FIRST_GAMMA, cap)
        if self.estimates.target_ms_per_token is None:
            return None  # one target-only round measures what speculation must beat
        if self.off_left > 0 and self.estimates.batch_rows != self.off_rows:
            self.off_left = 0  # the batch changed since these rounds began: plan again now
        if self.off_left > 0:
            self.off_left -= 1
            return None
        max_gamma, draft_trip = min(MAX_AUTO_GAMMA, cap), self.draft is not None
        plan = self.estimates.plan(self.ctx.max_tokens_per_round, max_gamma, draft_trip)
        if plan.speculate:
            self.backoff, self.probing = MIN_BACKOFF, False
            return plan.gamma
        if self.draft is not None and self.memory.draft_ms_per_token is None and self.draft_probes < DRAFT_PROBES:
            self.draft_probes += 1
            return min(FIRST_GAMMA, max_gamma)  # a draft ruled out on its own word: measure it first
        # A probe measures α again; it is worth its round only while α might still be high
        # enough for speculation to pay.
        if self.probing and plan.gamma > 0 and self.estimates.plan(
            self.ctx.max_tokens_per_round, max_gamma, draft_trip, optimistic=True
        ).speculate:
            self.probing = False
            return plan.gamma
        # Speculation is predicted slower: target-only rounds, then a probe; each probe that
        # fails doubles the wait before the next.
        self.off_left, self.backoff, self.probing = self.backoff - 1, min(2 * self.backoff, MAX_BACKOFF), True
        self.off_rows = self.estimates.batch_rows
        return None

    def _lookup(self, remaining: int) -> tuple[int, Proposal] | None:
        """This round's drafts copied from the history (`ngram_match`), with the match's n. At a
        fixed γ every match is taken (no timing decides, so a seed replays); auto γ takes one
        where the latency model prices it under the draft model's best round and a target-only
        one: (t_v(γ+1) + R_t) / E_n(γ), no draft time nor trip, E_n the copies' own
        (`CopyAcceptance`)."""
        if not self.lookup_min or self.pending is not None:
            return None
        fixed = self.ctx.params.num_speculative_tokens
        most = max(0, min(fixed or MAX_AUTO_GAMMA, remaining - 1, self.wire_gamma))
        if most == 0:
            return None
        n, tokens = ngram_match(torch.tensor(self.history, dtype=torch.long), most, LOOKUP_MAX_NGRAM, self.lookup_min)
        if n == 0:
            return None
        if fixed:
            return n, Proposal(tokens)
        estimates = self.estimates
        if not estimates.ready:
            return n, Proposal(tokens[:FIRST_GAMMA])
        gamma, copied_ms = self.copies[n].best(estimates.verify_at, estimates.target_trip_ms or 0.0, most)
        if copied_ms > estimates.model_ms_per_token(self.ctx.max_tokens_per_round, most):
            return None
        return n, Proposal(tokens[:gamma])

    def _ahead_gamma(self, drafted: int, remaining: int) -> int:
        """γ of the next round, proposed now on the guess that all of this one is accepted."""
        params = self.ctx.params
        if self.draft is None or not params.speculative_pipeline or self.alternatives:
            return 0
        cap = self._gamma_cap(remaining - drafted - 1, len(self.history) + drafted + 1)
        if params.num_speculative_tokens is not None or cap == 0:
            return min(params.num_speculative_tokens or 0, cap)
        if not self.estimates.ready:
            return min(FIRST_GAMMA, cap)
        plan = self.estimates.plan(self.ctx.max_tokens_per_round, min(MAX_AUTO_GAMMA, cap), draft_trip=False)
        return plan.gamma if plan.speculate else 0

    # -- rounds -------------------------------------------------------------------------------

    async def _target_only(self, remaining: int, current: Round, most: int | None = None) -> list[int]:
        """The target decides up to k tokens in one message, with the request's own rule; k
        doubles from 2 as greedy's rounds do, so the first tokens come as promptly."""
        ctx = self.ctx
        self.off_chunk = min(2 * self.off_chunk, ctx.max_tokens_per_round)
        count = min(self.off_chunk, remaining, most or remaining)
        keep, append = self.target_sync.catch_up(self.history)
        before = replace(ctx.stats.target)
        result = await self.target.step(
            StepRequest(
                tree_keep=self._take_tree_keep(),
                keep_tokens=keep,
                append_ids=append,
                propose=count,
                propose_greedy=not ctx.params.do_sample,
                propose_seed=ctx.draw_seed() if ctx.params.do_sample else 0,
                propose_ids_only=True,
                trace=ctx.trace(),
            )
        )
        assert result.proposed_ids is not None
        decided: list[int] = result.proposed_ids.reshape(-1).tolist()
        spent = ctx.stats.target.since(before)
        # The plan prices target-only rounds at full length: the short first ones (unfused steps,
        # a catch-up append) would overstate a token's cost.
        self._record_load(result)
        if count >= ctx.max_tokens_per_round or self.estimates.target_ms_per_token is None:
            self.estimates.record_target_only(spent.compute_ms, len(decided), spent.client_ms - spent.compute_ms)
            self.memory.target_ms_per_token = self.estimates.target_one_row_ms
        else:
            self.estimates.record_target_trip(spent.client_ms - spent.compute_ms)
        held = len(self.history) + len(decided)
        self.target_sync = SessionSync(held, held)
        ctx.stats.speculation_off_rounds += 1
        ctx.stats.target_only_tokens += len(decided)
        current.set(gamma=0, speculation="off", tokens=len(decided))
        return decided

    async def _speculate(
        self, gamma: int, remaining: int, current: Round, lookup: tuple[int, Proposal] | None = None
    ) -> list[int]:
        """One round: the draft model's proposal (or the pipelined one), or `lookup`'s copy."""
        ctx = self.ctx
        pipelined = self.pending is not None
        proposal = lookup[1] if lookup is not None else self.pending or await self._propose(gamma)
        self.pending = None
        drafts = proposal.tokens
        if not drafts:
            # Nothing to verify (no n-gram match, or a draft under its confidence threshold):
            # the target's one message may as well decide as many tokens as a fully accepted
            # round would have, and the drafter looks again after them.
            return await self._target_only(remaining, current, most=gamma + 1)
        ahead_gamma = self._ahead_gamma(len(drafts), remaining) if lookup is None else 0
        tree: DraftTree | None = None
        ahead: Proposal | None = None
        depths = self._tree_depths(proposal)
        if depths > 0:
            verified, tree = await self._verify_tree(proposal, depths)
        elif ahead_gamma > 0:
            verified, ahead = await asyncio.gather(self._verify(proposal), self._propose_ahead(drafts, ahead_gamma + 1))
        else:
            verified, ahead = await self._verify(proposal), None
        base = len(self.history)
        if tree is None:
            accepted_len, next_token = _decide(ctx, proposal, verified)
            kept, chained = drafts[:accepted_len], accepted_len
            self.target_sync = SessionSync(base + len(drafts), base + accepted_len)
        else:
            assert verified.scores is not None and verified.scores.argmax_ids is not None
            path, chained, next_token = tree.decide(verified.scores.argmax_ids)
            kept = [tree.tokens[node] for node in path[tree.root + 1 :]]
            accepted_len = len(kept)
            self.tree_keep = path  # the target holds the history and the accepted nodes after it
            self.target_sync = SessionSync(base + accepted_len, base + accepted_len)
            if chained < min(depths, len(drafts)):  # the chain missed where runners-up stood
                self.estimates.record_rescue(accepted_len > chained)
            ctx.stats.tree_rounds += 1
            ctx.stats.tree_nodes += len(tree.tokens) - tree.root
            current.set(tree_size=len(tree.tokens) - tree.root, tree_depths=depths)
        if ahead is not None:
            # The draft holds history + drafts + [guess] + its next proposal.
            held = base + len(drafts) + len(ahead.tokens)
            # The draft may propose nothing (its confidence threshold, or no draft replica left).
            if ahead.tokens and accepted_len == len(drafts) and next_token == ahead.tokens[0]:
                self.draft_sync = SessionSync(held, held)
                if len(ahead.tokens) > 1:
                    self.pending = ahead.rest()
            else:
                self.draft_sync = SessionSync(held, base + accepted_len)
                ctx.stats.pipeline_misses += 1
        elif self.draft is not None and lookup is None:  # copied drafts: the draft never saw them
            # Past the chain's accepted drafts, a runner-up and the next token are new to the draft.
            self.draft_sync = SessionSync(base + len(drafts), base + chained)
        # A round with nothing to draft (no n-gram match) yields one token: a failed trial. α is
        # the chain's: a runner-up taken counts in `rescue`.
        if lookup is None:
            self.estimates.record_acceptance(max(1, len(drafts)), chained)
            self.memory.record(max(1, len(drafts)), chained)
        else:
            n = lookup[0]
            self.copies[n].record(len(drafts), chained, self.estimates.decay)
            ctx.stats.lookup_rounds += 1
            ctx.stats.lookup_drafted += len(drafts)
        _count(ctx, len(drafts), accepted_len)
        ctx.stats.pipelined_rounds += int(pipelined)
        ctx.stats.speculative_rounds += 1
        ctx.stats.gamma_total += len(drafts)
        current.set(
            gamma=gamma, drafted=len(drafts), accepted=accepted_len, speculation="on", pipelined=pipelined,
            lookup_ngram=lookup[0] if lookup is not None else 0,
        )
        return kept + [next_token]

    async def _propose(self, gamma: int) -> Proposal:
        """γ draft tokens for the history: n-gram lookup here, or one message to the draft model."""
        if gamma == 0:
            return Proposal([])
        if self.draft is None:
            assert self.ngram is not None
            started = time.perf_counter()
            tokens = ngram_proposal(torch.tensor(self.history, dtype=torch.long), gamma, *self.ngram)
            self.estimates.record_draft((time.perf_counter() - started) * 1e3, gamma, 0.0)
            return Proposal(tokens)
        if not self.draft_opened:
            await self.draft.open(self._opening(self._draft_processing()))
            self.draft_opened = True
            self.draft_sync = SessionSync(len(self.history), len(self.history))
        proposal = await self._draft_step(self.history, gamma)
        held = len(self.history) + len(proposal.tokens)
        self.draft_sync = SessionSync(held, held)
        return proposal

    async def _propose_ahead(self, drafts: list[int], count: int) -> Proposal:
        """The draft's guess at this round's bonus token, then the next round's drafts."""
        return await self._draft_step(self.history + drafts, count)

    async def _draft_step(self, history: list[int], count: int) -> Proposal:
        ctx, params = self.ctx, self.ctx.params
        assert self.draft is not None
        keep, append = self.draft_sync.catch_up(history)
        before = replace(ctx.stats.draft)
        result = await self.draft.step(
            StepRequest(
                keep_tokens=keep,
                append_ids=append,
                propose=count,
                propose_greedy=not params.do_sample,
                propose_seed=ctx.draw_seed() if params.do_sample else 0,
                propose_min_confidence=params.draft_confidence_threshold,
                propose_alternatives=self.alternatives,
                trace=ctx.trace(),
            )
        )
        assert result.proposed_ids is not None
        tokens: list[int] = result.proposed_ids.reshape(-1).tolist()  # may be fewer than asked
        alternatives: list[list[int]] = []
        if result.alternative_ids is not None and tokens:
            alternatives = result.alternative_ids.reshape(len(tokens), -1).tolist()
        spent = ctx.stats.draft.since(before)
        # The first step carries the prompt's prefill, and one after target-only rounds their
        # tokens: a prefill, not what a round costs (as a round's fixed cost, 30 caught-up tokens
        # took Gemma-3-270M's draft from 1.3 to 2.3 ms a round, and the next round target-only).
        if ctx.stats.draft.calls > 2 and len(append) <= 1:
            self.estimates.record_draft(spent.compute_ms, len(tokens), spent.client_ms - spent.compute_ms)
            if self.estimates.draft_measured:
                self.memory.draft_ms_per_token = self.estimates.draft_ms_per_token
        return Proposal(tokens, result.proposal_scores if params.do_sample else None, alternatives)

    async def _verify(self, proposal: Proposal) -> StepResult:
        """The target scores the γ+1 positions the drafts decide, in one forward; sampled rounds
        are decided there too when it can, on q and a seed from here."""
        ctx, drafts = self.ctx, proposal.tokens
        keep, append = self.target_sync.catch_up(self.history)
        kind = ScoreKind.PROBS if ctx.params.do_sample else ScoreKind.ARGMAX
        verify = None
        if self.verify_remotely:
            verify = Verification(proposal.wire_probs(), ctx.draw_seed())
        return await self._send_verification(
            StepRequest(
                tree_keep=self._take_tree_keep(),
                keep_tokens=keep,
                append_ids=append + drafts,
                scoring=Scoring(kind, positions=len(drafts) + 1),
                verify=verify,
                trace=ctx.trace(),
            )
        )

    def _tree_depths(self, proposal: Proposal) -> int:
        """How many of the proposal's depths get their runners-up (`RunningEstimates.tree_depths`);
        0 (a chain) without runners-up, or where the tree would not fit the target's context (a
        tree takes a cache slot a node until the next step keeps one path)."""
        if not proposal.alternatives:
            return 0
        depths = self.estimates.tree_depths(len(proposal.tokens), self.alternatives)
        nodes = 1 + len(proposal.tokens) + sum(len(others) for others in proposal.alternatives[:depths])
        return depths if len(self.history) + nodes <= self.ctx.target.info.max_context else 0

    async def _verify_tree(self, proposal: Proposal, depths: int) -> tuple[StepResult, DraftTree]:
        """The target scores every node of the round's tree (`DraftTree`) in one forward."""
        ctx = self.ctx
        keep, trunk = self.target_sync.catch_up(self.history)
        if not trunk:  # the target holds the last decided token: it goes again, as the root
            keep, trunk = len(self.history) - 1, self.history[-1:]
        tree = DraftTree.build(trunk, proposal, depths)
        verified = await self._send_verification(
            StepRequest(
                tree_keep=self._take_tree_keep(),
                keep_tokens=keep,
                append_ids=tree.tokens,
                tree_parents=tree.parents,
                scoring=Scoring(ScoreKind.ARGMAX, positions=len(tree.tokens)),
                trace=ctx.trace(),
            )
        )
        return verified, tree

    async def _send_verification(self, request: StepRequest) -> StepResult:
        """One verification message to the target; its cost (at the positions it scores) and load
        go into the estimates."""
        ctx = self.ctx
        before = replace(ctx.stats.target)
        verified = await self.target.step(request)
        spent = ctx.stats.target.since(before)
        self._record_load(verified)
        if ctx.stats.target.calls > 2:  # the first step carries the prompt's prefill
            self.estimates.record_verify(spent.compute_ms, request.scoring.positions, spent.client_ms - spent.compute_ms)
            self.memory.record_verify_scale(self.estimates.batch_rows, self.estimates.verify_scale)
        return verified

    # -- bookkeeping --------------------------------------------------------------------------

    def _take_tree_keep(self) -> list[int]:
        """The last tree's accepted path, for the target's next step (once)."""
        kept, self.tree_keep = self.tree_keep, []
        return kept

    def _opening(self, processing: ProcessingConfig | None = None) -> OpenRequest:
        processing = processing or self.ctx.params.processing
        return OpenRequest(self.history, processing, 1, Scoring(ScoreKind.NONE), self.ctx.trace())

    def _draft_processing(self) -> ProcessingConfig:
        """The request's warping, and for sampled rounds at most the top `DRAFT_TOP_K` tokens."""
        processing = self.ctx.params.processing
        if not self.ctx.params.do_sample:
            return processing
        return replace(processing, top_k=min(processing.top_k or DRAFT_TOP_K, DRAFT_TOP_K))

    def _record_load(self, result: StepResult) -> None:
        """The batch a target reply rode in (`RunningEstimates.record_load`); at rows other than the
        last reply's, the verify scale the pair's rounds measured at those rows (1 alone)."""
        timing, rows = result.timing, self.estimates.batch_rows
        self.estimates.record_load(timing.batch_rows, timing.batch_costs, timing.one_row_costs)
        if self.estimates.batch_rows != rows:
            remembered = self.memory.verify_scale(self.estimates.batch_rows)
            alone = self.estimates.batch_rows == 1
            self.estimates.verify_scale = remembered or (1.0 if alone else self.estimates.verify_scale)

    def _discard_pending(self) -> None:
        """Drop a pipelined proposal: the draft keeps the history, not the proposal."""
        self.pending = None
        self.draft_sync = SessionSync(self.draft_sync.held, len(self.history))

    def _publish_estimates(self) -> None:
        stats, estimates = self.ctx.stats, self.estimates
        stats.alpha_estimate = estimates.alpha
        stats.draft_ms_per_token_estimate = estimates.draft_ms_per_token or 0.0
        stats.verify_ms_estimate = estimates.verify_ms or 0.0
        stats.target_ms_per_token_estimate = estimates.target_ms_per_token or 0.0
        stats.trip_ms_estimate = (estimates.target_trip_ms or 0.0) + (estimates.draft_trip_ms or 0.0)


def _decide(ctx: DecodeContext, proposal: Proposal, verified: StepResult) -> tuple[int, int]:
    """Accepted length and next token: the target's verdict, or decided here from its scores."""
    if verified.verdict is not None:
        return verified.verdict.accepted_len, verified.verdict.next_token
    scores = verified.scores
    assert scores is not None
    draft_tokens = torch.tensor(proposal.tokens, dtype=torch.long)  # [γ']
    if not ctx.params.do_sample:
        assert scores.argmax_ids is not None
        return accept_greedy(draft_tokens, scores.argmax_ids)
    vocab_size = ctx.target.info.vocab_size
    target_probs = scores.to_dense(vocab_size, 0.0)  # [γ'+1, V]
    return accept_draft(draft_tokens, proposal.probs(vocab_size), target_probs, ctx.generator)


def _count(ctx: DecodeContext, drafted: int, accepted_len: int) -> None:
    stats = ctx.stats
    stats.drafted_tokens += drafted
    stats.accepted_tokens += accepted_len
    if accepted_len < drafted:
        stats.corrections += 1
    else:
        stats.bonus_tokens += 1
    stats.record_accepted(accepted_len)
