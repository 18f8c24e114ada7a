"""Baseline strategies behind the same Plan interface.

* static CP (TE / Megatron ``--context-parallel-size``): the pool is DP x CP; documents are
  token-balanced over DP replicas and every document is zigzag-split over its replica's
  whole CP group of consecutive ranks. TE pads a document shorter than 2*CP to 2*CP tokens; a
  plan holds no padding, so such a document is split over s//2 ranks of its group instead
  (a negligible deviation that favours the baseline).
* hybrid DP: each document gets the fewest ranks that hold it within ``max_seqlen_per_rank``
  tokens each (1 when it fits), consecutive ranks inside a node, whole nodes beyond; placed
  longest first on the ranks with the least estimated work (attention + linear).
* Megatron hybrid CP: megatron-core's own ``BalancedCPScheduler`` (hybrid_cp_schedule.py)
  forms the groups; each group becomes a wave, run one after another with a barrier.

Both take Megatron's ``--max-seqlen-per-dp-cp-rank`` as ``max_seqlen_per_rank``; by default the
value Megatron's docs suggest starting from: longest document / CP size (one node here).

Baselines have one layout: the linear modules run on the attention layout.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_tasks
from megatron_zeppelin.options import require, setting
from megatron_zeppelin.plan import AttentionTask, Plan, Topology, zigzag_share, zigzag_share_bound
from megatron_zeppelin.plan_checks import wave_tokens
from megatron_zeppelin.planner.common import (Batch, CapacityError, assemble, prepare,
                                              smallest_share,
                                              within_capacity)
from megatron_zeppelin.planner import native
from megatron_zeppelin.planner.registry import Strategy, register


def _task(topology: Topology, seq: int, ring: Sequence[int], wave: int = 0) -> AttentionTask:
    ring = tuple(ring)
    return AttentionTask(seq=seq, ring=ring, tier=topology.tier_of(ring), wave=wave)


def default_cp_size(batch: Batch) -> int:
    """Smallest divisor of the pool, at least one node, whose groups hold the longest document."""
    topo = batch.topology
    longest = max(batch.seqlens)
    for cp in range(min(topo.gpus_per_node, topo.world_size), topo.world_size + 1):
        if topo.world_size % cp == 0 and zigzag_share_bound(longest, cp) <= batch.capacity:
            return cp
    return topo.world_size


def _positive_option(strategy: str, key: str, value: int | None) -> None:
    require(value is None or (isinstance(value, int) and value >= 1), f"{strategy}.{key}",
            value, "an integer >= 1")


@register
@dataclass(frozen=True)
class StaticCP(Strategy):
    """Every document zigzag over its DP replica's whole CP group (TE/Megatron CP)."""

    te_attention = True
    name = "static-cp"
    summary = "TE/Megatron CP: every document zigzag over its replica's CP group"
    cp_size: int | None = setting(None, "static-cp: ranks per CP group (default: the smallest "
                                  "multiple of a node that holds the longest document)")
    cp_nodes: int | None = setting(None, "static-cp: CP groups of this many whole nodes "
                                   "(instead of --cp-size)")

    def __post_init__(self) -> None:
        _positive_option(self.name, "cp_size", self.cp_size)
        _positive_option(self.name, "cp_nodes", self.cp_nodes)
        require(self.cp_size is None or self.cp_nodes is None, f"{self.name}.cp_nodes",
                self.cp_nodes, f"unset when the CP size is given too ({self.cp_size}): pass "
                "one of the two")

    def check_pool(self, pool: Topology) -> None:
        require(self.cp_nodes is None or pool.nodes % self.cp_nodes == 0,
                f"{self.name}.cp_nodes", self.cp_nodes, f"a divisor of the pool's {pool.nodes} "
                "node(s)")
        require(self.cp_size is None or pool.world_size % self.cp_size == 0,
                f"{self.name}.cp_size", self.cp_size, f"a divisor of the pool's "
                f"{pool.world_size} ranks")

    def group_size(self, batch: Batch) -> int:
        """The CP size of this batch (``cp_size``, ``cp_nodes`` or the default)."""
        topo = batch.topology
        if self.cp_nodes is not None:
            return min(self.cp_nodes, topo.nodes) * topo.gpus_per_node
        return self.cp_size or default_cp_size(batch)

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        cp = self.group_size(batch)
        return assemble(f"static-cp(cp={cp})", batch, static_cp_on_backend(batch, cost, config, cp))


