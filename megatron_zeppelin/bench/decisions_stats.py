"""The statistical test of ``zeppelin bench decisions``: is the pick's measured step
distinguishable from the fastest candidate's? Two-sided exact Wilcoxon-Mann-Whitney rank-sum
test on the two candidates' timed repeats (midranks for ties; the exact permutation
distribution of the rank sum, counted over every split of the pooled ranks, so no normal
approximation at the 3-10 repeats the benchmark takes)."""
from __future__ import annotations

from typing import Sequence

TEST = "two-sided exact Mann-Whitney U"
ALPHA = 0.05  # a pick whose p-value vs the fastest is >= ALPHA is indistinguishable from it


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values`` (ascending), ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return out


def _subset_sums(doubled: Sequence[int], size: int) -> dict[int, int]:
    """{sum: number of subsets of ``size`` items of ``doubled`` with that sum}."""
    table: list[dict[int, int]] = [{0: 1}] + [{} for _ in range(size)]
    for value in doubled:
        for k in range(size, 0, -1):
            for s, count in table[k - 1].items():
                table[k][s + value] = table[k].get(s + value, 0) + count
    return table[size]


def mann_whitney_p(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Two-sided exact p-value of the rank-sum test of ``xs`` vs ``ys`` (1.0 when either is
    empty): the share of equally likely splits of the pooled midranks whose rank sum of
    ``len(xs)`` items is at least as far from its mean as the observed one."""
    if not xs or not ys:
        return 1.0
    doubled = [round(2 * r) for r in ranks([*xs, *ys])]  # midranks are halves
    observed = sum(doubled[:len(xs)])
    mean2 = len(xs) * sum(doubled)  # 2 * n_total * mean rank sum (integers)
    total = len(doubled)
    far = abs(total * observed - mean2)
    sums = _subset_sums(doubled, len(xs))
    hits = sum(c for s, c in sums.items() if abs(total * s - mean2) >= far)
    return hits / sum(sums.values())


def smallest_p(n_x: int, n_y: int) -> float:
    """The smallest p-value the test can give at these sizes without ties (its resolution)."""
    return mann_whitney_p([float(i) for i in range(n_x)],
                          [float(n_x + i) for i in range(n_y)])


def indistinguishable(pick: Sequence[float], fastest: Sequence[float],
                      alpha: float = ALPHA) -> bool:
    """The pick's repeats are not shown slower than the fastest's at level ``alpha``."""
    return mann_whitney_p(pick, fastest) >= alpha
