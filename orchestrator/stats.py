"""Per-request statistics: what the strategies count, and its `GenerationStats` form."""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.orchestrator.entropix import DecisionRecord
from specwire.orchestrator.models import CallStats
from specwire.v1 import orchestrator_pb2


@dataclass
class RunStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    wall_ms: float = 0.0
    ttft_ms: float = 0.0
    # Beam search: target rows scored (hypotheses whose next-token distribution was computed).
    expansions: int = 0
    target: CallStats = field(default_factory=CallStats)
    draft: CallStats = field(default_factory=CallStats)
    # Speculative decoding.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    corrections: int = 0
    bonus_tokens: int = 0
    accepted_length_histogram: list[int] = field(default_factory=list)
    speculative_rounds: int = 0
    gamma_total: int = 0  # draft tokens verified, over speculative rounds
    speculation_off_rounds: int = 0
    target_only_tokens: int = 0
    pipelined_rounds: int = 0
    pipeline_misses: int = 0
    lookup_rounds: int = 0
    lookup_drafted: int = 0
    # The running estimates behind the last round's γ (`speedup.RunningEstimates`).
    alpha_estimate: float = 0.0
    draft_ms_per_token_estimate: float = 0.0
    verify_ms_estimate: float = 0.0
    target_ms_per_token_estimate: float = 0.0
    trip_ms_estimate: float = 0.0
    # Medusa: tree rounds, nodes verified, and rounds in which head k's node was accepted.
    tree_rounds: int = 0
    tree_nodes: int = 0
    head_accepted: list[int] = field(default_factory=list)
    # Contrastive decoding.
    valid_set_sizes: int = 0
    differs_from_expert: int = 0
    contrastive_steps: int = 0
    # Entropix: one record per decided token (the decision trace) and tokens per state.
    decisions: list[DecisionRecord] = field(default_factory=list)
    entropix_states: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One clock for both services: overlapping calls count once as waiting time.
        self.draft.clock = self.target.clock

    @property
    def waiting_ms(self) -> float:
        """Wall time during which at least one service call was outstanding."""
        return self.target.clock.total_s * 1e3

    def record_accepted(self, accepted: int) -> None:
        if len(self.accepted_length_histogram) <= accepted:
            self.accepted_length_histogram.extend([0] * (accepted + 1 - len(self.accepted_length_histogram)))
        self.accepted_length_histogram[accepted] += 1

    @property
    def orchestrator_ms(self) -> float:
        """Wall time not spent waiting on a service; calls in parallel overlap and count once."""
        return max(0.0, self.wall_ms - self.waiting_ms)

    def to_pb(self) -> orchestrator_pb2.GenerationStats:
        target, draft = self.target, self.draft
        total_bytes = target.bytes_sent + target.bytes_received + draft.bytes_sent + draft.bytes_received
        steps = max(1, self.contrastive_steps)
        return orchestrator_pb2.GenerationStats(
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            rounds=self.rounds,
            target_forwards=target.forward_calls,
            draft_forwards=draft.forward_calls,
            wall_ms=self.wall_ms,
            ttft_ms=self.ttft_ms,
            target_compute_ms=target.compute_ms,
            target_queue_ms=target.queue_ms,
            target_network_ms=target.network_ms,
            draft_compute_ms=draft.compute_ms,
            draft_queue_ms=draft.queue_ms,
            draft_network_ms=draft.network_ms,
            orchestrator_ms=self.orchestrator_ms,
            target_bytes_sent=target.bytes_sent,
            target_bytes_received=target.bytes_received,
            draft_bytes_sent=draft.bytes_sent,
            draft_bytes_received=draft.bytes_received,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            mean_accepted_length=self.accepted_tokens / self.rounds if self.drafted_tokens and self.rounds else 0.0,
            accepted_length_histogram=self.accepted_length_histogram,
            tokens_per_target_forward=self.new_tokens / target.forward_calls if target.forward_calls else 0.0,
            corrections=self.corrections,
            bonus_tokens=self.bonus_tokens,
            bytes_per_round=total_bytes / self.rounds if self.rounds else 0.0,
            speculation_off_rounds=self.speculation_off_rounds,
            target_only_tokens=self.target_only_tokens,
            pipelined_rounds=self.pipelined_rounds,
            pipeline_misses=self.pipeline_misses,
            lookup_rounds=self.lookup_rounds,
            lookup_drafted_tokens=self.lookup_drafted,
            mean_gamma=self.gamma_total / self.speculative_rounds if self.speculative_rounds else 0.0,
            alpha_estimate=self.alpha_estimate,
            draft_ms_per_token_estimate=self.draft_ms_per_token_estimate,
            verify_ms_estimate=self.verify_ms_estimate,
            target_ms_per_token_estimate=self.target_ms_per_token_estimate,
            trip_ms_estimate=self.trip_ms_estimate,
            expert_ms_per_step=target.client_ms / steps if self.contrastive_steps else 0.0,
            amateur_ms_per_step=draft.client_ms / steps if self.contrastive_steps else 0.0,
            mean_valid_set_size=self.valid_set_sizes / steps if self.contrastive_steps else 0.0,
            differs_from_expert_rate=self.differs_from_expert / steps if self.contrastive_steps else 0.0,
            sessions_rebuilt=target.rebuilds + draft.rebuilds,
            entropix_states=self.entropix_states,
            expansions=self.expansions,
            medusa_tree_size=self.tree_nodes / self.tree_rounds if self.tree_rounds else 0.0,
            medusa_head_acceptance=[count / self.tree_rounds for count in self.head_accepted],
        )
