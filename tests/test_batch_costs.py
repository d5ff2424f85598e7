"""`BatchCosts`: what a batched forward costs by (rows, width), read from the forwards served."""

from __future__ import annotations

import pytest

from specwire.cost_curve import forward_cost_at
from specwire.engine.batch_costs import CURVE_POSITIONS, BatchCosts, monotone


def cost(rows: int, width: int) -> float:
    """A compute-bound forward: a fixed part (the weights) and a part a position."""
    return 10.0 + 0.5 * rows * width


def nondecreasing(curve: list[tuple[int, float]]) -> bool:
    return all(a[1] <= b[1] for a, b in zip(curve, curve[1:], strict=False))


def test_pooling_adjacent_violators_gives_the_nearest_nondecreasing_curve() -> None:
    assert monotone([(1, 10.0), (2, 30.0), (3, 20.0), (4, 40.0)]) == [(1, 10.0), (2, 25.0), (3, 25.0), (4, 40.0)]
    assert monotone([(1, 30.0), (2, 20.0), (3, 10.0)]) == [(1, 20.0), (2, 20.0), (3, 20.0)]
    assert monotone([(1, 1.0), (5, 2.0)]) == [(1, 1.0), (5, 2.0)]
    assert monotone([]) == []


def test_a_curve_timed_out_of_order_reads_nondecreasing_in_width() -> None:
    """One forward timed while another process held the cores (width 8 at twice its cost, width 12
    at half) must not make a wider forward look cheaper than a narrower one."""
    costs = BatchCosts()
    for width in CURVE_POSITIONS:
        costs.record(1, width, cost(1, width) * {8: 2.0, 12: 0.5}.get(width, 1.0))
    curve = costs.curve(1, CURVE_POSITIONS)
    assert nondecreasing(curve)
    assert dict(curve)[1] == cost(1, 1)  # the widths before the disorder stay as timed


def test_a_batch_width_not_met_is_read_off_the_widths_met_at_its_rows() -> None:
    """Eight rows that all speculate meet only wide forwards; a decode step's cost at 8 rows is
    then read along their own slope (exact for a + b·R·W), not from a one-row curve timed under
    other load (here twice as dear at 8 positions as the same curve at 4, 16)."""
    costs = BatchCosts()
    for width in (1, 2, 4, 16):
        costs.record(1, width, cost(1, width))
    costs.record(1, 8, 2 * cost(1, 8))
    for width in (2, 6):
        costs.record(8, width, cost(8, width))
    curve = dict(costs.curve(8, CURVE_POSITIONS))
    for width in (1, 2, 3, 4, 6, 8, 16):
        assert curve[width] == pytest.approx(cost(8, width))


def test_one_width_met_at_a_batch_reads_the_others_along_the_one_row_curve() -> None:
    costs = BatchCosts()
    for width in (1, 2, 4, 8, 16):
        costs.record(1, width, cost(1, width))
    costs.record(4, 1, cost(4, 1))
    curve = dict(costs.curve(4, (1, 2, 8)))
    # c₁(4·2) − c₁(4·1) from the one-row curve; 4·8 = 32 positions is past it: its mean slope
    assert curve == pytest.approx({1: cost(4, 1), 2: cost(4, 2), 8: cost(4, 8)})


def test_rows_never_met_cost_what_their_positions_cost_in_one_row() -> None:
    costs = BatchCosts()
    assert costs.curve(2, (1,)) == []  # nothing timed: no curve
    costs.record(1, 4, 12.0)
    costs.record(1, 16, 18.0)
    # Beyond its last point the curve goes on at its mean slope, 0.5 ms a position.
    assert costs.curve(3, (2, 4, 8)) == [(2, 13.0), (4, 16.0), (8, 22.0)]


def test_a_batch_never_costs_less_than_one_row_of_its_width() -> None:
    costs = BatchCosts()
    for width in (1, 4, 16):
        costs.record(1, width, cost(1, width))
    costs.record(2, 8, 5.0)  # a forward timed impossibly fast
    costs.record(2, 16, 6.0)
    curve = dict(costs.curve(2, (1, 8, 16)))
    assert curve[8] >= cost(1, 8) and curve[16] >= cost(1, 16)
    assert nondecreasing(sorted(curve.items()))


def test_batch_costs_keep_each_shape_met_and_estimate_the_others_along_the_one_row_curve() -> None:
    costs = BatchCosts()
    assert costs.curve(8, (1, 5)) == []  # nothing at one row yet: no curve to read
    for width, ms in [(1, 10.0), (8, 30.0), (16, 50.0)]:
        costs.record(1, width, ms)
    costs.record(8, 1, 40.0)
    costs.record(8, 1, 50.0)  # a moving average: 40 + 0.2 · (50 − 40)
    curve = dict(costs.curve(8, (1, 2, 5)))
    assert curve[1] == pytest.approx(42.0)
    # One width met at 8 rows: 8 rows of 1 plus what 8 → 16 and 8 → 40 positions add on one row,
    # past its last point at its mean slope, (50 − 10) / 15 a position.
    assert curve[2] == pytest.approx(42.0 + 50.0 - 30.0)
    assert curve[5] == pytest.approx(42.0 + (50.0 + 40.0 / 15.0 * 24) - 30.0)
    costs.record(8, 5, 70.0)  # met now: the measurement wins, and 2 lies between two met widths
    curve = dict(costs.curve(8, (2, 5)))
    assert curve[5] == 70.0 and curve[2] == pytest.approx(42.0 + (70.0 - 42.0) / 4)
    assert dict(costs.curve(3, (1,)))[1] == pytest.approx(forward_cost_at([(1, 10.0), (8, 30.0), (16, 50.0)], 3))
    costs.clear()
    assert costs.curve(1, (1,)) == []