def static_cp_on_backend(batch: Batch, cost: CostModel, config: ZeppelinConfig, cp: int
                         ) -> list[AttentionTask]:
    """``static_cp_tasks`` on the configured backend (``native``)."""
    world = batch.topology.world_size
    if cp < 1 or world % cp:
        raise ValueError(f"cp_size={cp} is invalid: expected a divisor of the pool size {world}")
    tasks = native.twin_tasks("static_cp", batch.seqlens, batch.capacity, cost, config, cp)
    return tasks if tasks is not None else static_cp_tasks(batch, cp)


def static_cp_tasks(batch: Batch, cp: int) -> list[AttentionTask]:
    """Documents token-balanced over the DP replicas (longest first), each zigzag over its
    replica's group of ``cp`` consecutive ranks."""
    world = batch.topology.world_size
    if cp < 1 or world % cp:
        raise ValueError(f"cp_size={cp} is invalid: expected a divisor of the pool size {world}")
    replicas = [(0, r) for r in range(world // cp)]
    rank_tokens = [0] * world
    tasks: list[AttentionTask | None] = [None] * len(batch.seqlens)
    for seq in sorted(range(len(batch.seqlens)), key=lambda i: -batch.seqlens[i]):
        seqlen = batch.seqlens[seq]
        tokens, replica = heapq.heappop(replicas)
        group = range(replica * cp, (replica + 1) * cp)
        ring = tuple(sorted(sorted(group, key=rank_tokens.__getitem__)[:max(1, seqlen // 2)]))
        for r in ring:
            rank_tokens[r] += seqlen // len(ring)
        tasks[seq] = _task(batch.topology, seq, ring)
        heapq.heappush(replicas, (tokens + seqlen, replica))
    return tasks


# static-cp-best tries CP groups of up to this many nodes by default: a plan of G-rank groups
# lists every document on up to G ranks (32M ring entries for G = 1024 and 64M tokens), and no
# report run found a larger size fastest; --max-cp-size widens the search.
BEST_CP_MAX_NODES = 8


@register
@dataclass(frozen=True)
class StaticCPBest(Strategy):
    """Static CP at the size a user would tune it to for this batch: every legal CP size (a
    divisor of the pool whose groups hold the longest document within the capacity) up to
    ``max_cp_size``, the fastest by the step estimate (``estimate.estimate_tasks``)."""

    te_attention = True
    name = "static-cp-best"
    summary = "static CP at its best size for the batch (every legal size, by the estimate)"
    max_cp_size: int | None = setting(None, "static-cp-best: largest CP size tried (default: "
                                      f"{BEST_CP_MAX_NODES} nodes)")

    def __post_init__(self) -> None:
        _positive_option(self.name, "max_cp_size", self.max_cp_size)

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        config = dataclasses.replace(config, routing=config.routing and self.routed)
        topo = batch.topology
        max_cp = self.max_cp_size or min(topo.world_size, BEST_CP_MAX_NODES * topo.gpus_per_node)
        cpp = native.cpp_module(None)
        if cpp is not None:
            scores, twin = cpp.static_cp_best(
                native.problem_args(batch.seqlens, batch.capacity, cost, config), max_cp)
            tasks = twin if scores else None
        else:
            scored = [(estimate_tasks(t, batch.seqlens, batch.topology, cost,
                                      config.routing).step_s, cp, t)
                      for cp, t in static_cp_candidates(batch, cost, config, max_cp)]
            scores = [(cp, step) for step, cp, _ in scored]
            tasks = min(scored, key=lambda item: (item[0], item[1]))[2] if scored else None
        if tasks is None:
            raise CapacityError(f"static-cp-best: no CP size up to {max_cp} holds the longest "
                                f"document ({max(batch.seqlens)} tokens) within "
                                f"capacity_tokens_per_gpu={batch.capacity}: raise it or "
                                "max_cp_size (or give each GPU more tokens per batch)")
        ranked = sorted(scores, key=lambda item: (item[1], item[0]))
        label = f"static-cp(cp={ranked[0][0]})"
        return assemble(label, batch, tasks, None, candidate=label,
                        estimates=tuple((f"static-cp(cp={cp})", t) for cp, t in ranked))


def static_cp_candidates(batch: Batch, cost: CostModel, config: ZeppelinConfig,
                         max_cp: int) -> list[tuple[int, list[AttentionTask]]]:
    """(CP size, tasks) for every divisor of the pool up to ``max_cp`` whose plan keeps every
    rank within the capacity (Python reference)."""
    world = batch.topology.world_size
    out = []
    for cp in range(1, min(world, max_cp) + 1):
        if world % cp or zigzag_share_bound(max(batch.seqlens), cp) > batch.capacity:
            continue
        tasks = static_cp_tasks(batch, cp)
        if within_capacity(tasks, batch):
            out.append((cp, tasks))
    return out


def default_max_seqlen_per_rank(batch: Batch) -> int:
    """Megatron's suggested ``--max-seqlen-per-dp-cp-rank``: the longest document over a
    node-sized CP group, at least the mean tokens per rank, at most the capacity."""
    topo = batch.topology
    suggested = max(-(-max(batch.seqlens) // topo.gpus_per_node),
                    -(-batch.total_tokens // topo.world_size))
    longer = {s for s in batch.seqlens if s > suggested}  # give each of them a legal span
    return min(batch.capacity, max([suggested, *(smallest_share(s, topo) for s in longer)]))


MIN_CAP = 1024  # the smallest --max-seqlen-per-dp-cp-rank a sweep tries (tokens per rank)


def swept_caps(longest: int, ranks: int) -> list[int]:
    """--max-seqlen-per-dp-cp-rank values a user sweeps, largest first: the longest document
    over 1, 2, 4, ... ranks (Megatron's suggested start, longest / CP, among them), down to
    ``MIN_CAP`` tokens or the longest over every one of ``ranks``."""
    caps, k = [], 1
    while k <= ranks and (not caps or -(-longest // k) >= MIN_CAP):
        caps.append(-(-longest // k))
        k *= 2
    return caps


_MAX_SEQLEN_PER_RANK_HELP = (
    "hybrid-dp / megatron-hybrid-cp / megatron-dynamic-cp: the most tokens of a document a "
    "rank holds (Megatron's --max-seqlen-per-dp-cp-rank; default: the longest document over "
    "one node, at least the mean tokens per rank; tune it: zeppelin bench train sweeps it)")


@register
@dataclass(frozen=True)
class HybridDP(Strategy):
    """Fewest ranks that hold each document, greedy on estimated work, longest first."""

    te_attention = True
    name = "hybrid-dp"
    summary = "fewest ranks per document (within max_seqlen_per_rank), greedy on work"
    max_seqlen_per_rank: int | None = setting(None, _MAX_SEQLEN_PER_RANK_HELP,
                                              flag="--max-seqlen-per-dp-cp-rank")

    def __post_init__(self) -> None:
        _positive_option(self.name, "max_seqlen_per_rank", self.max_seqlen_per_rank)

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        per_rank = self.max_seqlen_per_rank or default_max_seqlen_per_rank(batch)
        tasks = native.twin_tasks("hybrid_dp", batch.seqlens, batch.capacity, cost, config,
                                  per_rank)
        return assemble("hybrid-dp", batch,
                        tasks if tasks is not None else hybrid_dp_tasks(batch, cost, per_rank))


def hybrid_dp_tasks(batch: Batch, cost: CostModel, per_rank: int) -> list[AttentionTask]:
    """Longest first, each document on the fewest ranks that hold it within ``per_rank``
    tokens each, the block whose busiest rank has the least work (attention + linear; the
    least-loaded rank with room when one rank holds it)."""
    topo, kernel = batch.topology, cost.kernel
    loads = [0.0] * topo.world_size
    tokens = [0] * topo.world_size
    heap = [(0.0, r) for r in range(topo.world_size)]  # (load, rank); stale entries skipped
    tasks: list[AttentionTask | None] = [None] * len(batch.seqlens)
    for seq in sorted(range(len(batch.seqlens)), key=lambda i: -batch.seqlens[i]):
        seqlen = batch.seqlens[seq]
        k = _fewest_ranks(seqlen, per_rank, topo)
        room = batch.capacity - zigzag_share_bound(seqlen, k)
        ring = _least_loaded_rank(heap, loads, tokens, room) if k == 1 else \
            _least_loaded_block(loads, tokens, room, k, topo)
        if ring is None:
            raise CapacityError(f"hybrid-dp: no {k} rank(s) have room for sequence {seq} "
                                f"({seqlen} tokens) within the capacity {batch.capacity}")
        tier = topo.tier_of(ring)
        work = kernel.task_time(seqlen, k, tier, False) + kernel.linear_per_token * seqlen / k
        for pos, r in enumerate(ring):
            loads[r] += work
            tokens[r] += zigzag_share(seqlen, k, pos)
            heapq.heappush(heap, (loads[r], r))
        tasks[seq] = AttentionTask(seq, ring, tier)
    return tasks


def _least_loaded_rank(heap: list[tuple[float, int]], loads: list[float], tokens: list[int],
                       room: int) -> tuple[int] | None:
    """The rank with the least work (then the lowest index) holding at most ``room`` tokens,
    from a heap of (load, rank) whose entries are stale once the rank's load changed."""
    skipped, found = [], None
    while heap:
        load, r = heap[0]
        if load != loads[r]:
            heapq.heappop(heap)
        elif tokens[r] > room:
            skipped.append(heapq.heappop(heap))
        else:
            found = (r,)
            break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


def ranks_per_document(lengths: Sequence[int], per_rank: int, topo: Topology
                       ) -> tuple[tuple[int, int], ...] | None:
    """(length, ranks) for each of ``lengths`` (distinct, longest first) that
    ``hybrid_dp_tasks`` spreads over more than one rank at ``per_rank`` tokens (the others
    take one: at most ``per_rank`` tokens), None where one does not fit the pool. The
    placement depends on the cap only through these counts: two caps with the same counts
    place the batch identically."""
    spread = []
    for seqlen in lengths:
        if seqlen <= per_rank:
            break
        try:
            spread.append((seqlen, _fewest_ranks(seqlen, per_rank, topo)))
        except CapacityError:
            return None
    return tuple(spread)


def _fewest_ranks(seqlen: int, capacity: int, topo: Topology) -> int:
    """Fewest ranks (within a node, else whole nodes) whose zigzag shares fit the capacity."""
    for k in range(1, topo.gpus_per_node + 1):
        if zigzag_share_bound(seqlen, k) <= capacity and (k == 1 or seqlen >= 2 * k):
            return k
    for nodes in range(2, topo.nodes + 1):
        k = nodes * topo.gpus_per_node
        if zigzag_share_bound(seqlen, k) <= capacity:
            return k
    raise CapacityError(f"a sequence of {seqlen} tokens does not fit the pool of "
                        f"{topo.world_size} ranks at {capacity} tokens per rank "
                        "(--max-seqlen-per-dp-cp-rank): raise it")


def _least_loaded_block(loads: list[float], tokens: list[int], room: int, k: int,
                        topo: Topology) -> tuple[int, ...] | None:
    """k consecutive ranks inside one node (k <= ranks per node), else whole nodes, each with
    at most ``room`` tokens already; the block whose busiest rank has the least work."""
    gpn = topo.gpus_per_node
    if k <= gpn:
        starts = [n * gpn + i for n in range(topo.nodes) for i in range(gpn - k + 1)]
    else:
        starts = [n * gpn for n in range(topo.nodes - k // gpn + 1)]
    starts = [s for s in starts if max(tokens[s:s + k]) <= room]
    if not starts:
        return None
    best = min(starts, key=lambda s: (max(loads[s:s + k]), s))
    return tuple(range(best, best + k))


class _PoolGroup:
    """What ``BalancedCPScheduler`` reads of its DPxCP process group: only its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@register
@dataclass(frozen=True)
class MegatronHybridCP(HybridDP):
    """Megatron-core's hybrid CP: groups from its ``BalancedCPScheduler``, one wave each
    (the same ``max_seqlen_per_rank`` option as hybrid DP)."""

    name = "megatron-hybrid-cp"
    summary = "megatron-core's BalancedCPScheduler groups, one wave each"

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        return plan_megatron_hybrid_cp(seqlens, cost, config, self.max_seqlen_per_rank)


def plan_megatron_hybrid_cp(seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig,
                            max_seqlen_per_rank: int | None = None) -> Plan:
    """Groups from megatron-core's ``BalancedCPScheduler`` (run as is), one wave each."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
    per_rank = max_seqlen_per_rank or default_max_seqlen_per_rank(batch)
    _fewest_ranks(max(batch.seqlens), per_rank, batch.topology)  # the longest fits, or says so
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=per_rank,
                                    dp_cp_group=_PoolGroup(batch.topology.world_size))
    try:
        _, id_groups = scheduler.get_groups_and_subsamples(list(enumerate(batch.seqlens)), None)
    except AssertionError as exc:  # its own limits, asserted
        raise CapacityError(f"megatron-hybrid-cp: megatron-core's BalancedCPScheduler refused "
                            f"{len(batch.seqlens)} sequences at {per_rank} tokens per rank "
                            f"(--max-seqlen-per-dp-cp-rank): {str(exc).strip()}") from None
    return plan_from_waves("megatron-hybrid-cp", batch, id_groups)


def plan_from_waves(name: str, batch: Batch, id_groups: Sequence[Sequence[Sequence[int]]]
                    ) -> Plan:
    """A plan from a Megatron scheduler's groups: ``id_groups[wave][rank]`` lists the sample
    ids rank ``rank`` works on in that wave; the ranks sharing a sample form its ring."""
    topo = batch.topology
    tasks: list[AttentionTask | None] = [None] * len(batch.seqlens)
    for wave, per_rank in enumerate(id_groups):
        members: dict[int, list[int]] = {}
        for rank, sample_ids in enumerate(per_rank):
            for sid in sample_ids:
                members.setdefault(sid, []).append(rank)
        for sid, ranks in members.items():
            if tasks[sid] is not None:
                raise RuntimeError(f"{name}: the scheduler placed sample {sid} in two groups")
            if len(ranks) > 1 and batch.seqlens[sid] < 2 * len(ranks):
                ranks = ranks[:max(1, batch.seqlens[sid] // 2)]  # TE pads; see the docstring
            tasks[sid] = _task(topo, sid, sorted(ranks), wave)
    missing = [i for i, t in enumerate(tasks) if t is None]
    if missing:
        raise RuntimeError(f"{name}: the scheduler left samples {missing[:8]} unscheduled")
    plan = assemble(name, batch, tasks, None)
    # Megatron runs every sub-sample as its own micro-batch, so what it bounds is tokens per
    # sub-sample (max_seqlen_per_rank), not per rank and wave: record the peak it reached.
    peak = max(max(per_rank) for per_rank in wave_tokens(plan))
    return dataclasses.replace(plan, capacity=max(plan.capacity, peak))
