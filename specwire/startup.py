"""Time to SERVING, by phase, counted from the process's start: logged and reported in `Info`.

A replica that restarts is the window in which a second failure loses a deployment, so how long
a start takes, and where the time goes, is a figure each service states about itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


def process_age_s() -> float:
    """Seconds since this process was started: its start time in /proc (field 22 of
    /proc/self/stat, clock ticks since boot, read against CLOCK_BOOTTIME); elsewhere 0, so
    phases count from the first clock made."""
    try:
        with open("/proc/self/stat") as stat:
            # The command name (field 2) may hold spaces: count fields after its closing ')'.
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@dataclass(frozen=True)
class StartupTimes:
    """Seconds from the process's start to SERVING, and the phases that time went to, in order."""

    serving_s: float
    phases: tuple[tuple[str, float], ...]

    def describe(self) -> str:
        """One log line's worth: "12.3 s (boot 3.1 s, load 0.5 s, …)"."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        return f"{self.serving_s:.1f} s ({parts})"


@dataclass
class StartupClock:
    """Marks the end of each start-up phase; the first phase runs from the process's start."""

    origin: float = field(default_factory=lambda: time.monotonic() - process_age_s())
    phases: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        """`phase` ended now; it began when the previous one ended."""
        elapsed = time.monotonic() - self.origin
        self.phases.append((phase, elapsed - sum(seconds for _, seconds in self.phases)))

    def times(self) -> StartupTimes:
        return StartupTimes(time.monotonic() - self.origin, tuple(self.phases))
