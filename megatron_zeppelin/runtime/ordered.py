"""The ``ordered`` test transport: NCCL's message matching, checked on gloo.

gloo matches a receive to a send by tag; NCCL ignores tags and matches the messages between
two ranks of one communicator by order: the i-th send from rank a to rank b on a communicator
meets the i-th receive from a posted by b on it, whatever either side meant. An order that
agrees on gloo (tags) can hang or swap data on NCCL. This transport makes gloo behave like NCCL
and fail loudly where NCCL would go wrong:

* Every process group is its own ordering domain (as each NCCL communicator is; the engine's
  worker thread drives ``route_group``, a communicator of its own). Per group and rank pair
  each side counts its messages in posting order (within a batch, list order, as in one
  ``ncclGroupStart``/``End``); message i travels under gloo tag ``TAG_BASE + 2 i`` (header) and
  ``TAG_BASE + 2 i + 1`` (payload), so gloo pairs them exactly as NCCL would. The caller's tags
  go into the header, not the matching.
* Each message is preceded by a fixed-size int64 header: message index, kind (P2P or
  all-to-all), the sender's tag, dtype and shape. The receiver checks it against the receive
  it posted before it posts the payload receive (on a thread per group, as soon as the header
  arrives: never after a wait of its own, so no false deadlock), and on any difference (order, tag, kind,
  dtype, shape or size) raises a RuntimeError naming both ranks, the group, the message index
  and both sides' descriptions. (A receive larger than the send passes gloo silently; a
  larger send aborts the receiving process: neither can happen to a checked payload.)
* An all-to-all is a collective: on NCCL every rank of the group enters it, and ProcessGroupNCCL
  runs it as grouped sends and receives between every pair. Here it sends one header (and the
  rows, when any) to every other rank of the group, so an all-to-all that one rank runs
  before a P2P and its peer after fails the same check.

CPU tensors only (gloo); selected with ``ZEPPELIN_TRANSPORT=ordered`` or ``transport="ordered"``.
Host waits are bounded by ``timeout_s`` as with ``direct``. Registered in ``transport.TRANSPORTS``
by this module (imported by the ``runtime`` package).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.runtime import transport
from megatron_zeppelin.runtime.transport import P2P, Pending, Transport, describe

TAG_BASE = 1 << 29  # above the tags the runtime uses (ring index, slice * chunks + chunk)
INDEX_WRAP = 1 << 27  # message indices wrap here (tags stay below 2**30)
MAX_DIMS = 6
P2P_KIND, ALL_TO_ALL_KIND = 0, 1
_KINDS = ("P2P", "all-to-all")
# every dtype torch defines, in a fixed order: the same table on every rank
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_HEADER = 5 + MAX_DIMS  # index, kind, tag, dtype, ndim, shape...


def _header(index: int, kind: int, tag: int, tensor: torch.Tensor) -> torch.Tensor:
    """The int64 header of message ``index`` carrying ``tensor`` (see the module docstring)."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"transport 'ordered': a {tensor.dim()}-d tensor: at most {MAX_DIMS}")
    shape = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim())
    return torch.tensor([index, kind, tag, _DTYPES.index(tensor.dtype), tensor.dim(), *shape],
                        dtype=torch.int64)


def _describe_header(header: Sequence[int]) -> str:
    index, kind, tag, dtype, ndim, *shape = (int(x) for x in header)
    kind_name = _KINDS[kind] if 0 <= kind < len(_KINDS) else f"kind {kind}"
    dtype_name = _DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else f"dtype {dtype}"
    return f"{kind_name} tag {tag} {tuple(shape[:ndim])} {dtype_name} (message {index})"


class _Receive:
    """One checked receive: its header buffer and what this side expects."""

    def __init__(self, op: P2P, index: int, kind: int, src: int, dst: int) -> None:
        self.op, self.index, self.src, self.dst = op, index, src, dst
        self.expected = _header(index, kind, op.tag, op.tensor)
        self.header = torch.empty(_HEADER, dtype=torch.int64)


