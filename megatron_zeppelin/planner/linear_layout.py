"""Linear layout derived from an attention layout (the remapping layer's plan).

Attention is balanced by time, so nodes holding long documents hold fewer tokens. Moving
tokens to a token-balanced layout shortens the slowest node's linear modules but sends q, k, v
and the output across nodes every layer. ``node_token_targets`` weighs the two: node n runs
the linear modules of L_n tokens at cost ``L_n * r + |A_n - L_n| * c`` (r: linear seconds per
token on the node, c: remap seconds per token over the node's NICs, A_n: its attention tokens)
and the targets minimise the slowest node's cost (convex per node: bisection on the cost).
Inside a node, moving tokens is cheap (NVLink): every rank of node n targets L_n / GPUs.

A rank keeps the first ``target`` tokens of its attention buffer; the rest are surplus.
Surpluses move to ranks short of their target inside the node first, and across nodes only
for what the node's target sends away, so the tokens crossing nodes are exactly
sum over nodes of max(0, A_n - L_n). A rank's linear buffer is its kept segments followed by
the segments it receives. ``Plan.transfers`` turns the two layouts into the remap.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from megatron_zeppelin.twin_arithmetic import add_up
from megatron_zeppelin.estimate import Move
from megatron_zeppelin.plan import Layout, Segment, Topology



def _intervals(tokens: np.ndarray, r: float, c: float, budget: float
               ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per node, the token counts L >= 0 with ``L * r + |A - L| * c <= budget`` as [lo, hi];
    the bool says whether every node has one."""
    right = (budget + tokens * c) / (r + c)  # the branch L >= A
    if r > c:
        left = (budget - tokens * c) / (r - c)  # only L < A is feasible when right < A
        hi = np.where(right >= tokens, right, left)
        ok = bool(np.all(hi >= 0))
        lo = np.zeros_like(hi)
    else:
        hi = right
        ok = bool(np.all(right >= tokens))
        lo = np.maximum(0.0, (tokens * c - budget) / (c - r)) if c > r else np.zeros_like(hi)
    return lo, hi, ok and bool(np.all(lo <= hi))


def node_token_targets(node_tokens: Sequence[int], r: float, c: float) -> list[int]:
    """Linear tokens per node minimising max_n (L_n * r + |A_n - L_n| * c), sum L = sum A.

    r: linear seconds per token on a node (> 0); c: cross-node remap seconds per token (>= 0).
    """
    total, n = sum(node_tokens), len(node_tokens)
    if n == 1 or total == 0:
        return list(node_tokens)
    tokens = np.asarray(node_tokens, dtype=np.float64)
    lo_t, hi_t = total / n * r, max(node_tokens) * r  # balanced for free .. no move at all
    for _ in range(50):
        mid = (lo_t + hi_t) / 2
        lo, hi, ok = _intervals(tokens, r, c, mid)
        if ok and add_up(lo.tolist()) <= total <= add_up(hi.tolist()):
            hi_t = mid
        else:
            lo_t = mid
    lo, hi, _ = _intervals(tokens, r, c, hi_t)
    return _closest_within(list(zip(lo.tolist(), hi.tolist())), node_tokens, total)


