"""What a batched forward costs, by its rows and its width, learnt from the forwards served.

A forward of R rows, each W new positions wide (rows of other widths are packed: W is their
mean, rounded up), costs neither R times one row's forward nor what one row of W positions
costs: on a CPU the matrix products grow with the R·W positions and attention with the rows. Speculation under
load must price a verification of γ drafts at what it does to the whole batch, R rows of γ + 1
positions (`ServerTiming.batch_costs`), so the table keeps what each (R, W) took.

A forward's cost never falls as its width grows, so each curve is read through its isotonic fit
(pool adjacent violators): one forward timed while another process held the cores must not make
the widths around it look cheaper or dearer than their order allows. Where (R, W) was not met
yet, it is read off the widths met at R rows (between them, linearly; beyond them, along their
mean slope: a + b·R·W at a fixed R), and where only one width was met, from it plus what the
extra positions cost along the one-row curve, c₁(R·W) − c₁(R·W'); with nothing met at R rows,
c₁(R·W). Beyond its widths a curve goes on at its mean slope: the last two points alone, timed
apart, made a 9-row forward look cheaper the wider it was.
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
        solo = monotone(sorted((width, ms) for (r, width), ms in table.items() if r == 1))
        if not solo:
            return []
        met = monotone(sorted((width, ms) for (r, width), ms in table.items() if r == rows))
        # Monotone in, monotone out: every branch of `_estimate` grows with the width.
        return [(width, _estimate(solo, met, rows, width)) for width in widths]


def monotone(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The nondecreasing fit nearest (least squares) to points in ascending width: pool adjacent
    violators, each pool at its mean (Barlow et al. 1972)."""
    pools: list[list[float]] = []  # [sum, count] of each pool
    for _, ms in points:
        pools.append([ms, 1.0])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    fitted = [total / count for total, count in pools for _ in range(int(count))]
    return [(width, ms) for (width, _), ms in zip(points, fitted, strict=True)]


def _slope(points: list[tuple[int, float]]) -> float:
    """ms a width, first point to last (0 for one point)."""
    (w0, ms0), (w1, ms1) = points[0], points[-1]
    return (ms1 - ms0) / (w1 - w0) if w1 > w0 else 0.0


def _read(points: list[tuple[int, float]], width: int) -> float:
    """A monotone curve at `width`: linear between its points, its first below them, along its
    mean slope beyond them."""
    last_width, last_ms = points[-1]
    if width <= last_width:
        return forward_cost_at(points, width)
    return last_ms + _slope(points) * (width - last_width)


def _estimate(solo: list[tuple[int, float]], met: list[tuple[int, float]], rows: int, width: int) -> float:
    if not met:
        return _read(solo, rows * width)
    floor = _read(solo, width)  # R rows never cost less than one row of the same width
    if len(met) > 1:
        first_width, first_ms = met[0]
        if width < first_width:
            return max(first_ms - _slope(met) * (first_width - width), floor)
        return max(_read(met, width), floor)
    near, near_ms = met[0]
    shift = _read(solo, rows * width) - _read(solo, rows * near)
    return max(near_ms + shift, floor)
