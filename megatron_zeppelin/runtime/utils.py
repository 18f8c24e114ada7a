"""The two pieces every ring-attention path shares: the LSE merge and the P2P ring helper.

LSE merge (online softmax). A partial result of attention over some keys is ``(out, lse)``:
``out [t, heads, head_dim]`` normalised over those keys and ``lse [heads, t]`` the natural log of
their softmax denominator. Two partials over disjoint key sets merge exactly into the partial
over their union: ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b
exp(lse_b - lse)``. The merge is associative and commutative; a row that saw no key has
``lse = -inf`` and ``out = 0`` and is neutral (two such rows merge to ``-inf``/0, never NaN).

P2P ring helper. A ring is an ordered tuple of ranks of an explicitly passed process group
(Plan rings; for the world group these are global ranks). ``RingComm.exchange`` posts one ring
step (send to the next rank, receive from the previous one) with
``torch.distributed.batch_isend_irecv`` and returns at once; ``P2PRequest.wait`` waits at most
``timeout_s`` (``env.p2p_timeout_s()`` by default) and then raises a RuntimeError naming the
ring, the step and the peer, so a failed peer never hangs the others forever. No process group
is created here. With NCCL the timed wait blocks the host until the transfer is done (the
transfer still overlaps the kernels queued before the wait).
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import env


# ----------------------------------------------------------------------------- LSE merge

def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint keys: ``(out [t, h, d], lse [h, t])``.

    Computed in the dtype of ``out_a`` (use float32 or float64 accumulators); rows with
    ``lse = -inf`` on both sides stay ``-inf`` with output 0.
    """
    acc = out_a.dtype
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    ref = lse.masked_fill(torch.isneginf(lse), 0.0)
    w_a = torch.exp(lse_a - ref).t().unsqueeze(-1)  # [t, h, 1]
    w_b = torch.exp(lse_b - ref).t().unsqueeze(-1)
    return out_a * w_a + out_b.to(acc) * w_b, lse


def merge_into_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Merge the partial ``(out, lse)`` of rows ``rows`` (None: all) into the accumulators.

    acc_out ``[T, h, d]`` and acc_lse ``[h, T]`` are updated in place; ``out [t, h, d]`` and
    ``lse [h, t]`` hold the partial of rows ``rows`` (int64 ``[t]``, distinct), in that order.
    """
    if rows is None:
        merged_out, merged_lse = merge_lse(acc_out, acc_lse, out, lse)
        acc_out.copy_(merged_out)
        acc_lse.copy_(merged_lse)
        return
    merged_out, merged_lse = merge_lse(acc_out.index_select(0, rows),
                                       acc_lse.index_select(1, rows), out, lse)
    acc_out.index_copy_(0, rows, merged_out)
    acc_lse.index_copy_(1, rows, merged_lse)


# ----------------------------------------------------------------------------- P2P ring helper

class _Op(NamedTuple):
    send: bool
    tensor: torch.Tensor
    peer: int  # group rank


class P2PRequest:
    """The posted ops of one exchange; ``wait`` returns the received tensors in order."""

    def __init__(self, works: list, ops: list[_Op], received: list[torch.Tensor], where: str,
                 timeout_s: float) -> None:
        self._works, self._ops, self._where, self._timeout_s = works, ops, where, timeout_s
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        """Wait for every op (at most ``timeout_s`` in all); RuntimeError naming the peer."""
        deadline = time.monotonic() + self._timeout_s
        for index, work in enumerate(self._works):
            remaining = deadline - time.monotonic()
            try:
                done = work.is_completed() or (remaining > 0 and work.wait(
                    timeout=timedelta(seconds=remaining)) is not False)
            except RuntimeError as exc:  # gloo and NCCL raise on timeout or a closed peer
                raise RuntimeError(self._failure(index) + f": {exc}") from exc
            if not done:
                raise RuntimeError(self._failure(index))
        return self._received

    def _failure(self, index: int) -> str:
        if len(self._works) == len(self._ops):
            op = self._ops[index]
            what = (f"send of {tuple(op.tensor.shape)} {op.tensor.dtype} to rank {op.peer}"
                    if op.send else
                    f"receive of {tuple(op.tensor.shape)} {op.tensor.dtype} from rank {op.peer}")
        else:
            what = f"ops with ranks {sorted({op.peer for op in self._ops})}"
        return (f"{self._where}: {what} did not complete within {self._timeout_s:g} s "
                "(peer failed or not participating?)")


class RingComm:
    """One ring of ranks of ``group``; posts ring steps for the rank ``rank`` of that ring.

    ring: ranks of ``group`` in ring order (position p sends to p+1, receives from p-1);
    rank: this process's rank in ``group``; tag: P2P tag of this ring's messages (distinct per
    ring, so rings that share a pair of ranks never match each other's messages); name: what
    errors call the ring (e.g. its tier and group key).
    """

    def __init__(self, ring: Sequence[int], rank: int, group: dist.ProcessGroup, *,
                 tag: int = 0, name: str = "ring", timeout_s: float | None = None) -> None:
        self.ring = tuple(ring)
        if rank not in self.ring:
            raise ValueError(f"rank {rank} is not in ring {self.ring}")
        if len(set(self.ring)) != len(self.ring):
            raise ValueError(f"ring {self.ring} lists a rank twice")
        self.group, self.tag, self.name = group, tag, name
        self.timeout_s = env.p2p_timeout_s() if timeout_s is None else timeout_s
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} is invalid: expected seconds > 0")
        self.position = self.ring.index(rank)
        size = len(self.ring)
        self.next = self.ring[(self.position + 1) % size]
        self.prev = self.ring[(self.position - 1) % size]

    def exchange(self, sends: Sequence[torch.Tensor],
                 recv_like: Sequence[tuple[tuple[int, ...], torch.dtype]], step: int, *,
                 send: bool = True, recv: bool = True, phase: str = "forward",
                 device: torch.device | None = None) -> P2PRequest:
        """Post one step: ``sends`` to the next rank, receive ``recv_like`` (shape, dtype) from
        the previous one into new tensors on ``device`` (default: that of ``sends``, else CPU);
        ``send``/``recv`` False skips that side. Returns at once."""
        if device is None:
            device = sends[0].device if sends else torch.device("cpu")
        received = [torch.empty(shape, dtype=dtype, device=device)
                    for shape, dtype in (recv_like if recv else ())]
        # empty tensors are not sent: both sides derive the shapes from the plan
        ops = [_Op(True, t.contiguous(), self.next) for t in (sends if send else ())
               if t.numel()] + [_Op(False, t, self.prev) for t in received if t.numel()]
        where = (f"{self.name} ring {self.ring}, {phase} step {step}, "
                 f"rank {self.ring[self.position]}")
        if not ops:
            return P2PRequest([], [], received, where, self.timeout_s)
        p2p = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor,
                          dist.get_global_rank(self.group, op.peer), self.group, self.tag)
               for op in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as exc:  # e.g. gloo closed the pair after an earlier timeout
            raise RuntimeError(f"{where}: posting P2P with ranks "
                               f"{sorted({op.peer for op in ops})} failed: {exc}") from exc
        return P2PRequest(works, ops, received, where, self.timeout_s)
