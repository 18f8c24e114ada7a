"""Inter-node exchange of one ring step over torch.distributed: routed (pipelined) or direct.

Every rank of the routing pool calls ``routed_exchange`` (or ``direct_exchange``) for every
inter-node ring step, with the same global ``flows`` list and the same ``RouteSchedule``
(``megatron_zeppelin.router.route`` is deterministic: each rank computes it itself). A rank acts
as source, proxy and/or destination as the schedule says; ranks with nothing to do return at
once. A routed slice has three legs:

1. dispatch: source -> source proxy over NVLink (slices whose src_proxy != src);
2. NIC: source proxy -> destination proxy, through the proxies' NICs;
3. combine: destination proxy -> destination over NVLink (slices whose dst_proxy != dst).

Pipeline. Every slice is cut into ``chunks`` byte ranges (``router.chunk_span``: whole
``align`` units, as even as possible; a slice shorter than ``chunks`` units leaves some chunks
empty, and empty chunks send nothing). The step runs ``chunks + 2`` batches, each one
``batch_isend_irecv``: batch t carries the dispatch legs of chunk t, the NIC legs of chunk t-1
and the combine legs of chunk t-2, so NVLink and NIC transfers overlap. A proxy forwards a
chunk only in the batch after the one that received it. Within a batch the ops of one rank
pair follow slice order on both sides (NCCL matches them by order); tags are
``slice * chunks + chunk`` (gloo matches by tag). ``chunks = 1`` is three sequential phases.

Tensor layouts. ``sends[f]``: the payload of flow ``f`` on its source rank, a 1-D contiguous
tensor of ``flows[f].nbytes`` bytes (any dtype). ``recv_like[f] = (numel, dtype)`` on the
destination rank; the result ``out[f]`` is a new 1-D contiguous tensor of that shape and dtype
holding the sender's bytes. Slices are byte ranges ``[offset, offset + nbytes)`` of the payload
and travel as ``uint8`` views, so ``align`` only has to divide the flow sizes. Proxies stage
slices in ``uint8`` buffers on ``device``. These functions do not record autograd history.

Ranks in ``flows`` and the schedule are ranks of ``group`` (the routing pool: node-major,
``node * gpus_per_node + local``); P2P ops address their global ranks. With NCCL, ``group`` must
have run a collective (e.g. a barrier) before its first exchange, as ``batch_isend_irecv``
requires. Batches go through a ``transport.Transport`` (``transport=``; None:
``ZEPPELIN_TRANSPORT``). On gloo each batch waits on the host at most ``timeout_s`` (default
``env.p2p_timeout_s()``) and then raises RuntimeError naming the step, the batch, the leg, the
chunk and the peer, instead of hanging. With NCCL a batch's completion is a join of the current
stream (all batches of a step run in order on NCCL's stream, so a proxy forwards a chunk only
after receiving it) and the host does not wait for the device.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.router.model import MAX_CHUNKS_LIMIT, chunk_span
from megatron_zeppelin.router.schedule import Flow, RouteSchedule
from megatron_zeppelin.runtime import transport as transports
from megatron_zeppelin.runtime.transport import P2P, Transport, collective_device

PHASES = ("dispatch", "NIC", "combine")  # a leg of phase i runs chunk c in batch c + i


CHUNK_WHAT = "{}, chunk {} of {} (slice bytes {}:{})"  # a chunk's name in errors


def describe(op: P2P) -> str:
    """The op's name for error messages."""
    return transports.describe(op.what)


class _Leg(NamedTuple):
    """This rank's side of one leg of a slice: the whole slice's bytes, before chunking.

    phase: index in ``PHASES``; index: the slice's index in the schedule."""

    phase: int
    send: bool
    tensor: torch.Tensor
    peer: int
    index: int
    what: str


def routed_exchange(sends: Mapping[int, torch.Tensor],
                    recv_like: Mapping[int, tuple[int, torch.dtype]], flows: Sequence[Flow],
                    schedule: RouteSchedule, group: dist.ProcessGroup, *, step: int = 0,
                    timeout_s: float | None = None, device: torch.device | str | None = None,
                    chunks: int | None = None,
                    transport: Transport | str | None = None) -> dict[int, torch.Tensor]:
    """Deliver every flow of one ring step along ``schedule`` (see the module docstring).

    sends: flow index -> payload on its source rank; recv_like: flow index -> (numel, dtype)
    on its destination rank; step: names the ring step in errors; device: where proxies stage
    slices (None: the device of this rank's first payload, else the group's default device);
    chunks: pipeline depth, the same on every rank (None: ``schedule.chunks``, the count the
    router modelled; any in ``[1, 16]`` delivers the same bytes); transport: see the module
    docstring. Returns flow index -> received tensor for the flows this rank is the destination of.
    """
    me = _my_rank(group)
    _check_schedule(flows, schedule)
    depth = _resolve_chunks(chunks, schedule)
    dev = _staging_device(device, sends, group)
    src_bytes = _payload_bytes(me, flows, sends)
    out = _allocate_outputs(me, flows, recv_like, dev)
    plan = _RankPlan(me, flows, src_bytes, {f: t.view(torch.uint8) for f, t in out.items()}, dev)
    plan.add_slices(schedule.slice_table)
    timeout, via = _resolve_timeout(timeout_s), transports.get_transport(transport)
    _global_ranks(group, flows)
    batches = make_batches(plan.legs, depth, schedule.align)
    for t, ops in enumerate(batches):
        via.post(ops, group, f"routed P2P step {step}, batch {t} of {len(batches)} (chunks "
                 f"{depth}), rank {me}", timeout).wait()
    return out


