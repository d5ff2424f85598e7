"""The latency model of speculative decoding: expected tokens per round, predicted speedup, best γ.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
(arXiv:2211.17192), §3: with per-token acceptance probability α and γ drafted tokens per round,
a round yields E = (1 − α^(γ+1)) / (1 − α) tokens (Eq. 1) and costs γ·c + 1 target-forward
times, c = draft forward time / target forward time; the expected speedup over target-only
decoding is E / (γ·c + 1) (Theorem 3.8).

Across hosts a round also pays the network: in wall time a round takes γ·t_d + t_v + RTT, so
the time per token is (γ·t_d + t_v + RTT) · (1 − α) / (1 − α^(γ+1)), and the best γ minimises
it. Target-only decoding with k tokens per message (multi-step rounds) takes t_s + RTT/k per
token, t_s the target's time per decoded token; speculation pays only when its best γ beats
that. Pure functions, no I/O: `bench` and `experiment` feed them measured figures, and
`RunningEstimates` keeps the figures a generation measures as it goes, so each round's γ (or
a target-only round) minimises the predicted time per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from specwire.cost_curve import forward_cost_at

WILSON_Z = 1.645  # `RunningEstimates.alpha_upper`: a one-sided 95% bound
# The weight a generation's first α takes from earlier ones (`AcceptanceMemory.prior`): about
# 8 rounds' trials at α 0.7, so one round neither turns speculation off nor locks it on.
PRIOR_TRIALS = 20.0
# α's prior where nothing was measured yet: 3 accepted, 2 rejected (0.6, five trials).
FIRST_PRIOR = (3.0, 2.0)
# Milliseconds to verify γ drafts (one target forward over γ + 1 positions), by γ.
VerifyCost = Callable[[int], float]


def expected_tokens_per_round(alpha: float, gamma: float) -> float:
    """E[tokens per round] = (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1, 1 when α = 0."""
    _check_alpha(alpha)
    if gamma < 0:
        raise ValueError(f"gamma must be ≥ 0, got {gamma}")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def tree_tokens_per_round(alpha: float, gamma: int, rescue: float, depths: int) -> float:
    """E of a round whose first `depths` drafts have runners-up beside them: the chain's E, plus
    at each such depth d the chain reaches and misses there (α^(d−1)·(1 − α)) a runner-up's chance
    `rescue` to be the target's token, which ends the round one token longer:
    E + rescue·(1 − α)·Σ_{d=1}^{depths} α^(d−1)."""
    reached = sum(alpha**depth for depth in range(min(depths, gamma)))
    return expected_tokens_per_round(alpha, gamma) + rescue * (1.0 - alpha) * reached


def best_tree_depths(
    alpha: float, gamma: int, rescue: float, alternatives: int, round_ms: float, verify_positions: Callable[[int], float]
) -> int:
    """argmin over m ∈ [0, γ] of (round_ms + t_v(1 + γ + k·m)) / E_tree(m): how many depths get
    their k runners-up, where each costs k more positions in the verification (the smallest m on
    ties; 0 = a chain). `round_ms`: the round's time besides the verification."""
    def per_token(depths: int) -> float:
        verify = verify_positions(1 + gamma + alternatives * depths)
        return (round_ms + verify) / tree_tokens_per_round(alpha, gamma, rescue, depths)

    return min(range(gamma + 1), key=per_token)


def predicted_speedup(alpha: float, gamma: float, cost_ratio: float) -> float:
    """Leviathan et al. Thm. 3.8: E[tokens per round] / (γ·c + 1), against target-only decoding."""
    if cost_ratio < 0:
        raise ValueError(f"cost ratio c must be ≥ 0, got {cost_ratio}")
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1.0)


def time_per_token_ms(gamma: float, alpha: float, draft_ms_per_token: float, verify_ms: float, rtt_ms: float) -> float:
    """(γ·t_d + t_v + RTT) · (1 − α) / (1 − α^(γ+1)): wall time per generated token.

    `rtt_ms` is everything a round pays regardless of γ besides the verify forward: network
    round trips and fixed per-round overhead.
    """
    return (gamma * draft_ms_per_token + verify_ms + rtt_ms) / expected_tokens_per_round(alpha, gamma)


