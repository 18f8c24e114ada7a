"""Remapping layer: move rows between the linear (token-balanced) and attention layouts.

Linear modules run on ``Plan.linear[rank]``; core attention runs on ``Plan.attention[rank]``.
Around core attention, q, k, v go linear -> attention and the output goes back. Both are one
``all_to_all_single`` with uneven splits over the pool's process group; the rows a rank keeps
are copied locally. The mapping is a bijection of token positions, so the backward of one
direction is the other direction: gradients are exact.

Buffers are ``[tokens, ...]`` (e.g. q ``[tokens, heads, head_dim]``); row i of a rank's
linear buffer is the i-th token of its ``Plan.linear[rank]`` segments, likewise for attention.
Ranks of the plan are ranks of ``group`` (the Zeppelin pool: data x context parallel).

The all-to-all goes through a ``transport.Transport`` (``ZEPPELIN_TRANSPORT``; ``staged`` for
several ranks on one GPU); the kept rows are copied while it is in flight. ``exchange``
``pairs`` (``ZEPPELIN_REMAP_EXCHANGE``) posts the same rows as point-to-point sends and
receives between the ranks that move rows only: a rank that neither sends nor receives posts
nothing and waits for no one (the all-to-all is a collective of the whole pool, every rank
meets every other one four times per layer). ``RemapIndex.to``
moves the index tensors to the device once per plan (``device_index``), ahead of the step.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.runtime.device_index import to_device
from megatron_zeppelin.runtime.transport import P2P, Transport, get_transport, warm_up


@dataclass(frozen=True)
class RemapIndex:
    """One rank's side of the remap, derived from the plan (same on every rank).

    send_rows: rows of the linear buffer to send, grouped by destination rank in rank order.
    send_splits / recv_splits: rows per peer rank (0 for this rank: kept rows are copied).
    recv_rows: where received rows land in the attention buffer, grouped by source rank.
    keep_src / keep_dst: kept rows, linear buffer -> attention buffer.
    transport / timeout_s: how the all-to-all travels and the most it may wait (read once).
    exchange: ``all-to-all`` or ``pairs`` (module doc).
    """

    rank: int
    linear_rows: int
    attention_rows: int
    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_rows: torch.Tensor
    recv_splits: tuple[int, ...]
    keep_src: torch.Tensor
    keep_dst: torch.Tensor
    transport: Transport
    timeout_s: float
    probe: object = None  # runtime.probe.Probe timing each all-to-all (online profile fit)
    exchange: str = "all-to-all"

    def to(self, device: torch.device | str) -> "RemapIndex":
        """The same index with its row tensors on ``device`` (one copy per dtype)."""
        fields = ("send_rows", "recv_rows", "keep_src", "keep_dst")
        moved = to_device([getattr(self, name) for name in fields], device)
        return dataclasses.replace(self, **dict(zip(fields, moved)))

    def cross_node_rows(self, plan: Plan) -> int:
        """Rows this rank sends to ranks of other nodes (linear -> attention)."""
        node = plan.topology.node_of
        return sum(n for peer, n in enumerate(self.send_splits) if node(peer) != node(self.rank))


def build_remap_index(plan: Plan, rank: int, *, transport: Transport | str | None = None,
                      timeout_s: float | None = None, exchange: str | None = None
                      ) -> RemapIndex:
    """The remap of ``rank`` from ``Plan.transfers`` (sorted by (src, dst, dst_offset));
    transport / timeout_s / exchange: None reads ``ZEPPELIN_TRANSPORT`` /
    ``ZEPPELIN_P2P_TIMEOUT_S`` / ``ZEPPELIN_REMAP_EXCHANGE``."""
    world = plan.topology.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is invalid: the plan has ranks [0, {world})")
    exchange = env.remap_exchange() if exchange is None else exchange
    if exchange not in env.REMAP_EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is invalid: expected one of "
                         f"{list(env.REMAP_EXCHANGES)}")
    send, recv, keep_src, keep_dst = [], [], [], []
    send_splits, recv_splits = [0] * world, [0] * world
    for t in plan.transfers:
        rows = t.end - t.start
        if t.src == rank and t.dst == rank:
            keep_src.append(torch.arange(t.src_offset, t.src_offset + rows))
            keep_dst.append(torch.arange(t.dst_offset, t.dst_offset + rows))
        elif t.src == rank:
            send.append(torch.arange(t.src_offset, t.src_offset + rows))
            send_splits[t.dst] += rows
        elif t.dst == rank:
            recv.append(torch.arange(t.dst_offset, t.dst_offset + rows))
            recv_splits[t.src] += rows
    return RemapIndex(rank, plan.linear_tokens()[rank], plan.attention_tokens()[rank],
                      _cat(send), tuple(send_splits), _cat(recv), tuple(recv_splits),
                      _cat(keep_src), _cat(keep_dst), get_transport(transport),
                      env.p2p_timeout_s() if timeout_s is None else float(timeout_s),
                      exchange=exchange)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _exchange(x: torch.Tensor, gather: torch.Tensor, send_splits: tuple[int, ...],
              recv_splits: tuple[int, ...], scatter: torch.Tensor, keep_src: torch.Tensor,
              keep_dst: torch.Tensor, out_rows: int, group: dist.ProcessGroup | None,
              idx: RemapIndex) -> torch.Tensor:
    """out[scatter] = all_to_all(x[gather]); out[keep_dst] = x[keep_src]."""
    started = idx.probe.start() if idx.probe is not None else None
    out = x.new_empty((out_rows, *x.shape[1:]))
    received = x.new_empty((sum(recv_splits), *x.shape[1:]))
    timeout = idx.timeout_s
    where = f"remap all-to-all on rank {idx.rank}"
    sent = x.index_select(0, gather.to(x.device))
    if idx.exchange == "pairs":  # every rank: NCCL's first P2P batch on a group needs all
        pool = group if group is not None else dist.group.WORLD
        warm_up([pool], x.device)
        pending = idx.transport.post(_pair_ops(sent, send_splits, received, recv_splits), pool,
                                     where, timeout)
    else:
        pending = idx.transport.all_to_all(received, sent, list(recv_splits), list(send_splits),
                                           group, where, timeout)
    if keep_src.numel():
        out.index_copy_(0, keep_dst.to(x.device), x.index_select(0, keep_src.to(x.device)))
    try:
        pending.wait()
    except RuntimeError as exc:
        raise RuntimeError(f"{where} failed: a peer of the pool stopped or stalled (timeout "
                           f"{timeout:.0f} s, ZEPPELIN_P2P_TIMEOUT_S); rows were expected from "
                           f"ranks {[r for r, n in enumerate(recv_splits) if n]}: {exc}"
                           ) from exc
    if received.shape[0]:
        out.index_copy_(0, scatter.to(x.device), received)
    if started is not None:
        row_bytes = x.element_size() * math.prod(x.shape[1:])
        idx.probe.stop(started, ("remap", float(gather.numel() * row_bytes)))
    return out


def _pair_ops(sent: torch.Tensor, send_splits: tuple[int, ...], received: torch.Tensor,
              recv_splits: tuple[int, ...]) -> list[P2P]:
    """The all-to-all's rows as one send per peer that gets rows and one receive per peer
    that sends some (``sent`` / ``received`` grouped by peer in rank order)."""
    ops = []
    for send, rows, splits in ((True, sent, send_splits), (False, received, recv_splits)):
        for peer, part in enumerate(rows.split(list(splits))):
            if splits[peer]:
                ops.append(P2P(send, part, peer, 0, ("remap rows with rank {}", peer)))
    return ops


def _forward(x: torch.Tensor, idx: RemapIndex, group) -> torch.Tensor:
    """Linear layout -> attention layout."""
    return _exchange(x, idx.send_rows, idx.send_splits, idx.recv_splits, idx.recv_rows,
                     idx.keep_src, idx.keep_dst, idx.attention_rows, group, idx)


def _inverse(x: torch.Tensor, idx: RemapIndex, group) -> torch.Tensor:
    """Attention layout -> linear layout (every arrow of ``_forward`` reversed)."""
    return _exchange(x, idx.recv_rows, idx.recv_splits, idx.send_splits, idx.send_rows,
                     idx.keep_dst, idx.keep_src, idx.linear_rows, group, idx)


class _Remap(torch.autograd.Function):
    """One direction of the remap; its backward is the other direction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: RemapIndex, group, to_attention: bool) -> torch.Tensor:
        ctx.idx, ctx.group, ctx.to_attention = idx, group, to_attention
        return (_forward if to_attention else _inverse)(x, idx, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _inverse if ctx.to_attention else _forward
        return back(grad.contiguous(), ctx.idx, ctx.group), None, None, None


def _check_rows(x: torch.Tensor, rows: int, layout: str, rank: int) -> None:
    if x.shape[0] != rows:
        raise ValueError(f"rank {rank}: a {layout}-layout tensor must have {rows} rows (tokens) "
                         f"as the plan says, got shape {tuple(x.shape)}")


def to_attention_layout(x: torch.Tensor, idx: RemapIndex,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` [linear tokens, ...] -> [attention tokens, ...]; autograd-aware."""
    _check_rows(x, idx.linear_rows, "linear", idx.rank)
    return _Remap.apply(x.contiguous(), idx, group, True)


def to_linear_layout(x: torch.Tensor, idx: RemapIndex,
                     group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x`` [attention tokens, ...] -> [linear tokens, ...]; autograd-aware."""
    _check_rows(x, idx.attention_rows, "attention", idx.rank)
    return _Remap.apply(x.contiguous(), idx, group, False)
