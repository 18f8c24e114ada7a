"""The P2P ring helper: one ring of ranks of an explicitly passed process group.

A ring is an ordered tuple of ranks of a group (Plan rings; for the world group these are
global ranks). ``RingComm.exchange`` posts one ring step (send to the next rank, receive from
the previous one) as one P2P batch through the ring's ``Transport`` and returns at once; the
returned ``RingRequest.wait`` gives the received tensors. ``exchange_both`` also sends to the
previous rank and receives from the next one (the halo exchange of ``halo.py``). Given a
``RingBatch`` it adds the step's ops to that batch instead: the engine posts the steps of
every ring of a round on one group as one ``batch_isend_irecv`` (one NCCL group call, one
launch, instead of one per ring). On gloo the wait is bounded by
``timeout_s`` (``env.p2p_timeout_s()`` by default) and raises a RuntimeError naming the ring,
the phase, the step and the peer, so a failed peer never hangs the others forever; on NCCL it
joins the current stream to NCCL's (see ``transport``). No process group is created here.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.runtime.transport import P2P, Pending, Transport, get_transport
from megatron_zeppelin.schedule import Phase

Like = Sequence[tuple[tuple[int, ...], torch.dtype]]


class RingBatch(Pending):
    """The ring steps of one round on one group, posted as one batch (``post``, once every
    ring has added its ops, in the same ring order on every rank); ``wait`` runs once however
    many rings ask (a gloo work must be waited only once)."""

    def __init__(self, transport: Transport, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.transport, self.group, self.timeout_s = transport, group, timeout_s
        self.ops: list[P2P] = []
        self._pending: Pending | None = None
        self._waited = False

    def post(self, where: str) -> None:
        self._pending = self.transport.post(self.ops, self.group, where, self.timeout_s)

    def done(self) -> bool:
        return self._waited or self._pending.done()

    def wait(self) -> None:
        if not self._waited:
            self._pending.wait()
            self._waited = True


class RingRequest:
    """One posted ring step: ``done()`` never blocks; ``wait()`` -> the received tensors."""

    def __init__(self, pending: Pending, received: list[torch.Tensor]) -> None:
        self._pending, self.received = pending, received

    def done(self) -> bool:
        return self._pending.done()

    def wait(self) -> list[torch.Tensor]:
        self._pending.wait()
        return self.received


class RingComm:
    """One ring of ranks of ``group``; posts ring steps for the rank ``rank`` of that ring.

    ring: ranks of ``group`` in ring order (position p sends to p+1, receives from p-1);
    rank: this process's rank in ``group``; tag: P2P tag of this ring's messages (distinct per
    ring, so rings that share a pair of ranks never match each other's messages); name: what
    errors call the ring (e.g. its tier and group key); transport: a ``Transport`` or its name
    (None: ``ZEPPELIN_TRANSPORT``).
    """

    def __init__(self, ring: Sequence[int], rank: int, group: dist.ProcessGroup, *,
                 tag: int = 0, name: str = "ring", timeout_s: float | None = None,
                 transport: Transport | str | None = None) -> None:
        self.ring = tuple(ring)
        if rank not in self.ring:
            raise ValueError(f"rank {rank} is not in ring {self.ring}")
        if len(set(self.ring)) != len(self.ring):
            raise ValueError(f"ring {self.ring} lists a rank twice")
        self.group, self.tag, self.name = group, tag, name
        self.timeout_s = env.p2p_timeout_s() if timeout_s is None else timeout_s
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} is invalid: expected seconds > 0")
        self.transport = get_transport(transport)
        self.position = self.ring.index(rank)
        size = len(self.ring)
        self.next = self.ring[(self.position + 1) % size]
        self.prev = self.ring[(self.position - 1) % size]

    def exchange(self, sends: Sequence[torch.Tensor], recv_like: Like, step: int, *,
                 send: bool = True, recv: bool = True, phase: Phase = Phase.FORWARD,
                 device: torch.device | None = None,
                 batch: RingBatch | None = None) -> RingRequest:
        """Post one step: ``sends`` to the next rank, receive ``recv_like`` (shape, dtype) from
        the previous one into new tensors on ``device`` (default: that of ``sends``, else CPU);
        ``send``/``recv`` False skips that side. Returns at once. ``batch``: add the ops to
        it instead (posted by its owner, on this ring's group)."""
        if device is None:
            device = sends[0].device if sends else torch.device("cpu")
        received = self._received(recv_like if recv else (), device)
        ops = self._ops(sends if send else (), self.next, received, self.prev)
        return self._post(ops, received, step, phase, batch)

    def exchange_both(self, to_next: Sequence[torch.Tensor], from_prev: Like,
                      to_prev: Sequence[torch.Tensor], from_next: Like, step: int, *,
                      phase: Phase = Phase.FORWARD, device: torch.device,
                      batch: RingBatch | None = None) -> RingRequest:
        """Post one halo exchange (a ring of at least 3 ranks, ``runtime.halo``): ``to_next``
        to the next rank and ``to_prev`` to the previous one, receive ``from_prev`` and
        ``from_next`` (shape, dtype) into new tensors on ``device``; the request's tensors are
        those from the previous rank, then those from the next. As ``exchange`` otherwise."""
        if len(self.ring) < 3:
            raise ValueError(f"{self.name} ring {self.ring}: a halo exchange needs 3 ranks or "
                             "more (the previous and the next rank differ)")
        back, ahead = self._received(from_prev, device), self._received(from_next, device)
        ops = self._ops(to_next, self.next, back, self.prev) + \
            self._ops(to_prev, self.prev, ahead, self.next)
        return self._post(ops, back + ahead, step, phase, batch)

    @staticmethod
    def _received(like: Like, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in like]

    def _ops(self, sends: Sequence[torch.Tensor], to: int, received: list[torch.Tensor],
             source: int) -> list[P2P]:
        """Sends of ``sends`` to rank ``to`` and receives into ``received`` from ``source``;
        empty tensors are not sent: both sides derive the shapes from the plan."""
        ops = [P2P(True, t.contiguous(), to, self.tag, (_WHAT, self.name, self.ring, "send",
                                                         tuple(t.shape), t.dtype, "to", to))
               for t in sends if t.numel()]
        return ops + [P2P(False, t, source, self.tag, (_WHAT, self.name, self.ring, "receive",
                                                        tuple(t.shape), t.dtype, "from",
                                                        source))
                      for t in received if t.numel()]

    def _post(self, ops: list[P2P], received: list[torch.Tensor], step: int, phase: Phase,
              batch: RingBatch | None) -> RingRequest:
        """``ops`` added to ``batch``, or posted now through the transport."""
        if batch is not None:
            if batch.group is not self.group:
                raise ValueError(f"{self.name} ring {self.ring}: a batch of another group")
            batch.ops += ops
            return RingRequest(batch, received)
        where = (f"{self.name} ring {self.ring}, {Phase(phase).value} step {step}, "
                 f"rank {self.ring[self.position]}")
        return RingRequest(self.transport.post(ops, self.group, where, self.timeout_s), received)


_WHAT = "{} ring {}: {} of {} {} {} rank {}"  # an op's name in errors
