"""Inter-node ring steps as GLOBAL steps: the engine's seam to the routing layer.

The routing layer (``routed_p2p``) moves the inter-node traffic of one ring step as a global
phase in which every rank of the pool takes part (as source, proxy or destination). So the
inter-node queue of a wave runs as global steps ``s = 0..S-1``: in forward, ``S`` is the longest
inter-node ring of the wave minus one (KV exchanges); in backward, that ring length plus one
(KV + dKV exchanges, then the final dKV return; see ``attention``). Under a sliding window a
group's sequences whose chunks hold it run by halo exchange (``halo.py``, as
``waves.windowed`` splits the group: ``zigzag_window.halo_parts``), counting as a ring of
``schedule.HALO_ROUNDS_SIZE`` (``schedule.wave_global_steps``). Every rank computes the same
flow list for every step from the plan: for each run of each inter-node group in global order
(``Plan.ring_groups``) and each ring position ``p`` whose hop ``ring[p] -> ring[p+1]`` (a halo
run also ``ring[p] -> ring[p-1]``) crosses nodes and carries bytes at that step,
``Flow(source, destination, nbytes)``. Hops inside one node of an inter-node ring stay on the
direct ring P2P (``RingComm``).

A flow's payload is the concatenated bytes of what the ring step sends (``attention.recv_like``
of the receiving position, ``halo.halo_like`` by halo: KV ``[2, tokens, kv_heads,
head_dim]``, then in backward the float32 dKV accumulator), sent as a 1-D ``uint8`` tensor and
cut back into tensors on arrival.

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
import itertools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.plan import Plan, RingGroup, Tier
from megatron_zeppelin.router import Flow, RouterTopology, RouteSchedule, route
from megatron_zeppelin.runtime.attention import recv_like
from megatron_zeppelin.runtime.halo import halo_like
from megatron_zeppelin.runtime.zigzag import ZigzagLayout
from megatron_zeppelin.runtime.lanes import lanes_for
from megatron_zeppelin.runtime.routed_p2p import direct_exchange, routed_exchange
from megatron_zeppelin.runtime.transport import Transport
from megatron_zeppelin.schedule import Phase, wave_global_steps
from megatron_zeppelin.zigzag_window import halo_parts

Like = list[tuple[tuple[int, ...], torch.dtype]]


def exchange(sends: Mapping[int, torch.Tensor], recv_like: Mapping[int, tuple[int, torch.dtype]],
             flows: Sequence[Flow], group: dist.ProcessGroup, *, routing: bool,
             device: torch.device, schedule: RouteSchedule | None = None, step: int = 0,
             timeout_s: float | None = None,
             transport: Transport | str | None = None) -> dict[int, torch.Tensor]:
    """Deliver one global step's flows: routed (``schedule`` required) or direct.

    sends / recv_like / result: as ``routed_p2p.routed_exchange`` (flow index -> 1-D payload on
    its source; flow index -> (numel, dtype) on its destination; flow index -> received tensor).
    device: where received and relayed tensors live, the engine's. Required: a rank that only
    receives or relays has no payload to take it from, and a gloo route group (the staged
    transport, several ranks on one GPU) would otherwise stage them on the CPU.
    """
    if routing:
        if schedule is None:
            raise ValueError("exchange(routing=True) needs the step's RouteSchedule "
                             "(router.route(topology, flows))")
        return routed_exchange(sends, recv_like, flows, schedule, group, step=step,
                               timeout_s=timeout_s, device=device, transport=transport)
    return direct_exchange(sends, recv_like, flows, group, step=step, timeout_s=timeout_s,
                           device=device, transport=transport)


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


class _Run(NamedTuple):
    """One run of an INTER group under a window (``zigzag_window.halo_parts``): its key
    (group key, by halo exchange), ring, every position's layout of its sequences and, by
    halo, ``reads[(p, q)]``: how many KV rows of its neighbour q position p reads."""

    key: tuple[tuple, bool]
    ring: tuple[int, ...]
    halo: bool
    layouts: list[ZigzagLayout]
    reads: dict[tuple[int, int], int]


class _Step(NamedTuple):
    """One global step as every rank computes it from the plan."""

    flows: list[Flow]
    index: dict[int, tuple[_Run, int, int]]  # flow -> (run, source position, direction)
    schedule: RouteSchedule | None  # routed only


class InterQueue:
    """This rank's side of the global inter-node steps of a plan.

    plan/rank: the plan and this rank (a rank of ``route_group``); routing: routed or direct
    exchanges; router_topology: the cluster's NICs (required when routing); timeout_s: per
    exchange phase; transport: as ``transport.get_transport``; halo: windowed groups run by
    halo exchange where it fits (``waves.build_waves``'s, the same on every rank).

    Traffic is keyed ``(run key, direction)``: ``Ring.run_key``, +1 for a hop to the next
    position (what arrives from the previous one), -1 for a halo hop to the previous one.
    """

    def __init__(self, plan: Plan, rank: int, route_group: dist.ProcessGroup, *, routing: bool,
                 router_topology: RouterTopology | None, timeout_s: float,
                 transport: Transport | str | None = None, halo: bool = True) -> None:
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
        self.transport, self.halo = transport, halo
        self.groups = [g for g in plan.ring_groups if g.tier == Tier.INTER]
        self._runs: dict[tuple, list[_Run]] = {}  # (group key, window, split) -> its runs
        self._steps: dict[tuple, _Step] = {}
        self._pool: ThreadPoolExecutor | None = None

    def num_steps(self, wave: int, phase: Phase, window: int | None = None,
                  split: bool = False) -> int:
        """Global steps of ``wave``'s inter-node queue in ``phase`` under sliding window
        ``window`` (None: full causal), ``split`` as ``waves.windowed`` (0 without such
        rings)."""
        return wave_global_steps(((len(run.ring), run.halo) for group in self.groups
                                  if group.wave == wave
                                  for run in self._group_runs(group, window, split)),
                                 Phase(phase))

    def crosses(self, group: RingGroup, position: int) -> bool:
        """Whether hop ``ring[position] -> ring[position + 1]`` crosses nodes."""
        node, ring = self.plan.topology.node_of, group.ring
        return node(ring[position]) != node(ring[(position + 1) % len(ring)])

    def post(self, wave: int, step: int, phase: Phase, sends: dict[tuple, list[torch.Tensor]],
             meta: tuple, device: torch.device) -> Future:
        """Start global step ``step`` on the worker thread; the future gives ``{(run key,
        direction): received tensors}`` for this rank's incoming hops that cross nodes, once
        ``complete`` has been called with it.

        sends: ``(run key, direction)`` -> the tensors this rank sends at this step, for its
        hops that cross nodes; meta: ``((kv_heads, head_dim + v_head_dim), KV dtype, sliding
        window or None, split)`` (a window trims the relayed KV rows, ``recv_like``, or runs
        a halo exchange; split: ``waves.halo_split``).
        """
        phase = Phase(phase)
        plan = self._step(wave, step, phase, meta)
        payloads, likes = {}, {}
        for f, flow in enumerate(plan.flows):
            if flow.src == self.rank:
                run, _, direction = plan.index[f]
                payloads[f] = pack(sends[(run.key, direction)])
            if flow.dst == self.rank:
                likes[f] = (flow.nbytes, torch.uint8)
        call = functools.partial(exchange, payloads, likes, plan.flows, self.group,
                                 routing=self.routing, device=device, schedule=plan.schedule,
                                 step=step, timeout_s=self.timeout_s, transport=self.transport)
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
        """The received flows cut into each run's tensors (what the receiving position
        expects, ``_like``), keyed ``(run key, direction)``."""
        out = {}
        for f, buffer in got.items():
            run, source, direction = plan.index[f]
            position = (source + direction) % len(run.ring)
            out[(run.key, direction)] = unpack(
                buffer, self._like(run, position, source, step, phase, meta), device)
        return out

    @staticmethod
    def _like(run: _Run, position: int, source: int, step: int, phase: Phase, meta) -> Like:
        """What ``position`` of ``run`` receives from ``source`` at ``step``."""
        if run.halo:
            return halo_like(run.reads[(position, source)], run.reads[(source, position)],
                             phase, step, *meta[:2])
        return recv_like(run.layouts[position], step, phase, *meta[:2])

    def _group_runs(self, group: RingGroup, window: int | None, split: bool) -> list[_Run]:
        """The runs of INTER group ``group`` under ``window`` (cached): as
        ``waves.windowed`` cuts it, each with every position's layout."""
        cache_key = (group.key, window, split)
        if cache_key not in self._runs:
            lengths, size = [self.plan.seqlens[s] for s in group.seqs], len(group.ring)
            self._runs[cache_key] = []
            for halo, seqs in halo_parts(lengths, size, window, split, self.halo):
                layouts = [ZigzagLayout([lengths[i] for i in seqs], size, p, window)
                           for p in range(size)]
                reads = {(p, q % size): len(layouts[p].read_rows(p, q % size))
                         for p in range(size) for q in (p - 1, p + 1)} if halo else {}
                self._runs[cache_key].append(_Run((group.key, halo), group.ring, halo,
                                                  layouts, reads))
        return self._runs[cache_key]

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
                for run in self._group_runs(group, *meta[2:]):
                    g = len(run.ring)
                    for p, direction in itertools.product(range(g), (1, -1)[:1 + run.halo]):
                        dst = (p + direction) % g
                        size = nbytes(self._like(run, dst, p, step, phase, meta))
                        if size and self.crosses(group, p if direction == 1 else dst):
                            index[len(flows)] = (run, p, direction)
                            flows.append(Flow(run.ring[p], run.ring[dst], size))
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