def best_gamma(
    alpha: float, draft_ms_per_token: float, verify_ms: float | VerifyCost, rtt_ms: float, max_gamma: int = 32
) -> int:
    """argmin over γ ∈ [1, max_gamma] of `time_per_token_ms` (the smallest γ on ties); `verify_ms`
    is one cost for every γ, or the cost at each γ (a forward that grows with its positions)."""
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be ≥ 1, got {max_gamma}")
    verify = _verify_cost(verify_ms)
    return min(
        range(1, max_gamma + 1),
        key=lambda gamma: time_per_token_ms(gamma, alpha, draft_ms_per_token, verify(gamma), rtt_ms),
    )


def _verify_cost(verify_ms: float | VerifyCost) -> VerifyCost:
    if callable(verify_ms):
        return verify_ms
    return lambda gamma: verify_ms


def target_only_time_per_token_ms(step_ms_per_token: float, rtt_ms: float, tokens_per_round: int) -> float:
    """t_s + RTT / k: wall time per token when the target decides k tokens per message alone."""
    if tokens_per_round < 1:
        raise ValueError(f"tokens_per_round must be ≥ 1, got {tokens_per_round}")
    return step_ms_per_token + rtt_ms / tokens_per_round


@dataclass(frozen=True)
class RoundPlan:
    """The best γ for the next round, and whether speculating at it beats a target-only round."""

    gamma: int  # the argmin γ; 0 when no draft token fits
    speculative_ms_per_token: float  # predicted at that γ
    target_only_ms_per_token: float  # predicted for a target-only round

    @property
    def speculate(self) -> bool:
        return self.gamma > 0 and self.speculative_ms_per_token <= self.target_only_ms_per_token


def plan_round(
    alpha: float,
    draft_ms_per_token: float,
    verify_ms: float | VerifyCost,
    rtt_ms: float,
    target_ms_per_token: float,
    target_rtt_ms: float,
    tokens_per_round: int,
    max_gamma: int,
) -> RoundPlan:
    """γ* = argmin_γ (γ·t_d + t_v + R)(1 − α)/(1 − α^(γ+1)), to compare with target-only rounds,
    t_s + R_t/k. R counts both services' trips, R_t the target's alone; t_v may depend on γ."""
    off_ms = target_only_time_per_token_ms(target_ms_per_token, target_rtt_ms, tokens_per_round)
    if max_gamma < 1:
        return RoundPlan(0, float("inf"), off_ms)
    verify = _verify_cost(verify_ms)
    gamma = best_gamma(alpha, draft_ms_per_token, verify, rtt_ms, max_gamma)
    spec_ms = time_per_token_ms(gamma, alpha, draft_ms_per_token, verify(gamma), rtt_ms)
    return RoundPlan(gamma, spec_ms, off_ms)


@dataclass
class CopyAcceptance:
    """Drafts copied from the history, as a two-state chain: the first copy is the target's token
    with probability a, each later one, after an accepted one, with c (a loop, once entered, tends
    to go on; i.i.d. α would price long copies too low). A round of γ copies yields
    E = 1 + a·(1 − c^γ)/(1 − c) tokens. a and c: decayed counts, as α's."""

    first: tuple[float, float] = (1.0, 1.0)  # (accepted, rejected) of first copies
    later: tuple[float, float] = (2.0, 1.0)  # of copies after an accepted one

    def record(self, drafted: int, accepted: int, decay: float) -> None:
        if drafted < 1:
            return
        self.first = decayed_counts(*self.first, decay, 1, min(accepted, 1))
        if accepted >= 1 and drafted > 1:
            self.later = decayed_counts(*self.later, decay, drafted - 1, accepted - 1)

    def tokens(self, gamma: int) -> float:
        """E[tokens a round of γ ≥ 1 copies] = 1 + a·E_chain(c, γ − 1)."""
        return 1.0 + alpha_estimate(*self.first) * expected_tokens_per_round(alpha_estimate(*self.later), gamma - 1)

    def best(self, verify_ms: VerifyCost, trip_ms: float, most: int) -> tuple[int, float]:
        """(γ, ms a token): argmin over γ ∈ [1, most] of (t_v(γ) + R_t) / E(γ)."""
        gamma = min(range(1, most + 1), key=lambda g: (verify_ms(g) + trip_ms) / self.tokens(g))
        return gamma, (verify_ms(gamma) + trip_ms) / self.tokens(gamma)


