"""How tensors reach torch.distributed: point-to-point batches and the remap's all-to-all.

Every exchange of the runtime (ring steps, ``ring_comm``; routed/direct inter-node steps,
``routed_p2p``; the remap, ``remap``) goes through a ``Transport``:

* ``direct`` (default): tensors go to torch.distributed as they are. CPU tensors on gloo: the
  returned ``Pending`` waits on the host, at most ``timeout_s``, and a RuntimeError names the
  exchange, the op and the peer. CUDA tensors on NCCL: NCCL runs the ops on its own stream,
  which waits for the work queued on the caller's stream before the post; ``Pending.wait``
  makes the caller's current stream wait for them (an event join: the host never blocks, the
  process group's timeout and NCCL's watchdog bound a lost peer).
* ``staged``: CUDA tensors travel through pinned host buffers over gloo, for several ranks
  sharing one GPU (NCCL refuses two ranks on one GPU; gloo cannot send CUDA tensors). A post
  copies the sends to host buffers (async, on the current stream), waits for those copies on
  the host, and posts the host buffers; ``Pending.wait`` waits for the transfer on the host and
  copies what arrived into the receive tensors (async, on the current stream). A test and
  debugging transport: the host waits for the device before every post. It is never picked by
  itself: ``ZEPPELIN_TRANSPORT=staged`` or ``transport="staged"`` selects it. With CPU tensors
  it stages through plain host buffers (the same path, tested on CPU).
* ``ordered`` (``runtime/ordered.py``, tests on gloo): messages matched by order per rank pair
  and process group as NCCL matches them (tags ignored), each checked by a header; a mismatch
  of order, tag, size, dtype or shape fails loudly naming both ranks and the message index.

Host-side waits on gloo make progress only inside ``work.wait``: ``Pending.done`` starts the
wait on a helper thread the first time it is asked (the engine asks while it fills the wait
with LOCAL work) and ``Pending.wait`` then joins that thread; never asked, it waits inline.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import env


class P2P(NamedTuple):
    """One point-to-point op of this rank: ``peer`` is a rank of the group; ``what`` names it
    for errors, a string or ``(format, *args)`` formatted only when an error needs it."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    what: str | tuple


def describe(what: str | tuple) -> str:
    """The text of a ``P2P.what``."""
    return what if isinstance(what, str) else what[0].format(*what[1:])


class Pending:
    """Posted communication: ``done()`` never blocks; ``wait()`` returns once the received
    tensors may be used on the current stream (RuntimeError naming the op on failure)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


_HELPER: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    """The process's one helper thread for host-side waits (in posting order); a forked
    child makes its own (the parent's thread does not exist there)."""
    global _HELPER
    if _HELPER is None or _HELPER[0] != os.getpid():
        _HELPER = (os.getpid(), ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix="zeppelin-p2p-wait"))
    return _HELPER[1]


class _HostPending(Pending):
    """gloo works waited on the host, at most ``timeout_s`` in all."""

    def __init__(self, works: list, ops: Sequence[P2P], where: str, timeout_s: float) -> None:
        self._works, self._ops, self._where, self._timeout_s = works, ops, where, timeout_s
        self._watch: Future | None = None

    def done(self) -> bool:
        if self._watch is None:
            self._watch = _helper().submit(self._wait_works)
        return self._watch.done()

    def wait(self) -> None:
        if self._watch is None:
            self._wait_works()
        else:
            self._watch.result()

    def _wait_works(self) -> None:
        deadline = time.monotonic() + self._timeout_s
        for index, work in enumerate(self._works):
            remaining = max(deadline - time.monotonic(), 0.0)
            try:  # a completed work returns at once, or raises the error it completed with
                ok = (work.is_completed() or remaining > 0) and work.wait(
                    timeout=timedelta(seconds=remaining)) is not False
            except RuntimeError as exc:  # gloo and NCCL raise on timeout or a closed peer
                raise RuntimeError(self._failure(index) + f": {exc}") from exc
            if not ok:
                raise RuntimeError(self._failure(index))

    def _failure(self, index: int) -> str:
        if len(self._works) == len(self._ops):
            what = describe(self._ops[index].what)
        else:
            what = f"ops with ranks {sorted({op.peer for op in self._ops})}"
        return (f"{self._where}: {what} did not complete within {self._timeout_s:g} s "
                "(peer failed or not participating?)")


