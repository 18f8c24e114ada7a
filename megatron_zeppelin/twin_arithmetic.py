"""Float arithmetic in the order the C++ planner twin evaluates it (``csrc/planner*``), so that
the Python reference and the twin compute bit-identical doubles: a left-to-right sum and
``numpy.interp``'s piecewise-linear interpolation of one point.
"""
from __future__ import annotations

from typing import Sequence


def add_up(values) -> float:
    """Left-to-right float sum, the order the C++ planner twin adds in (``sum`` compensates
    float rounding from Python 3.12 on, so it would differ from the twin by an ulp)."""
    total = 0.0
    for value in values:
        total += value
    return total


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear interpolation of one point, clamped at the ends: ``numpy.interp``'s
    expression (``slope * (x - xs[j]) + ys[j]``), which the C++ planner twin evaluates too, so
    that both compute the same double. ``xs`` ascending."""
    if x <= xs[0]:
        return ys[0]
    last = len(xs) - 1
    if x >= xs[last]:
        return ys[last]
    j = 0
    while xs[j + 1] <= x:
        j += 1
    if xs[j] == x:
        return ys[j]
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return slope * (x - xs[j]) + ys[j]