# What a remembered verify scale keeps of its distance from 1 each time a generation takes it up
# (`AcceptanceMemory.verify_scale`).
SCALE_RECALL = 0.9


@dataclass
class AcceptanceMemory:
    """The acceptance counts of a draft/target pair's earlier rounds, across generations: the α a
    new generation starts from. A generation's first rounds are a few trials; from a fixed prior
    of 3 in 5, Gemma-3-270M's first rejection took α under the break-even and its next 30 tokens
    target-only, where the pair's α is 0.73 (auto γ 1.00× greedy against γ 4's 1.15×)."""

    accepted: float = 0.0
    rejected: float = 0.0
    decay: float = 0.99  # ~100 rounds: several generations
    # The draft's ms a token as this orchestrator measured it (`RunningEstimates.draft_ms_per_token`);
    # None until then, when the plan has only the service's warm-up figure (`Info`).
    draft_ms_per_token: float | None = None
    # A target-only token's ms as this rule's rounds measured it (`RunningEstimates.target_ms_per_token`):
    # the service's figure is a greedy step's, and a sampled one also warps and draws
    # (Gemma-3-270M, 2 cores: 9.2 ms against 8.1, which kept sampled speculation off where γ 4 paid).
    target_ms_per_token: float | None = None
    # What verifications took over the target's curve (`RunningEstimates.verify_scale`), by the
    # rows (≥ 2) of the batch they rode in: a generation starts from it, not from 1. The curve's
    # guess at a batch's wider forwards falls short (Gemma-3-270M, 2 cores, 8 rows: ×2.7), and
    # every new generation at 8 streams spent its first rounds finding that out again.
    verify_scales: dict[int, float] = field(default_factory=dict)

    def verify_scale(self, rows: int) -> float | None:
        """The scale remembered at `rows` rows, for a generation whose batch now has them; each
        such reading moves it a little toward 1 (SCALE_RECALL), so a figure that keeps speculation
        off is measured again before long rather than trusted for ever. None at one row (the
        target's own curve, timed alone, is what a verification costs there) or where nothing was
        measured."""
        scale = self.verify_scales.get(rows) if rows >= 2 else None
        if scale is None:
            return None
        self.verify_scales[rows] = 1.0 + SCALE_RECALL * (scale - 1.0)
        return scale

    def record_verify_scale(self, rows: int, scale: float) -> None:
        if rows >= 2:
            self.verify_scales[rows] = scale

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted, self.rejected = decayed_counts(self.accepted, self.rejected, self.decay, drafted, accepted)

    def prior(self, trials: float = PRIOR_TRIALS) -> tuple[float, float]:
        """(accepted, rejected) worth `trials` trials at the remembered α; FIRST_PRIOR before any round."""
        if self.accepted + self.rejected <= 0:
            return FIRST_PRIOR
        alpha = alpha_estimate(self.accepted, self.rejected)
        return alpha * trials, (1.0 - alpha) * trials


# `LoadTrial`: an epoch's length, and how many epochs the better mode runs before the other is
# tried again (the load, and what it favours, may have changed): TRIAL_EXPLOIT_EPOCHS, doubled
# each time the other is tried and loses, up to TRIAL_MAX_EXPLOIT_EPOCHS.
TRIAL_EPOCH_S = 1.0
TRIAL_EXPLOIT_EPOCHS = 4
TRIAL_MAX_EXPLOIT_EPOCHS = 32
TRIAL_WINDOW_S = 1.0  # a generation with no round started for this long no longer counts


