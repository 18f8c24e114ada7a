"""The engine's static structure of one plan on one rank: its waves, rings and LOCAL calls.

``build_waves`` turns ``Plan.rank_groups[rank]`` into ``Wave``s (run order: INTER, INTRA rings,
then LOCAL calls), each ring with its ``ZigzagLayout`` (rows ``[start, end)`` of the rank's
attention buffer ``[tokens, heads, head_dim]``) and ``RingComm``; LOCAL sequences become varlen
calls (``schedule.local_calls``). Indices are host tensors here; ``windowed`` gives a ring its
sliding-window layout (a halo exchange where it fits: ``runtime/halo.py``) and moves its
blocks to the device (``engine.AttentionEngine.prepare``).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_zeppelin.plan import Plan, RingGroup, Tier
from megatron_zeppelin.runtime.halo import HaloBlocks, halo_blocks
from megatron_zeppelin.runtime.zigzag import StepBlocks, ZigzagLayout, device_blocks
from megatron_zeppelin.runtime.kernels import Pieces, make_pieces
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.runtime.transport import Transport
from megatron_zeppelin.schedule import HALO_SPLIT, Phase, local_calls
from megatron_zeppelin.zigzag_window import halo_parts


@dataclasses.dataclass
class Ring:
    """A ring group of this rank: rows ``[start, end)`` of the buffer, layout, comm, and its
    blocks on the prepared device."""

    group: RingGroup
    start: int
    end: int
    layout: ZigzagLayout
    comm: RingComm
    routed_send: bool = False  # hop to the next position goes through the global inter step
    routed_recv: bool = False  # hop from (and, by halo, to) the previous one likewise
    blocks: StepBlocks | HaloBlocks | None = None
    halo_ok: bool = True  # a halo exchange where the window fits (``build_waves``'s halo)
    halo: bool = False  # run by halo exchange (``windowed``: HaloBlocks)
    index: torch.Tensor | None = None  # its rows where they are not [start, end) (``windowed``)

    @property
    def run_key(self) -> tuple[tuple, bool]:
        """Its run's key in the global inter-node steps: (group key, by halo exchange)."""
        return self.group.key, self.halo

    @property
    def rows(self) -> slice | torch.Tensor:
        """Its rows of the rank's buffer: ``[start, end)``, or int64 indices (a part of a
        group, ``windowed``)."""
        return slice(self.start, self.end) if self.index is None else self.index

    def by_way(self, sends, like) -> tuple[tuple, tuple, tuple, dict]:
        """A round's traffic of its run (``sends``/``recv_like``; a relay's one way) cut by
        way: ``(to next, to previous)`` sends and ``(from previous, from next)`` receives,
        all of them; of them those that go by ring P2P (the others empty); and
        ``{(run key, direction): sends}`` of its hops across nodes in the global step
        (``InterQueue.post``: direction 1 to the next position, -1 to the previous)."""
        sends, like = (sends, like) if self.halo else ((sends, []), (like, []))
        routed = {(self.run_key, 1): sends[0]} if self.routed_send else {}
        if self.routed_recv and self.halo:
            routed[(self.run_key, -1)] = sends[1]
        return (sends[0] if not self.routed_send else [],
                sends[1] if not self.routed_recv else []), (
            like[0] if not self.routed_recv else [],
            like[1] if not self.routed_send else []), like, routed

    def received(self, like: tuple, got: list, routed: dict, device: torch.device
                 ) -> list[torch.Tensor]:
        """What its run receives in a round (``by_way``'s ``like``), from the previous
        position then the next: ``got`` by ring P2P, the rest from the global step's
        ``routed`` (empty tensors where a window left a hop no rows, hence no flow)."""
        back, out = 0 if self.routed_recv else len(like[0]), []
        for direction, expect, global_step, mine in (
                (1, like[0], self.routed_recv, got[:back]),
                (-1, like[1], self.routed_send, got[back:])):
            if global_step and expect:
                mine = routed.get((self.run_key, direction)) or [
                    torch.empty(shape, dtype=dtype, device=device) for shape, dtype in expect]
            out += mine
        return out


class LocalCall(NamedTuple):
    """One causal varlen call of LOCAL sequences.

    lengths: tokens of its sequences in call order; rows: their rows of the rank's buffer in
    that order (a slice when contiguous, else int64 indices on the prepared device); pieces:
    ``kernels.Pieces`` with ``cu = (0, n_1, n_1 + n_2, ...)`` for queries and keys; work: sum
    of s^2.
    """

    lengths: tuple[int, ...]
    rows: slice | torch.Tensor
    pieces: Pieces
    work: int


@dataclasses.dataclass
class Wave:
    """One wave of this rank: its rings and its LOCAL calls."""

    rings: list[Ring]
    local: list[LocalCall]  # in run order


def whole_buffer_call(waves: list[Wave], tokens: int, inter) -> LocalCall | None:
    """The rank's only work when it is one LOCAL call over its whole buffer (one wave, no
    ring, no global step), else None."""
    if len(waves) != 1 or waves[0].rings or len(waves[0].local) != 1 or (
            inter is not None and inter.num_steps(0, Phase.FORWARD)):
        return None
    call = waves[0].local[0]
    return call if isinstance(call.rows, slice) and call.rows == slice(0, tokens) else None


