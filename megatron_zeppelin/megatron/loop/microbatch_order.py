"""``--zeppelin-microbatch-order``: how each global batch's documents form the micro-batches.

``arrival`` (``corpus.MicroBatchSampler``): the stream packed greedily into micro-batches of
micro-batch x seq-length tokens, dealt round-robin to the data-parallel pools, run in arrival
order. ``balanced`` (``BalancedSampler``): the same documents (the ``M x pools`` micro-batches
the packing gives for one iteration, the stream left at the same position after them),
regrouped by ``planner.microbatches.balance_global_batch`` with the balanced-compute cost of
each micro-batch on a pool (``pipeline_cost.microbatch_work_cost``: attention of every document
+ linear modules of its tokens, over the pool's ranks) under the same token capacity, dealt to
the pools and ordered for Megatron's pipeline schedule (1F1B or interleaved). ``auto`` (the
default): ``balanced`` with pipeline parallelism, else ``arrival`` (without PP the micro-batches
of a pool run one after another, so balancing them only evens the data-parallel replicas).

Why the math does not change: the loop's loss is per token over the whole global batch
(``calculate_per_token_loss``), every document's labels are cut from the document itself
(``megatron/common/data.py``), and the global batch holds the same documents in either order;
only the floating-point summation order differs (``tests/test_training_pipeline.py``). What
does change: which plan each micro-batch gets, and Megatron's logged MTP losses (a mean per
micro-batch, averaged over the micro-batches).

Every rank (every stage, pool rank and TP rank) walks the same stream and regroups the same
lengths with the same deterministic function and cost model, so all hold the same grouping
without a message. The grouping runs once per iteration on the training thread (its time is
in the run summary, ``OrderTally.line``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.megatron.loop.corpus import DocumentSource, MicroBatchSampler, Piece
from megatron_zeppelin.planner.microbatches import balance_global_batch, idle_share
from megatron_zeppelin.planner.pipeline_cost import microbatch_work_cost


def resolve(order: str, pp: int) -> str:
    """``balanced`` or ``arrival`` for ``--zeppelin-microbatch-order`` with ``pp`` stages."""
    if order == "auto":
        return "balanced" if pp > 1 else "arrival"
    return order


@dataclass
class OrderTally:
    """What balancing did over a run: global batches, documents in it, documents moved
    (now in a micro-batch of other documents, or dealt to another pool), the estimated step
    and idle share (bubble and data-parallel waits: ``idle_share``) of the arrival grouping
    and of the balanced one, summed over the batches, and the seconds spent grouping."""

    batches: int = 0
    documents: int = 0
    moved: int = 0
    step_before_s: float = 0.0
    step_after_s: float = 0.0
    idle_before: float = 0.0
    idle_after: float = 0.0
    seconds: float = 0.0

    def line(self) -> str:
        if not self.batches:
            return "micro-batch order balanced: no global batch read"
        n = self.batches
        return (f"micro-batch order balanced: {n} global batch(es), {self.moved:,} of "
                f"{self.documents:,} documents (pieces of split ones apiece) moved; estimated "
                f"(work cost model) step {self.step_before_s / n * 1e3:.2f} -> {self.step_after_s / n * 1e3:.2f} ms, "
                f"idle stages {self.idle_before / n:.1%} -> {self.idle_after / n:.1%} per "
                f"batch (arrival -> balanced); grouping took {self.seconds / n * 1e3:.1f} ms "
                "per batch")


class Regrouper:
    """Arrival micro-batches (lengths, in the stream's order: micro-batch ``r * pools + i``
    is pool ``i``'s ``r``-th) -> per pool, its micro-batches as indices into the
    concatenated lengths, in run order; tallied in ``tally`` (the estimated steps and idle
    shares only when ``estimate``: the rank that prints the summary)."""

    def __init__(self, cost: CostModel, ranks: int, micro: int, pools: int, capacity: int,
                 pp: int, vpp: int, estimate: bool = True) -> None:
        self.cost = microbatch_work_cost(cost, ranks)
        self.micro, self.pools, self.capacity, self.pp, self.vpp = micro, pools, capacity, pp, vpp
        self.estimate = estimate
        self.tally = OrderTally()

    def __call__(self, arrival: Sequence[Sequence[int]]) -> list[list[list[int]]]:
        started = time.perf_counter()
        lengths = [n for batch in arrival for n in batch]
        starts = [0]
        for batch in arrival:
            starts.append(starts[-1] + len(batch))
        packed = [[list(range(starts[k], starts[k + 1]))
                   for k in range(p, len(arrival), self.pools)] for p in range(self.pools)]
        dealt = balance_global_batch(lengths, self.micro, self.pools, self.cost,
                                     capacity=self.capacity, pp=self.pp, vpp=self.vpp,
                                     backward_ratio=FWD_BWD_LINEAR - 1.0, arrival=packed)
        placed = sorted(i for pool in dealt for batch in pool for i in batch)
        if placed != list(range(len(lengths))):  # balance_global_batch's guarantee
            raise RuntimeError(f"micro-batch balancing placed {len(placed)} of "
                               f"{len(lengths)} documents")
        self._count(arrival, lengths, dealt, time.perf_counter() - started)
        return dealt

    def _count(self, arrival, lengths, dealt, seconds: float) -> None:
        before, start = {}, 0
        for k, batch in enumerate(arrival):
            members = frozenset(range(start, start + len(batch)))
            before.update((i, (k % self.pools, members)) for i in members)
            start += len(batch)
        after = {i: (p, frozenset(batch)) for p, pool in enumerate(dealt) for batch in pool
                 for i in batch}
        t = self.tally
        t.batches, t.documents, t.seconds = t.batches + 1, t.documents + len(lengths), \
            t.seconds + seconds
        t.moved += sum(before[i] != after[i] for i in before)
        if not self.estimate:
            return
        rows_before = [[self.cost(list(arrival[r * self.pools + p])) for r in range(self.micro)]
                       for p in range(self.pools)]
        rows_after = [[self.cost([lengths[i] for i in batch]) for batch in pool]
                      for pool in dealt]
        for rows, step, idle in ((rows_before, "step_before_s", "idle_before"),
                                 (rows_after, "step_after_s", "idle_after")):
            s, share = idle_share(rows, self.pp, self.vpp, FWD_BWD_LINEAR - 1.0)
            setattr(t, step, getattr(t, step) + s)
            setattr(t, idle, getattr(t, idle) + share)


class BalancedSampler(MicroBatchSampler):
    """This pool's micro-batches with every global batch (``micro`` rounds of ``pools``
    packed micro-batches) regrouped by ``regroup`` (module doc). The position is the
    stream's before the global batch being handed out (a checkpoint is taken between
    iterations, when none is), so a restart reads the same global batch again."""

    def __init__(self, source: DocumentSource, tokens: int, seed: int, max_len: int,
                 overlong: str, regroup: Regrouper, pools: int = 1, pool: int = 0) -> None:
        super().__init__(source, tokens, seed, max_len, overlong, pools, pool)
        self.regroup = regroup
        self.pending: list[list[Piece]] = []
        self.batch_start: dict | None = None

    def __next__(self) -> list[torch.Tensor]:
        if not self.pending:
            self.batch_start = self.stream.state_dict()
            arrival = [self._pack() for _ in range(self.regroup.micro * self.pools)]
            pieces = [piece for batch in arrival for piece in batch]
            dealt = self.regroup([[end - start for _, start, end in batch] for batch in arrival])
            self.pending = [[pieces[i] for i in batch] for batch in dealt[self.pool]]
        mine = self.pending.pop(0)
        return [self.source.tokens(doc, start, end) for doc, start, end in mine]

    def state_dict(self) -> dict:
        if self.pending:
            return {**self.fingerprint, "stream": self.batch_start}
        return super().state_dict()

    def load_state_dict(self, state: dict) -> str | None:
        self.pending = []
        return super().load_state_dict(state)
