"""``Plan.validate()``: proves a plan keeps the contract described in ``plan.py``.

Checked: every token of every sequence is in the attention layout exactly once and in the
linear layout exactly once; tasks are one per sequence; rings are made of distinct valid ranks,
their tier matches the nodes they span, sharded sequences have at least 2G tokens; attention
tokens per rank in each wave respect the capacity; sources match the sequence lengths; the
attention kind is one the runtime runs. A Ulysses plan's groups hold their rows in the same
zigzag layout as rings (``runtime/ulysses.py``), so the same checks apply to both kinds.
"""
from __future__ import annotations

from typing import Any, Protocol

from megatron_zeppelin.segments import Segment, zigzag_share


class CheckedPlan(Protocol):
    """What the checks read of a ``plan.Plan`` (described here, not imported: ``plan.py``
    imports this module, and the package has no import circles)."""

    topology: Any  # plan.Topology: world_size, tier_of(ring)
    seqlens: tuple[int, ...]
    sources: tuple[Segment, ...]
    tasks: tuple[Any, ...]  # plan.AttentionTask: seq, ring, tier, wave
    linear: tuple[tuple[Segment, ...], ...]
    capacity: int

    @property
    def attention(self) -> tuple[tuple[Segment, ...], ...]: ...

    @property
    def num_waves(self) -> int: ...


# ``Plan.attention_kind``: zigzag ring attention, or Ulysses all-to-all head parallelism (FlexSP)
ATTENTION_KINDS = ("ring", "ulysses")


class PlanError(ValueError):
    """A plan breaks the contract (lost or duplicated tokens, bad ring, capacity exceeded)."""


def check_plan(plan: CheckedPlan) -> None:
    _check_header(plan)
    _check_tasks(plan)
    _check_cover("attention", plan.attention, plan.seqlens)
    _check_cover("linear", plan.linear, plan.seqlens)
    for wave, per_rank in enumerate(wave_tokens(plan)):
        for rank, tokens in enumerate(per_rank):
            if tokens > plan.capacity:
                where = f" in wave {wave}" if plan.num_waves > 1 else ""
                raise PlanError(f"rank {rank} holds {tokens} attention tokens{where}, over the "
                                f"capacity {plan.capacity}")


def wave_tokens(plan: CheckedPlan) -> list[list[int]]:
    """Attention tokens per rank in each wave (waves run one after another)."""
    out = [[0] * plan.topology.world_size for _ in range(plan.num_waves)]
    for task in plan.tasks:
        size, length = len(task.ring), plan.seqlens[task.seq]
        for pos, rank in enumerate(task.ring):
            out[task.wave][rank] += zigzag_share(length, size, pos)
    return out


def _check_header(plan: CheckedPlan) -> None:
    world = plan.topology.world_size
    if len(plan.linear) != world:
        raise PlanError(f"linear layout has {len(plan.linear)} ranks, topology has {world}")
    if len(plan.tasks) != len(plan.seqlens) or len(plan.sources) != len(plan.seqlens):
        raise PlanError(f"{len(plan.seqlens)} sequences but {len(plan.tasks)} tasks and "
                        f"{len(plan.sources)} sources: expected one each")
    for i, (length, src) in enumerate(zip(plan.seqlens, plan.sources)):
        if length < 1:
            raise PlanError(f"sequence {i} has length {length}: expected >= 1")
        if src.end - src.start != length or src.start < 0:
            raise PlanError(f"sequence {i} of length {length} has source {src}")
    if plan.attention_kind not in ATTENTION_KINDS:
        raise PlanError(f"attention_kind={plan.attention_kind!r} is invalid: expected one of "
                        f"{list(ATTENTION_KINDS)}")
    if plan.capacity < 1:
        raise PlanError(f"capacity {plan.capacity} is invalid: expected >= 1")


def _check_tasks(plan: CheckedPlan) -> None:
    world = plan.topology.world_size
    for i, task in enumerate(plan.tasks):
        if task.seq != i:
            raise PlanError(f"task {i} attends sequence {task.seq}: tasks must be in sequence "
                            "order")
        ring = task.ring
        if not ring or len(set(ring)) != len(ring) or any(not 0 <= r < world for r in ring):
            raise PlanError(f"sequence {i} has ring {ring}: expected distinct ranks in "
                            f"[0, {world})")
        if plan.topology.tier_of(ring) != task.tier:
            raise PlanError(f"sequence {i} ring {ring} is {plan.topology.tier_of(ring).name}, "
                            f"task says {task.tier.name}")
        if len(ring) > 1 and plan.seqlens[i] < 2 * len(ring):
            raise PlanError(f"sequence {i} of {plan.seqlens[i]} tokens is split over "
                            f"{len(ring)} ranks: zigzag needs at least {2 * len(ring)} tokens")
        if task.wave < 0:
            raise PlanError(f"sequence {i} has wave {task.wave}: expected >= 0")


def _check_cover(name: str, layout: tuple[tuple[Segment, ...], ...], seqlens: tuple[int, ...]
                 ) -> None:
    """Every sequence's segments in ``layout`` tile [0, length) with no gap and no overlap."""
    per_seq: list[list[tuple[int, int]]] = [[] for _ in seqlens]
    for rank, segs in enumerate(layout):
        for seq, start, end in segs:
            if not 0 <= seq < len(seqlens):
                raise PlanError(f"{name} layout of rank {rank} names sequence {seq}, "
                                f"valid: [0, {len(seqlens)})")
            if start >= end:
                raise PlanError(f"{name} layout of rank {rank} has empty segment "
                                f"{(seq, start, end)}")
            per_seq[seq].append((start, end))
    for seq, pieces in enumerate(per_seq):
        pieces.sort()
        pos = 0
        for start, end in pieces:
            if start != pos:
                kind = "duplicated" if start < pos else "missing"
                lo, hi = (start, pos) if start < pos else (pos, start)
                raise PlanError(f"{name} layout: tokens [{lo}, {hi}) of sequence {seq} are {kind}")
            pos = end
        if pos != seqlens[seq]:
            raise PlanError(f"{name} layout: tokens [{pos}, {seqlens[seq]}) of sequence {seq} "
                            "are missing")
