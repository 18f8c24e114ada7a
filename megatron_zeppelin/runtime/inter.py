"""Inter-node ring steps as GLOBAL steps: the engine's seam to the routing layer.

The routing layer (``routed_p2p``) moves the inter-node traffic of one ring step as a global
phase in which every rank of the pool takes part (as source, proxy or destination). So the
inter-node queue of a wave runs as global steps ``s = 0..S-1``: in forward, ``S`` is the longest
inter-node ring of the wave minus one (KV exchanges); in backward, that ring length plus one
(KV + dKV exchanges, then the final dKV return; see ``attention``). Every rank computes the
same flow list for every step from the plan: for each inter-node group in global order
(``Plan.ring_groups``) and each ring position ``p`` whose hop ``ring[p] -> ring[p+1]`` crosses
nodes and carries bytes at that step, ``Flow(ring[p], ring[p+1], nbytes)``. Hops inside one
node of an inter-node ring stay on the direct ring P2P (``RingComm``).

A flow's payload is the concatenated bytes of what the ring step sends (``attention.recv_like``
of the receiving position: KV ``[2, tokens, kv_heads, head_dim]``, then in backward the float32
dKV accumulator), sent as a 1-D ``uint8`` tensor and cut back into tensors on arrival.

``exchange`` is the one switch: ``routing=True`` -> ``routed_exchange`` along the router's
schedule, ``routing=False`` -> ``direct_exchange`` (same global step, no proxies). Steps run on
one worker thread (``InterQueue``), so the engine computes while a step is in flight; the
thread drives only ``route_group``, a process group of its own (one communicator must not be
driven from two threads with NCCL). On CUDA the worker queues the step on the device's
``inter`` lane (``lanes.lanes_for``: one high-priority stream per device and process)
that first waits for an event recorded on the caller's stream at the post (the payloads are
packed there), and ``complete`` makes the caller's stream wait for the step's end by event;
with NCCL neither thread waits for the device.
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.plan import Plan, RingGroup, Tier
from megatron_zeppelin.router import Flow, RouterTopology, RouteSchedule, route
from megatron_zeppelin.runtime.attention import recv_like
from megatron_zeppelin.runtime.zigzag import ZigzagLayout
from megatron_zeppelin.runtime.lanes import lanes_for
from megatron_zeppelin.runtime.routed_p2p import direct_exchange, routed_exchange
from megatron_zeppelin.runtime.transport import Transport
from megatron_zeppelin.schedule import Phase, global_steps

Like = list[tuple[tuple[int, ...], torch.dtype]]


def exchange(sends: Mapping[int, torch.Tensor], recv_like: Mapping[int, tuple[int, torch.dtype]],
             flows: Sequence[Flow], group: dist.ProcessGroup, *, routing: bool,
             schedule: RouteSchedule | None = None, step: int = 0,
             timeout_s: float | None = None,
             transport: Transport | str | None = None) -> dict[int, torch.Tensor]:
    """Deliver one global step's flows: routed (``schedule`` required) or direct.

    sends / recv_like / result: as ``routed_p2p.routed_exchange`` (flow index -> 1-D payload on
    its source; flow index -> (numel, dtype) on its destination; flow index -> received tensor).
    """
    if routing:
        if schedule is None:
            raise ValueError("exchange(routing=True) needs the step's RouteSchedule "
                             "(router.route(topology, flows))")
        return routed_exchange(sends, recv_like, flows, schedule, group, step=step,
                               timeout_s=timeout_s, transport=transport)
    return direct_exchange(sends, recv_like, flows, group, step=step, timeout_s=timeout_s,
                           transport=transport)


def nbytes(like: Like) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in like)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` concatenated into one 1-D ``uint8`` tensor."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: torch.Tensor, like: Like, device: torch.device) -> list[torch.Tensor]:
    """Cut a ``pack``-ed 1-D ``uint8`` buffer back into tensors of ``like`` (shape, dtype)."""
    out, offset = [], 0
    for shape, dtype in like:
        size = math.prod(shape) * dtype.itemsize
        if size == 0:
            out.append(torch.empty(shape, dtype=dtype, device=device))
            continue
        piece = buffer[offset:offset + size]
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()
        out.append(piece.view(dtype).view(shape))
        offset += size
    return out


class _Step(NamedTuple):
    """One global step as every rank computes it from the plan."""

    flows: list[Flow]
    index: dict[int, tuple[tuple, int]]  # flow -> (group key, source ring position)
    schedule: RouteSchedule | None  # routed only


class InterQueue:
    """This rank's side of the global inter-node steps of a plan.

    plan/rank: the plan and this rank (a rank of ``route_group``); routing: routed or direct
    exchanges; router_topology: the cluster's NICs (required when routing); timeout_s: per
    exchange phase; transport: as ``transport.get_transport``.
    """

    def __init__(self, plan: Plan, rank: int, route_group: dist.ProcessGroup, *, routing: bool,
                 router_topology: RouterTopology | None, timeout_s: float,
                 transport: Transport | str | None = None) -> None:
        if routing and router_topology is None:
            raise ValueError("routing=True needs router_topology "
                             "(RouterTopology.from_cluster(cluster_spec))")
        if router_topology is not None and (
                router_topology.nodes, router_topology.gpus_per_node) != (
                plan.topology.nodes, plan.topology.gpus_per_node):
            raise ValueError(f"router_topology has {router_topology.nodes} x "
                             f"{router_topology.gpus_per_node} ranks: expected the plan's "
                             f"{plan.topology.nodes} x {plan.topology.gpus_per_node}")
        self.plan, self.rank, self.group = plan, rank, route_group
        self.routing, self.topology, self.timeout_s = routing, router_topology, timeout_s
        self.transport = transport
        self.groups = [g for g in plan.ring_groups if g.tier == Tier.INTER]
        self._layouts: dict[tuple, list[ZigzagLayout]] = {}  # (group key, window) -> per position
        self._steps: dict[tuple, _Step] = {}
        self._pool: ThreadPoolExecutor | None = None

    def num_steps(self, wave: int, phase: Phase) -> int:
        """Global steps of ``wave``'s inter-node queue in ``phase`` (0 without such rings)."""
        return global_steps(max((len(g.ring) for g in self.groups if g.wave == wave), default=0),
                            Phase(phase))

    def crosses(self, group: RingGroup, position: int) -> bool:
        """Whether hop ``ring[position] -> ring[position + 1]`` crosses nodes."""
        node, ring = self.plan.topology.node_of, group.ring
        return node(ring[position]) != node(ring[(position + 1) % len(ring)])

    def post(self, wave: int, step: int, phase: Phase, sends: dict[tuple, list[torch.Tensor]],
             meta: tuple[tuple[int, ...], torch.dtype], device: torch.device) -> Future:
        """Start global step ``step`` on the worker thread; the future gives ``{group key:
        received tensors}`` for this rank's groups whose incoming hop crosses nodes, once
        ``complete`` has been called with it.

        sends: group key -> the tensors this rank sends at this step, for its groups whose
        outgoing hop crosses nodes; meta: ``((kv_heads, head_dim + v_head_dim), KV dtype,
        sliding window or None)`` (a window trims the relayed KV rows: ``recv_like``).
        """
        phase = Phase(phase)
        plan = self._step(wave, step, phase, meta)
        payloads, likes = {}, {}
        for f, flow in enumerate(plan.flows):
            if flow.src == self.rank:
                payloads[f] = pack(sends[plan.index[f][0]])
            if flow.dst == self.rank:
                likes[f] = (flow.nbytes, torch.uint8)
        call = functools.partial(exchange, payloads, likes, plan.flows, self.group,
                                 routing=self.routing, schedule=plan.schedule, step=step,
                                 timeout_s=self.timeout_s, transport=self.transport)
        ready = None
        if device.type == "cuda":  # the worker's stream waits for the packing above
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeppelin-inter")
        return self._pool.submit(self._run, call, plan, (wave, step, phase), meta, device, ready,
                                 list(payloads.values()))

    def _run(self, call, plan: _Step, where: tuple[int, int, Phase], meta, device, ready,
             payloads: list[torch.Tensor]):
        """Worker thread: run one global step, cut what arrived into the rings' tensors;
        returns them and, on CUDA, the event that marks the step's end on the worker's
        stream. payloads: what this rank sends (packed on the caller's stream)."""
        wave, step, phase = where
        if not plan.flows:
            return {}, None, device
        try:
            if ready is None:
                return self._unpack(call(), plan, step, phase, meta, device), None, device
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                got = call()
                # the payloads were packed on the caller's stream and are freed when this
                # returns: the allocator must not hand their memory back to that stream
                # before this stream's transfers have read them (NCCL keeps no such record)
                for payload in payloads:
                    payload.record_stream(stream)
                out = self._unpack(got, plan, step, phase, meta, device)
                done = torch.cuda.Event()
                done.record(stream)
            return out, done, device
        except RuntimeError as exc:
            raise RuntimeError(f"wave {wave} {phase.value} inter-node step {step} "
                               f"({'routed' if self.routing else 'direct'}): {exc}") from exc

    def _unpack(self, got: dict[int, torch.Tensor], plan: _Step, step: int, phase: Phase,
                meta, device: torch.device) -> dict[tuple, list[torch.Tensor]]:
        """The received flows cut into each ring's tensors (``recv_like`` of this position)."""
        out = {}
        for f, buffer in got.items():
            key, position = plan.index[f]
            layouts = self._group_layouts(key, meta[2])
            layout = layouts[(position + 1) % len(layouts)]
            out[key] = unpack(buffer, recv_like(layout, step, phase, *meta[:2]), device)
        return out

    def _group_layouts(self, key: tuple, window: int | None) -> list[ZigzagLayout]:
        """Every ring position's layout of INTER group ``key`` under ``window`` (cached)."""
        if (key, window) not in self._layouts:
            group = next(g for g in self.groups if g.key == key)
            lengths = [self.plan.seqlens[s] for s in group.seqs]
            self._layouts[(key, window)] = [ZigzagLayout(lengths, len(group.ring), p, window)
                                            for p in range(len(group.ring))]
        return self._layouts[(key, window)]

    @staticmethod
    def _stream(device: torch.device) -> torch.cuda.Stream:
        """The worker's stream: the device's ``inter`` lane (made once per process)."""
        return lanes_for(device).inter

    @staticmethod
    def complete(future: Future) -> dict[tuple, list[torch.Tensor]]:
        """What ``post``'s step delivered, usable on the caller's current stream (CUDA: the
        stream waits for the step by event; no host wait for the device with NCCL)."""
        out, done, device = future.result()
        if done is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(done)
            for tensors in out.values():
                for tensor in tensors:
                    tensor.record_stream(stream)
        return out

    def _step(self, wave, step, phase, meta) -> _Step:
        """The global flows of a step (the same on every rank) and their schedule."""
        cache_key = (wave, step, phase, meta)
        if cache_key not in self._steps:
            flows, index = [], {}
            for group in self.groups:
                if group.wave != wave:
                    continue
                layouts = self._group_layouts(group.key, meta[2])
                for p in range(len(group.ring)):
                    size = nbytes(recv_like(layouts[(p + 1) % len(layouts)], step, phase,
                                            *meta[:2]))
                    if size and self.crosses(group, p):
                        index[len(flows)] = (group.key, p)
                        flows.append(Flow(group.ring[p], group.ring[(p + 1) % len(group.ring)],
                                          size))
            schedule = route(self.topology, flows) if self.routing and flows else None
            self._steps[cache_key] = _Step(flows, index, schedule)
        return self._steps[cache_key]

    def stats(self) -> dict[str, int]:
        """Totals over the steps built so far: steps, flows, bytes, slices and the slices a
        proxy relays (routed only)."""
        totals = dict(steps=0, flows=0, bytes=0, slices=0, proxied_slices=0)
        for flows, _, schedule in self._steps.values():
            totals["steps"] += 1
            totals["flows"] += len(flows)
            totals["bytes"] += sum(flow.nbytes for flow in flows)
            for piece in (schedule.slices if schedule is not None else ()):
                flow = flows[piece.flow]
                totals["slices"] += 1
                totals["proxied_slices"] += (piece.src_proxy, piece.dst_proxy) != (flow.src,
                                                                                   flow.dst)
        return totals

    def close(self) -> None:
        """Stop the worker thread (after the steps in flight)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
