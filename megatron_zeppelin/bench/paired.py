"""Paired step-time ratios of two strategies measured by ``zeppelin bench train``.

Every strategy of a ``bench train`` run trains the same documents in the same steps (same seed,
same flags), so step ``i`` of round ``r`` is the same global batch for all of them: the ratio
of two strategies' times of that step cancels what the batch itself costs (its documents'
lengths), which dominates the spread of the raw step times. A round's steps share the machine's
load of those seconds, so the rounds, not the steps, are the independent samples: the ratio is
summarised per round (geometric mean of its steps' ratios), and the rounds give the overall
geometric mean and its 95% confidence interval (Student's t over the rounds' log ratios; none
with one round).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# two-sided 95% quantiles of Student's t by degrees of freedom 1-30; more rounds use df 30's
# (a slightly wider interval than theirs)
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Paired:
    """``steps / reference`` step by step: the geometric mean over the rounds, each round's
    geometric mean, and the 95% confidence interval (``None`` with one round)."""

    ratio: float
    rounds: tuple[float, ...]
    low: float | None
    high: float | None

    def text(self) -> str:
        """``0.96x (95% CI 0.93-0.99, 5 rounds)``."""
        ci = f"95% CI {self.low:.2f}-{self.high:.2f}, " if self.low is not None else ""
        return f"{self.ratio:.2f}x ({ci}{len(self.rounds)} round{'s' * (len(self.rounds) > 1)})"


def paired(steps: Sequence[float], reference: Sequence[float], per_round: int) -> Paired:
    """Step-by-step ratios of ``steps`` over ``reference`` (seconds of the same steps, round
    after round, ``per_round`` each) summarised by round (module doc). Raises ``ValueError``
    when the two do not hold the same whole rounds."""
    if per_round < 1 or not steps or len(steps) != len(reference) or len(steps) % per_round:
        raise ValueError(f"paired step times need the same whole rounds of {per_round} steps: "
                         f"got {len(steps)} and {len(reference)}")
    logs = [math.log(a / b) for a, b in zip(steps, reference)]
    rounds = [statistics.fmean(logs[i:i + per_round]) for i in range(0, len(logs), per_round)]
    mean = statistics.fmean(rounds)
    low = high = None
    if len(rounds) > 1:
        t = T_975[min(len(rounds) - 1, len(T_975)) - 1]
        half = t * statistics.stdev(rounds) / math.sqrt(len(rounds))
        low, high = math.exp(mean - half), math.exp(mean + half)
    return Paired(math.exp(mean), tuple(math.exp(r) for r in rounds), low, high)
