"""Shift per-token tensors by ``k`` positions within documents, across a plan's linear layout.

Multi-token prediction (megatron-core's MTP) needs, at depth ``k``, the input id and the label
``k`` positions later in the same document. In the linear layout a rank holds pieces
``Segment(seq, start, end)`` of planned sequences (``Plan.linear[rank]``, in buffer order, then
``pad`` rows that belong to no sequence); the token ``k`` positions after ``(seq, pos)`` is in the
same piece when ``pos + k < end``, else in a later piece of ``seq``, possibly on another rank, and
possibly several pieces later (pieces shorter than ``k``).

The shift, on a ``[rows, ...]`` buffer (``[tokens]`` ids / labels / mask, ``[tokens, hidden]``
activations)::

    shift(x)[row of (seq, pos)] = x[row of (seq, pos + k)]   if pos + k < seqlens[seq]
                                = 0                          otherwise, and on pad rows

which is megatron-core 0.16.1's packed-sequence roll (``roll_tensor`` with packed params and
CP 1: each sequence rolled left by one, its last position zeroed) applied ``k`` times, with the
sequence split over ranks. The masking is the zero fill: a shifted loss mask is 0 wherever the
shifted label would cross its document's end, exactly as Megatron masks in one process.

``build_shift_index(plan, rank, k)`` plans the shift once per micro-batch (host Python over the
plan's pieces, never over tokens; the same on every rank, so both sides of every transfer agree),
``ShiftIndex.to(device)`` moves its row indices once. ``shift(x, index, group)`` is then one
batch of P2P with the peers that hold the rows it needs or needs its rows (none when every
document continues on the same rank), the local rows copied while it is in flight; autograd-aware
(the backward sends the gradient rows back the same way: the shift is injective).
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.runtime.device_index import to_device
from megatron_zeppelin.runtime.transport import P2P, Transport, get_transport, warm_up

SHIFT_TAG = 1 << 27  # gloo tag of shift messages (ring tags are small, ordered.py's above 2^29)


@dataclass(frozen=True)
class ShiftIndex:
    """One rank's side of a shift by ``k`` (pool ranks; row tensors int64).

    local_src / local_dst: ``out[local_dst] = x[local_src]`` for targets this rank holds.
    send_peers / send_splits / send_rows: rows of ``x`` sent to each peer (grouped, peer order).
    recv_peers / recv_splits / recv_rows: where each peer's rows land in ``out`` (grouped).
    tokens: the rank's linear tokens (a buffer has these rows, then pad rows).
    """

    rank: int
    k: int
    tokens: int
    local_src: torch.Tensor
    local_dst: torch.Tensor
    send_peers: tuple[int, ...]
    send_splits: tuple[int, ...]
    send_rows: torch.Tensor
    recv_peers: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: torch.Tensor
    transport: Transport
    timeout_s: float

    def to(self, device: torch.device | str) -> "ShiftIndex":
        """The same index with its row tensors on ``device`` (one copy)."""
        fields = ("local_src", "local_dst", "send_rows", "recv_rows")
        moved = to_device([getattr(self, name) for name in fields], device)
        return dataclasses.replace(self, **dict(zip(fields, moved)))


def _pieces_by_seq(plan: Plan, ranks: set[int] | None) -> dict[int, list[tuple]]:
    """``seq -> [(start, end, rank, offset)]`` sorted by start, for the sequences that have a
    piece on one of ``ranks`` (None: all)."""
    wanted = None if ranks is None else {seq for r in ranks for seq, _, _ in plan.linear[r]}
    pieces: dict[int, list[tuple]] = defaultdict(list)
    for rank, segments in enumerate(plan.linear):
        offset = 0
        for seq, start, end in segments:
            if wanted is None or seq in wanted:
                pieces[seq].append((start, end, rank, offset))
            offset += end - start
    for seq_pieces in pieces.values():
        seq_pieces.sort()
    return pieces


def shift_moves(plan: Plan, k: int, ranks: set[int] | None = None) -> list[tuple]:
    """Every row run of the shift by ``k``: ``(dst_rank, dst_row, src_rank, src_row, n)``:
    rows ``dst_row .. +n`` of ``dst_rank`` take rows ``src_row .. +n`` of ``src_rank``, in one
    global order (sequence, destination piece, source piece); only runs touching ``ranks``."""
    if k < 1:
        raise ValueError(f"k={k} is invalid: expected a shift of at least 1 position")
    moves = []
    for seq in sorted(pieces := _pieces_by_seq(plan, ranks)):
        length, seq_pieces = plan.seqlens[seq], pieces[seq]
        starts = [p[0] for p in seq_pieces]
        for start, end, dst, offset in seq_pieces:
            lo, hi = start + k, min(end + k, length)  # the target positions of this piece
            j = max(0, bisect.bisect_right(starts, lo) - 1)
            while lo < hi and j < len(seq_pieces):
                s, e, src, src_offset = seq_pieces[j]
                a, b = max(lo, s), min(hi, e)
                if a < b and (ranks is None or dst in ranks or src in ranks):
                    moves.append((dst, offset + a - k - start, src, src_offset + a - s, b - a))
                j += 1
                if s >= hi:
                    break
    return moves


def _runs(runs: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``(first, n)`` runs, concatenated (int64)."""
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(first, first + n) for first, n in runs])


