"""What a batched forward costs, by its rows and its width, learnt from the forwards served.

A forward of R rows, each W new positions wide (rows of other widths are packed: W is their
mean, rounded up), costs neither R times one row's forward nor what one row of W positions
costs: on a CPU the matrix products grow with the R·W positions and attention with the rows. Speculation under
load must price a verification of γ drafts at what it does to the whole batch, R rows of γ + 1
positions (`ServerTiming.batch_costs`), so the table keeps what each (R, W) took.

Where (R, W) was not met yet, it is estimated from the nearest width met at R rows, plus what
the extra positions cost along the one-row curve: cost(R, W') + c₁(R·W) − c₁(R·W'), c₁ the
one-row forward at that many positions (a matrix product's cost follows its positions, whatever
rows they come in); with nothing met at R rows, c₁(R·W).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specwire.cost_curve import forward_cost_at

WEIGHT = 0.2  # of each new forward in an entry's moving average
# The widths a curve reports (`ServerTiming.batch_costs`, `Info.forward_costs`): 1 = a decode
# step, γ + 1 = a verification of γ drafts.
CURVE_POSITIONS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


class BatchCosts:
    """Milliseconds of a forward by (rows, width): moving averages of the forwards served."""

    def __init__(self) -> None:
        self._ms: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()  # recorded on the forward thread, read by the sessions'

    def record(self, rows: int, width: int, ms: float) -> None:
        key = (rows, width)
        with self._lock:
            old = self._ms.get(key)
            self._ms[key] = ms if old is None else (1.0 - WEIGHT) * old + WEIGHT * ms

    def clear(self) -> None:
        """Forget every entry (the forwards changed, e.g. they run compiled now)."""
        with self._lock:
            self._ms.clear()

    def curve(self, rows: int, widths: Sequence[int]) -> list[tuple[int, float]]:
        """(width, ms) of a forward of `rows` rows at each of `widths`; empty when nothing was
        served at one row yet (no curve to estimate from)."""
        with self._lock:
            table = dict(self._ms)
        solo = sorted((width, ms) for (r, width), ms in table.items() if r == 1)
        if not solo:
            return []
        met = sorted((width, ms) for (r, width), ms in table.items() if r == rows)
        return [(width, _estimate(table, solo, met, rows, width)) for width in widths]


def _estimate(
    table: dict[tuple[int, int], float],
    solo: list[tuple[int, float]],
    met: list[tuple[int, float]],
    rows: int,
    width: int,
) -> float:
    if (rows, width) in table:
        return table[rows, width]
    if not met:
        return forward_cost_at(solo, rows * width)
    near, near_ms = min(met, key=lambda point: (abs(point[0] - width), point[0]))
    shift = forward_cost_at(solo, rows * width) - forward_cost_at(solo, rows * near)
    # A wider forward never costs less than a narrower one met, nor a narrower one more, nor
    # R rows less than one row of the same width.
    if width > near:
        return max(near_ms, near_ms + shift)
    return max(min(near_ms, near_ms + shift), forward_cost_at(solo, width))
