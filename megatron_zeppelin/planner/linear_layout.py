"""Token-balanced linear layout derived from an attention layout (the remapping layer's plan).

Each rank targets T/N tokens (the first T mod N ranks one more). A rank keeps the first
``target`` tokens of its attention buffer; the rest are surplus. Surpluses move to ranks short
of their target, inside the node first and across nodes only for what the node cannot absorb,
so the tokens crossing nodes are the minimum any balanced layout needs:
sum over nodes of max(0, node surplus - node deficit).

A rank's linear buffer is its kept segments followed by the segments it receives, in the
order they are assigned. ``Plan.transfers`` turns the two layouts into the remap.
"""
from __future__ import annotations

from collections import deque

from megatron_zeppelin.plan import Segment, Topology

Layout = tuple[tuple[Segment, ...], ...]


def balance_linear(attention: Layout, topology: Topology) -> Layout:
    """The token-balanced linear layout for ``attention`` (per rank segments, buffer order)."""
    world = topology.world_size
    total = sum(end - start for segs in attention for _, start, end in segs)
    targets = [total // world + (1 if r < total % world else 0) for r in range(world)]
    kept: list[list[Segment]] = []
    surplus: list[deque[Segment]] = []
    deficit = []
    for rank in range(world):
        have = sum(end - start for _, start, end in attention[rank])
        if have <= targets[rank]:
            keep, rest = list(attention[rank]), []
        else:
            keep, rest = _split_at(attention[rank], targets[rank])
        kept.append(keep)
        surplus.append(deque(rest))
        deficit.append(max(0, targets[rank] - have))
    for node in range(topology.nodes):
        ranks = list(topology.node_ranks(node))
        _match(ranks, ranks, surplus, deficit, kept)
    _match(range(world), range(world), surplus, deficit, kept)
    return tuple(tuple(segs) for segs in kept)


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
           kept: list[list[Segment]]) -> None:
    """Move surplus segments of ``sources`` to ranks of ``sinks`` with a deficit, in rank order."""
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
            if take < seg.end - seg.start:
                queue.appendleft(Segment(seg.seq, seg.start + take, seg.end))
            deficit[dst] -= take
            if deficit[dst] == 0:
                k += 1