def make_batches(legs: Sequence[_Leg], chunks: int, align: int) -> list[list[P2P]]:
    """The ``chunks + 2`` batches of a pipelined step: chunk c of a leg of phase i goes to
    batch ``c + i``; legs keep their (slice, phase) order inside a batch; empty chunks are
    skipped (the peer computes the same spans, so both skip them)."""
    batches: list[list[P2P]] = [[] for _ in range(chunks + 2)]
    for leg in legs:
        nbytes = leg.tensor.numel()
        for c in range(chunks):
            lo, hi = chunk_span(nbytes, align, chunks, c)
            if lo == hi:
                continue
            batches[c + leg.phase].append(P2P(leg.send, leg.tensor[lo:hi], leg.peer,
                                              leg.index * chunks + c,
                                              (CHUNK_WHAT, leg.what, c, chunks, lo, hi)))
    return batches


def direct_exchange(sends: Mapping[int, torch.Tensor],
                    recv_like: Mapping[int, tuple[int, torch.dtype]], flows: Sequence[Flow],
                    group: dist.ProcessGroup, *, step: int = 0, timeout_s: float | None = None,
                    device: torch.device | str | None = None,
                    transport: Transport | str | None = None) -> dict[int, torch.Tensor]:
    """Deliver every flow of one ring step src -> dst in one phase (no routing).

    Same arguments, layouts and result as ``routed_exchange`` without the schedule.
    """
    me = _my_rank(group)
    dev = _staging_device(device, sends, group)
    src_bytes = _payload_bytes(me, flows, sends)
    out = _allocate_outputs(me, flows, recv_like, dev)
    ops = []
    for f, flow in enumerate(flows):
        if me == flow.src:
            ops.append(P2P(True, src_bytes[f], flow.dst, f, f"send of flow {f} to rank {flow.dst}"))
        if me == flow.dst:
            ops.append(P2P(False, out[f].view(torch.uint8), flow.src, f,
                           f"receive of flow {f} from rank {flow.src}"))
    timeout = _resolve_timeout(timeout_s)
    _global_ranks(group, flows)
    transports.get_transport(transport).post(
        ops, group, f"routed P2P step {step}, direct phase, rank {me}", timeout).wait()
    return out


class _RankPlan:
    """This rank's legs of a routed step (whole slices), built from the slice table in
    (slice, phase) order."""

    def __init__(self, me: int, flows: Sequence[Flow], src_bytes: dict[int, torch.Tensor],
                 out_bytes: dict[int, torch.Tensor], device: torch.device) -> None:
        self.me, self.flows, self.device = me, flows, device
        self.src_bytes, self.out_bytes = src_bytes, out_bytes
        self.legs: list[_Leg] = []

    def add_slices(self, table: Sequence[int]) -> None:
        """Add this rank's legs for every slice it is src, src proxy, dst proxy or dst of."""
        me = self.me
        for index in range(len(table) // 5):
            f, sp, dp, offset, nbytes = table[5 * index:5 * index + 5]
            flow = self.flows[f]
            if me in (flow.src, sp, dp, flow.dst):
                self.add_slice(index, f, flow, sp, dp, slice(offset, offset + nbytes))

    def add_slice(self, index: int, f: int, flow: Flow, sp: int, dp: int, span: slice) -> None:
        """Add this rank's legs for slice ``index``: bytes ``span`` of flow ``f`` relayed
        src -> ``sp`` -> ``dp`` -> dst (a rank is never both proxies of one slice)."""
        me, name = self.me, f"slice {index} (flow {f}, bytes {span.start}:{span.stop})"
        size, staged = span.stop - span.start, None

        def leg(phase: int, send: bool, tensor: torch.Tensor, peer: int) -> None:
            verb = "send of" if send else "receive of"
            where = f"to rank {peer}" if send else f"from rank {peer}"
            self.legs.append(_Leg(phase, send, tensor, peer, index,
                                  f"{PHASES[phase]} {verb} {name} {where}"))

        if sp != flow.src and me == flow.src:
            leg(0, True, self.src_bytes[f][span], sp)
        if sp != flow.src and me == sp:
            staged = torch.empty(size, dtype=torch.uint8, device=self.device)
            leg(0, False, staged, flow.src)
        if me == sp:
            leg(1, True, self.src_bytes[f][span] if sp == flow.src else staged, dp)
        if me == dp:
            staged = (self.out_bytes[f][span] if dp == flow.dst else
                      torch.empty(size, dtype=torch.uint8, device=self.device))
            leg(1, False, staged, sp)
        if dp != flow.dst and me == dp:
            leg(2, True, staged, flow.dst)
        if dp != flow.dst and me == flow.dst:
            leg(2, False, self.out_bytes[f][span], dp)


def _my_rank(group: dist.ProcessGroup) -> int:
    """This process's rank in ``group``; ValueError when it is not a member."""
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError("this process is not a member of the process group passed as `group`")
    return me


def _resolve_chunks(chunks: int | None, schedule: RouteSchedule) -> int:
    """The pipeline depth: ``chunks``, or the schedule's when None; ValueError when invalid."""
    if chunks is None:
        return schedule.chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not (
            1 <= chunks <= MAX_CHUNKS_LIMIT):
        raise ValueError(f"chunks={chunks!r} is invalid: expected an integer in "
                         f"[1, {MAX_CHUNKS_LIMIT}] (or None for the schedule's "
                         f"{schedule.chunks})")
    return chunks


def _resolve_timeout(timeout_s: float | None) -> float:
    """Seconds a phase may wait: ``timeout_s``, or ``env.p2p_timeout_s()`` when None."""
    if timeout_s is None:
        return env.p2p_timeout_s()
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} is invalid: expected a positive number of "
                         "seconds (or None for ZEPPELIN_P2P_TIMEOUT_S)")
    return float(timeout_s)


