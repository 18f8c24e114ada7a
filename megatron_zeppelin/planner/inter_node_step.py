"""Zeppelin's inter-node step (``zeppelin.py``, paper s.4): sequences to nodes, longest first.

A sequence whose work (or tokens) one node cannot take within the per-rank target spans the
fewest whole nodes that bring its per-rank time under the target (``choose_node_span``); the
rest go whole to nodes, attention-heavy ones by LPT on attention time, light ones where they
keep max attention + max linear over nodes lowest (``assign_nodes``).
"""
from __future__ import annotations

import heapq

import numpy as np

from megatron_zeppelin.plan import Tier
from megatron_zeppelin.planner.common import CapacityError
from megatron_zeppelin.planner.placement_state import (Placement, node_span_times,
                                                       smallest_near_best)


def assign_nodes(state: Placement, order: list[int]
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


def _place_heavy(state: Placement, order: list[int], heap: list, tokens: list[int],
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


def _place_light(state: Placement, order: list[int], heap: list, tokens: list[int],
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


def choose_node_span(state: Placement, node_loads: list[float], seq: int,
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
    return min(under) if under else smallest_near_best(peaks, state.slack)


def _span_grid(nodes: int) -> list[int]:
    """Node counts 2..nodes: all of them up to 16, then about 12 per doubling."""
    grid, m = [], 2
    while m <= nodes:
        grid.append(m)
        m = m + 1 if m < 16 else m + max(1, m // 12)
    if nodes >= 2 and grid[-1] != nodes:
        grid.append(nodes)
    return grid


def _best_node_time(state: Placement, seq: int, cache: dict) -> float:
    """Lowest per-rank time of sequence ``seq`` on the GPUs of one node (inf if it cannot fit),
    remembered in ``cache``."""
    if seq not in cache:
        cache[seq] = min((t for _, t in node_span_times(state, seq, {})), default=float("inf"))
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