class _StreamPending(Pending):
    """NCCL works: ``wait`` joins the current stream to NCCL's (no host block)."""

    def __init__(self, works: list) -> None:
        self._works = works

    def done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class _StagedPending(Pending):
    """A host exchange whose received host buffers are copied into device tensors."""

    def __init__(self, inner: Pending, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._inner, self._copies = inner, copies

    def done(self) -> bool:
        return self._inner.done()

    def wait(self) -> None:
        self._inner.wait()
        for target, buffer in self._copies:
            target.copy_(buffer, non_blocking=target.is_cuda)


def _post(ops: Sequence[P2P], group: dist.ProcessGroup, where: str) -> list:
    """``batch_isend_irecv`` of ``ops``; RuntimeError naming the peers if posting fails."""
    p2p = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor,
                      dist.get_global_rank(group, op.peer), group, op.tag) for op in ops]
    try:
        return dist.batch_isend_irecv(p2p)
    except RuntimeError as exc:  # e.g. gloo closed the pair after an earlier timeout
        raise RuntimeError(f"{where}: posting P2P with ranks "
                           f"{sorted({op.peer for op in ops})} failed: {exc}") from exc


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor like ``tensor`` (pinned when ``tensor`` is on CUDA)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (async from CUDA into pinned memory)."""
    buffer = _host_buffer(tensor)
    buffer.copy_(tensor, non_blocking=tensor.is_cuda)
    return buffer


def _device_copies_done(tensors: Sequence[torch.Tensor]) -> None:
    """Wait on the host for the copies just queued from CUDA ``tensors`` (staging only)."""
    devices = {t.device for t in tensors if t.is_cuda}
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


class Transport:
    """Posts P2P batches and all-to-alls (see the module docstring). ``name``: its choice."""

    name = "direct"

    def post(self, ops: Sequence[P2P], group: dist.ProcessGroup, where: str,
             timeout_s: float) -> Pending:
        """Post ``ops`` (one batch); returns at once. ``where`` names the exchange in errors."""
        if not ops:
            return Pending()
        works = _post(ops, group, where)
        if ops[0].tensor.is_cuda:
            return _StreamPending(works)
        return _HostPending(works, ops, where, timeout_s)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, recv_splits: list[int],
                   send_splits: list[int], group: dist.ProcessGroup | None, where: str,
                   timeout_s: float) -> Pending:
        """``all_to_all_single`` with uneven splits into ``received``; returns at once."""
        work = dist.all_to_all_single(received, sent, output_split_sizes=recv_splits,
                                      input_split_sizes=send_splits, group=group, async_op=True)
        if sent.is_cuda:
            return _StreamPending([work])
        return _HostPending([work], [P2P(False, received, -1, 0, "the all-to-all")], where,
                            timeout_s)


class StagedTransport(Transport):
    """CUDA tensors through host buffers over gloo (see the module docstring)."""

    name = "staged"

    def post(self, ops: Sequence[P2P], group: dist.ProcessGroup, where: str,
             timeout_s: float) -> Pending:
        if not ops:
            return Pending()
        staged = [op._replace(tensor=_staged(op.tensor) if op.send else _host_buffer(op.tensor))
                  for op in ops]
        _device_copies_done([op.tensor for op in ops if op.send])
        copies = [(op.tensor, host.tensor) for op, host in zip(ops, staged) if not op.send]
        return _StagedPending(_HostPending(_post(staged, group, where), staged, where, timeout_s),
                              copies)

    def all_to_all(self, received, sent, recv_splits, send_splits, group, where, timeout_s):
        host_sent, host_received = _staged(sent), _host_buffer(received)
        _device_copies_done([sent])
        work = dist.all_to_all_single(host_received, host_sent, output_split_sizes=recv_splits,
                                      input_split_sizes=send_splits, group=group, async_op=True)
        inner = _HostPending([work], [P2P(False, host_received, -1, 0, "the all-to-all")], where,
                             timeout_s)
        return _StagedPending(inner, [(received, host_received)])


TRANSPORTS = {"direct": Transport(), "staged": StagedTransport()}


def get_transport(choice: str | Transport | None = None) -> Transport:
    """The transport for ``choice``: a name in ``env.TRANSPORTS``, a Transport, or None for
    ``ZEPPELIN_TRANSPORT`` (default ``direct``)."""
    if isinstance(choice, Transport):
        return choice
    name = env.transport() if choice is None else choice
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r} is invalid: expected one of {list(TRANSPORTS)}")
    return TRANSPORTS[name]


# groups warm_up has judged: NCCL ones it ran a barrier on, others needing none (by id; the
# groups are held, so an id is never reused while it is here)
_WARMED: dict[int, dist.ProcessGroup] = {}


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of a collective on ``group`` (None: the world) must live: this
    thread's CUDA device on NCCL, which refuses host tensors, else the host (gloo)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def warm_up(groups: list[dist.ProcessGroup], device: torch.device) -> None:
    """A barrier on each NCCL group of ``groups`` that has not yet run a collective in this
    process: NCCL needs one before a communicator's first P2P batch. Once per group and
    process (not per engine: an engine is built per plan, and a NCCL barrier waits on the
    host for the device). A gloo group needs none; it is remembered too, so that callers on
    the per-layer path (remap pairs, the MTP shift) ask its backend once."""
    for group in groups:
        if id(group) in _WARMED:
            continue
        if "nccl" in str(dist.get_backend(group)):
            index = device.index if device.index is not None else torch.cuda.current_device()
            dist.barrier(group=group, device_ids=[index])
        _WARMED[id(group)] = group