@dataclass
class LoadTrial:
    """Whether concurrent generations of a pair may speculate, measured on all of them at once.

    Each generation plans for itself, against what a target-only token costs it. Under load that
    cost is the batch's, and the batch pays for every row's verification: its extra positions,
    and the fused decode steps (`FUSED_STEPS`) a forward with a verification in it cannot take.
    Eight Gemma-3-270M streams on 2 cores: greedy 17.1 ms a token each, but 30 ms for target-only
    rounds among speculating ones, and 32.5 for speculative rounds; each generation saw both
    options alike, and the batch ran at 0.48–0.73× greedy's. So while two or more run, epochs
    of TRIAL_EPOCH_S alternate between letting the plans speculate ("on") and target-only
    rounds for all ("off"), and the generations' tokens a second in each choose: the better mode
    runs for a while, then the other is tried for an epoch; each time it loses again the while
    doubles, so a trial that keeps confirming its choice costs ever less. A lone generation plans
    alone."""

    epoch_s: float = TRIAL_EPOCH_S
    exploit_epochs: int = TRIAL_EXPLOIT_EPOCHS  # the epochs of the better mode before the next try
    max_exploit_epochs: int = TRIAL_MAX_EXPLOIT_EPOCHS
    span: int = 0  # the better mode's epochs now between tries
    exploring: bool = False  # this epoch tries the mode that measured slower
    seen: dict[int, float] = field(default_factory=dict)  # generation → its last round's start
    speculate: bool = True  # this epoch's mode
    started: float | None = None  # this epoch's start (None: no epoch under way)
    tokens: int = 0  # this epoch's tokens, all generations
    rates: dict[bool, float] = field(default_factory=dict)  # tokens a second by mode, moving averages
    left: int = 0  # epochs of the present mode before the other is tried

    def allows(self, generation: int, now: float) -> bool:
        """Whether `generation`'s round starting at `now` may speculate. The running generations
        are those that started a round within TRIAL_WINDOW_S and have not left: one abandoned
        without leaving stops counting then."""
        self.seen[generation] = now
        self.seen = {key: last for key, last in self.seen.items() if now - last <= TRIAL_WINDOW_S}
        if len(self.seen) < 2:
            self.started = None  # an epoch's rate counts concurrent generations only
            return True
        if self.started is None:
            self.started, self.tokens = now, 0
        elif now - self.started >= self.epoch_s:
            self._close(now)
        return self.speculate

    def leave(self, generation: int) -> None:
        self.seen.pop(generation, None)

    def record(self, tokens: int) -> None:
        if self.started is not None:
            self.tokens += tokens

    def _close(self, now: float) -> None:
        assert self.started is not None
        self.rates[self.speculate] = _ema(self.rates.get(self.speculate), self.tokens / (now - self.started), 0.5)
        self.started, self.tokens = now, 0
        if (not self.speculate) not in self.rates:  # each mode's first epoch
            self.speculate, self.exploring = not self.speculate, True
            return
        better = self.rates[True] >= self.rates[False]
        if self.exploring:
            lost = self.speculate != better
            self.span = min(2 * self.span, self.max_exploit_epochs) if lost and self.span else self.exploit_epochs
            self.speculate, self.exploring, self.left = better, False, self.span - 1
        elif self.left > 0:
            self.speculate, self.left = better, self.left - 1
        else:
            self.speculate, self.exploring = not better, True


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class RunningEstimates:
    """One generation's running figures for `plan_round`: moving averages of measured costs and
    decayed acceptance counts (α by `alpha_estimate`, from a prior: 3 accepted, 2 rejected, or
    what earlier generations of the pair accepted, `AcceptanceMemory`). None until measured, unless the
    services timed themselves at warm-up (`seeded`): then the first round is planned too.

    The verify forward's cost depends on γ where a forward's cost grows with its positions (a
    CPU: every position is another row through each matrix product). With the target's
    measured curve (`Info.forward_costs`), t_v(γ) is that curve at γ + 1 positions times
    `verify_scale`, the running ratio of what verifications take now to what the curve says (a
    busier machine, a longer context); without it, t_v is one running figure for every γ.

    Under load both are multiplied by what the batch adds at each width, `load`: a forward of
    the rows the last target message rode in over one row's (`ServerTiming.batch_costs` ÷
    `one_row_costs`); measurements are divided by it, so they stay one-row figures. With every
    row of a batch planning on the same factors, a γ is chosen only where R rows of γ + 1
    positions yield more tokens a millisecond than R rows of one: E(γ) / t(R, γ + 1) against
    1 / t(R, 1), the batch's throughput, not one session's."""

    draft_ms_per_token: float | None = None
    # A draft message's compute is fixed + γ·t_d: it also appends the tokens the last round kept.
    # With the draft's warm-up step (`draft_step_ms`) t_d is at most that, and the rest is fixed;
    # as one figure a token, a short γ made every token look dear and the next γ shorter still
    # (Gemma-3-270M, int4 draft: auto γ 2.08 → 2.17 on average, c 0.19 → 0.16).
    draft_step_ms: float | None = None
    draft_fixed_ms: float | None = None
    draft_measured: bool = False  # the draft figures are this generation's rounds', not a seed
    target_measured: bool = False  # likewise the target-only figures
    verify_ms: float | None = None
    target_ms_per_token: float | None = None  # target-only rounds: compute per decided token
    draft_trip_ms: float | None = None  # a draft message's time beyond the draft's compute
    target_trip_ms: float | None = None  # a target message's time beyond the target's compute
    verify_costs: list[tuple[int, float]] = field(default_factory=list)  # the target's (positions, ms)
    verify_scale: float = 1.0
    # Tree rounds: how often a runner-up was the target's token where the chain's draft was not
    # (decayed counts, from a prior of 1 in 4).
    rescued: float = 1.0
    unrescued: float = 3.0
    load: list[tuple[int, float]] = field(default_factory=list)  # (positions, batch ms ÷ one row's); [] = 1
    batch_rows: int = 0  # the rows of the last batch
    target_one_row_ms: float | None = None  # a target-only token's ms, ÷ the load it met
    accepted: float = FIRST_PRIOR[0]
    rejected: float = FIRST_PRIOR[1]
    # α's memory, ~1 / (1 − decay) rounds. At 0.9 (~30 trials) its noise alone took Gemma-3-270M's
    # α 0.73 under the 0.55 where target-only rounds win, and speculation off (auto γ 0.92× greedy,
    # 1.02× at 0.95, γ 4 fixed 1.12–1.15×).
    decay: float = 0.95

    @classmethod
    def seeded(
        cls,
        verify_costs: list[tuple[int, float]],
        target_ms_per_token: float,
        draft_ms_per_token: float,
        prior: tuple[float, float] = FIRST_PRIOR,
    ) -> RunningEstimates:
        """Starting from the services' warm-up timings (0 = not measured) and α's `prior`
        (accepted, rejected), as `AcceptanceMemory.prior` gives it."""
        return cls(
            draft_ms_per_token=draft_ms_per_token or None,
            draft_step_ms=draft_ms_per_token or None,
            target_ms_per_token=target_ms_per_token or None,
            verify_costs=sorted(verify_costs),
            target_one_row_ms=target_ms_per_token or None,
            accepted=prior[0],
            rejected=prior[1],
        )

    def load_at(self, positions: int) -> float:
        """What the last batch multiplies a forward of `positions` positions by."""
        return forward_cost_at(self.load, positions) if self.load else 1.0

    @property
    def alpha(self) -> float:
        return alpha_estimate(self.accepted, self.rejected)

    @property
    def alpha_upper(self) -> float:
        """The largest α the counts make plausible: the Wilson score bound, one-sided 95%. Probing
        is worth a round only while speculation would pay at this α."""
        trials = self.accepted + self.rejected
        if trials <= 0:
            return 1.0
        z2 = WILSON_Z**2
        p = self.alpha
        spread = WILSON_Z * math.sqrt(p * (1.0 - p) / trials + z2 / (4.0 * trials**2))
        return min(1.0, (p + z2 / (2.0 * trials) + spread) / (1.0 + z2 / trials))

    @property
    def ready(self) -> bool:
        return self.draft_ms_per_token is not None and (self.verify_ms is not None or bool(self.verify_costs))

    def verify_at(self, gamma: int) -> float:
        """Predicted ms of a verification of γ drafts."""
        return self.verify_positions(gamma + 1)

    def verify_positions(self, positions: int) -> float:
        """Predicted ms of a verification forward of `positions` positions."""
        if self.verify_costs:
            return forward_cost_at(self.verify_costs, positions) * self.load_at(positions) * self.verify_scale
        assert self.verify_ms is not None
        return self.verify_ms

    def target_step_ms(self) -> float:
        """Predicted ms a token of a target-only round; until one is measured, what a one-draft
        verification costs."""
        if self.target_one_row_ms is None:
            return self.verify_at(0)
        return self.target_one_row_ms * self.load_at(1)

    def record_load(self, rows: int, batch: list[tuple[int, float]], one_row: list[tuple[int, float]]) -> None:
        """The batch a target message rode in: its rows, and a forward's cost at that many rows and
        at one, by width, where they changed (nothing from a service that does not batch)."""
        if rows == 1:
            self.batch_rows, self.load = 1, []
        elif rows > 1:
            single = dict(one_row)
            factors = [(n, ms / single[n]) for n, ms in sorted(batch) if single.get(n, 0.0) > 0]
            self.batch_rows, self.load = rows, factors or self.load

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        self.accepted, self.rejected = decayed_counts(self.accepted, self.rejected, self.decay, drafted, accepted)

    def record_rescue(self, rescued: bool) -> None:
        """A tree round whose chain missed at a depth with runners-up: whether one was taken."""
        self.rescued, self.unrescued = decayed_counts(self.rescued, self.unrescued, self.decay, 1, int(rescued))

    @property
    def rescue(self) -> float:
        return alpha_estimate(self.rescued, self.unrescued)

    def tree_depths(self, gamma: int, alternatives: int) -> int:
        """The depths of a γ-draft round that get their runners-up (`best_tree_depths`); all of
        them until the round's costs are measured."""
        if not self.ready:
            return gamma
        assert self.draft_ms_per_token is not None
        trips = (self.target_trip_ms or 0.0) + (self.draft_trip_ms or 0.0) + (self.draft_fixed_ms or 0.0)
        round_ms = gamma * self.draft_ms_per_token + trips
        return best_tree_depths(self.alpha, gamma, self.rescue, alternatives, round_ms, self.verify_positions)

    def record_draft(self, compute_ms: float, tokens: int, trip_ms: float) -> None:
        if tokens > 0:
            if not self.draft_measured:  # a seed gives way: averaged in, a stale one would linger
                self.draft_ms_per_token = None
                self.draft_step_ms = min(self.draft_step_ms, compute_ms / tokens) if self.draft_step_ms else None
                self.draft_measured = True
            per_token = compute_ms / tokens if self.draft_step_ms is None else min(compute_ms / tokens, self.draft_step_ms)
            self.draft_ms_per_token = _ema(self.draft_ms_per_token, per_token)
            if self.draft_step_ms is not None:
                self.draft_fixed_ms = _ema(self.draft_fixed_ms, compute_ms - tokens * per_token)
        self.draft_trip_ms = _ema(self.draft_trip_ms, trip_ms)

    def record_verify(self, compute_ms: float, positions: int, trip_ms: float) -> None:
        self.verify_ms = _ema(self.verify_ms, compute_ms)
        if self.verify_costs:
            expected = forward_cost_at(self.verify_costs, positions) * self.load_at(positions)
            self.verify_scale = _ema(self.verify_scale, compute_ms / expected) if expected > 0 else 1.0
        self.target_trip_ms = _ema(self.target_trip_ms, trip_ms)

    def record_target_only(self, compute_ms: float, tokens: int, trip_ms: float) -> None:
        if tokens > 0:
            if not self.target_measured:  # a seed gives way, as the draft's does
                self.target_ms_per_token = self.target_one_row_ms = None
                self.target_measured = True
            self.target_ms_per_token = _ema(self.target_ms_per_token, compute_ms / tokens)
            self.target_one_row_ms = _ema(self.target_one_row_ms, compute_ms / tokens / self.load_at(1))
        self.target_trip_ms = _ema(self.target_trip_ms, trip_ms)

    def record_target_trip(self, trip_ms: float) -> None:
        """A target message's time beyond its compute, from a message of neither kind (the open)."""
        self.target_trip_ms = _ema(self.target_trip_ms, trip_ms)

    def plan(self, tokens_per_round: int, max_gamma: int, draft_trip: bool, optimistic: bool = False) -> RoundPlan:
        """The best next round; `draft_trip` is False when drafting costs no message (n-gram
        drafting in the orchestrator, or a proposal already made in the previous round);
        `optimistic` plans at `alpha_upper` instead of α."""
        assert self.draft_ms_per_token is not None and self.ready
        target_trip = self.target_trip_ms or 0.0
        # Until a draft message is measured, it is taken to cost what a target message does.
        draft_trip_ms = self.draft_trip_ms if self.draft_trip_ms is not None else target_trip
        rtt = target_trip + (draft_trip_ms + (self.draft_fixed_ms or 0.0) if draft_trip else 0.0)
        step = self.target_step_ms()
        alpha = self.alpha_upper if optimistic else self.alpha
        return plan_round(
            alpha, self.draft_ms_per_token, self.verify_at, rtt, step, target_trip, tokens_per_round, max_gamma
        )

    def model_ms_per_token(self, tokens_per_round: int, max_gamma: int) -> float:
        """Predicted ms a token of the best round without copied drafts: the draft model's at
        its best γ ≤ `max_gamma`, or a target-only one."""
        plan = self.plan(tokens_per_round, max_gamma, draft_trip=True)
        return min(plan.speculative_ms_per_token, plan.target_only_ms_per_token)

    def span_attributes(self) -> dict[str, float]:
        figures = {
            "alpha_estimate": self.alpha,
            "draft_ms_per_token": self.draft_ms_per_token,
            "draft_fixed_ms": self.draft_fixed_ms,
            "verify_ms": self.verify_ms,
            "verify_scale": self.verify_scale if self.verify_costs else None,
            "batch_rows": self.batch_rows or None,
            "target_ms_per_token": self.target_ms_per_token,
            "draft_trip_ms": self.draft_trip_ms,
            "target_trip_ms": self.target_trip_ms,
        }
        return {name: value for name, value in figures.items() if value is not None}


def decayed_counts(
    accepted: float, rejected: float, decay: float, drafted: int, accepted_now: int
) -> tuple[float, float]:
    """One verified round added to decayed counts: `accepted_now` successes and, when short of
    `drafted`, one rejection."""
    return decay * accepted + accepted_now, decay * rejected + (1.0 if accepted_now < drafted else 0.0)


def alpha_estimate(accepted: float, rejected: float) -> float:
    """Maximum-likelihood α under the i.i.d. model: accepted / (accepted + rejected).

    Each compared draft token is a Bernoulli(α) trial until the first rejection, so rounds cut
    short by γ (all accepted) contribute only successes. This differs from accepted / drafted,
    which also counts the tokens after a rejection that were never compared.
    """
    trials = accepted + rejected
    if accepted < 0 or rejected < 0:
        raise ValueError(f"counts must be ≥ 0, got {accepted}, {rejected}")
    return accepted / trials if trials else 0.0


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
