"""Whether the model services are up, as the orchestrator's replica watchers see them.

Each model-service replica is followed on its own standard health `Watch` stream
(`orchestrator.replicas.ReplicaSet`: one watcher per replica). A role is up while at least one of
its replicas is healthy; the replica sets report every change of that here.

What depends on it: the orchestrator's own health (SERVING while a target replica is up), the
strategies `Info` lists, and the UNAVAILABLE answer to a new request whose service is down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("specwire")

# Strategies that need the draft service, and those the target alone serves.
DRAFT_STRATEGIES = frozenset({"speculative", "contrastive"})


@dataclass
class ServiceStates:
    """The last known state of each model role; both up unless its replica set says otherwise
    (in-process models have none)."""

    target_up: bool = True
    draft_up: bool = True
    # Called after any change, with the new states (the server updates its own health).
    listeners: list[Callable[[ServiceStates], None]] = field(default_factory=list)

    def set(self, label: str, up: bool) -> None:
        before = (self.target_up, self.draft_up)
        if label == "target":
            self.target_up = up
        else:
            self.draft_up = up
        if (self.target_up, self.draft_up) != before:
            log.warning("%s service is %s", label, "up" if up else "unreachable or not serving")
            for listener in self.listeners:
                listener(self)
