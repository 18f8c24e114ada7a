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
without a message. The grouping runs once per global batch, one global batch ahead on a worker
thread of the sampler (``BalancedSampler``: the next batch is read and grouped as soon as the
current one is taken), so the training thread only takes a finished grouping; the result is
the one computed in place (same function, same lengths). Its time is in the run summary
(``OrderTally.line``); ``scripts/bench_microbatch_order.py`` measures it.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.megatron.loop.corpus import (DocumentSource, DocumentStats,
                                                   MicroBatchSampler, Piece)
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

    def add(self, other: "OrderTally") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def line(self) -> str:
        if not self.batches:
            return "micro-batch order balanced: no global batch read"
        n = self.batches
        return (f"micro-batch order balanced: {n} global batch(es), {self.moved:,} of "
                f"{self.documents:,} documents (pieces of split ones apiece) moved; estimated "
                f"(work cost model) step {self.step_before_s / n * 1e3:.2f} -> {self.step_after_s / n * 1e3:.2f} ms, "
                f"idle stages {self.idle_before / n:.1%} -> {self.idle_after / n:.1%} per "
                f"batch (arrival -> balanced); grouping took {self.seconds / n * 1e3:.1f} ms "
                "per batch (one batch ahead, on a worker thread)")


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
        dealt, counted = self.group(arrival)
        self.tally.add(counted)
        return dealt

    def group(self, arrival: Sequence[Sequence[int]]
              ) -> tuple[list[list[list[int]]], OrderTally]:
        """(the grouping, this batch's tally): all the work, touching no state of ``self``
        but the cost function's cache (any one thread at a time may run it)."""
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
        return dealt, self._count(arrival, lengths, dealt, time.perf_counter() - started)

    def _count(self, arrival, lengths, dealt, seconds: float) -> OrderTally:
        before, start = {}, 0
        for k, batch in enumerate(arrival):
            members = frozenset(range(start, start + len(batch)))
            before.update((i, (k % self.pools, members)) for i in members)
            start += len(batch)
        after = {i: (p, frozenset(batch)) for p, pool in enumerate(dealt) for batch in pool
                 for i in batch}
        t = OrderTally(batches=1, documents=len(lengths), seconds=seconds,
                       moved=sum(before[i] != after[i] for i in before))
        if not self.estimate:
            return t
        rows_before = [[self.cost(list(arrival[r * self.pools + p])) for r in range(self.micro)]
                       for p in range(self.pools)]
        rows_after = [[self.cost([lengths[i] for i in batch]) for batch in pool]
                      for pool in dealt]
        t.step_before_s, t.idle_before = idle_share(rows_before, self.pp, self.vpp,
                                                    FWD_BWD_LINEAR - 1.0)
        t.step_after_s, t.idle_after = idle_share(rows_after, self.pp, self.vpp,
                                                  FWD_BWD_LINEAR - 1.0)
        return t


class BalancedSampler(MicroBatchSampler):
    """This pool's micro-batches with every global batch (``micro`` rounds of ``pools``
    packed micro-batches) regrouped by ``regroup`` (module doc). The position is the
    stream's before the global batch being handed out (a checkpoint is taken between
    iterations, when none is), so a restart reads the same global batch again.

    ``ahead``: when a global batch is taken, the next one is read from the stream and grouped
    on a worker thread meanwhile (``Regrouper.group``); its tally is added, and its documents
    count in ``stats``, when it is taken. Off: grouped in place, when taken."""

    def __init__(self, source: DocumentSource, tokens: int, seed: int, max_len: int,
                 overlong: str, regroup: Regrouper, pools: int = 1, pool: int = 0,
                 ahead: bool = True) -> None:
        super().__init__(source, tokens, seed, max_len, overlong, pools, pool)
        self.regroup = regroup
        self.pending: list[list[Piece]] = []
        self.batch_start: dict | None = None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="zeppelin-regroup") \
            if ahead else None
        self.next: tuple[dict, list[Piece], Future] | None = None  # the global batch ahead
        self.taken = DocumentStats()  # ``stats``: the stream's up to the batch ahead

    def _read(self) -> tuple[dict, list[Piece], Future | tuple]:
        """The next global batch: (the stream's position before it, its pieces, its grouping
        with its tally: a Future on the worker, or done in place)."""
        position = self.stream.state_dict()
        arrival = [self._pack() for _ in range(self.regroup.micro * self.pools)]
        lengths = [[end - start for _, start, end in batch] for batch in arrival]
        grouping = (self.worker.submit(self.regroup.group, lengths) if self.worker else
                    self.regroup.group(lengths))
        return position, [piece for batch in arrival for piece in batch], grouping

    def __next__(self) -> list[torch.Tensor]:
        if not self.pending:
            self.batch_start, pieces, grouping = self.next or self._read()
            dealt, counted = grouping.result() if isinstance(grouping, Future) else grouping
            self.regroup.tally.add(counted)
            self.pending = [[pieces[i] for i in batch] for batch in dealt[self.pool]]
            self.next = self._read() if self.worker else None
            self._take_stats()
        mine = self.pending.pop(0)
        return [self.source.tokens(doc, start, end) for doc, start, end in mine]

    @property
    def stats(self) -> DocumentStats:
        """What the stream read up to the global batch ahead (counted when taken); one
        object over the run, updated in place."""
        return self.taken

    def _take_stats(self) -> None:
        counted = self.next[0]["stats"] if self.next is not None else \
            dataclasses.asdict(self.stream.stats)
        for name, value in counted.items():
            setattr(self.taken, name, value)

    def state_dict(self) -> dict:
        if self.pending:
            return {**self.fingerprint, "stream": self.batch_start}
        if self.next is not None:
            return {**self.fingerprint, "stream": self.next[0]}
        return super().state_dict()

    def load_state_dict(self, state: dict) -> str | None:
        self.pending = []
        self._drop_next()
        why = super().load_state_dict(state)
        self._take_stats()
        return why

    def _drop_next(self) -> None:
        """Forget the global batch ahead, the stream back before it (its grouping finishes
        on the worker, unused)."""
        if self.next is not None:
            self.next[2].cancel()
            self.stream.load_state_dict(self.next[0])
            self.next = None

    def close(self) -> None:
        self._drop_next()
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
