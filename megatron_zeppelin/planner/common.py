"""What every strategy shares: input checks, capacity, the overlong policy, plan assembly."""
from __future__ import annotations

import dataclasses
import math
import operator
import time
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.plan import (AttentionTask, Layout, OverlongReport, Plan, Segment,
                                    Topology, attention_layout_of, ring_groups_of, zigzag_share,
                                    zigzag_share_bound)
from megatron_zeppelin.planner.overlong import OverlongTally, check_policy


class CapacityError(ValueError):
    """The batch cannot be placed within the capacity (tokens per rank); names the limit."""


@dataclass(frozen=True)
class Batch:
    """Planner input after checks: sequences to place and where they come from.

    seqlens: sequences after the overlong policy; sources[i] = (document, start, end).
    capacity: attention-layout tokens a rank may hold.
    """

    topology: Topology
    seqlens: tuple[int, ...]
    sources: tuple[Segment, ...]
    capacity: int
    report: OverlongReport
    started: float

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)


def check_lengths(seqlens: Sequence[int]) -> tuple[int, ...]:
    """Reject an empty batch and lengths that are not positive integers, naming the item."""
    if isinstance(seqlens, (str, bytes, dict, set, frozenset)) or \
            not hasattr(seqlens, "__iter__"):
        raise ValueError(f"seqlens={seqlens!r} is invalid: expected a sequence of positive "
                         "integers (tokens per document)")
    lengths = tuple(seqlens)
    if not lengths:
        raise ValueError("empty batch: expected at least one sequence length")
    if all(type(x) is int for x in lengths) and min(lengths) >= 1:
        return lengths  # the common case, checked in one pass
    out = []
    for i, length in enumerate(lengths):
        try:  # ints and numpy's integer scalars; not bools, floats, arrays (a 2-D batch's rows)
            value = None if isinstance(length, bool) else operator.index(length)
        except TypeError:
            value = None
        if value is None:
            raise ValueError(f"sequence {i} has length {length!r}: expected a positive integer")
        if value < 1:
            raise ValueError(f"sequence {i} has length {value}: expected a positive integer "
                             "(zero and negative lengths are invalid)")
        out.append(value)
    return tuple(out)


def resolve_capacity(seqlens: tuple[int, ...], topology: Topology, config: ZeppelinConfig) -> int:
    """The configured capacity, or ``capacity_factor`` x the mean tokens per rank, raised if
    needed so that every sequence has a legal span (tiny batches on large pools)."""
    total = sum(seqlens)  # no rank ever holds more: a larger capacity means the same
    if config.capacity_tokens_per_gpu is not None:
        return min(config.capacity_tokens_per_gpu, total)
    capacity = min(max(1, math.ceil(config.capacity_factor * total / topology.world_size)),
                   total)
    longer = {s for s in seqlens if s > capacity}  # only these need a multi-rank span
    return max([capacity, *(smallest_share(s, topology) for s in longer)])


