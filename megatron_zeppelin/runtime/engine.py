"""The attention engine of one rank: every ring group of a plan, three queues, overlapped.

``AttentionEngine(plan, rank, group).forward(q, k, v)`` computes causal self-attention of the
rank's attention buffer (``Plan.attention[rank]`` order; q ``[tokens, heads, head_dim]``, k/v
``[tokens, kv_heads, head_dim]``), with autograd, exactly as if every sequence ran alone.

Queues and overlap. The rank's groups of a wave run in global order (``Plan.rank_groups``):
INTER rings, then INTRA rings, then LOCAL sequences. A wave runs in rounds ``r = 0, 1, ...``:

1. post the round's exchanges, in global group order: every INTER and INTRA ring's step-``r``
   P2P (``RingComm``, async) and, with ``inter_mode`` ``direct``/``routed``, the wave's global
   inter-node step ``r`` on the worker thread (``inter.InterQueue``);
2. compute step ``r`` of every ring (INTER first, then INTRA), then this round's share of the
   LOCAL sequences (spread over the rounds that have traffic in flight, balanced by s^2);
3. wait for the exchanges (at most the timeout) and hand the received blocks to the rings.

So each ring's traffic flies while the later queues (and the other rings) compute. Backward
runs the same rounds with the backward rings (KV forward, dKV back to the owner) and the LOCAL
gradients. Waves run one after another.

Deadlock freedom. Each exchange is a set of P2P ops between ring neighbours of one group,
tagged with the group's global index. Every rank posts its exchanges in one global total order,
``(phase, wave, round, group key)``, the same order on every rank, and a rank waits for its
round-``r`` exchanges before it posts round ``r+1``. Take the smallest exchange in that order
that has not completed: every member of its group has completed all smaller exchanges (by
minimality), so each member gets past its earlier waits and posts it; its ops then match
(same peers, same tag, same sizes: both sides derive them from the plan) and it completes. So
every exchange completes: no deadlock, also on NCCL, where the P2P of one communicator runs
in issue order. Global inter-node steps run on ``route_group`` in the same (wave, round)
order on every rank of the pool (all of them take part, with or without inter-node rings),
waited within the same round, so the argument holds for them as well. A peer that fails makes
its neighbours' waits time out with an error naming the ring, the step and the peer. With
NCCL, the first ``run`` issues a barrier on each NCCL group (a collective must precede a
communicator's first P2P batch), so every rank must make its first call together.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.plan import Plan, RingGroup, Tier
from megatron_zeppelin.router import RouterTopology
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.attention import RingGroupRun, ZigzagLayout, accum_dtype
from megatron_zeppelin.runtime.inter import InterQueue
from megatron_zeppelin.runtime.utils import RingComm

INTER_MODES = ("ring", "direct", "routed")
WORKS = ("all", "compute", "comm")


@dataclasses.dataclass
class _Ring:
    """A ring group of this rank: rows ``[start, end)`` of the buffer, layout, comm."""

    group: RingGroup
    start: int
    end: int
    layout: ZigzagLayout
    comm: RingComm
    routed_send: bool = False  # outgoing hop goes through the global inter-node step
    routed_recv: bool = False  # incoming hop likewise


@dataclasses.dataclass
class _Wave:
    rings: list[_Ring]
    local: tuple[int, int, tuple[int, ...]] | None  # rows [start, end) and sequence lengths


def split_balanced(lengths: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut sequences into at most ``parts`` consecutive runs ``[i, j)`` of similar s^2 work."""
    total = sum(n * n for n in lengths)
    cuts, acc, start = [], 0, 0
    for i, n in enumerate(lengths):
        acc += n * n
        if len(cuts) < parts - 1 and acc * parts >= total * (len(cuts) + 1):
            cuts.append((start, i + 1))
            start = i + 1
    if start < len(lengths):
        cuts.append((start, len(lengths)))
    return cuts


