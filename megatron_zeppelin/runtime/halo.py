"""Halo exchange: a windowed ring group that trades KV with its two neighbours in one round.

With a sliding window ``L`` no larger than any zigzag chunk of the group's sequences
(``zigzag_window.halo_fits``: a ring of ``G >= 3`` positions), a query's keys lie in its own
chunk or the one before it. Position ``p`` holds chunks ``p`` and ``2G-1-p`` (``zigzag``), so it
reads only the last ``L`` rows of chunk ``p - 1`` (held by position ``p - 1``, which the ring
brings at step 1) and of chunk ``2G-2-p`` (held by position ``p + 1``, which the ring relays
through every other position to bring at step ``G - 1``). The ring's middle steps compute
nothing, yet its hops carry those rows all the way round: ``G - 1`` rounds forward and ``G + 1``
backward. The halo exchange sends them straight:

* forward, 2 rounds: round 0 sends the rows ``p + 1`` reads to ``p + 1`` and those ``p - 1``
  reads to ``p - 1`` (``RingComm.exchange_both``) while step 0 (the position's own chunks)
  computes; round 1 computes against the two received blocks, the previous position's first
  (the ring's step 1), then the next one's (its step ``G - 1``): the merge order of the ring, so
  the output is the same;
* backward, 3 rounds: round 0 sends the KV rows again while step 0 computes (dq and the
  position's own dK/dV); round 1 computes against the two received blocks (dq, and the dK/dV
  of the neighbours' rows); round 2 returns those dK/dV to their owners, which add them into
  their rows.

Layouts as ``attention``: q ``[tokens, heads, head_dim]``, KV ``[tokens, kv_heads, head_dim +
v_head_dim]`` (k and v side by side), dK/dV in the accumulator dtype. ``HaloGroupRun`` has the
interface of ``attention.RingGroupRun`` except that ``sends`` and ``recv_like`` are pairs
(towards the next position, towards the previous one) and ``receive`` takes what came from
the previous position, then what came from the next one. The engine uses it for a windowed
ring where it fits (``waves.windowed``); a hop across nodes of an INTER ring, either way,
travels in the global inter-node steps (``runtime.inter``, sized by ``halo_like``).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from megatron_zeppelin.runtime.attention import Like, RingGroupRun, _add_rows, take
from megatron_zeppelin.runtime.kernels import KernelBackend, accum_dtype
from megatron_zeppelin.runtime.zigzag import Block, ZigzagLayout, place_blocks
from megatron_zeppelin.schedule import Phase, halo_steps
from megatron_zeppelin.zigzag_window import halo_fits


class HaloBlocks(NamedTuple):
    """One position's halo calls and rows on a device: ``own`` (step 0), ``prev``/``next``
    (against the rows received from position ``p - 1``/``p + 1``, keys indexing those rows);
    ``to_next``/``to_prev``: int64 rows of this position's KV that ``p + 1``/``p - 1`` read;
    ``from_prev``/``from_next``: how many rows arrive from ``p - 1``/``p + 1``."""

    own: tuple[Block, ...]
    prev: tuple[Block, ...]
    next: tuple[Block, ...]
    to_next: torch.Tensor
    to_prev: torch.Tensor
    from_prev: int
    from_next: int


def halo_blocks(layout: ZigzagLayout, device: torch.device | str) -> HaloBlocks:
    """The halo calls and rows of ``layout``'s position on ``device`` (one move); ValueError
    unless its group exchanges with its neighbours only (``halo_fits``)."""
    size, p = layout.ring_size, layout.position
    if not halo_fits(layout.lengths, size, layout.window):
        raise ValueError(f"window={layout.window!r} on a ring of {size} over lengths "
                         f"{list(layout.lengths)}: a halo exchange needs a ring of 3 or more "
                         "and every zigzag chunk at least as long as the window")
    prev, nxt = (p - 1) % size, (p + 1) % size
    from_prev, from_next = layout.read_rows(p, prev), layout.read_rows(p, nxt)
    calls = [layout.blocks(0), layout.window_blocks(prev, from_prev),
             layout.window_blocks(nxt, from_next)]
    placed, moved = place_blocks(calls, [layout.read_rows(nxt, p), layout.read_rows(prev, p)],
                                 device)
    return HaloBlocks(*placed, *moved, len(from_prev), len(from_next))


def halo_like(reads: int, read_by: int, phase: Phase, step: int, tail: tuple[int, ...],
              dtype: torch.dtype) -> Like:
    """What a position receives from one neighbour in round ``step`` of a halo exchange: the
    ``reads`` KV rows ``[reads, *tail]`` it reads of the neighbour's (round 0), in backward
    the dK/dV (accumulator dtype) of the ``read_by`` rows of its own the neighbour read
    (round 2); nothing in the other rounds."""
    if step == 0:
        return [((reads, *tail), dtype)]
    if Phase(phase) is Phase.BACKWARD and step == 2:
        return [((read_by, *tail), accum_dtype(dtype))]
    return []


class HaloGroupRun(RingGroupRun):
    """One windowed ring group on this rank by halo exchange (module docstring); driven as
    ``RingGroupRun`` is, with two-way ``sends``/``recv_like``/``receive``."""

    def __init__(self, layout: ZigzagLayout, scale: float,
                 backend: KernelBackend | str | None = None,
                 blocks: HaloBlocks | None = None) -> None:
        super().__init__(layout, scale, backend, blocks)

    def steps(self, phase: Phase) -> int:
        return halo_steps(Phase(phase))

    def _begin(self, q: torch.Tensor) -> None:
        if self.blocks is None:
            self.blocks = halo_blocks(self.layout, q.device)
        super()._begin(q)

    def sends(self, phase: Phase, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(to the next position, to the previous one) in round ``step``."""
        b = self.blocks
        if step == 0:
            return [take(self.kv, b.to_next)], [take(self.kv, b.to_prev)]
        if phase is Phase.BACKWARD and step == 2:  # the neighbours' rows' dK/dV, home
            return [self.dkv_next], [self.dkv_prev]
        return [], []

    def recv_like(self, phase: Phase, step: int) -> tuple[Like, Like]:
        """(from the previous position, from the next one) in round ``step``: what they
        send (``sends``) in the same round."""
        b, tail, dtype = self.blocks, tuple(self.kv.shape[1:]), self.kv.dtype
        return (halo_like(b.from_prev, b.to_prev.numel(), phase, step, tail, dtype),
                halo_like(b.from_next, b.to_next.numel(), phase, step, tail, dtype))

    def compute(self, phase: Phase, step: int) -> None:
        b = self.blocks
        if phase is Phase.FORWARD:
            if step == 0:
                self._forward_blocks(b.own, self.kv)
            else:
                self._forward_blocks(b.prev, self.halo_prev)
                self._forward_blocks(b.next, self.halo_next)
        elif step == 0:
            self._backward_blocks(b.own, self.kv, self.dkv)
        elif step == 1:
            self.dkv_prev = self._backward_blocks(b.prev, self.halo_prev)
            self.dkv_next = self._backward_blocks(b.next, self.halo_next)

    def receive(self, phase: Phase, step: int, received: Sequence[torch.Tensor]) -> None:
        if step == 0:
            self.halo_prev, self.halo_next = received
        elif phase is Phase.BACKWARD and step == 2:
            from_prev, from_next = received  # my rows' dK/dV as p - 1 and p + 1 read them
            _add_rows(self.dkv, self.blocks.to_prev, from_prev)
            _add_rows(self.dkv, self.blocks.to_next, from_next)

    def end_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        del self.halo_prev, self.halo_next
        return super().end_forward()

    def end_backward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        del self.halo_prev, self.halo_next, self.dkv_prev, self.dkv_next
        return super().end_backward()
