"""Zeppelin's intra-node step (``zeppelin.py``, paper s.4), per node: the inter-node shares
first, then each sequence LOCAL on the least-loaded GPU with room when that keeps the node
within the target, else ringed over the GPUs of the node that give the lowest projected
makespan (INTRA); sequences no span of their node has room for are placed last, anywhere
(``place_leftovers``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_zeppelin.plan import AttentionTask, Tier, zigzag_share, zigzag_share_bound
from megatron_zeppelin.planner.common import CapacityError
from megatron_zeppelin.planner.placement_state import (Placement, node_span_times,
                                                       smallest_near_best)
from megatron_zeppelin.twin_arithmetic import add_up


@dataclass
class NodeGpus:
    """Per-GPU load (seconds) and attention tokens of one node (a handful of GPUs: scans)."""

    loads: list[float]
    tokens: list[int]
    total: float = 0.0  # sum of loads

    @classmethod
    def empty(cls, gpn: int) -> "NodeGpus":
        return cls([0.0] * gpn, [0] * gpn)

    def charge(self, gpus: list[int], seqlen: int, per_rank: float) -> None:
        """Add a task's per-rank time and zigzag share to ``gpus`` (ring order)."""
        for p, g in enumerate(gpus):
            self.loads[g] += per_rank
            self.tokens[g] += zigzag_share(seqlen, len(gpus), p)
        self.total = add_up(self.loads)

    def place_local(self, seqlen: int, seconds: float, capacity: int,
                    limit: float = float("inf")) -> int | None:
        """LPT: the least-loaded GPU with room takes the whole sequence if that keeps it
        within ``limit`` seconds; None (nothing placed) otherwise."""
        loads, tokens, best = self.loads, self.tokens, -1
        room = capacity - seqlen
        for g in range(len(loads)):
            if tokens[g] <= room and (best < 0 or loads[g] < loads[best]):
                best = g
        if best < 0 or loads[best] + seconds > limit:
            return None
        loads[best] += seconds
        tokens[best] += seqlen
        self.total += seconds
        return best


def assign_gpus(state: Placement, node: int, inter: dict[int, tuple[int, ...]],
                seqs: list[int]) -> tuple[list[AttentionTask], list[int], NodeGpus]:
    """Place one node's work on its GPUs: inter-node shares first, then longest first.

    Returns the tasks, the sequences no GPU span of this node had room for (placed later by
    ``place_leftovers``), and the node's GPU loads.
    """
    ranks = state.batch.topology.node_ranks(node)
    gpus = NodeGpus.empty(state.gpn)
    tasks = _place_inter_shares(state, node, inter, gpus)
    leftovers = []
    capacity, target = state.batch.capacity, state.target
    seqlens, local_time = state.batch.seqlens, state.local_time
    remaining = add_up(local_time[seq] for seq in seqs)
    spans: dict[int, list[tuple[int, float]]] = {}  # per sequence: (k, per-rank time)
    for i, seq in enumerate(seqs):
        seqlen, seconds = seqlens[seq], local_time[seq]
        floor = (gpus.total + remaining) / state.gpn * (1.0 + state.slack)
        g = gpus.place_local(seqlen, seconds, capacity, limit=max(target, floor))
        if g is not None:  # fast path: LPT on the lightest GPU with room, within the limit
            tasks.append(AttentionTask(seq=seq, ring=(ranks[g],), tier=Tier.LOCAL))
            remaining -= seconds
            continue
        upcoming = seqs[i + 1] if i + 1 < len(seqs) else None
        picked = choose_gpus(state, gpus, seq, remaining, upcoming, spans)
        remaining -= seconds
        if picked is None:
            leftovers.append(seq)
        elif len(picked) == 1:
            gpus.charge(picked, seqlen, seconds)
            tasks.append(AttentionTask(seq=seq, ring=(ranks[picked[0]],), tier=Tier.LOCAL))
        else:
            gpus.charge(picked, seqlen, state.span_time(seqlen, len(picked), Tier.INTRA))
            tasks.append(AttentionTask(seq, tuple(ranks[g] for g in picked), Tier.INTRA))
    return tasks, leftovers, gpus