def _global_ranks(group: dist.ProcessGroup, flows: Sequence[Flow]) -> list[int]:
    """Global rank of each group rank; ValueError when a flow names a rank outside the group."""
    ranks = dist.get_process_group_ranks(group)
    for f, flow in enumerate(flows):
        if not (0 <= flow.src < len(ranks) and 0 <= flow.dst < len(ranks)):
            raise ValueError(f"flow {f} {flow}: ranks must be in [0, {len(ranks)}), the size "
                             "of the process group passed as `group`")
    return ranks


def _staging_device(device: torch.device | str | None, sends: Mapping[int, torch.Tensor],
                    group: dist.ProcessGroup) -> torch.device:
    """``device`` if given, else the payloads' device, else CUDA for NCCL groups, else CPU."""
    if device is not None:
        return torch.device(device)
    for tensor in sends.values():
        return tensor.device
    return collective_device(group)


def _payload_bytes(me: int, flows: Sequence[Flow],
                   sends: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``uint8`` views of this rank's payloads; ValueError on a missing or malformed one."""
    mine = {f for f, flow in enumerate(flows) if flow.src == me}
    if set(sends) != mine:
        raise ValueError(f"rank {me}: sends has flows {sorted(sends)}, expected exactly the "
                         f"flows this rank is the source of: {sorted(mine)}")
    views = {}
    for f, tensor in sends.items():
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dim() != 1 or not tensor.is_contiguous() or nbytes != flows[f].nbytes:
            raise ValueError(f"rank {me}: sends[{f}] has shape {tuple(tensor.shape)}, "
                             f"{nbytes} bytes: expected a 1-D contiguous tensor of "
                             f"{flows[f].nbytes} bytes ({flows[f]})")
        views[f] = tensor.detach().view(torch.uint8)
    return views


def _allocate_outputs(me: int, flows: Sequence[Flow],
                      recv_like: Mapping[int, tuple[int, torch.dtype]],
                      device: torch.device) -> dict[int, torch.Tensor]:
    """Empty 1-D receive tensors; ValueError when ``recv_like`` does not match the flows."""
    mine = {f for f, flow in enumerate(flows) if flow.dst == me}
    if set(recv_like) != mine:
        raise ValueError(f"rank {me}: recv_like has flows {sorted(recv_like)}, expected exactly "
                         f"the flows this rank is the destination of: {sorted(mine)}")
    out = {}
    for f, (numel, dtype) in recv_like.items():
        out[f] = torch.empty(numel, dtype=dtype, device=device)
        if out[f].numel() * out[f].element_size() != flows[f].nbytes:
            raise ValueError(f"rank {me}: recv_like[{f}] = ({numel}, {dtype}) holds "
                             f"{out[f].numel() * out[f].element_size()} bytes, expected "
                             f"{flows[f].nbytes} ({flows[f]})")
    return out


def _check_schedule(flows: Sequence[Flow], schedule: RouteSchedule) -> None:
    """ValueError unless the schedule's slices tile exactly these flows."""
    covered = [0] * len(flows)
    table = schedule.slice_table
    for index in range(0, len(table), 5):
        f, offset, nbytes = table[index], table[index + 3], table[index + 4]
        if not 0 <= f < len(flows) or offset != covered[f]:
            raise ValueError(f"schedule slice {index // 5} (flow {f}, offset {offset}) does not "
                             f"match the {len(flows)} flows passed: route these flows again")
        covered[f] += nbytes
    for f, flow in enumerate(flows):
        if covered[f] != flow.nbytes:
            raise ValueError(f"schedule covers {covered[f]} bytes of flow {f} {flow}: expected "
                             f"{flow.nbytes}; route these flows again")
