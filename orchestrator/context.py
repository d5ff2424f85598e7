"""What a strategy gets to work with: parameters, prompt, model handles, generator, statistics.

`DecodeContext.round()` is where every round is observed: counted in the statistics, traced as
a span under the generation's root span (with the strategy's own attributes — γ, drafted,
accepted — and the round's time split by part, measured without clock sync), and fed to the
metrics. `trace()` hands strategies the context their service messages carry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from opentelemetry.trace import Span
from specwire.orchestrator.models import CallStats, ModelHandle
from specwire.orchestrator.params import GenerationParams
from specwire.orchestrator.stats import RunStats

from specwire import telemetry
from specwire.errors import FailedPrecondition
from specwire.metrics import OrchestratorMetrics
from specwire.session import ModelSession


@dataclass
class BeamSequence:
    token_ids: list[int]
    score: float


@dataclass
class Round:
    """One decoding round: strategies record what happened in it (drafted, accepted, …)."""

    index: int
    attributes: dict[str, object] = field(default_factory=dict)

    def set(self, **attributes: object) -> None:
        self.attributes.update(attributes)


@dataclass(frozen=True)
class RoundBreakdown:
    """Where one round's wall time went. Without parallel calls the parts add up to `wall_ms`:
    draft compute + target compute + queue + network + orchestrator."""

    wall_ms: float
    waiting_ms: float  # at least one service call outstanding
    target: CallStats  # each service's share of the round: `CallStats.since`
    draft: CallStats

    @property
    def orchestrator_ms(self) -> float:
        return max(0.0, self.wall_ms - self.waiting_ms)

    def parts_ms(self) -> dict[str, float]:
        """The round's latency by part, keyed as `specwire.metrics.ROUND_PARTS`."""
        return {
            "draft": self.draft.compute_ms,
            "target": self.target.compute_ms,
            "queue": self.draft.queue_ms + self.target.queue_ms,
            "network": self.draft.network_ms + self.target.network_ms,
            "orchestrator": self.orchestrator_ms,
        }

    def span_attributes(self) -> dict[str, float | int]:
        attributes: dict[str, float | int] = {
            "specwire.round.wall_ms": self.wall_ms,
            "specwire.round.waiting_ms": self.waiting_ms,
            "specwire.round.orchestrator_ms": self.orchestrator_ms,
            "specwire.round.bytes_sent": self.target.bytes_sent + self.draft.bytes_sent,
            "specwire.round.bytes_received": self.target.bytes_received + self.draft.bytes_received,
        }
        for label, totals in (("target", self.target), ("draft", self.draft)):
            prefix = f"specwire.round.{label}"
            attributes[f"{prefix}.calls"] = totals.calls
            attributes[f"{prefix}.compute_ms"] = totals.compute_ms
            attributes[f"{prefix}.queue_ms"] = totals.queue_ms
            attributes[f"{prefix}.network_ms"] = totals.network_ms
            attributes[f"{prefix}.bytes_sent"] = totals.bytes_sent
            attributes[f"{prefix}.bytes_received"] = totals.bytes_received
        return attributes


def _span_value(value: object) -> str | bool | int | float:
    """A round attribute as a span attribute value (those are primitives)."""
    return value if isinstance(value, (str, bool, int, float)) else str(value)


@dataclass
class DecodeContext:
    params: GenerationParams
    prompt_ids: list[int]
    target: ModelHandle
    draft: ModelHandle | None
    eos_token_ids: frozenset[int]
    generator: torch.Generator
    stats: RunStats = field(default_factory=RunStats)
    # Beam search leaves its finished hypotheses here, best first.
    sequences: list[BeamSequence] = field(default_factory=list)
    # Target-only decoding: the most tokens one round may ask the target for (1 = one per trip).
    max_tokens_per_round: int = 16
    _sessions: list[ModelSession] = field(default_factory=list)
    # Observability, all None when off: the generation's tracer and root span, the metrics.
    tracing: telemetry.Tracing | None = None
    root_span: Span | None = None
    metrics: OrchestratorMetrics | None = None
    _round_span: Span | None = None
    _carrier: dict[str, str] | None = None

    def target_session(self) -> ModelSession:
        session = self.target.session(self.stats.target)
        self._sessions.append(session)
        return session

    def draft_session(self) -> ModelSession:
        if self.draft is None:
            raise FailedPrecondition(f"strategy {self.params.strategy!r} needs a draft service; none is configured")
        session = self.draft.session(self.stats.draft)
        self._sessions.append(session)
        return session

    @contextmanager
    def round(self, **attributes: object) -> Iterator[Round]:
        """Wrap one round's service calls and decision: counts it in the statistics and, when on,
        traces it as a span under the root and records its latency parts in the metrics."""
        current = Round(self.stats.rounds, dict(attributes))
        self.stats.rounds += 1
        if self.tracing is None and self.metrics is None:
            yield current
            return
        strategy = self.params.strategy
        target_before, draft_before = replace(self.stats.target), replace(self.stats.draft)
        clock = self.stats.target.clock
        waiting_before = clock.elapsed_s()
        span = None
        if self.tracing is not None:
            span = self.tracing.start_span(
                "round",
                telemetry.parent(self.root_span),
                attributes={"specwire.strategy": strategy, "specwire.round.index": current.index},
            )
            self._round_span, self._carrier = span, None
        started = time.perf_counter()
        try:
            yield current
        except Exception as error:
            if span is not None:
                telemetry.record_error(span, error)
            raise
        finally:
            breakdown = RoundBreakdown(
                wall_ms=(time.perf_counter() - started) * 1e3,
                waiting_ms=(clock.elapsed_s() - waiting_before) * 1e3,
                target=self.stats.target.since(target_before),
                draft=self.stats.draft.since(draft_before),
            )
            if span is not None:
                self._round_span, self._carrier = None, None
                span.set_attributes({f"specwire.round.{k}": _span_value(v) for k, v in current.attributes.items()})
                span.set_attributes(breakdown.span_attributes())
                span.end()
            if self.metrics is not None:
                drafted, accepted = current.attributes.get("drafted"), current.attributes.get("accepted")
                self.metrics.round_finished(
                    strategy,
                    breakdown.wall_ms / 1e3,
                    {part: ms / 1e3 for part, ms in breakdown.parts_ms().items()},
                    {
                        "target": (breakdown.target.bytes_sent, breakdown.target.bytes_received),
                        "draft": (breakdown.draft.bytes_sent, breakdown.draft.bytes_received),
                    },
                    drafted if isinstance(drafted, int) else None,
                    accepted if isinstance(accepted, int) else None,
                )

    def trace(self) -> dict[str, str] | None:
        """The W3C trace context the next service message carries: the current round's span (the
        root's between rounds). None when tracing is off."""
        if self.tracing is None:
            return None
        if self._carrier is None:
            span = self._round_span or self.root_span
            self._carrier = telemetry.carrier(span) if span is not None else {}
        return self._carrier or None

    def draw_seed(self) -> int:
        """A seed for a service-side sampler, drawn from the request's generator."""
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    async def close(self) -> None:
        for session in self._sessions:
            await session.close()
        self._sessions.clear()