def _place_inter_shares(state: Placement, node: int, inter: dict[int, tuple[int, ...]],
                        gpus: NodeGpus) -> list[AttentionTask]:
    """Charge this node's GPUs for the inter-node rings it is part of; emit each task once."""
    tasks = []
    topo, gpn = state.batch.topology, state.gpn
    for seq, nodes in inter.items():
        if node not in nodes:
            continue
        seqlen, ring_size = state.batch.seqlens[seq], len(nodes) * gpn
        per_rank = state.span_time(seqlen, ring_size, Tier.INTER)
        first = nodes.index(node) * gpn
        for g in range(gpn):
            gpus.loads[g] += per_rank
            gpus.tokens[g] += zigzag_share(seqlen, ring_size, first + g)
            if gpus.tokens[g] > state.batch.capacity:
                raise CapacityError(f"node {node} GPU {g} would hold {gpus.tokens[g]} tokens of "
                                 f"inter-node sequences, over the capacity {state.batch.capacity}"
                                 "; raise capacity_tokens_per_gpu (or capacity_factor)")
        if nodes[0] == node:
            ring = tuple(r for n in nodes for r in topo.node_ranks(n))
            tasks.append(AttentionTask(seq=seq, ring=ring, tier=Tier.INTER))
    gpus.total = add_up(gpus.loads)
    return tasks


def choose_gpus(state: Placement, gpus: NodeGpus, seq: int, remaining: float = 0.0,
                upcoming: int | None = None, spans: dict | None = None) -> list[int] | None:
    """The GPUs of the node sequence ``seq`` runs on: the span (least-loaded GPUs with room)
    with the lowest projected node makespan, the fewest GPUs on a tie; None if no span has room.

    Projected makespan of k GPUs = max(peak, floor, next): peak = load of the k-th
    least-loaded GPU + the per-rank time at k (compute plus ring traffic not hidden); floor =
    the node's work (placed plus ``remaining``, this sequence's included) per GPU, plus the
    traffic this span leaves exposed (wasted time every GPU of the node ends up sharing);
    next = the best placement of the ``upcoming`` sequence of the node on the loads that
    follow. Sharding pays only when it lowers the makespan, not just this sequence's peak.
    ``spans`` caches each sequence's (k, per-rank time) list across calls.
    """
    gpn, seqlen, seconds = state.gpn, state.batch.seqlens[seq], state.local_time[seq]
    spans = {} if spans is None else spans
    order = sorted(range(gpn), key=gpus.loads.__getitem__)
    floor = (gpus.total + remaining) / gpn
    ahead = node_span_times(state, upcoming, spans) if upcoming is not None else None
    options: dict[int, list[int]] = {}
    peaks: list[tuple[float, int]] = []
    for k, per_rank in node_span_times(state, seq, spans):
        share = zigzag_share_bound(seqlen, k)
        room = [g for g in order if gpus.tokens[g] + share <= state.batch.capacity][:k]
        if len(room) < k:
            continue
        wasted = max(0.0, per_rank * k - seconds) / gpn
        projected = max(gpus.loads[room[-1]] + per_rank, floor + wasted)
        if ahead:
            after = sorted(gpus.loads[g] + (per_rank if g in room else 0.0) for g in range(gpn))
            projected = max(projected, min(after[j - 1] + t for j, t in ahead))
        peaks.append((projected, k))
        options[k] = sorted(room)
    if not peaks:
        return None
    return options[smallest_near_best(peaks, 1e-9)]


def place_leftovers(state: Placement, seqs: list[int], nodes: list[NodeGpus]
                    ) -> list[AttentionTask]:
    """Sequences their node had no room for: whole on the least-loaded GPU with room anywhere,
    else ringed over the GPUs of the node that keeps the busiest of them least loaded."""
    tasks = []
    topo, capacity = state.batch.topology, state.batch.capacity
    for seq in sorted(seqs, key=lambda i: -state.batch.seqlens[i]):
        seqlen, seconds = state.batch.seqlens[seq], state.local_time[seq]
        spots = [(gpus.loads[g], n, g) for n, gpus in enumerate(nodes)
                 for g in range(state.gpn) if gpus.tokens[g] + seqlen <= capacity]
        if spots:
            _, n, g = min(spots)
            nodes[n].charge([g], seqlen, seconds)
            tasks.append(AttentionTask(seq, (topo.node_ranks(n)[g],), Tier.LOCAL))
            continue
        options = [(max(gpus.loads[g] for g in picked), n, picked)
                   for n, gpus in enumerate(nodes)
                   if (picked := choose_gpus(state, gpus, seq)) is not None]
        if not options:
            raise CapacityError(f"sequence {seq} ({seqlen} tokens) fits nowhere: no GPU, and no "
                             f"GPUs of one node, have room for it within the capacity {capacity} "
                             "tokens per GPU; raise capacity_tokens_per_gpu (or capacity_factor)")
        _, n, picked = min(options)
        tier = Tier.INTRA if len(picked) > 1 else Tier.LOCAL
        nodes[n].charge(picked, seqlen, state.span_time(seqlen, len(picked), tier))
        ranks = topo.node_ranks(n)
        tasks.append(AttentionTask(seq, tuple(ranks[g] for g in picked), tier))
    return tasks
