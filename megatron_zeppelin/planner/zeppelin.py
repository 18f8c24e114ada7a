"""Zeppelin's hierarchical sequence partitioner (paper s.4; design brief s.5).

Two levels, longest sequence first, balancing estimated attention time (not tokens):

1. Inter-node step: a sequence whose work (or tokens) one node cannot take within the
   per-rank target W* = total/N (1 + slack) spans the fewest whole nodes that bring its
   per-rank time (compute plus ring traffic not hidden, routed over all NICs) under W*.
   It goes to the least-loaded nodes. Every other sequence goes whole to the least-loaded
   node with room (LPT with a heap).
2. Intra-node step, per node: inter-node shares first (every GPU of the node in the ring);
   then a sequence stays LOCAL on the least-loaded GPU with room when its time is under W*,
   otherwise it is ringed over the fewest GPUs of the node that bring it under W* (INTRA).

Sharded sequences use the zigzag split. Per-rank attention tokens never exceed the capacity.
The ``zeppelin`` strategy (``portfolio.py``) scores this placement with and without the remap
against the peers' plans of the same batch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_zeppelin.config import ZeppelinConfig, add_up
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import (AttentionTask, Tier, zigzag_share,
                                    zigzag_share_bound)
from megatron_zeppelin.planner.common import Batch, CapacityError


@dataclass
class _Placement:
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


def place_hierarchical(batch: Batch, cost: CostModel, config: ZeppelinConfig,
                       with_linear: bool = False) -> list[AttentionTask]:
    """Zeppelin's hierarchical placement of ``batch`` (module doc): one task per sequence.

    with_linear: balance each rank's attention plus the linear modules of the tokens it holds
    (a plan without the remap runs its linear modules on the attention layout); otherwise
    attention alone, with tokens balanced per node for the remap (``_place_light``).
    """
    per_token = cost.kernel.linear_per_token if with_linear else 0.0
    local_time = cost.attention_times(batch.seqlens)
    if with_linear:
        local_time = [t + per_token * s for t, s in zip(local_time, batch.seqlens)]
    world = batch.topology.world_size
    total = add_up(local_time)
    state = _Placement(batch, cost, config.routing, total / world * (1.0 + config.balance_slack),
                       local_time, config.balance_slack, total, per_token)
    order = sorted(range(len(batch.seqlens)), key=lambda i: -batch.seqlens[i])
    inter, per_node = assign_nodes(state, order)
    tasks: list[AttentionTask | None] = [None] * len(batch.seqlens)
    nodes, leftovers = [], []
    for node in range(batch.topology.nodes):
        placed, left, gpus = assign_gpus(state, node, inter, per_node[node])
        nodes.append(gpus)
        leftovers.extend(left)
        for task in placed:
            tasks[task.seq] = task
    for task in place_leftovers(state, leftovers, nodes):
        tasks[task.seq] = task
    return tasks


# ---------------------------------------------------------------------------- inter-node step

def assign_nodes(state: _Placement, order: list[int]
                 ) -> tuple[dict[int, tuple[int, ...]], list[list[int]]]:
    """Sequences to nodes, balancing attention time and tokens (linear time) across nodes.

    Attention-heavy sequences (more attention time per token than the batch's mean: the long
    ones, and any that one GPU cannot take whole) go first, by attention time (LPT, spans
    over nodes when needed); the light rest go where they keep max attention + max linear
    over nodes lowest, so the linear layout, which the remap balances inside nodes, is
    balanced across nodes too.
    Returns (inter-node seq -> its nodes, per node its whole sequences, longest first).
    """
    topo = state.batch.topology
    heap = [(0.0, node) for node in range(topo.nodes)]
    tokens = [0] * topo.nodes
    inter: dict[int, tuple[int, ...]] = {}
    per_node: list[list[int]] = [[] for _ in range(topo.nodes)]
    density = state.total_work / state.batch.total_tokens  # mean attention seconds per token
    split = next((i for i, seq in enumerate(order)
                  if state.local_time[seq] <= density * state.batch.seqlens[seq] and
                  state.local_time[seq] <= state.target and
                  state.batch.seqlens[seq] <= state.batch.capacity), len(order))
    _place_heavy(state, order[:split], heap, tokens, inter, per_node)
    _place_light(state, order[split:], heap, tokens, per_node)
    return inter, per_node


def _place_heavy(state: _Placement, order: list[int], heap: list, tokens: list[int],
                 inter: dict, per_node: list[list[int]]) -> None:
    """Attention-heavy sequences: LPT on node attention load; a sequence spans several nodes
    when one node cannot take it (``choose_node_span``)."""
    seqlens, local_time = state.batch.seqlens, state.local_time
    room, target, capacity = state.gpn * state.batch.capacity, state.target, state.batch.capacity
    best_times: dict[int, float] = {}  # per sequence: its best per-rank time on one node
    for position, seq in enumerate(order):
        seqlen, seconds = seqlens[seq], local_time[seq]
        if seconds <= target and seqlen <= capacity:  # fast path: whole, to the least-loaded
            load, node = heap[0]                      # node with room
            if tokens[node] + seqlen <= room:
                heapq.heapreplace(heap, (load + seconds, node))
            else:
                load, node = _pop_nodes(heap, tokens, seqlen, room, 1, seq, state.gpn)[0]
                heapq.heappush(heap, (load + seconds, node))
            per_node[node].append(seq)
            tokens[node] += seqlen
            continue
        upcoming = order[position + 1] if position + 1 < len(order) else None
        span = choose_node_span(state, sorted(load for load, _ in heap), seq, upcoming,
                                best_times)
        share = -(-seqlen // span)
        chosen = _pop_nodes(heap, tokens, share, room, span, seq, state.gpn)
        if span == 1:
            per_node[chosen[0][1]].append(seq)
            work = seconds
        else:
            inter[seq] = tuple(sorted(node for _, node in chosen))
            work = state.span_time(seqlen, span * state.gpn, Tier.INTER) * state.gpn
            state.overhead += max(0.0, work * span - seconds)
        for load, node in chosen:
            tokens[node] += share
            heapq.heappush(heap, (load + work, node))


def _place_light(state: _Placement, order: list[int], heap: list, tokens: list[int],
                 per_node: list[list[int]]) -> None:
    """Light sequences (the short ones), longest first: each to the node that keeps the step
    shortest, max attention + max linear over nodes (the remap balances the linear layout
    inside nodes, so a node's linear time follows its tokens), the fewest tokens on a tie.
    When the loads include the linear modules (``per_token``): to the least-loaded node with
    room (LPT), so that every node keeps the GPU-level slack its whole sequences need."""
    if state.per_token:
        room = state.gpn * state.batch.capacity
        for seq in order:
            seqlen = state.batch.seqlens[seq]
            load, node = _pop_nodes(heap, tokens, seqlen, room, 1, seq, state.gpn)[0]
            heapq.heappush(heap, (load + state.local_time[seq], node))
            tokens[node] += seqlen
            per_node[node].append(seq)
        return
    att = [0.0] * state.batch.topology.nodes
    for load, node in heap:
        att[node] = load
    light = _LightNodes(att, tokens, state.gpn * state.batch.capacity,
                        0.0 if state.per_token else state.cost.linear_time(1))
    for seq in order:
        node = light.place(state.local_time[seq], state.batch.seqlens[seq])
        if node is None:
            raise CapacityError(f"sequence {seq} ({state.batch.seqlens[seq]} tokens) fits on no "
                                f"node: every node is within {state.batch.seqlens[seq]} tokens "
                                f"of its {light.room} (capacity {state.batch.capacity} tokens "
                                "per GPU)")
        per_node[node].append(seq)


class _LightNodes:
    """Node attention load and tokens while light sequences are added (``_place_light``)."""

    SCAN = 16  # nodes at the attention max skipped before evaluating every node

    def __init__(self, att: list[float], tokens: list[int], room: int, per_token: float):
        self.att, self.tokens, self.room, self.per_token = att, tokens, room, per_token
        self.att_max, self.tok_max = max(att), max(tokens)
        self.heap = [(t, n) for n, t in enumerate(tokens)]
        heapq.heapify(self.heap)

    def place(self, seconds: float, seqlen: int) -> int | None:
        node = self._easy(seconds, seqlen)
        if node is None:
            node = self._best(seconds, seqlen)
            if node is None:
                return None
        self.att[node] += seconds
        self.tokens[node] += seqlen
        self.att_max = max(self.att_max, self.att[node])
        self.tok_max = max(self.tok_max, self.tokens[node])
        heapq.heappush(self.heap, (self.tokens[node], node))  # older entries of node: stale
        return node

    def _easy(self, seconds: float, seqlen: int) -> int | None:
        """The fewest-tokens node if adding there raises neither maximum (then optimal)."""
        skipped, found = [], None
        while self.heap and len(skipped) < self.SCAN:
            count, n = heapq.heappop(self.heap)
            if count != self.tokens[n]:
                continue  # stale: the node has gained tokens since
            if count + seqlen <= self.room and self.att[n] + seconds <= self.att_max:
                if count + seqlen <= self.tok_max:
                    found = n
                else:
                    skipped.append((count, n))
                break
            skipped.append((count, n))
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found

    def _best(self, seconds: float, seqlen: int) -> int | None:
        """Every node evaluated: max attention + max linear after adding there."""
        att, tok = np.asarray(self.att), np.asarray(self.tokens, dtype=np.float64)
        step = np.maximum(self.att_max, att + seconds) + \
            np.maximum(self.tok_max, tok + seqlen) * self.per_token
        step = np.where(tok + seqlen > self.room, np.inf, step + tok * 1e-15)
        node = int(np.argmin(step))
        return None if step[node] == np.inf else node


def choose_node_span(state: _Placement, node_loads: list[float], seq: int,
                     upcoming: int | None = None, best_times: dict | None = None) -> int:
    """How many nodes a sequence spans: the fewest whose projected makespan stays under the
    target, else the fewest within the slack of the lowest one (spans on a geometric grid).

    Projected makespan of m nodes = max(peak, mean, next): the peak is (load of the m-th
    least-loaded node + the sequence's work per node) per GPU, on one node at least the
    sequence's best per-rank time there; the mean is the whole batch's work plus the ring
    traffic left exposed so far and by this span, per rank; ``next`` places the ``upcoming``
    (next longest) sequence on the least-loaded node left, at its best per-rank time there,
    when one node can take it under the target (it cannot spread over the whole pool then).
    Exposed inter-node traffic is wasted time that raises every rank's load, so a wider span
    must earn it.
    """
    gpn, nodes, world = state.gpn, state.batch.topology.nodes, state.batch.topology.world_size
    seqlen, seconds = state.batch.seqlens[seq], state.local_time[seq]
    best_times = {} if best_times is None else best_times
    floor = (state.total_work + state.overhead) / world
    after = _best_node_time(state, upcoming, best_times) if upcoming is not None else 0.0
    if after > state.target:
        after = 0.0  # the next sequence will span nodes itself: no node-bound lookahead
    peaks: list[tuple[float, int]] = []
    one = _best_node_time(state, seq, best_times)
    if one < float("inf"):
        rest = node_loads[1] if nodes > 1 else node_loads[0] + seconds
        nxt = min(rest, node_loads[0] + seconds) / gpn + after
        peaks.append((max((node_loads[0] + seconds) / gpn, one, floor, nxt), 1))
    grid = [span for span in _span_grid(nodes) if state.fits(seqlen, span * gpn)]
    times = state.span_times(seqlen, [span * gpn for span in grid], Tier.INTER) if grid else []
    for span, per_rank in zip(grid, times):
        wasted = max(0.0, per_rank * span * gpn - seconds) / world
        rest = node_loads[span] if span < nodes else float("inf")
        nxt = min(rest, node_loads[0] + per_rank * gpn) / gpn + after
        peaks.append((max(node_loads[span - 1] / gpn + per_rank, floor + wasted, nxt), span))
    if not peaks:
        raise CapacityError(f"a sequence of {seqlen} tokens cannot be placed: no span of ranks "
                            f"keeps every rank within the capacity {state.batch.capacity} "
                            "tokens")
    under = [span for peak, span in peaks if peak <= state.target]
    return min(under) if under else _smallest_near_best(peaks, state.slack)


def _span_grid(nodes: int) -> list[int]:
    """Node counts 2..nodes: all of them up to 16, then about 12 per doubling."""
    grid, m = [], 2
    while m <= nodes:
        grid.append(m)
        m = m + 1 if m < 16 else m + max(1, m // 12)
    if nodes >= 2 and grid[-1] != nodes:
        grid.append(nodes)
    return grid


def _smallest_near_best(peaks: list[tuple[float, int]], slack: float) -> int:
    """The smallest span whose peak is within ``slack`` of the lowest peak."""
    best = min(peak for peak, _ in peaks)
    return min(span for peak, span in peaks if peak <= best * (1.0 + slack))


def _best_node_time(state: _Placement, seq: int, cache: dict) -> float:
    """Lowest per-rank time of sequence ``seq`` on the GPUs of one node (inf if it cannot fit),
    remembered in ``cache``."""
    if seq not in cache:
        cache[seq] = min((t for _, t in _span_times(state, seq, {})), default=float("inf"))
    return cache[seq]


def _pop_nodes(heap: list[tuple[float, int]], tokens: list[int], share: int, room: int,
               count: int, seq: int, gpn: int) -> list[tuple[float, int]]:
    """Pop the ``count`` least-loaded nodes with room for ``share`` more tokens each."""
    chosen, skipped = [], []
    while heap and len(chosen) < count:
        load, node = heapq.heappop(heap)
        (chosen if tokens[node] + share <= room else skipped).append((load, node))
    for item in skipped:
        heapq.heappush(heap, item)
    if len(chosen) < count:
        raise CapacityError(f"sequence {seq} needs {count} node(s) with room for {share} tokens "
                            f"each, found {len(chosen)} (a node holds {room} tokens at the "
                            f"capacity of {room // gpn} tokens per GPU); raise "
                            "capacity_tokens_per_gpu (or capacity_factor)")
    return chosen


# ---------------------------------------------------------------------------- intra-node step

@dataclass
class _NodeGpus:
    """Per-GPU load (seconds) and attention tokens of one node (a handful of GPUs: scans)."""

    loads: list[float]
    tokens: list[int]
    total: float = 0.0  # sum of loads

    @classmethod
    def empty(cls, gpn: int) -> "_NodeGpus":
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


def assign_gpus(state: _Placement, node: int, inter: dict[int, tuple[int, ...]],
                seqs: list[int]) -> tuple[list[AttentionTask], list[int], _NodeGpus]:
    """Place one node's work on its GPUs: inter-node shares first, then longest first.

    Returns the tasks, the sequences no GPU span of this node had room for (placed later by
    ``place_leftovers``), and the node's GPU loads.
    """
    ranks = state.batch.topology.node_ranks(node)
    gpus = _NodeGpus.empty(state.gpn)
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


def _place_inter_shares(state: _Placement, node: int, inter: dict[int, tuple[int, ...]],
                        gpus: _NodeGpus) -> list[AttentionTask]:
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


def choose_gpus(state: _Placement, gpus: _NodeGpus, seq: int, remaining: float = 0.0,
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
    ahead = _span_times(state, upcoming, spans) if upcoming is not None else None
    options: dict[int, list[int]] = {}
    peaks: list[tuple[float, int]] = []
    for k, per_rank in _span_times(state, seq, spans):
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
    return options[_smallest_near_best(peaks, 1e-9)]


def _span_times(state: _Placement, seq: int, cache: dict) -> list[tuple[int, float]]:
    """(k, per-rank time) of sequence ``seq`` for every legal span of k GPUs of one node."""
    if seq not in cache:
        seqlen, seconds = state.batch.seqlens[seq], state.local_time[seq]
        spans = [(1, seconds)] if seqlen <= state.batch.capacity else []
        ks = [k for k in range(2, state.gpn + 1) if state.fits(seqlen, k)]
        if ks:
            spans += zip(ks, state.span_times(seqlen, ks, Tier.INTRA))
        cache[seq] = spans
    return cache[seq]


def place_leftovers(state: _Placement, seqs: list[int], nodes: list[_NodeGpus]
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
