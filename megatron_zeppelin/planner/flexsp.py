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
* MILP (scipy's HiGHS ``milp``), aggregated per size: integers ``m_d`` (groups of size d, in
  binary digits) and ``n_bd`` (sequences of bucket b on size d), binaries ``u_bd`` (bucket b
  uses size d), makespan ``C``. Constraints: ``sum_d d m_d`` = pool size; every sequence
  assigned; a size's work spread over its groups, ``sum_b n_bd t_bd <= m_d C`` (the product
  linearised bit by bit with a big M); ``C >= t_bd`` where bucket b uses size d; per-rank
  tokens ``sum_b n_bd share_bd <= m_d x capacity`` (share at the bucket's longest sequence).
  Minimise C. (The aggregation assumes a size's groups can be balanced; the per-group
  formulation took HiGHS minutes with large gaps.) A time limit bounds the solve and the best
  solution found is used; the plan's ``candidate`` records the status, gap and solve time.

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


@register
@dataclass(frozen=True)
class FlexSP(Strategy):
    """Heterogeneous Ulysses SP groups and sequence assignment by a MILP (module doc)."""

    name = "flexsp"
    summary = "FlexSP: heterogeneous Ulysses SP groups and assignment by a MILP (HiGHS)"
    attention = "ulysses"
    buckets: int = setting(16, "flexsp: sequence buckets of the MILP (FlexSP's bucketing)")
    time_limit_s: float = setting(30.0, "flexsp: seconds the MILP solver may take (the best "
                                  "solution found is used)")

    def __post_init__(self) -> None:
        require(isinstance(self.buckets, int) and self.buckets >= 1, "flexsp.buckets",
                self.buckets, "an integer >= 1")
        require(isinstance(self.time_limit_s, (int, float)) and self.time_limit_s > 0,
                "flexsp.time_limit_s", self.time_limit_s, "a number of seconds > 0")

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        problem = _Problem(batch, cost, self.buckets)
        groups, per_size, status = problem.solve(self.time_limit_s)
        tasks = problem.assign(groups, per_size)
        return assemble("flexsp", batch, tasks, None, attention_kind="ulysses",
                        candidate=status)


def length_buckets(seqlens: Sequence[int], count: int) -> list[list[int]]:
    """Sequence indices in at most ``count`` buckets of similar length: equal ratios of the
    batch's length range (log scale), empty buckets dropped, shortest first."""
    lo, hi = math.log(min(seqlens)), math.log(max(seqlens))
    width = (hi - lo) / count or 1.0
    out: list[list[int]] = [[] for _ in range(count)]
    for i, s in enumerate(seqlens):
        out[min(count - 1, int((math.log(s) - lo) / width))].append(i)
    return [b for b in out if b]


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
    """Column indices of the MILP's variables (module doc): ``n[b,d]``, ``u[b,d]`` (bucket b
    uses size d), ``z[d,k]`` (bit k of m_d), ``w[d,k]`` (= z[d,k] * C), then ``C``, for
    ``nb`` buckets and the group ``sizes`` (index j) of a pool of ``world`` ranks."""

    def __init__(self, nb: int, sizes: list[int], world: int) -> None:
        self.nb, self.nd, self.world = nb, len(sizes), world
        self.bits = [max(1, (world // d).bit_length()) for d in sizes]
        self.z0 = 2 * nb * self.nd
        self.z_at = [self.z0 + sum(self.bits[:j]) for j in range(self.nd)]
        self.w0 = self.z0 + sum(self.bits)
        self.c = self.w0 + sum(self.bits)
        self.count = self.c + 1

    def n(self, b: int, j: int) -> int:
        return b * self.nd + j

    def u(self, b: int, j: int) -> int:
        return self.nb * self.nd + b * self.nd + j

    def z(self, j: int, k: int) -> int:
        return self.z_at[j] + k

    def w(self, j: int, k: int) -> int:
        return self.w0 + self.z_at[j] - self.z0 + k

    def groups(self, j: int, scale: float = 1.0) -> list[tuple[int, float]]:
        """``scale * m_d`` as a sum of its bits."""
        return [(self.z(j, k), scale * (1 << k)) for k in range(self.bits[j])]


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

    def solve(self, time_limit_s: float) -> tuple[list[int], list[list[int]], str]:
        """(groups per size m_d, sequences of bucket b per size n_bd, solver status)."""
        from scipy.optimize import Bounds, LinearConstraint, milp

        v = _Columns(len(self.buckets), self.sizes, self.batch.topology.world_size)
        big = sum(len(members) * max(t for t in row if t < math.inf)
                  for members, row in zip(self.buckets, self.times))
        rows = _Rows()
        self._bucket_rows(rows, v)
        self._size_rows(rows, v, big)
        integrality = np.zeros(v.count)
        integrality[:v.w0] = 1
        objective = np.zeros(v.count)
        objective[v.c] = 1.0
        started = time.perf_counter()
        with solver_output_to_stderr():
            result = milp(objective, integrality=integrality,
                          bounds=Bounds(np.zeros(v.count), self._upper(v, big)),
                          constraints=LinearConstraint(rows.matrix(v.count), rows.lo, rows.hi),
                          options={"time_limit": time_limit_s, "mip_rel_gap": 1e-3,
                                   "disp": False})
        if result.x is None:
            raise CapacityError(f"flexsp: the MILP found no assignment within the capacity "
                                f"{self.batch.capacity} tokens per rank ({result.message})")
        x = np.rint(result.x).astype(int)
        m = [sum(int(x[v.z(j, k)]) << k for k in range(v.bits[j])) for j in range(v.nd)]
        per_size = [[int(x[v.n(b, j)]) for j in range(v.nd)] for b in range(v.nb)]
        gap = getattr(result, "mip_gap", float("nan"))
        status = (f"milp {'optimal' if result.status == 0 else 'at the time limit'}, gap "
                  f"{gap:.1%}, {v.count} variables, {time.perf_counter() - started:.2f} s")
        return m, per_size, status

    def _bucket_rows(self, rows: "_Rows", v: "_Columns") -> None:
        """Sizes tile the pool (``sum_d d m_d`` = pool size); per bucket: every sequence
        assigned, ``n_bd <= count_b u_bd``, ``C >= t_bd`` where bucket b uses size d."""
        rows.add([e for j, d in enumerate(self.sizes) for e in v.groups(j, float(d))],
                 v.world, v.world)
        for b, members in enumerate(self.buckets):
            count = len(members)
            rows.add([(v.n(b, j), 1.0) for j in range(v.nd)], count, count)
            for j in range(v.nd):
                rows.add([(v.n(b, j), 1.0), (v.u(b, j), -float(count))], -np.inf, 0.0)
                if self.times[b][j] < math.inf:  # a sequence in a group of size d takes t_bd
                    rows.add([(v.c, 1.0), (v.u(b, j), -self.times[b][j])], 0.0, np.inf)

    def _size_rows(self, rows: "_Rows", v: "_Columns", big: float) -> None:
        """Per size: its work spread over its groups, its tokens within the capacity, and
        ``w = z C`` (big-M) for every bit of m_d."""
        times = self.times
        longest = [max(self.batch.seqlens[i] for i in m) for m in self.buckets]
        for j, d in enumerate(self.sizes):
            usable = [b for b in range(v.nb) if times[b][j] < math.inf]
            # the class's work spread over its m_d groups: sum_b n_bd t_bd <= m_d * C
            rows.add([(v.n(b, j), times[b][j]) for b in usable] +
                     [(v.w(j, k), -float(1 << k)) for k in range(v.bits[j])], -np.inf, 0.0)
            rows.add([(v.n(b, j), float(zigzag_share_bound(longest[b], d))) for b in usable]
                     + v.groups(j, -float(self.batch.capacity)), -np.inf, 0.0)
            for k in range(v.bits[j]):  # w = z * C (big-M)
                w, z = v.w(j, k), v.z(j, k)
                rows.add([(w, 1.0), (v.c, -1.0)], -np.inf, 0.0)
                rows.add([(w, 1.0), (z, -big)], -np.inf, 0.0)
                rows.add([(w, 1.0), (v.c, -1.0), (z, -big)], -big, np.inf)

    def _upper(self, v: "_Columns", big: float) -> np.ndarray:
        """Upper bounds of the variables (lower bounds are 0)."""
        upper = np.full(v.count, np.inf)
        for b, members in enumerate(self.buckets):
            for j in range(v.nd):
                upper[v.n(b, j)] = len(members) if self.times[b][j] < math.inf else 0.0
                upper[v.u(b, j)] = 1.0
        upper[v.z0:v.w0] = 1.0
        upper[v.c] = big
        return upper

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
