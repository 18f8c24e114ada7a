"""The working state of Zeppelin's hierarchical placement (``zeppelin.py``), shared by its
inter-node step (``inter_node_step.py``) and intra-node step (``intra_node_step.py``): the
batch, its cost model, the per-rank target and the helpers both steps price spans with.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Tier, zigzag_share_bound
from megatron_zeppelin.planner.common import Batch


@dataclass
class Placement:
    """Working state shared by the two steps (mutable, private to one planning call)."""

    batch: Batch
    cost: CostModel
    routed: bool
    target: float  # per-rank attention time every rank should stay under
    local_time: list[float]
    slack: float  # relative peak increase accepted to use a smaller span
    total_work: float  # sum of the local attention times of the batch
    per_token: float = 0.0  # linear seconds per token folded into a rank's load (0: none)
    overhead: float = 0.0  # exposed ring traffic of the inter-node spans chosen so far

    @property
    def gpn(self) -> int:
        return self.batch.topology.gpus_per_node

    def fits(self, seqlen: int, ring: int) -> bool:
        return (ring == 1 or seqlen >= 2 * ring) and \
            zigzag_share_bound(seqlen, ring) <= self.batch.capacity

    def span_time(self, seqlen: int, ring: int, tier: Tier) -> float:
        """Per-rank seconds of a sequence over ``ring`` ranks: its attention with the ring
        traffic not hidden, plus (``per_token``) the linear modules of its share."""
        seconds = self.cost.task_time(seqlen, ring, tier, self.routed)
        return seconds + self.per_token * seqlen / ring if self.per_token else seconds

    def span_times(self, seqlen: int, rings: list[int], tier: Tier) -> list[float]:
        return [self.span_time(seqlen, ring, tier) for ring in rings]


def node_span_times(state: Placement, seq: int, cache: dict) -> list[tuple[int, float]]:
    """(k, per-rank time) of sequence ``seq`` for every legal span of k GPUs of one node."""
    if seq not in cache:
        seqlen, seconds = state.batch.seqlens[seq], state.local_time[seq]
        spans = [(1, seconds)] if seqlen <= state.batch.capacity else []
        ks = [k for k in range(2, state.gpn + 1) if state.fits(seqlen, k)]
        if ks:
            spans += zip(ks, state.span_times(seqlen, ks, Tier.INTRA))
        cache[seq] = spans
    return cache[seq]


def smallest_near_best(peaks: list[tuple[float, int]], slack: float) -> int:
    """The smallest span whose peak is within ``slack`` of the lowest peak."""
    best = min(peak for peak, _ in peaks)
    return min(span for peak, span in peaks if peak <= best * (1.0 + slack))