class _OrderedPending(Pending):
    """Posted messages: the group's arming thread waits for the headers, checks them and posts
    the payload receives at once (never waiting for a payload), so no rank's progress depends
    on the order in which its peers wait, as on NCCL; ``wait`` raises the mismatch, if any,
    then waits for every send and receive (host waits bounded by ``timeout_s``)."""

    def __init__(self, works: list, ops: list[P2P], receives: list[tuple[int, _Receive]],
                 group, where: str, timeout_s: float) -> None:
        # a gloo work is waited once (a second wait finds its completion consumed): the
        # sends here, the header receives on the arming thread
        heads = {i for i, _ in receives}
        sends = [i for i in range(len(ops)) if i not in heads]
        self._sends = transport._HostPending([works[i] for i in sends], [ops[i] for i in sends],
                                             where, timeout_s)
        self._group, self._where, self._timeout_s = group, where, timeout_s
        self._armed = _arming_thread(group).submit(self._arm, [works[i] for i, _ in receives],
                                                   [ops[i] for i, _ in receives],
                                                   [r for _, r in receives])

    def _arm(self, works: list, ops: list[P2P], receives: list[_Receive]) -> Pending:
        """Wait for the headers, check them, post the payload receives."""
        transport._HostPending(works, ops, self._where, self._timeout_s).wait()
        for receive in receives:
            if not torch.equal(receive.header, receive.expected):
                raise RuntimeError(
                    f"{self._where}: NCCL order mismatch on group ranks "
                    f"{dist.get_process_group_ranks(self._group)}: message {receive.index} "
                    f"from rank {receive.src} to rank {receive.dst}: rank {receive.src} sent "
                    f"{_describe_header(receive.header.tolist())}, rank {receive.dst} expected "
                    f"{_describe_header(receive.expected.tolist())} "
                    f"({describe(receive.op.what)})")
        payloads = [r.op._replace(tag=_tag(r.index, 1)) for r in receives if r.op.tensor.numel()]
        if not payloads:
            return Pending()
        works = transport._post(payloads, self._group, self._where)
        return transport._HostPending(works, payloads, self._where, self._timeout_s)

    def done(self) -> bool:
        if not self._armed.done():
            return False
        if self._armed.exception() is not None:
            return True
        return self._sends.done() and self._armed.result().done()

    def wait(self) -> None:
        payloads = self._armed.result()  # raises a mismatch
        self._sends.wait()
        payloads.wait()


_ARMING: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _arming_thread(group: dist.ProcessGroup) -> ThreadPoolExecutor:
    """The arming thread of ``group`` in this process (one per group: each is its own ordering
    domain and progresses on its own, as NCCL communicators do; a forked child makes its own)."""
    key = (os.getpid(), id(group))
    if key not in _ARMING:
        _ARMING[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeppelin-ordered")
    return _ARMING[key]


def _tag(index: int, part: int) -> int:
    return TAG_BASE + 2 * (index % INDEX_WRAP) + part


class OrderedTransport(Transport):
    """NCCL's order matching on gloo (see the module docstring)."""

    name = "ordered"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, bool, int], int] = {}
        self._groups: dict[int, dist.ProcessGroup] = {}  # held, so that ids are not reused

    def _next(self, group: dist.ProcessGroup, send: bool, peer: int) -> int:
        """The index of this rank's next message to (send) or from ``peer`` on ``group``."""
        key = (id(group), send, peer)
        self._groups[id(group)] = group
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        return index

    def post(self, ops: Sequence[P2P], group: dist.ProcessGroup, where: str,
             timeout_s: float) -> Pending:
        if not ops:
            return Pending()
        return self._post_kind(list(ops), P2P_KIND, group, where, timeout_s)

    def _post_kind(self, ops: list[P2P], kind: int, group, where: str,
                   timeout_s: float) -> Pending:
        """Post ``ops`` (zero-size tensors: a header alone) as numbered messages of ``kind``."""
        if any(op.tensor.is_cuda for op in ops):
            raise ValueError("transport 'ordered' checks NCCL's ordering on gloo with CPU "
                             "tensors: use 'direct' or 'staged' for CUDA tensors")
        me = dist.get_rank(group)
        first, receives = [], []
        with self._lock:  # indices in posting order, even with a second thread on the group
            for op in ops:
                index = self._next(group, op.send, op.peer)
                if op.send:
                    header = _header(index, kind, op.tag, op.tensor)
                    first.append(op._replace(tensor=header, tag=_tag(index, 0)))
                    if op.tensor.numel():
                        first.append(op._replace(tag=_tag(index, 1)))
                else:
                    receive = _Receive(op, index, kind, op.peer, me)
                    receives.append((len(first), receive))
                    first.append(op._replace(tensor=receive.header, tag=_tag(index, 0)))
            works = transport._post(first, group, where) if first else []
        return _OrderedPending(works, first, receives, group, where, timeout_s)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, recv_splits: list[int],
                   send_splits: list[int], group: dist.ProcessGroup | None, where: str,
                   timeout_s: float) -> Pending:
        group = dist.group.WORLD if group is None else group
        me, ops = dist.get_rank(group), []
        sent_rows, received_rows = sent.split(send_splits), received.split(recv_splits)
        if send_splits[me]:
            received_rows[me].copy_(sent_rows[me])
        for peer in range(dist.get_world_size(group)):
            if peer != me:
                ops.append(P2P(True, sent_rows[peer].contiguous(), peer, 0,
                               f"all-to-all send of {send_splits[peer]} rows to rank {peer}"))
                ops.append(P2P(False, received_rows[peer], peer, 0,
                               f"all-to-all receive of {recv_splits[peer]} rows from rank {peer}"))
        return self._post_kind(ops, ALL_TO_ALL_KIND, group, where, timeout_s)


transport.TRANSPORTS[OrderedTransport.name] = OrderedTransport()