class AttentionEngine:
    """Causal attention of a plan's attention layout on one rank (see the module docstring).

    plan/rank: the plan and this rank (a rank of ``group``); group: the pool's process group
    (its ranks are the plan's ranks); backend: kernel backend (None: ``env``); timeout_s: the
    most a P2P wait may take (None: ``env.p2p_timeout_s()``); scale: softmax scale (None:
    head_dim ** -0.5); inter_mode: ``ring`` (inter-node rings use direct ring P2P like intra
    ones), ``direct`` or ``routed`` (global inter-node steps through ``inter.exchange`` on
    ``route_group``, a second process group over the same ranks; ``routed`` needs
    ``router_topology``); work: ``all``, or a measurement switch for overlap benchmarks:
    ``compute`` (no P2P: received blocks are zeros) or ``comm`` (no kernels); the results of
    both are wrong.
    """

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup, *,
                 backend: str | None = None, timeout_s: float | None = None,
                 scale: float | None = None, inter_mode: str = "ring",
                 route_group: dist.ProcessGroup | None = None,
                 router_topology: RouterTopology | None = None, work: str = "all") -> None:
        plan.topology.check_world_size(dist.get_world_size(group))
        if dist.get_rank(group) != rank:
            raise ValueError(f"rank={rank} is not this process's rank in the group "
                             f"({dist.get_rank(group)})")
        if inter_mode not in INTER_MODES:
            raise ValueError(f"inter_mode={inter_mode!r} is invalid: expected one of "
                             f"{list(INTER_MODES)}")
        if work not in WORKS:
            raise ValueError(f"work={work!r} is invalid: expected one of {list(WORKS)}")
        if inter_mode != "ring" and route_group is None:
            raise ValueError(f"inter_mode={inter_mode!r} needs route_group: a second process "
                             "group over the pool's ranks (dist.new_group)")
        self.plan, self.rank, self.group = plan, rank, group
        self.backend, self.scale, self.inter_mode, self.work = backend, scale, inter_mode, work
        self.timeout_s = env.p2p_timeout_s() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: expected seconds > 0")
        self.tokens = plan.attention_tokens()[rank]
        self._unwarmed = [g for g in (group, route_group)
                          if g is not None and "nccl" in str(dist.get_backend(g))]
        self.inter = None if inter_mode == "ring" else InterQueue(
            plan, rank, route_group, routing=inter_mode == "routed",
            router_topology=router_topology, timeout_s=self.timeout_s)
        self.waves = self._build_waves()

    def _build_waves(self) -> list[_Wave]:
        waves = [_Wave([], None) for _ in range(self.plan.num_waves)]
        index = {g.key: i for i, g in enumerate(self.plan.ring_groups)}
        offset = 0
        for group in self.plan.rank_groups[self.rank]:
            lengths = [self.plan.seqlens[s] for s in group.seqs]
            position = group.ring.index(self.rank)
            layout = ZigzagLayout(lengths, len(group.ring), position)
            start, offset = offset, offset + layout.tokens()
            if group.tier == Tier.LOCAL:
                waves[group.wave].local = (start, offset, tuple(lengths))
                continue
            comm = RingComm(group.ring, self.rank, self.group, tag=index[group.key],
                            name=f"{group.tier.name} group {group.key}", timeout_s=self.timeout_s)
            ring = _Ring(group, start, offset, layout, comm)
            if self.inter is not None and group.tier == Tier.INTER:
                ring.routed_send = self.inter.crosses(group, position)
                ring.routed_recv = self.inter.crosses(group, (position - 1) % len(group.ring))
            waves[group.wave].rings.append(ring)
        if offset != self.tokens:
            raise RuntimeError(f"rank {self.rank}: ring groups hold {offset} tokens, the plan's "
                               f"attention layout {self.tokens}")
        return waves

    # ------------------------------------------------------------------ public API
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output ``[tokens, heads, head_dim]`` of the rank's buffer, with autograd."""
        if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != self.tokens \
                or k.shape[0] != self.tokens:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                             f"expected [{self.tokens}, heads, head_dim] and [{self.tokens}, "
                             "kv_heads, head_dim] (the rank's attention tokens)")
        return _EngineFunction.apply(q, k, v, self)

    __call__ = forward

    def close(self) -> None:
        """Stop the inter-node worker thread, if any."""
        if self.inter is not None:
            self.inter.close()

    # ------------------------------------------------------------------ one phase
    def run(self, phase: str, q, k, v, out=None, lse=None, dout=None):
        """One phase on the rank's buffers (layouts as ``forward``; lse ``[heads, tokens]``).

        ``forward``: returns ``(out, lse)``. ``backward`` (given the forward's ``out``/``lse``
        and ``dout``): returns ``(dq, dk, dv)``. ``forward`` wraps both in autograd.
        """
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase={phase!r} is invalid: expected 'forward' or 'backward'")
        while self._unwarmed:  # NCCL: a collective must precede a group's first P2P batch
            dist.barrier(group=self._unwarmed.pop())
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        acc = accum_dtype(q.dtype)
        if phase == "forward":
            result = (torch.empty_like(q), torch.empty((q.shape[1], self.tokens), dtype=acc,
                                                       device=q.device))
        else:
            result = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        for wave_index, wave in enumerate(self.waves):
            runs = [RingGroupRun(ring.layout, scale, self.backend, compute=self.work != "comm")
                    for ring in wave.rings]
            for ring, run in zip(wave.rings, runs):
                rows = slice(ring.start, ring.end)
                if phase == "forward":
                    run.begin_forward(q[rows], k[rows], v[rows])
                else:
                    run.begin_backward(dout[rows], q[rows], k[rows], v[rows], out[rows],
                                       lse[:, rows])
            self._rounds(phase, wave_index, wave, runs, (q, k, v, out, lse, dout), result, scale)
            for ring, run in zip(wave.rings, runs):
                rows = slice(ring.start, ring.end)
                if phase == "forward":
                    result[0][rows], result[1][:, rows] = run.end_forward()
                else:
                    result[0][rows], result[1][rows], result[2][rows] = run.end_backward()
        return result

    def _rounds(self, phase, wave_index, wave, runs, tensors, result, scale) -> None:
        steps = [run.forward_steps if phase == "forward" else run.backward_steps for run in runs]
        exchanges = [s - 1 if phase == "forward" else (s if s > 1 else 0) for s in steps]
        global_steps = self.inter.num_steps(wave_index, phase) if self.inter else 0
        busy = max(exchanges + [global_steps, 0])
        parts = self._local_parts(wave, max(busy, 1))
        for r in range(max(steps + [global_steps, len(parts)])):
            pending = self._post(phase, wave_index, wave, runs, r, global_steps, tensors[1])
            for run, n in zip(runs, steps):
                if r < n:
                    _calls(run, phase).compute(r)
            if r < len(parts) and self.work != "comm":
                self._local(phase, parts[r], tensors, result, scale)
            self._complete(phase, wave, runs, r, pending, tensors[0].device)

    def _local_parts(self, wave: _Wave, rounds: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """The LOCAL sequences cut into one consecutive run per round (rows and lengths)."""
        if wave.local is None:
            return []
        start, _, lengths = wave.local
        parts, offset = [], start
        for i, j in split_balanced(lengths, rounds):
            size = sum(lengths[i:j])
            parts.append((offset, offset + size, lengths[i:j]))
            offset += size
        return parts

    def _local(self, phase, part, tensors, result, scale) -> None:
        """One round's share of the LOCAL queue: one causal varlen call."""
        start, end, lengths = part
        rows = slice(start, end)
        cu = tuple([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
        q, k, v, out, lse, dout = tensors
        if phase == "forward":
            result[0][rows], result[1][:, rows] = kernels.block_forward(
                q[rows], k[rows], v[rows], cu, cu, True, scale, self.backend)
        else:
            result[0][rows], result[1][rows], result[2][rows] = kernels.block_backward(
                dout[rows], q[rows], k[rows], v[rows], out[rows], lse[:, rows], cu, cu, True,
                scale, self.backend)

    def _post(self, phase, wave_index, wave, runs, r, global_steps, k):
        """Post round ``r``: ring P2P in global group order, then the global inter step."""
        pending, routed_sends = [], {}
        for ring, run in zip(wave.rings, runs):
            sends, like = _calls(run, phase).sends(r), _calls(run, phase).recv_like(r)
            if ring.routed_send:
                routed_sends[ring.group.key] = sends
            request = None
            if self.work == "compute":
                pass  # measurement switch: no P2P, the ring gets zeros
            elif (sends and not ring.routed_send) or (like and not ring.routed_recv):
                request = ring.comm.exchange(sends, like, r, send=not ring.routed_send,
                                             recv=not ring.routed_recv, phase=phase,
                                             device=k.device)
            pending.append((request, like))
        future = None
        if r < global_steps and self.work != "compute":  # every rank of the pool takes part
            meta = ((k.shape[1], k.shape[2]), k.dtype)
            future = self.inter.post(wave_index, r, phase, routed_sends, meta, k.device)
        return pending, future

    def _complete(self, phase, wave, runs, r, pending, device) -> None:
        """Wait for round ``r``'s exchanges and hand each ring what it received."""
        requests, future = pending
        routed = future.result() if future is not None else {}
        for ring, run, (request, like) in zip(wave.rings, runs, requests):
            received = request.wait() if request is not None else []
            if like and (ring.routed_recv or self.work == "compute"):
                received = routed.get(ring.group.key) or [
                    torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in like]
            _calls(run, phase).receive(r, received)


class _Calls(NamedTuple):
    """A ring's step methods of one phase."""

    sends: Callable
    recv_like: Callable
    compute: Callable
    receive: Callable


def _calls(run: RingGroupRun, phase: str) -> _Calls:
    if phase == "forward":
        return _Calls(run.forward_sends, run.forward_recv_like, run.forward_compute,
                      run.forward_receive)
    return _Calls(run.backward_sends, run.backward_recv_like, run.backward_compute,
                  run.backward_receive)


class _EngineFunction(torch.autograd.Function):
    """Autograd of ``AttentionEngine.forward``: both phases run the engine's rounds."""

    @staticmethod
    def forward(ctx, q, k, v, engine):
        out, lse = engine.run("forward", q.detach(), k.detach(), v.detach())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.engine = engine
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.engine.run("backward", q, k, v, out, lse, dout.contiguous())
        # one entry per forward input: q, k, v, engine
        return dq, dk, dv, None
