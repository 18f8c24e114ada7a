"""FlexSP-style planner: heterogeneous Ulysses sequence-parallel groups chosen by a MILP.

Modelled on FlexSP (Wang et al., "FlexSP: Accelerating Large Language Model Training via
Flexible Sequence Parallelism", ASPLOS'25, arXiv 2412.01523): each step, the devices are
partitioned into sequence-parallel (DeepSpeed-Ulysses) groups of different sizes and every
sequence is assigned to one group, minimising the slowest group's time under the memory limit,
as a mixed-integer linear program (the paper solves it with SCIP, with sequence bucketing to
shrink it). Here:

* group sizes d: every size up to the query heads per rank (Ulysses splits the heads over the
  group, unevenly where d does not divide them: the busiest rank holds ceil(heads / d), as
  ``CostKernel.ulysses_compute`` charges), inside a node (d <= GPUs per node) or of whole
  nodes (a multiple of it) so that a group's tier is known; FlexSP's paper fixes no power of
  two. Only the sum of the sizes is constrained: groups of whole nodes come first, the others
  are packed into the remaining nodes (first fit, largest first); a multiset that cannot be
  packed without a group spanning two nodes gets that group as it falls (its tier, INTER, is
  what the simulator charges, the MILP's estimate having assumed INTRA);
* buckets: sequences in at most ``buckets`` buckets of similar length (equal ratios of the
  length range: the paper's sequence bucketing); ``t_bd``, a bucket's per-rank time per
  sequence in a group of size d, is the mean over its sequences of attention at the full length
  over 1/d of the heads, the all-to-alls (``CostKernel.ulysses_compute`` and ``ulysses_comm``)
  and the linear modules on s/d tokens;
* MILP (scipy's HiGHS ``milp``), aggregated per size: integers ``m_d`` (groups of size d) and
  ``n_bd`` (sequences of bucket b on size d), makespan ``C``. Constraints: ``sum_d d m_d`` =
  pool size; every sequence assigned; a size's work spread over its groups,
  ``sum_b n_bd t_bd <= m_d C``; ``n_bd = 0`` where ``t_bd > C``; per-rank tokens
  ``sum_b n_bd share_bd <= m_d x capacity`` (share at the bucket's longest sequence).
  Minimise C. The product ``m_d C`` makes it bilinear; it is solved exactly by bisection on C:
  for a fixed C every constraint is linear, and each step is a small feasibility MILP (no
  big M). The bisection starts from proven bounds (every bucket needs its cheapest size; the
  pool's rank-seconds cover the least work of every sequence), moves the upper end to the
  makespan of each solution found and stops when the two ends are within ``REL_GAP``
  (0.1%): the plan is then within 0.1% of the model's optimum. Each feasibility solve is
  bounded by ``node_limit`` branch-and-bound nodes, a deterministic work limit (never a
  wall-clock one, so the plan never depends on the machine's load); a solve that reaches it
  without an answer counts as infeasible, and the plan's ``candidate`` says how many did and
  the gap to the proven lower bound that results. (The aggregation assumes a size's groups
  can be balanced; the per-group formulation took HiGHS minutes with large gaps, and the
  earlier big-M linearisation of ``m_d C`` bit by bit hit a 30 s wall-clock limit at gaps
  up to 90% on 128-GPU batches.)

The MILP's counts become sequences: per bucket longest first to the largest sizes it was given;
then, longest first over the batch, each to the least-loaded group of its size with room for
its per-rank share (another size where none has room; a ``CapacityError`` where no group has). Attention of the plan is Ulysses
(``Plan.attention_kind``): the simulator models it (``sim/ulysses.py``) and the attention engine
runs it as all-to-all attention (``runtime/ulysses.py``).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.options import require, setting
from megatron_zeppelin.plan import AttentionTask, Plan, Tier, zigzag_share_bound
from megatron_zeppelin.planner.common import (Batch, CapacityError, assemble, prepare)
from megatron_zeppelin.planner.registry import Strategy, register


STATUS = re.compile(r"milp bisection: (\d+) solves, (\d+) at the node limit, gap ([\d.]+)%")
NODE_LIMIT = 5000  # branch-and-bound nodes per feasibility solve (FlexSP.node_limit)
REL_GAP = 1e-3  # the bisection stops when its ends are this close (relative)


@register
@dataclass(frozen=True)
class FlexSP(Strategy):
    """Heterogeneous Ulysses SP groups and sequence assignment by a MILP (module doc)."""

    name = "flexsp"
    summary = "FlexSP: heterogeneous Ulysses SP groups and assignment by a MILP (HiGHS)"
    attention = "ulysses"
    buckets: int = setting(16, "flexsp: sequence buckets of the MILP (FlexSP's bucketing)")
    node_limit: int = setting(NODE_LIMIT, "flexsp: branch-and-bound nodes each feasibility "
                              "MILP of the bisection may explore (a deterministic work limit; "
                              "the plan's candidate says how often it was reached)")

    def __post_init__(self) -> None:
        require(isinstance(self.buckets, int) and self.buckets >= 1, "flexsp.buckets",
                self.buckets, "an integer >= 1")
        require(isinstance(self.node_limit, int) and not isinstance(self.node_limit, bool)
                and self.node_limit >= 1, "flexsp.node_limit", self.node_limit,
                "an integer >= 1")

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        problem = _Problem(batch, cost, self.buckets)
        groups, per_size, status = problem.solve(self.node_limit)
        tasks = problem.assign(groups, per_size)
        return assemble("flexsp", batch, tasks, None, attention_kind="ulysses",
                        candidate=status)


def solver_stats(status: str) -> tuple[int, int, float] | None:
    """(solves, solves ended by the node limit, gap to the proven bound) from a FlexSP plan's
    ``candidate`` (None for another status)."""
    found = STATUS.match(status)
    return (int(found[1]), int(found[2]), float(found[3]) / 100) if found else None


def length_buckets(seqlens: Sequence[int], count: int) -> list[list[int]]:
    """Sequence indices in at most ``count`` buckets of similar length: equal ratios of the
    batch's length range (log scale), empty buckets dropped, shortest first."""
    lo, hi = math.log(min(seqlens)), math.log(max(seqlens))
    width = (hi - lo) / count or 1.0
    out: dict[int, list[int]] = {}  # only the buckets that hold a sequence
    for i, s in enumerate(seqlens):
        out.setdefault(min(count - 1, int((math.log(s) - lo) / width)), []).append(i)
    return [out[b] for b in sorted(out)]