def smallest_share(seqlen: int, topology: Topology) -> int:
    """Fewest tokens per rank any legal span gives ``seqlen``: k ranks of one node or whole
    nodes, with at least 2 tokens per rank for a zigzag split. (The share shrinks as the span
    grows, so it is the share at the widest legal span.)"""
    gpn = topology.gpus_per_node
    nodes = min(topology.nodes, seqlen // 2 // gpn)
    widest = nodes * gpn if nodes >= 2 else max(1, min(gpn, seqlen // 2))
    return zigzag_share_bound(seqlen, widest)


def pool_limit(world: int, capacity: int) -> int:
    """Longest sequence the pool holds: zigzag over every rank, each share within ``capacity``
    (by ``zigzag_share_bound``, so the exact shares fit too), or whole on one rank (an odd
    ``capacity`` of 1 holds no zigzag chunks, yet a 1-token document)."""
    return max(capacity, 2 * world * (capacity // 2))


def apply_overlong(seqlens: tuple[int, ...], limit: int, policy: str, why: str = "the limit"
                   ) -> tuple[tuple[int, ...], tuple[Segment, ...], OverlongReport]:
    """Apply the overlong policy (``overlong.py``) to sequences longer than ``limit`` tokens."""
    check_policy(policy)
    lengths: list[int] = []
    sources: list[Segment] = []
    tally = OverlongTally()
    for doc, length in enumerate(seqlens):
        for start, end in tally.admit(doc, length, limit, policy, why=why):
            lengths.append(end - start)
            sources.append(Segment(doc, start, end))
    if not lengths:
        raise ValueError(f"every sequence of the batch was dropped as overlong "
                         f"({tally.dropped_sequences} sequences, {tally.dropped_tokens} tokens; "
                         f"{why} is {limit} tokens)")
    return tuple(lengths), tuple(sources), tally.report(policy)


def prepare(seqlens: Sequence[int], topology: Topology, config: ZeppelinConfig) -> Batch:
    """Check the lengths, apply the overlong policy and fix the capacity.

    A document is overlong when it exceeds ``max_seqlen`` or, with a configured capacity,
    what the pool holds; a derived capacity always grows to hold every document.
    """
    started = time.perf_counter()
    lengths = check_lengths(seqlens)
    limit, why = config.max_seqlen or 0, "max_seqlen"
    if config.capacity_tokens_per_gpu is not None:
        pool = pool_limit(topology.world_size, config.capacity_tokens_per_gpu)
        if not limit or pool < limit:
            limit, why = pool, (f"the pool limit ({topology.world_size} ranks x "
                                f"capacity_tokens_per_gpu {config.capacity_tokens_per_gpu})")
    if limit:
        planned, sources, report = apply_overlong(lengths, limit, config.overlong, why)
    else:
        planned, sources = lengths, whole_segments(lengths)
        report = OverlongReport(config.overlong, documents=len(lengths))
    capacity = resolve_capacity(planned, topology, config)
    if sum(planned) > topology.world_size * capacity:
        raise CapacityError(f"the batch has {sum(planned)} tokens but the pool holds at most "
                         f"{topology.world_size * capacity} ({topology.world_size} ranks x "
                         f"capacity {capacity}); raise capacity_tokens_per_gpu or add ranks")
    return Batch(topology, planned, sources, capacity, report, started)


def whole_segments(lengths: Sequence[int]) -> tuple[Segment, ...]:
    """``Segment(i, 0, n)`` for every sequence (the twin builds them faster, when used)."""
    from megatron_zeppelin.planner.native import cpp_module

    cpp = cpp_module(None)
    if cpp is not None:
        return cpp.whole_segments(lengths)
    return tuple(map(tuple.__new__, repeat(Segment), zip(range(len(lengths)), repeat(0),
                                                           lengths)))


def with_derived_capacity(plan_fn: Callable[..., Plan], seqlens: Sequence[int], cost,
                          config: ZeppelinConfig) -> Plan:
    """``plan_fn(seqlens, cost, config)``; when a greedy placement cannot meet a *derived*
    capacity (the default; tight on tiny batches over large pools), grow it by half and plan
    again, up to 4 times. A configured capacity is the user's limit: its ``CapacityError``
    propagates."""
    for attempt in range(5):
        try:
            return plan_fn(seqlens, cost, config)
        except CapacityError:
            if config.capacity_tokens_per_gpu is not None or attempt == 4:
                raise
            config = dataclasses.replace(config, capacity_factor=config.capacity_factor * 1.5)
    raise AssertionError("unreachable")


def assemble(strategy: str, batch: Batch, tasks: Sequence[AttentionTask],
             linear: Layout | None = None, **fields) -> Plan:
    """Build the Plan; ``linear``: the linear layout (None: the attention layout, no remap).
    ``fields``: further ``Plan`` fields (``attention_kind``, ``candidate``, ``estimates``)."""
    tasks = tuple(tasks)
    if linear is None:
        linear = attention_layout_of(ring_groups_of(tasks, batch.topology), batch.seqlens,
                                     batch.topology.world_size)
    return Plan(strategy=strategy, topology=batch.topology, seqlens=batch.seqlens,
                sources=batch.sources, tasks=tasks, linear=linear, capacity=batch.capacity,
                overlong=batch.report, plan_time_s=time.perf_counter() - batch.started,
                **fields)


def within_capacity(tasks: Sequence[AttentionTask], batch: Batch) -> bool:
    """Whether every rank's attention tokens stay within the batch's capacity."""
    tokens = [0] * batch.topology.world_size
    for task in tasks:
        size, length = len(task.ring), batch.seqlens[task.seq]
        for pos, r in enumerate(task.ring):
            tokens[r] += zigzag_share(length, size, pos)
    return max(tokens) <= batch.capacity