def _closest_within(spans: list[tuple[float, float]], node_tokens: Sequence[int],
                    total: int) -> list[int]:
    """Integers summing to ``total`` inside (up to rounding) the intervals ``spans`` and as
    close to ``node_tokens`` as possible: start from each node's own tokens clamped into its
    interval, then move only in the one direction the sum needs (fewest tokens moved)."""
    values = [min(max(a, lo), hi) for a, (lo, hi) in zip(node_tokens, spans)]
    left = total - add_up(values)
    for i, (lo, hi) in enumerate(spans):  # the bisection made sum(lo) <= total <= sum(hi)
        if left > 0:
            step = min(hi - values[i], left)
        elif left < 0:
            step = max(lo - values[i], left)
        else:
            break
        values[i] += step
        left -= step
    ints = [int(round(v)) for v in values]
    order = sorted(range(len(values)), key=lambda i: ints[i] - values[i])
    rest = total - sum(ints)
    for i in (order * (abs(rest) // len(order) + 1))[:abs(rest)]:
        ints[i] += 1 if rest > 0 else -1
    return ints


def rank_tokens(attention: Layout) -> list[int]:
    return [sum(end - start for _, start, end in segs) for segs in attention]


def rank_targets(per_rank: Sequence[int], topology: Topology, r: float | None = None,
                 c: float = 0.0) -> list[int]:
    """Linear tokens per rank from each rank's attention tokens: node targets
    (``node_token_targets``) split evenly over the node's ranks. ``r=None`` or ``c=0``: plain
    token balance over all ranks."""
    world, gpn = topology.world_size, topology.gpus_per_node
    total = sum(per_rank)
    if r is None or c <= 0:
        return [total // world + (1 if rank < total % world else 0) for rank in range(world)]
    nodes = [sum(per_rank[q] for q in topology.node_ranks(n)) for n in range(topology.nodes)]
    targets = []
    for node_total in node_token_targets(nodes, r / gpn, c):
        targets.extend(node_total // gpn + (1 if i < node_total % gpn else 0) for i in range(gpn))
    return targets


def balance_linear(attention: Layout, topology: Topology,
                   targets: Sequence[int] | None = None,
                   per_rank: Sequence[int] | None = None) -> Layout:
    """The linear layout for ``attention``: every rank ends with ``targets[rank]`` tokens
    (default: token balance), inside the node first. ``per_rank``: the ranks' attention
    tokens, when the caller has them."""
    return linear_plan(attention, topology, targets, per_rank)[0]


def linear_plan(attention: Layout, topology: Topology, targets: Sequence[int] | None = None,
                per_rank: Sequence[int] | None = None) -> tuple[Layout, list[Move]]:
    """``balance_linear``'s layout and the remap it implies as moves (tokens a rank holds in
    the linear layout that another rank attends: ``Move(linear holder, attention holder)``)."""
    world = topology.world_size
    per_rank = rank_tokens(attention) if per_rank is None else per_rank
    targets = list(targets) if targets is not None else rank_targets(per_rank, topology)
    if sum(targets) != sum(per_rank):
        raise ValueError(f"linear targets hold {sum(targets)} tokens, the attention layout "
                         f"{sum(per_rank)}")
    kept: list[list[Segment]] = []
    surplus: list[deque[Segment]] = []
    deficit = []
    for rank in range(world):
        have = per_rank[rank]
        if have <= targets[rank]:
            keep, rest = list(attention[rank]), []
        else:
            keep, rest = _split_at(attention[rank], targets[rank])
        kept.append(keep)
        surplus.append(deque(rest))
        deficit.append(max(0, targets[rank] - have))
    moves: list[Move] = []
    for node in range(topology.nodes):
        ranks = list(topology.node_ranks(node))
        _match(ranks, ranks, surplus, deficit, kept, moves)
    _match(range(world), range(world), surplus, deficit, kept, moves)
    return tuple(tuple(segs) for segs in kept), moves


def _split_at(segments: tuple[Segment, ...], budget: int) -> tuple[list[Segment], list[Segment]]:
    """The first ``budget`` tokens of ``segments`` and the rest, splitting one segment if needed."""
    keep: list[Segment] = []
    rest: list[Segment] = []
    for seg in segments:
        length = seg.end - seg.start
        if budget >= length:
            keep.append(seg)
            budget -= length
        elif budget > 0:
            keep.append(Segment(seg.seq, seg.start, seg.start + budget))
            rest.append(Segment(seg.seq, seg.start + budget, seg.end))
            budget = 0
        else:
            rest.append(seg)
    return keep, rest


def _match(sources, sinks, surplus: list[deque[Segment]], deficit: list[int],
           kept: list[list[Segment]], moves: list[Move]) -> None:
    """Move surplus segments of ``sources`` to ranks of ``sinks`` with a deficit, in rank order
    (each piece recorded in ``moves``)."""
    sinks = [r for r in sinks if deficit[r] > 0]
    if not sinks:
        return
    k = 0
    for src in sources:
        queue = surplus[src]
        while queue and k < len(sinks):
            dst = sinks[k]
            seg = queue.popleft()
            take = min(seg.end - seg.start, deficit[dst])
            kept[dst].append(Segment(seg.seq, seg.start, seg.start + take))
            moves.append(Move(dst, src, take))
            if take < seg.end - seg.start:
                queue.appendleft(Segment(seg.seq, seg.start + take, seg.end))
            deficit[dst] -= take
            if deficit[dst] == 0:
                k += 1