def group_sizes(world: int, heads: int, gpus_per_node: int | None = None) -> list[int]:
    """Ulysses group sizes of a pool of ``world`` ranks: every size up to the query heads per
    rank, inside a node or of whole nodes of ``gpus_per_node`` (default: one node, the pool)."""
    gpn = gpus_per_node or world
    return [d for d in range(1, min(world, heads) + 1) if d <= gpn or d % gpn == 0]


@contextlib.contextmanager
def solver_output_to_stderr():
    """What the solver's C code prints on file descriptor 1 goes to 2 meanwhile, so that it
    never mixes into a command's output (``zeppelin simulate --json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class _Columns:
    """Column indices of a feasibility MILP's variables (module doc): ``n[b,d]`` then ``m[d]``,
    for ``nb`` buckets and the group ``sizes`` (index j)."""

    def __init__(self, nb: int, sizes: list[int]) -> None:
        self.nb, self.nd = nb, len(sizes)
        self.count = nb * self.nd + self.nd

    def n(self, b: int, j: int) -> int:
        return b * self.nd + j

    def m(self, j: int) -> int:
        return self.nb * self.nd + j


class _Rows:
    """Sparse constraint rows ``lo <= A x <= hi``, in the order added."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, entries: list[tuple[int, float]], low: float, high: float) -> None:
        for col, val in entries:
            self.rows.append(len(self.lo))
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(low)
        self.hi.append(high)

    def matrix(self, columns: int):
        from scipy.sparse import coo_array

        return coo_array((self.vals, (self.rows, self.cols)),
                         shape=(len(self.lo), columns)).tocsr()


