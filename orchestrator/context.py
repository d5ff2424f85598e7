"""What a strategy gets to work with: parameters, prompt, model handles, generator, statistics."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from orchestrator.models import ModelHandle
from orchestrator.params import GenerationParams
from orchestrator.stats import RunStats
from specwire.errors import FailedPrecondition
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
    _sessions: list[ModelSession] = field(default_factory=list)

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
        """Wrap one round's service calls and decision; counts it in the statistics."""
        current = Round(self.stats.rounds, dict(attributes))
        self.stats.rounds += 1
        yield current

    def trace(self) -> dict[str, str] | None:
        """The W3C trace context to carry in the next service message (None: tracing off)."""
        return None

    def draw_seed(self) -> int:
        """A seed for a service-side sampler, drawn from the request's generator."""
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    async def close(self) -> None:
        for session in self._sessions:
            await session.close()
        self._sessions.clear()
