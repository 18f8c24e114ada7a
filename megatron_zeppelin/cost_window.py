"""The sliding window's part of the cost model (``cost_model``): the share of a sequence's
attention work a window keeps, and a windowed ring's work per step and rows per hop
(``CostKernel.window_parts`` fills ``WindowParts``; a ring sums them in a ``RingWindow``).
The C++ planner twin (``csrc/planner.h``, ``planner_costs.cpp``) mirrors each of them.
No torch; below the planner.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


def window_work(seqlen, window: int, share: float):
    """The fraction of a causal sequence's attention work (``s^2``, the dense model's count)
    its layers do when ``share`` of them attend a sliding window of ``window`` tokens
    (Megatron's ``window_size=(window, 0)``): ``(1 - share) + share * kept``, where a windowed
    layer keeps ``(2 s (W + 1) - W (W + 1)) / s^2`` of it (at most 1; 1 while s <= W + 1).
    ``seqlen``: a number or a numpy array; 1.0 without a window (``share`` 0). The C++
    planner twin (``Costs::window_work``) evaluates the same expression."""
    if share <= 0.0:
        return 1.0
    if isinstance(seqlen, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):  # short ones take 1.0
            kept = np.minimum(1.0, window_kept(seqlen, window))
        return (1.0 - share) + share * np.where(seqlen > window + 1.0, kept, 1.0)
    if seqlen <= window + 1.0:
        return 1.0
    return (1.0 - share) + share * min(1.0, window_kept(seqlen, window))


def window_kept(seqlen, window: int):
    """``(2 s (W + 1) - W (W + 1)) / s^2``: a windowed layer's share of the dense count, valid
    once s > W + 1 (before the cap at 1)."""
    w = window + 1.0
    return (2.0 * seqlen * w - window * w) / (seqlen * seqlen)


class WindowParts(NamedTuple):
    """A windowed layer's ring work of one rank's share of a sequence, all windowed layers
    (seconds: ``first`` at step 0, ``rest`` spread over the steps within ``reach`` of it,
    ``even`` over every step), the rows each hop carries, and whether the window fits in
    each of its zigzag chunks on a ring of 3 or more (``halo``: ``zigzag_window.halo_fits``)
    (``CostKernel.window_parts``)."""

    even: float
    first: float
    rest: float
    reach: int
    kv: float
    dkv: float
    halo: bool = False


class RingWindow:
    """The windowed layers' work of a ring of ``ring`` positions, summed over its sequences
    (``add``, in sequence order): ``near[d]``, the work of the steps ``d`` away from step 0
    (steps d and G - d), ``first``, ``even``, and the hop rows (KV, dK/dV) of the sequences
    whose window fits in their chunks (``halo_kv``, ``halo_dkv``: the engine runs them by halo
    exchange) and of the others (``rest_kv``, ``rest_dkv``, ``rest`` sequences)."""

    def __init__(self, ring: int) -> None:
        self.ring, self.even, self.first = ring, 0.0, 0.0
        self.near = [0.0] * (ring // 2 + 1)
        self.halo_kv, self.halo_dkv, self.rest_kv, self.rest_dkv = 0.0, 0.0, 0.0, 0.0
        self.rest = 0

    def add(self, parts: WindowParts) -> "RingWindow":
        if parts.halo:
            self.halo_kv += parts.kv
            self.halo_dkv += parts.dkv
        else:
            self.rest_kv += parts.kv
            self.rest_dkv += parts.dkv
            self.rest += 1
        self.even += parts.even
        self.first += parts.first
        if parts.rest > 0.0:  # over the min(G - 1, 2D) steps within the reach
            per_step = parts.rest / min(self.ring - 1, 2 * parts.reach)
            for d in range(1, parts.reach + 1):
                self.near[d] += per_step
        return self

    def settle(self, split: bool) -> "RingWindow":
        """The group as the engine runs it (``schedule.HALO_SPLIT``): unless it splits a group
        (``split``; on CPU it does not), a group with any sequence round the ring sends them
        all round the ring, the fitting ones' rows too."""
        if not split and self.rest > 0:
            self.rest_kv, self.rest_dkv = self.rest_kv + self.halo_kv, self.rest_dkv + self.halo_dkv
            self.halo_kv, self.halo_dkv = 0.0, 0.0
        return self