class _Problem:
    """The MILP of one batch (module doc): size classes, buckets, per-bucket times, the solve
    and the assignment of the actual sequences."""

    def __init__(self, batch: Batch, cost: CostModel, buckets: int) -> None:
        self.batch, self.cost = batch, cost
        topo = batch.topology
        self.sizes = group_sizes(topo.world_size, cost.heads, topo.gpus_per_node)
        self.buckets = length_buckets(batch.seqlens, buckets)
        self.times = [[self._mean_time(members, d) for d in self.sizes]
                      for members in self.buckets]
        for members, row in zip(self.buckets, self.times):
            if all(t == math.inf for t in row):
                raise CapacityError(
                    f"flexsp: no Ulysses group size {self.sizes} holds the sequences of "
                    f"{min(batch.seqlens[i] for i in members)}-"
                    f"{max(batch.seqlens[i] for i in members)} tokens within the capacity "
                    f"{batch.capacity} tokens per rank (a group is at most the "
                    f"{cost.heads} query heads per rank)")

    def tier(self, d: int) -> Tier:
        gpn = self.batch.topology.gpus_per_node
        return Tier.LOCAL if d == 1 else Tier.INTRA if d <= gpn else Tier.INTER

    def seq_time(self, s: int, d: int) -> float:
        """Per-rank seconds of a sequence of ``s`` tokens in a group of ``d`` ranks."""
        kernel = self.cost.kernel
        return kernel.ulysses_compute(s, d) + kernel.ulysses_comm(s / d, d, self.tier(d)) + \
            kernel.linear_per_token * s / d

    def _mean_time(self, members: list[int], d: int) -> float:
        """Mean per-rank seconds of the bucket's sequences in a group of ``d`` ranks (inf
        where its shortest cannot be split over d ranks or its longest exceeds the capacity)."""
        seqlens = self.batch.seqlens
        if (d > 1 and min(seqlens[i] for i in members) < 2 * d) or \
                zigzag_share_bound(max(seqlens[i] for i in members), d) > self.batch.capacity:
            return math.inf
        return sum(self.seq_time(seqlens[i], d) for i in members) / len(members)

    def solve(self, node_limit: int) -> tuple[list[int], list[list[int]], str]:
        """(groups per size m_d, sequences of bucket b per size n_bd, solver status): the
        bisection on the makespan C of the module doc."""
        started = time.perf_counter()
        proven_lo = self.lower_bound()
        lo, solves, at_limit = proven_lo, 1, 0
        found = self._feasible(math.inf, node_limit)
        if found is None:
            raise CapacityError(f"flexsp: the MILP found no assignment within the capacity "
                                f"{self.batch.capacity} tokens per rank")
        hi = self.makespan(*found)
        while hi > lo * (1 + REL_GAP):
            mid = math.sqrt(lo * hi)
            solves += 1
            answer = self._feasible(mid, node_limit)
            if isinstance(answer, tuple):
                found, hi = answer, min(hi, self.makespan(*answer))
            else:  # proven infeasible (True) or undecided at the node limit (False)
                lo = mid
                proven_lo = mid if answer else proven_lo
                at_limit += not answer
        status = (f"milp bisection: {solves} solves, {at_limit} at the node limit, gap "
                  f"{100 * (hi / proven_lo - 1):.2f}%, "
                  f"{_Columns(len(self.buckets), self.sizes).count} variables, "
                  f"{time.perf_counter() - started:.2f} s")
        return found[0], found[1], status

    def lower_bound(self) -> float:
        """A proven lower bound of the makespan: every bucket's cheapest size, and the pool's
        rank-seconds against the least rank-seconds of every sequence."""
        cheapest = [min(row) for row in self.times]
        work = sum(len(members) * min(d * t for d, t in zip(self.sizes, row))
                   for members, row in zip(self.buckets, self.times))
        return max(max(cheapest), work / self.batch.topology.world_size)

    def makespan(self, groups: list[int], per_size: list[list[int]]) -> float:
        """The model's makespan of a solution: the busiest size's work over its groups, or the
        slowest bucket-size pair used, whichever is larger."""
        out = 0.0
        for j, count in enumerate(groups):
            used = [b for b in range(len(self.buckets)) if per_size[b][j]]
            if used:
                work = sum(per_size[b][j] * self.times[b][j] for b in used)
                out = max(out, work / count, *(self.times[b][j] for b in used))
        return out

    def _feasible(self, c: float, node_limit: int):
        """A solution (m_d, n_bd) with makespan at most ``c``; True when proven infeasible,
        False when the node limit ends the solve undecided."""
        from scipy.optimize import Bounds, LinearConstraint, milp

        v = _Columns(len(self.buckets), self.sizes)
        rows = _Rows()
        self._feasibility_rows(rows, v, c)
        upper = np.zeros(v.count)
        for b, members in enumerate(self.buckets):
            for j in range(v.nd):
                upper[v.n(b, j)] = len(members) if self._allowed(b, j, c) else 0.0
        world = self.batch.topology.world_size
        for j, d in enumerate(self.sizes):
            upper[v.m(j)] = world // d
        with solver_output_to_stderr():
            result = milp(np.zeros(v.count), integrality=np.ones(v.count),
                          bounds=Bounds(np.zeros(v.count), upper),
                          constraints=LinearConstraint(rows.matrix(v.count), rows.lo, rows.hi),
                          options={"node_limit": node_limit, "disp": False})
        if result.x is None:
            return result.status == 2  # 2: infeasible; 1: the node limit, undecided
        x = np.rint(result.x).astype(int)
        return ([int(x[v.m(j)]) for j in range(v.nd)],
                [[int(x[v.n(b, j)]) for j in range(v.nd)] for b in range(v.nb)])

    def _allowed(self, b: int, j: int, c: float) -> bool:
        """Whether bucket b may use size j under makespan ``c`` (finite time within it)."""
        return self.times[b][j] < math.inf and self.times[b][j] <= c

    def _feasibility_rows(self, rows: "_Rows", v: "_Columns", c: float) -> None:
        """Sizes tile the pool (``sum_d d m_d`` = pool size); every sequence of a bucket
        assigned; per size, its work within ``m_d c`` (no bound when ``c`` is infinite) and
        its per-rank tokens within ``m_d`` x the capacity. Times are scaled by the lower
        bound (numbers near 1 for the solver)."""
        scale = 1.0 / self.lower_bound()
        world = self.batch.topology.world_size
        rows.add([(v.m(j), float(d)) for j, d in enumerate(self.sizes)], world, world)
        for b, members in enumerate(self.buckets):
            rows.add([(v.n(b, j), 1.0) for j in range(v.nd)], len(members), len(members))
        longest = [max(self.batch.seqlens[i] for i in m) for m in self.buckets]
        for j, d in enumerate(self.sizes):
            usable = [b for b in range(v.nb) if self._allowed(b, j, c)]
            if c < math.inf:
                rows.add([(v.n(b, j), self.times[b][j] * scale) for b in usable] +
                         [(v.m(j), -c * scale)], -np.inf, 0.0)
            rows.add([(v.n(b, j), float(zigzag_share_bound(longest[b], d))) for b in usable]
                     + [(v.m(j), -float(self.batch.capacity))], -np.inf, 0.0)

    def assign(self, groups: list[int], per_size: list[list[int]]) -> list[AttentionTask]:
        """Groups tile the pool (``place_groups``); each bucket's sequences go to
        the sizes the MILP gave them, longest to the largest size; then, longest sequence
        first over the whole batch, each to the least-loaded group of its size with room for the sequence's per-rank share (the MILP
        bounds a size's tokens, not each group's: ``_place`` keeps every group within the
        capacity)."""
        seqlens = self.batch.seqlens
        by_size = {d: [[0.0, 0, ring] for ring in rings]
                   for d, rings in place_groups(dict(zip(self.sizes, groups)),
                                                 self.batch.topology.gpus_per_node,
                                                 self.batch.topology.world_size).items()}
        size_of: dict[int, int] = {}
        for b, members in enumerate(self.buckets):
            ordered = sorted(members, key=lambda i: -seqlens[i])
            start = 0
            for j in sorted(range(len(self.sizes)), key=lambda j: -self.sizes[j]):
                size_of.update((seq, self.sizes[j])
                               for seq in ordered[start:start + per_size[b][j]])
                start += per_size[b][j]
        tasks: list[AttentionTask | None] = [None] * len(seqlens)
        for seq in sorted(size_of, key=lambda i: (-seqlens[i], i)):  # longest first: packs
            tasks[seq] = self._place(seq, size_of[seq], by_size)
        return tasks

    def _place(self, seq: int, d: int, by_size: dict[int, list[list]]) -> AttentionTask:
        """The least-loaded group of size ``d`` with room for the sequence's per-rank share;
        where none has room, the least-loaded group of any other size that can hold and split
        it (largest size first); none at all is a ``CapacityError`` naming the sequence."""
        s, capacity = self.batch.seqlens[seq], self.batch.capacity
        others = sorted((e for e in by_size if e != d), reverse=True)
        for size in [d] + others:
            share = zigzag_share_bound(s, size)
            room = [g for g in by_size.get(size, ()) if g[1] + share <= capacity
                    and (size == 1 or s >= 2 * size)]
            if room:
                group = min(room, key=lambda g: g[0])
                group[0] += self.seq_time(s, size)
                group[1] += share
                return AttentionTask(seq, group[2], self.batch.topology.tier_of(group[2]))
        raise CapacityError(f"flexsp: no Ulysses group has room for sequence {seq} ({s} tokens) "
                            f"within the capacity {capacity} tokens per rank")


