"""A forward-cost curve: (new positions a row, ms) points, read between and beyond them.

The engine learns such curves from the forwards it serves (`engine.batch_costs`); the
orchestrator plans speculative rounds with them (`orchestrator.speedup`).
"""

from __future__ import annotations

from collections.abc import Sequence


def forward_cost_at(costs: Sequence[tuple[int, float]], positions: int) -> float:
    """The cost at `positions`, from points (positions, ms) in ascending order: linear between
    them, along the last two beyond them, the first below it."""
    if not costs:
        raise ValueError("no forward costs measured")
    if positions <= costs[0][0] or len(costs) == 1:
        return costs[0][1]
    for (n0, ms0), (n1, ms1) in zip(costs, costs[1:], strict=False):
        if positions <= n1:
            return ms0 + (ms1 - ms0) * (positions - n0) / (n1 - n0)
    (n0, ms0), (n1, ms1) = costs[-2], costs[-1]
    return ms1 + (ms1 - ms0) * (positions - n1) / (n1 - n0)
