"""Hydraulis-style planner: dynamic heterogeneous CP/DP replicas and two-stage assignment.

Modelled on Hydraulis (Li et al., "Hydraulis: Balancing Large Transformer Model Training via
Co-designing Parallel Strategies and Data Assignment", arXiv 2412.07894): instead of one
parallel strategy for every model replica, each step picks a set of replicas with different
context-parallel degrees for the batch's length distribution (the paper's dynamic heterogeneous
strategies and its data-distribution-aware strategy generator), then assigns the data in two
stages: sequences are dispatched across replicas, then packed within each replica. Here, with
one micro-batch per step and no pipeline or tensor changes per replica:

* strategies: ``big`` replicas of a power-of-two CP size ``c`` that holds the batch's longest
  sequence (and 2c, 4c), the rest of the pool as replicas of a small size ``c'`` in
  1, 2, 4, ..., one node (``c' <= c``); ``big`` over powers of two;
* stage 1 (across replicas): sequences longest first, each to the replica where it ends
  soonest (replica load + its time there: ring attention over the replica with traffic not
  hidden, ``CostKernel.task_time``, plus the linear modules on s/c tokens per rank), among the
  replicas whose ranks keep it within the capacity; the strategy with the lowest slowest
  replica wins;
* stage 2 (within a replica): every sequence zigzag over the replica's CP group; one shorter
  than 2c over the ``s // 2`` ranks of the replica holding the fewest tokens so far (as TE pads
  it instead).

Replicas are aligned blocks of consecutive ranks (largest first), so a replica of at most a
node's ranks stays inside a node and a larger one spans whole nodes; the linear modules run
on the attention layout (no remap).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import AttentionTask, Plan, Tier, zigzag_share_bound
from megatron_zeppelin.planner.common import (Batch, CapacityError, assemble, prepare)
from megatron_zeppelin.planner import native
from megatron_zeppelin.planner.registry import Strategy, register


@register
@dataclass(frozen=True)
class Hydraulis(Strategy):
    """Heterogeneous CP replicas per step and two-stage data assignment (module doc)."""

    name = "hydraulis"
    summary = "Hydraulis: heterogeneous CP replicas per step, two-stage data assignment"

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        cpp = native.cpp_module(None)
        if cpp is not None:
            twin, sizes = cpp.hydraulis(native.problem_args(batch.seqlens, batch.capacity, cost,
                                                            config))
            tasks, label = twin, replicas_label(sizes)
        else:
            tasks, label = hydraulis_tasks(batch, cost)
        return assemble("hydraulis", batch, tasks, None, candidate=label)


def hydraulis_tasks(batch: Batch, cost: CostModel) -> tuple[list[AttentionTask], str]:
    """The tasks of the best strategy (stage 1's slowest replica) and its replicas as text."""
    best = None
    for sizes in strategies(batch):
        dispatched = dispatch(batch, cost, sizes, best[0] if best else float("inf"))
        if dispatched is not None:
            best = (dispatched[0], sizes, dispatched[1])
    if best is None:
        raise CapacityError(f"hydraulis: no set of CP replicas holds the batch within the "
                            f"capacity {batch.capacity} tokens per rank")
    _, sizes, members = best
    return pack(batch, sizes, members), replicas_label(sizes)


def replicas_label(sizes: list[int]) -> str:
    """``replicas 2x8+56x2``: how many replicas of each CP size, largest first."""
    return "replicas " + "+".join(f"{sizes.count(c)}x{c}" for c in sorted(set(sizes), reverse=True))


def _powers(limit: int) -> list[int]:
    out, c = [], 1
    while c <= limit:
        out.append(c)
        c *= 2
    return out


def strategies(batch: Batch) -> list[list[int]]:
    """Candidate replica CP sizes (module doc), each a list of sizes summing to the pool."""
    topo = batch.topology
    world, gpn = topo.world_size, topo.gpus_per_node
    longest = max(batch.seqlens)
    fits = [c for c in _powers(world) if world % c == 0 and
            zigzag_share_bound(longest, c) <= batch.capacity]
    out = []
    for big in fits[:3]:
        for count in _powers(world // big):
            rest = world - count * big
            for small in [c for c in _powers(min(big, gpn)) if rest % c == 0]:
                sizes = [big] * count + [small] * (rest // small)
                if sizes not in out:
                    out.append(sizes)
    return out


def _seq_time(cost: CostModel, seqlen: int, size: int, tier: Tier) -> float:
    """Per-rank seconds of a sequence on a replica of ``size`` ranks (stage 1's cost)."""
    ring = max(1, min(size, seqlen // 2))
    return cost.kernel.task_time(seqlen, ring, tier if ring > 1 else Tier.LOCAL, False) + \
        cost.kernel.linear_per_token * seqlen / ring


def dispatch(batch: Batch, cost: CostModel, sizes: list[int], bound: float = float("inf")
             ) -> tuple[float, list[list[int]]] | None:
    """Stage 1: (slowest replica's seconds, sequences per replica), or None when a sequence
    fits no replica within the capacity or a replica reaches ``bound`` (the best strategy so
    far: this one cannot beat it)."""
    gpn = batch.topology.gpus_per_node
    load = [0.0] * len(sizes)
    tokens = [0] * len(sizes)  # per replica: tokens per rank, bounded by the zigzag shares
    members: list[list[int]] = [[] for _ in sizes]
    heaps = {c: [(0.0, r) for r, size in enumerate(sizes) if size == c] for c in set(sizes)}
    for seq in sorted(range(len(batch.seqlens)), key=lambda i: -batch.seqlens[i]):
        s = batch.seqlens[seq]
        best = None
        for size, heap in heaps.items():
            share = zigzag_share_bound(s, max(1, min(size, s // 2)))
            r = _least_loaded_with_room(heap, load, tokens, batch.capacity - share)
            if r is not None:
                end = load[r] + _seq_time(cost, s, size, Tier.INTRA if size <= gpn else
                                          Tier.INTER)
                if best is None or (end, r) < (best[0], best[1]):
                    best = (end, r, share, size)
        if best is None or best[0] >= bound:
            return None
        end, r, share, size = best
        heapq.heappush(heaps[size], (end, r))  # the replica's older entry is now stale
        load[r] = end
        tokens[r] += share
        members[r].append(seq)
    return max(load), members


def _least_loaded_with_room(heap: list[tuple[float, int]], load: list[float],
                            tokens: list[int], room: int) -> int | None:
    """The least-loaded replica of ``heap`` whose ranks hold at most ``room`` tokens (entries
    of replicas that gained load since they were pushed are stale and dropped)."""
    skipped, found = [], None
    while heap:
        entry = heap[0]
        if entry[0] != load[entry[1]]:
            heapq.heappop(heap)
            continue
        if tokens[entry[1]] <= room:
            found = entry[1]
            break
        skipped.append(heapq.heappop(heap))
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


def pack(batch: Batch, sizes: list[int], members: list[list[int]]) -> list[AttentionTask]:
    """Stage 2: replicas as aligned blocks (largest first); each sequence zigzag over its
    replica, one shorter than 2c over the replica's ranks holding the fewest tokens."""
    topo = batch.topology
    tasks: list[AttentionTask | None] = [None] * len(batch.seqlens)
    first = 0
    for r in sorted(range(len(sizes)), key=lambda r: -sizes[r]):
        size = sizes[r]
        held = [(0, first + i) for i in range(size)]
        for seq in sorted(members[r], key=lambda i: -batch.seqlens[i]):
            s = batch.seqlens[seq]
            k = max(1, min(size, s // 2))
            chosen = [heapq.heappop(held) for _ in range(k)]
            for count, rank in chosen:
                heapq.heappush(held, (count + s // k, rank))
            ring = tuple(sorted(rank for _, rank in chosen))
            tasks[seq] = AttentionTask(seq, ring, topo.tier_of(ring))
        first += size
    return tasks