def place_groups(counts: dict[int, int], gpus_per_node: int, world: int
                 ) -> dict[int, list[tuple[int, ...]]]:
    """The ranks of every group (``counts``: groups per size, sizes summing to ``world``):
    groups of whole nodes first, then the others largest first, each into the first node
    with room for all of it, else (no node has) on the lowest free ranks, spanning nodes."""
    nodes = world // gpus_per_node
    free = [list(range(n * gpus_per_node, (n + 1) * gpus_per_node)) for n in range(nodes)]
    out: dict[int, list[tuple[int, ...]]] = {d: [] for d in counts}
    node = 0
    for d in sorted((d for d in counts if d % gpus_per_node == 0), reverse=True):
        for _ in range(counts[d]):
            out[d].append(tuple(range(node * gpus_per_node, node * gpus_per_node + d)))
            for n in range(node, node + d // gpus_per_node):
                free[n] = []
            node += d // gpus_per_node
    for d in sorted((d for d in counts if d % gpus_per_node), reverse=True):
        for _ in range(counts[d]):
            fits = next((f for f in free if len(f) >= d), None)
            ranks = fits[:d] if fits is not None else sorted(r for f in free for r in f)[:d]
            out[d].append(tuple(ranks))
            for f in free:
                f[:] = [r for r in f if r not in ranks]
    return out
