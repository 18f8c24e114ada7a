"""The Plan: the contract between the planner and the runtime.

Data flows one way: sequence lengths -> planner -> ``Plan`` -> runtime / simulator.

A plan places one global batch of variable-length sequences on a pool of ranks
(``Topology``: nodes x ranks per node; a rank is one GPU, or one tensor-parallel group):

* attention layout: every sequence has exactly one ``AttentionTask``. A task whose ring has one
  rank is LOCAL (the whole sequence on that rank); otherwise the sequence is zigzag-split into
  2G chunks over its ring of G global ranks (ring position p holds chunks p and 2G-1-p), and the
  ring is INTRA (one node) or INTER (several nodes). A rank's attention buffer is
  ``[tokens, heads, head_dim]`` in ``Plan.attention[rank]`` order: ring groups sorted by the
  global key (wave, tier, first task), inside a group its sequences in task order, each as
  ``[chunk p, chunk 2G-1-p]``.
* linear layout: ``Plan.linear[rank]`` lists the token ranges a rank holds for the linear modules
  (QKV/MLP), balanced by token count. ``Plan.transfers`` is the remap between the two layouts.

Only the standard library is used here, so plans can be built and checked anywhere.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from typing import NamedTuple, Sequence

from megatron_zeppelin import env
from megatron_zeppelin.plan_checks import PlanError, check_plan
from megatron_zeppelin.segments import (Layout, Segment, zigzag_bounds, zigzag_segments,
                                        zigzag_share, zigzag_share_bound)

__all__ = ["AttentionTask", "Layout", "OverlongReport", "Plan", "PlanError", "RingGroup",
           "Segment", "Tier", "Topology", "Transfer", "local_call_groups", "zigzag_bounds",
           "zigzag_segments", "zigzag_share", "zigzag_share_bound"]


class Tier(enum.IntEnum):
    """Attention queue of a sequence, in the order a rank runs them."""

    INTER = 0  # ring across nodes
    INTRA = 1  # ring over NVLink inside one node
    LOCAL = 2  # whole sequence on one rank


@dataclass(frozen=True)
class Topology:
    """A pool of ``nodes x gpus_per_node`` ranks; global rank = node * gpus_per_node + local."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"topology {key}={value!r} is invalid: expected an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def tier_of(self, ring: tuple[int, ...]) -> Tier:
        if len(ring) == 1:
            return Tier.LOCAL
        first = ring[0] // self.gpus_per_node
        if all(r // self.gpus_per_node == first for r in ring):
            return Tier.INTRA
        return Tier.INTER

    def check_world_size(self, world_size: int) -> None:
        """Raise unless a process group of ``world_size`` ranks matches this topology."""
        if world_size != self.world_size:
            raise ValueError(f"world size {world_size} does not match the topology: "
                             f"{self.nodes} nodes x {self.gpus_per_node} ranks per node = "
                             f"{self.world_size}")


class AttentionTask(NamedTuple):
    """Sequence ``seq`` attended on ``ring`` (global ranks in ring order) in ``wave``.

    Waves run one after another with a barrier between them (Megatron's hybrid CP groups);
    Zeppelin plans use a single wave. (A NamedTuple: immutable and cheap to build in bulk.)
    """

    seq: int
    ring: tuple[int, ...]
    tier: Tier
    wave: int = 0


class RingGroup(NamedTuple):
    """Tasks that share a ring and a wave: one fused varlen attention call per ring step."""

    key: tuple[int, int, int]  # (wave, tier, index of the first task): the global order
    ring: tuple[int, ...]
    tier: Tier
    wave: int
    seqs: tuple[int, ...]


@dataclass(frozen=True)
class OverlongReport:
    """What the overlong policy (``planner/overlong.py``) did; nothing is dropped or split
    without being counted here. ``documents``: documents it saw."""

    policy: str = "error"
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    split_sequences: int = 0
    split_pieces: int = 0
    documents: int = 0


class Transfer(NamedTuple):
    """Tokens ``[start, end)`` of ``seq`` move from ``src``'s linear buffer at ``src_offset``
    to ``dst``'s attention buffer at ``dst_offset`` (the reverse for the attention output)."""

    src: int
    dst: int
    seq: int
    start: int
    end: int
    src_offset: int
    dst_offset: int


# A candidate plan with the remapping layer is named after its placement plus this suffix
# (``planner/portfolio.py``); ``Plan.name`` keeps it only where the plan does remap.
REMAP_SUFFIX = "+remap"


@dataclass(frozen=True)
class Plan:
    """One global batch placed on the pool. ``tasks[i]`` attends sequence ``i``.

    seqlens: planned sequences (after the overlong policy), tokens each.
    sources: per planned sequence, the input document and token range it comes from
        (``Segment(doc, start, end)``); a ``split`` policy maps several sequences to one doc.
    linear: per rank, the token ranges of its linear (token-balanced) layout, in buffer order.
    capacity: attention-layout tokens a rank may hold.
    attention_kind: ``ring`` (zigzag ring attention over each task's ring: what the engine
        runs) or ``ulysses`` (all-to-all head parallelism over the task's ranks, FlexSP's
        sequence parallelism: the engine runs it through ``runtime/ulysses.py``).
    candidate / estimates: for a strategy that scores several candidate plans of the batch
        (``zeppelin``'s portfolio), the candidate returned and every candidate's estimated
        step seconds (``cost_model.estimate_step``), fastest first; empty otherwise.
    """

    strategy: str
    topology: Topology
    seqlens: tuple[int, ...]
    sources: tuple[Segment, ...]
    tasks: tuple[AttentionTask, ...]
    linear: tuple[tuple[Segment, ...], ...]
    capacity: int
    overlong: OverlongReport = OverlongReport()
    plan_time_s: float = 0.0
    attention_kind: str = "ring"
    candidate: str = ""
    estimates: tuple[tuple[str, float], ...] = ()

    @property
    def margin(self) -> float:
        """How much faster (estimated) the returned candidate is than the next best one:
        runner-up seconds / chosen seconds (1.0 without a portfolio or on a tie)."""
        times = [t for _, t in self.estimates]
        return times[1] / times[0] if len(times) > 1 and times[0] > 0 else 1.0

    @property
    def remaps(self) -> bool:
        """Whether the linear modules run on another layout than attention: the remap's
        all-to-alls run (``runtime/remap.py``) and ``transfers`` move tokens between ranks."""
        return self.linear != self.attention

    @property
    def name(self) -> str:
        """What logs and summaries call the plan, decided here only: the candidate the
        strategy chose (``candidate``), else the strategy; a ``...+remap`` candidate whose
        plan remaps nothing (its placement already holds the linear layout's tokens) is
        named without the suffix, since it runs no remap. ``candidate`` itself stays the
        portfolio's key into ``estimates``."""
        name = self.candidate or self.strategy
        if name.endswith(REMAP_SUFFIX) and not self.remaps:
            return name[:-len(REMAP_SUFFIX)]
        return name

    def estimated_gain(self, candidate: str) -> float | None:
        """``candidate``'s estimated seconds / the chosen plan's (None if not scored)."""
        mine = dict(self.estimates)
        if candidate not in mine or not self.estimates or self.estimates[0][1] <= 0:
            return None
        return mine[candidate] / self.estimates[0][1]

    # ------------------------------------------------------------------ derived views
    @cached_property
    def ring_groups(self) -> tuple[RingGroup, ...]:
        """All ring groups of the plan in the global order every rank follows."""
        return ring_groups_of(self.tasks, self.topology)

    @cached_property
    def rank_groups(self) -> tuple[tuple[RingGroup, ...], ...]:
        """Per rank, the ring groups it takes part in, in global order."""
        per_rank: list[list[RingGroup]] = [[] for _ in range(self.topology.world_size)]
        for group in self.ring_groups:
            for rank in group.ring:
                per_rank[rank].append(group)
        return tuple(tuple(g) for g in per_rank)

    @cached_property
    def attention(self) -> Layout:
        """Per rank, the token ranges of its attention buffer, in buffer order."""
        return attention_layout_of(self.ring_groups, self.seqlens, self.topology.world_size)

    def attention_tokens(self) -> list[int]:
        return [sum(end - start for _, start, end in segs) for segs in self.attention]

    def linear_tokens(self) -> list[int]:
        return [sum(end - start for _, start, end in segs) for segs in self.linear]

    @property
    def num_waves(self) -> int:
        return 1 + max((t.wave for t in self.tasks), default=0)

    def tier_counts(self) -> dict[str, int]:
        counts = {tier.name.lower(): 0 for tier in Tier}
        for task in self.tasks:
            counts[task.tier.name.lower()] += 1
        return counts

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """The remap from the linear layout to the attention layout, sorted by (src, dst,
        dst_offset)."""
        att = _pieces_by_seq(self.attention, len(self.seqlens))
        lin = _pieces_by_seq(self.linear, len(self.seqlens))
        out: list[Transfer] = []
        for seq in range(len(self.seqlens)):
            out.extend(_intersect(seq, lin[seq], att[seq]))
        out.sort(key=lambda t: (t.src, t.dst, t.dst_offset))
        return tuple(out)

    def remap_matrix(self) -> list[list[int]]:
        """tokens[src][dst] moved from src's linear layout to dst's attention layout
        (src != dst)."""
        n = self.topology.world_size
        matrix = [[0] * n for _ in range(n)]
        for t in self.transfers:
            if t.src != t.dst:
                matrix[t.src][t.dst] += t.end - t.start
        return matrix

    def remap_cross_node_tokens(self) -> int:
        node = self.topology.node_of
        return sum(t.end - t.start for t in self.transfers if node(t.src) != node(t.dst))

    def __reduce__(self):
        """Pickle as plain tuples of ints (``_rebuild_plan``): far faster to send to and
        rebuild in another process (the planner process) than one object per segment."""
        return _rebuild_plan, (
            self.strategy, self.topology, self.seqlens, tuple(zip(*self.sources)),
            tuple(t.ring for t in self.tasks), tuple(int(t.tier) for t in self.tasks),
            tuple(t.wave for t in self.tasks), tuple(len(segs) for segs in self.linear),
            tuple(zip(*(seg for segs in self.linear for seg in segs))), self.capacity,
            self.overlong, self.plan_time_s, self.attention_kind, self.candidate,
            self.estimates)

    def validate(self) -> "Plan":
        """Check the contract; raise ``PlanError`` naming the first violation. Returns self."""
        check_plan(self)
        return self


def _segments(columns: tuple) -> list[Segment]:
    """Segments from (seqs, starts, ends) columns, without Segment's Python constructor."""
    return list(map(tuple.__new__, repeat(Segment), zip(*columns))) if columns else []


def _plan_parts(rings, tiers, waves, counts, linear, sources) -> tuple:
    """``_rebuild_plan``'s tasks, linear layout and sources, from the columns."""
    tier = tuple(Tier)
    tasks = tuple(map(tuple.__new__, repeat(AttentionTask),
                      zip(range(len(rings)), rings, map(tier.__getitem__, tiers), waves)))
    segments, layout, first = _segments(linear), [], 0
    for count in counts:
        layout.append(tuple(segments[first:first + count]))
        first += count
    return tasks, tuple(layout), tuple(_segments(sources))


def _twin(name: str, reference):
    """The planner's C++ twin's function ``name`` (the same objects as the Python ``reference``,
    built without Python calls and kept out of the cyclic garbage collector, so that a process
    holding many plans does not pay for them in its collections), or ``reference`` where the
    twin is not built or ``ZEPPELIN_PLANNER_BACKEND=python`` (the switch ``planner/native.py``
    reads)."""
    if env.planner_backend() != "python":
        try:
            from megatron_zeppelin import _planner_cpp
            return getattr(_planner_cpp, name)
        except ImportError:
            pass
    return reference


def _rebuild_plan(strategy, topology, seqlens, sources, rings, tiers, waves, counts, linear,
                  capacity, overlong, plan_time_s, attention_kind, candidate, estimates) -> Plan:
    """The Plan ``Plan.__reduce__`` pickled."""
    tasks, layout, source_segments = _twin("plan_parts", _plan_parts)(
        rings, tiers, waves, counts, linear, sources)
    return Plan(strategy, topology, seqlens, source_segments, tasks, layout, capacity, overlong,
                plan_time_s, attention_kind, candidate, estimates)


def ring_groups_of(tasks: Sequence[AttentionTask], topology: Topology) -> tuple[RingGroup, ...]:
    """The ring groups of ``tasks`` (tasks sharing a wave and a ring fuse), in the global
    order (wave, tier, first task) every rank follows."""
    members: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for task in tasks:
        members.setdefault((task.wave, task.ring), []).append(task.seq)
    tier_of = topology.tier_of
    groups = []
    for (wave, ring), seqs in members.items():
        tier = tier_of(ring)
        groups.append(RingGroup((wave, int(tier), seqs[0]), ring, tier, wave, tuple(seqs)))
    groups.sort(key=lambda g: g.key)
    return tuple(groups)


def attention_layout_of(groups: Sequence[RingGroup], seqlens: Sequence[int], world: int
                        ) -> Layout:
    """Per rank, the token ranges of its attention buffer: its ring groups in global order,
    inside a group the sequences in task order, each as ``[chunk p, chunk 2G-1-p]`` (the twin's
    where built: ``_twin``)."""
    return _twin("attention_layout", _attention_layout)(groups, seqlens, world)


def _attention_layout(groups: Sequence[RingGroup], seqlens: Sequence[int], world: int
                      ) -> Layout:
    """``attention_layout_of`` in Python."""
    out: list[list[Segment]] = [[] for _ in range(world)]
    for group in groups:
        size = len(group.ring)
        if size == 1:
            out[group.ring[0]].extend(Segment(seq, 0, seqlens[seq]) for seq in group.seqs)
            continue
        for pos, rank in enumerate(group.ring):
            for seq in group.seqs:
                out[rank].extend(zigzag_segments(seq, seqlens[seq], size, pos))
    return tuple(tuple(segs) for segs in out)


def local_call_groups(squares: Sequence[float], min_tokens: int) -> list[tuple[int, ...]]:
    """How a rank runs its LOCAL sequences (the engine does it, the simulator models it): the
    sequence indices of each kernel call, in run order, from each sequence's s^2. A sequence
    of at least ``min_tokens`` tokens is a call of its own; shorter ones, shortest first, are
    packed into calls that close once they hold the work (sum of s^2) of one
    ``min_tokens``-token sequence; calls run by ascending work (ties: lowest first index)."""
    floor = min_tokens * min_tokens
    calls, batch, work = [], [], 0
    for i in sorted(range(len(squares)), key=lambda i: (squares[i], i)):
        if squares[i] >= floor:
            calls.append((i,))
            continue
        batch.append(i)
        work += squares[i]
        if work >= floor:
            calls.append(tuple(batch))
            batch, work = [], 0
    if batch:
        calls.append(tuple(batch))
    return sorted(calls, key=lambda call: (sum(squares[i] for i in call), call[0]))


def _pieces_by_seq(layout: tuple[tuple[Segment, ...], ...], num_seqs: int
                   ) -> list[list[tuple[int, int, int, int]]]:
    """Per sequence, the (start, end, rank, buffer offset) of every piece, sorted by start."""
    pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in range(num_seqs)]
    for rank, segs in enumerate(layout):
        offset = 0
        for seq, start, end in segs:
            pieces[seq].append((start, end, rank, offset))
            offset += end - start
    for p in pieces:
        p.sort()
    return pieces


def _intersect(seq: int, lin: list[tuple[int, int, int, int]],
               att: list[tuple[int, int, int, int]]) -> list[Transfer]:
    """Overlaps of two sorted tilings of one sequence, as transfers from linear to attention."""
    out: list[Transfer] = []
    i = j = 0
    while i < len(lin) and j < len(att):
        ls, le, lr, lo = lin[i]
        as_, ae, ar, ao = att[j]
        start, end = max(ls, as_), min(le, ae)
        if start < end:
            out.append(Transfer(lr, ar, seq, start, end, lo + start - ls, ao + start - as_))
        if le <= ae:
            i += 1
        else:
            j += 1
    return out