def halo_split(device: torch.device | str, split: bool | None = None) -> bool:
    """Whether a ring group whose sequences only partly fit a halo exchange is split in two
    runs on ``device`` (``split`` None: the device's ``schedule.HALO_SPLIT``)."""
    return HALO_SPLIT[torch.device(device).type] if split is None else split


def windowed(ring: Ring, window: int | None, device: torch.device,
             split: bool | None = None) -> list[Ring]:
    """``ring`` with its layout for sliding window ``window`` and its blocks on ``device``.
    Its sequences whose chunks hold the window (``zigzag_window.halo_parts``: the same on
    every member) run by halo exchange, the others around the ring: two runs over one ring
    when it holds both, in that order, each on its own rows of the group's buffer, where
    ``split`` (``halo_split``)."""
    old = ring.layout
    runs = halo_parts(old.lengths, old.ring_size, window, halo_split(device, split),
                      ring.halo_ok)
    if len(runs) == 1:
        halo = runs[0][0]
        layout = old if window is None else ZigzagLayout(old.lengths, old.ring_size,
                                                         old.position, window)
        blocks = halo_blocks(layout, device) if halo else device_blocks(layout, device)
        return [dataclasses.replace(ring, layout=layout, blocks=blocks, halo=halo)]
    spans = list(itertools.accumulate((a + b for a, b in old.held(old.position)),
                                      initial=ring.start))
    parts = []
    for halo, seqs in runs:
        layout = ZigzagLayout([old.lengths[i] for i in seqs], old.ring_size, old.position,
                              window)
        rows = torch.cat([torch.arange(spans[i], spans[i + 1], dtype=torch.int64)
                          for i in seqs])
        blocks = halo_blocks(layout, device) if halo else device_blocks(layout, device)
        parts.append(dataclasses.replace(ring, layout=layout, blocks=blocks, halo=halo,
                                         index=rows.to(device)))
    return parts


def build_waves(plan: Plan, rank: int, pg: dist.ProcessGroup, inter, local_call_tokens: int,
                timeout_s: float, transport: Transport, halo: bool = True) -> list[Wave]:
    """``rank``'s rings and LOCAL calls per wave of ``plan``, indices on the host: ring groups
    in global order with their layout and ``RingComm`` on process group ``pg``; ``inter`` (an
    ``InterQueue`` or None) decides which hops go through the global inter-node step; LOCAL
    groups become calls of ``local_call_tokens`` (one call where the wave has no traffic);
    ``halo`` False: windowed rings relay round the ring even where a halo exchange fits."""
    waves = [Wave([], []) for _ in range(plan.num_waves)]
    index = {g.key: i for i, g in enumerate(plan.ring_groups)}
    offset, local = 0, []
    for group in plan.rank_groups[rank]:
        lengths = [plan.seqlens[s] for s in group.seqs]
        position = group.ring.index(rank)
        layout = ZigzagLayout(lengths, len(group.ring), position)
        start, offset = offset, offset + layout.tokens()
        if group.tier == Tier.LOCAL:
            local.append((group.wave, lengths, start))
            continue
        comm = RingComm(group.ring, rank, pg, tag=index[group.key],
                        name=f"{group.tier.name} group {group.key}", timeout_s=timeout_s,
                        transport=transport)
        ring = Ring(group, start, offset, layout, comm, halo_ok=halo)
        if inter is not None and group.tier == Tier.INTER:
            ring.routed_send = inter.crosses(group, position)
            ring.routed_recv = inter.crosses(group, (position - 1) % len(group.ring))
        waves[group.wave].rings.append(ring)
    tokens = plan.attention_tokens()[rank]
    if offset != tokens:
        raise RuntimeError(f"rank {rank}: ring groups hold {offset} tokens, the plan's "
                           f"attention layout {tokens}")
    for wave, lengths, start in local:
        quiet = not waves[wave].rings and not (inter and inter.num_steps(
            wave, Phase.FORWARD))
        waves[wave].local.extend(local_calls_of(lengths, start, quiet, local_call_tokens))
    return waves


def local_calls_of(lengths: list[int], start: int, fused: bool, local_call_tokens: int
                   ) -> list[LocalCall]:
    """The calls of a LOCAL group whose buffer rows begin at ``start`` (run order):
    ``local_calls``, or one call of the whole group (``fused``: a wave in which this rank
    has no traffic, so no wait to fill)."""
    if not lengths:
        return []
    starts = list(itertools.accumulate(lengths, initial=start))
    groups = [tuple(range(len(lengths)))] if fused else local_calls(lengths,
                                                                     local_call_tokens)
    calls = []
    for seqs in groups:
        ranges = [(starts[i], starts[i + 1]) for i in seqs]
        if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
            rows = slice(ranges[0][0], ranges[-1][1])
        else:
            rows = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])
        sizes = tuple(lengths[i] for i in seqs)
        cu = tuple(itertools.accumulate(sizes, initial=0))
        calls.append(LocalCall(sizes, rows, make_pieces(cu, cu), sum(n * n for n in sizes)))
    return calls