def build_shift_index(plan: Plan, rank: int, k: int = 1, *,
                      transport: Transport | str | None = None,
                      timeout_s: float | None = None) -> ShiftIndex:
    """``rank``'s side of the shift by ``k`` of ``plan``'s linear layout; transport /
    timeout_s: None reads ``ZEPPELIN_TRANSPORT`` / ``ZEPPELIN_P2P_TIMEOUT_S``."""
    world = plan.topology.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is invalid: the plan has ranks [0, {world})")
    local_src, local_dst = [], []
    sends: dict[int, list] = defaultdict(list)
    recvs: dict[int, list] = defaultdict(list)
    for dst, dst_row, src, src_row, n in shift_moves(plan, k, {rank}):
        if dst == rank and src == rank:
            local_src.append((src_row, n))
            local_dst.append((dst_row, n))
        elif src == rank:
            sends[dst].append((src_row, n))
        elif dst == rank:
            recvs[src].append((dst_row, n))
    send_peers, recv_peers = tuple(sorted(sends)), tuple(sorted(recvs))
    return ShiftIndex(
        rank, k, plan.linear_tokens()[rank], _runs(local_src), _runs(local_dst),
        send_peers, tuple(sum(n for _, n in sends[p]) for p in send_peers),
        _runs([run for p in send_peers for run in sends[p]]),
        recv_peers, tuple(sum(n for _, n in recvs[p]) for p in recv_peers),
        _runs([run for p in recv_peers for run in recvs[p]]),
        get_transport(transport), env.p2p_timeout_s() if timeout_s is None else float(timeout_s))


def _move(x: torch.Tensor, index: ShiftIndex, group: dist.ProcessGroup | None,
          backward: bool) -> torch.Tensor:
    """``out = zeros_like(x)``, then the index's rows moved (``backward``: every arrow
    reversed, the adjoint). One P2P batch with the peers; local rows copied meanwhile."""
    gather, gather_peers, gather_splits = index.send_rows, index.send_peers, index.send_splits
    scatter, scatter_peers, scatter_splits = index.recv_rows, index.recv_peers, \
        index.recv_splits
    local_src, local_dst = index.local_src, index.local_dst
    if backward:
        gather, gather_peers, gather_splits, scatter, scatter_peers, scatter_splits = \
            scatter, scatter_peers, scatter_splits, gather, gather_peers, gather_splits
        local_src, local_dst = local_dst, local_src
    where = f"MTP shift by {index.k} on rank {index.rank}" + (" (backward)" if backward else "")
    sent = x.index_select(0, gather).split(list(gather_splits)) if gather_peers else ()
    received = [x.new_empty((n, *x.shape[1:])) for n in scatter_splits]
    ops = [P2P(True, t.contiguous(), peer, SHIFT_TAG, where) for t, peer in
           zip(sent, gather_peers)] + [P2P(False, t, peer, SHIFT_TAG, where) for t, peer in
                                       zip(received, scatter_peers)]
    warm_up([group if group is not None else dist.group.WORLD], x.device)  # NCCL: every rank
    pending = index.transport.post(ops, group, where, index.timeout_s) if ops else None
    out = torch.zeros_like(x)
    if local_src.numel():
        out.index_copy_(0, local_dst, x.index_select(0, local_src))
    if pending is not None:
        try:
            pending.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"{where} failed: a peer of the pool stopped or stalled (timeout "
                               f"{index.timeout_s:.0f} s, ZEPPELIN_P2P_TIMEOUT_S); rows were "
                               f"expected from ranks {list(scatter_peers)}: {exc}") from exc
    if received:
        out.index_copy_(0, scatter, torch.cat(received))
    return out


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: ShiftIndex, group) -> torch.Tensor:
        ctx.index, ctx.group = index, group
        return _move(x, index, group, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _move(grad.contiguous(), ctx.index, ctx.group, backward=True), None, None


def shift(x: torch.Tensor, index: ShiftIndex,
          group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` ``[rows, ...]`` (the rank's linear tokens, then pad rows) shifted by ``index.k``
    within documents (module docstring); ``group``: the pool's process group (the plan's
    ranks). Every rank of the pool calls it with the same ``k``. Autograd-aware."""
    if x.dim() < 1 or x.shape[0] < index.tokens:
        raise ValueError(f"rank {index.rank}: the tensor to shift must be [rows, ...] with at "
                         f"least the {index.tokens} linear tokens of the plan, got shape "
                         f"{tuple(x.shape)}")
    group = dist.group.WORLD if group is None else group
    if x.requires_grad:
        return _Shift.apply(x.contiguous(), index, group)
    return _move(x.contiguous(), index, group, backward=False)


__all__ = ["ShiftIndex", "build_shift_index", "shift", "shift_moves"]
