"""The attention engine of one rank: every ring group of a plan, three queues, overlapped.

``AttentionEngine(plan, rank, group).forward(q, k, v)`` computes causal self-attention of the
rank's attention buffer (``Plan.attention[rank]`` order; q ``[tokens, heads, head_dim]``, k
``[tokens, kv_heads, head_dim]``, v ``[tokens, kv_heads, v_head_dim]``: multi-latent attention
has ``v_head_dim != head_dim``), with autograd, exactly as if every sequence ran alone;
``forward(..., window=L)`` limits each query to itself and the ``L`` keys before it in its
document (Megatron's ``window_size=(L, 0)``; per call, so interleaved local/global layers
share one engine: each window's ring blocks are built once per plan, ``prepare``).
What follows is ring attention (``Plan.attention_kind`` ``ring``); a ``ulysses`` plan (FlexSP)
is handed to ``runtime/ulysses.py`` (all-to-all head parallelism, its own autograd) instead
(full causal attention with one head dim: a window or a different value head dim is refused).

Queues and overlap. The rank's groups of a wave run in global order (``Plan.rank_groups``):
INTER rings, then INTRA rings, then LOCAL sequences. A wave runs in rounds ``r = 0, 1, ...``
(``schedule``: which round sends what):

1. post the round's exchanges, in global group order: every INTER and INTRA ring's step-``r``
   P2P (``RingComm``, async; all of them one batch on the pool's group, ``RingBatch``; where
   a sliding window allows, a halo exchange with both neighbours, ``halo.py``) and,
   with ``inter_mode`` ``direct``/``routed``, the wave's global inter-node step ``r`` on the
   worker thread (``inter.InterQueue``);
2. compute step ``r`` of every ring (INTER first, then INTRA);
3. fill the wait with LOCAL work (``lanes``). On CPU: while some exchange of the round is
   still in flight, run the next LOCAL call (``local_calls``: LOCAL sequences, shortest first,
   short ones batched into calls of at least the work of one ``local_call_tokens``-token
   sequence). On CUDA, every LOCAL call of the wave was queued at its start on a low-priority
   stream, so the GPU fills the waits itself and the host never polls. (In a wave where the
   rank has no traffic at all, its LOCAL sequences are one fused call: no wait to fill.)
4. complete the round's exchanges (gloo: a host wait of at most the timeout; NCCL: the ring
   stream waits for the transfer by event) and hand the received blocks to the rings.

On CPU the LOCAL calls left after the last round run back to back. So each ring's traffic flies
while the later queues (and the other rings) compute, and a ring step waits for at most one
LOCAL call once its data has arrived (on CUDA, for at most one thread block of one). Backward
runs the same rounds with the backward rings (KV forward, dKV back to the owner) and the LOCAL
gradients. Waves run one after another.

Hot path. Everything a round reads is built once per plan and device (``prepare``: every
block's row indices and int32 offsets moved to the device in one copy per dtype, the kernel
backend resolved once per device and dtype, the environment read at construction); the
per-round loop only indexes, calls kernels, merges and posts P2P: no ``.item()``,
``.tolist()``, ``.cpu()`` or branch on tensor values, and no host wait on CUDA with NCCL.

Exactness does not depend on timing: which round runs a LOCAL call varies with the traffic, but
the calls themselves (their sequences and order) are fixed by the plan, each LOCAL sequence is
attended alone, and every call writes its own rows of the output (forward) or of dq, dk, dv
(backward), disjoint from each other and from the rings' rows.

Deadlock freedom. Each exchange is a set of P2P ops between ring neighbours of one group (to
the next one, and for a halo exchange also to the previous one), tagged with the group's
global index; a group split by a window into a halo run and a ring run (``waves.windowed``)
posts both, in that order, under its tag, and messages between two ranks with one tag match
in posting order. Every rank posts its exchanges in one global total order,
``(phase, wave, round, group key)``, the same order on every rank, and completes its round-``r``
exchanges before it posts round ``r+1``; between a post and its completion it only computes
(ring steps and LOCAL calls: finite work, no communication, and a helper thread that only waits
for ops already posted). Take the smallest exchange in that order that has not completed: every
member of its group has completed all smaller exchanges (by minimality), so each member gets
past its earlier completions, computes finitely long and posts it; its ops then match (same
peers, same tag, same sizes: both sides derive them from the plan) and it completes. So every
exchange completes: no deadlock. On CUDA with NCCL "completes" is a stream join rather than a
host wait, and the argument holds on the device: NCCL runs one communicator's ops in issue
order, the transfer of round ``r`` waits only for work queued before its post, and the ring
step that needs it waits only for that transfer. Global inter-node steps run on
``route_group`` in the same (wave, round) order on every rank of the pool (all of them take
part, with or without inter-node rings), completed within the same round, so the argument
holds for them as well. The two communicators are driven from two threads, but in one order on
every rank: a round's ring P2P is enqueued (caller's thread) before its global step is handed
to the worker, and the next round's P2P only after that step was enqueued (``complete``
waits for the worker), so no rank's NCCL kernels wait on ops another rank has not enqueued.
With NCCL, the first ``run`` on a group in a process issues a barrier on it (a collective
must precede a communicator's first P2P batch; ``warm_up``), so every rank of the pool
makes its first call together.
"""
from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.plan import Plan, Tier
from megatron_zeppelin.plan_checks import ATTENTION_KINDS
from megatron_zeppelin.router import RouterTopology
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.attention import RingGroupRun, take
from megatron_zeppelin.runtime.halo import HaloGroupRun
from megatron_zeppelin.runtime.device_index import to_device
from megatron_zeppelin.runtime.inter import InterQueue
from megatron_zeppelin.runtime.kernels import KernelBackend, accum_dtype
from megatron_zeppelin.runtime.lanes import Lanes, lanes_for
from megatron_zeppelin.runtime.merge import sink_grad, with_sink
from megatron_zeppelin.runtime.passes import PostedRound, Tensors, WavePass, fill
from megatron_zeppelin.runtime.plain import plain_ops
from megatron_zeppelin.runtime.probe import Probe
from megatron_zeppelin.runtime.ring_comm import RingBatch
from megatron_zeppelin.runtime.transport import Transport, get_transport, warm_up
from megatron_zeppelin.runtime.ulysses import UlyssesAttention
from megatron_zeppelin.runtime.waves import (LocalCall, Ring, Wave, build_waves, halo_split,
                                             whole_buffer_call, windowed)
from megatron_zeppelin.schedule import LOCAL_CALL_TOKENS, Phase

INTER_MODES = ("ring", "direct", "routed")


def _canonical(device: torch.device | str) -> torch.device:
    """``device`` with its index (CUDA without one: the current device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _put(x: torch.Tensor, rows, value: torch.Tensor, dim: int = 0) -> None:
    """Write ``value`` into rows ``rows`` (slice or int64 indices) of ``x`` along ``dim``."""
    if isinstance(rows, slice):
        if dim == 0:
            x[rows] = value
        else:
            x[:, rows] = value
    else:
        x.index_copy_(dim, rows, value.to(x.dtype))


def refuse_unknown_kind(plan: Plan) -> None:
    """ValueError unless the engine runs the plan's kind of attention: ``ring`` (this module)
    or ``ulysses`` (FlexSP's all-to-all attention, ``runtime/ulysses.py``)."""
    if plan.attention_kind not in ATTENTION_KINDS:
        raise ValueError(f"plan of strategy {plan.strategy!r} has attention_kind="
                         f"{plan.attention_kind!r}: the attention engine runs one of "
                         f"{list(ATTENTION_KINDS)}")


def _check_options(inter_mode: str, route_group, local_call_tokens: int, backend) -> None:
    """ValueError naming an ``AttentionEngine`` option that cannot run."""
    if inter_mode not in INTER_MODES:
        raise ValueError(f"inter_mode={inter_mode!r} is invalid: expected one of "
                         f"{list(INTER_MODES)}")
    if inter_mode != "ring" and route_group is None:
        raise ValueError(f"inter_mode={inter_mode!r} needs route_group: a second process "
                         "group over the pool's ranks (dist.new_group)")
    if not (isinstance(local_call_tokens, int) and local_call_tokens >= 1):
        raise ValueError(f"local_call_tokens={local_call_tokens!r} is invalid: expected an "
                         "integer >= 1")
    if isinstance(backend, str) and backend != kernels.AUTO:
        kernels.get(backend)  # a bad name fails here, not in the first step


class AttentionEngine:
    """Causal attention of a plan's attention layout on one rank (see the module docstring).

    plan/rank: the plan and this rank (a rank of ``group``); group: the pool's process group
    (its ranks are the plan's ranks); backend: kernel backend name, object or None
    (``ZEPPELIN_ATTENTION_BACKEND``); timeout_s: the most a P2P wait may take (None:
    ``env.p2p_timeout_s()``); scale: softmax scale (None: head_dim ** -0.5); inter_mode:
    ``ring`` (inter-node rings use direct ring P2P like intra ones), ``direct`` or ``routed``
    (global inter-node steps through ``inter.exchange`` on ``route_group``, a second process
    group over the same ranks; ``routed`` needs ``router_topology``); local_call_tokens: LOCAL
    sequences shorter than this are batched into calls of at least the work of one sequence of
    this length (``schedule.local_calls``); transport: a ``transport.Transport`` or its name
    (None: ``ZEPPELIN_TRANSPORT``); device: prepare the plan's indices there now (else at the
    first call, on the inputs' device); windows: the sliding windows (None: full causal) whose
    ring blocks ``prepare`` builds ahead (another window's are built at its first call); halo /
    halo_split: ``waves.build_waves`` / ``waves.windowed`` (``zeppelin bench halo``). A
    ``ulysses`` plan runs on ``group`` through ``ulysses.UlyssesAttention`` (backend,
    timeout_s, scale, transport and device apply); ``inter_mode``/``route_group`` route ring
    traffic and have none to route there.
    """

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup, *,
                 backend: str | KernelBackend | None = None, timeout_s: float | None = None,
                 scale: float | None = None, inter_mode: str = "ring",
                 route_group: dist.ProcessGroup | None = None,
                 router_topology: RouterTopology | None = None,
                 local_call_tokens: int = LOCAL_CALL_TOKENS,
                 transport: Transport | str | None = None,
                 device: torch.device | str | None = None,
                 windows: tuple[int | None, ...] = (None,), halo: bool = True,
                 halo_split: bool | None = None) -> None:
        refuse_unknown_kind(plan)
        plan.topology.check_world_size(dist.get_world_size(group))
        if dist.get_rank(group) != rank:
            raise ValueError(f"rank={rank} is not this process's rank in the group "
                             f"({dist.get_rank(group)})")
        _check_options(inter_mode, route_group, local_call_tokens, backend)
        self.plan, self.rank, self.group = plan, rank, group
        self.backend, self.scale, self.inter_mode = backend, scale, inter_mode
        self.timeout_s = env.p2p_timeout_s() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: expected seconds > 0")
        self.transport = get_transport(transport)
        self.tokens = plan.attention_tokens()[rank]
        self._groups = [g for g in (group, route_group) if g is not None]
        self.ulysses = None  # FlexSP's plans: all-to-all attention (its module doc)
        if plan.attention_kind == "ulysses":
            self.ulysses = UlyssesAttention(plan, rank, group, kernel=self._kernel, scale=scale,
                                            transport=self.transport, timeout_s=self.timeout_s)
        self.inter = None if inter_mode == "ring" or self.ulysses else InterQueue(
            plan, rank, route_group, routing=inter_mode == "routed",
            router_topology=router_topology, timeout_s=self.timeout_s,
            transport=self.transport, halo=halo)
        self.waves = [] if self.ulysses else build_waves(
            plan, rank, group, self.inter, local_call_tokens, self.timeout_s, self.transport,
            halo)
        self.windows, self.halo_split = tuple(windows), halo_split
        # per device: the waves of each sliding window (None: full causal) and the lanes
        self._prepared: dict[torch.device, tuple[dict[int | None, list[Wave]], Lanes]] = {}
        self._kernels: dict[tuple[torch.device, torch.dtype], KernelBackend] = {}
        self.probe: Probe | None = None  # per-micro-batch measurements (runtime/probe.py)
        if device is not None:
            self.prepare(device)

    # ------------------------------------------------------------------ preparation
    def prepare(self, device: torch.device | str) -> None:
        """Move every index tensor of the plan to ``device`` (one copy per dtype) and take
        the device's lanes (``lanes_for``: streams made once per process, not per engine), for
        each of ``windows``; call it ahead of the step (e.g. when the plan arrives).
        Idempotent."""
        device = _canonical(device)
        if self.ulysses is not None:
            self.ulysses.prepare(device)
        for window in self.windows:
            self._prepare(device, window)

    def _prepare(self, device: torch.device, window: int | None) -> None:
        """``prepare`` for one sliding window (None: full causal)."""
        if window in self._prepared.get(device, ({},))[0]:
            return
        calls = [c for wave in self.waves for c in wave.local]
        moved = iter(to_device([t for c in calls for t in (
            None if isinstance(c.rows, slice) else c.rows, c.pieces.cu_q_dev)], device))
        placed = {}
        for call in calls:
            rows, cu = next(moved), next(moved)
            placed[id(call)] = call._replace(rows=call.rows if rows is None else rows,
                                             pieces=call.pieces._replace(cu_q_dev=cu,
                                                                         cu_k_dev=cu))
        waves = [Wave([part for ring in wave.rings
                       for part in windowed(ring, window, device, self.halo_split)],
                       [placed[id(c)] for c in wave.local]) for wave in self.waves]
        self._prepared.setdefault(device, ({}, lanes_for(device)))[0][window] = waves

    def _kernel(self, q: torch.Tensor) -> KernelBackend:
        """The kernel backend for ``q``'s device and dtype, resolved once."""
        key = (q.device, q.dtype)
        if key not in self._kernels:
            self._kernels[key] = kernels.select(self.backend, q)
        return self._kernels[key]

    # ------------------------------------------------------------------ public API
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None, window: int | None = None,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``[tokens, heads, v_head_dim]`` of the rank's buffer, with
        autograd; scale: this call's softmax scale (None: the engine's); window: sliding
        window ``L >= 0`` (None: full causal); sink: attention-sink logits ``[heads]`` or
        None (``merge.with_sink``; trained when it requires grad)."""
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or v.shape[:2] != k.shape[:2] \
                or q.shape[2] != k.shape[2] or q.shape[0] != self.tokens \
                or k.shape[0] != self.tokens:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                             f"expected [{self.tokens}, heads, head_dim], [{self.tokens}, "
                             f"kv_heads, head_dim] and [{self.tokens}, kv_heads, v_head_dim] "
                             "(the rank's attention tokens)")
        if window is not None and not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window={window!r} is invalid: expected an integer >= 0 or None")
        if self.ulysses is not None:
            if window is not None or sink is not None or v.shape[2] != q.shape[2]:
                raise ValueError(f"a {self.plan.strategy} plan (Ulysses attention) runs full "
                                 f"causal attention with one head dim and no sink: window="
                                 f"{window!r}, sink={sink is not None}, v head dim {v.shape[2]} "
                                 f"vs q/k {q.shape[2]}: use a ring strategy")
            return self.ulysses.forward(q, k, v, scale)
        return _EngineFunction.apply(q, k, v, sink, self, scale, window)

    __call__ = forward

    def close(self) -> None:
        """Stop the inter-node worker thread, if any."""
        if self.inter is not None:
            self.inter.close()

    # ------------------------------------------------------------------ one phase
    def run(self, phase: Phase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            dout: torch.Tensor | None = None, scale: float | None = None,
            window: int | None = None) -> tuple[torch.Tensor, ...]:
        """One phase on the rank's buffers (layouts as ``forward``; lse ``[heads, tokens]``;
        scale: None for the engine's, itself None for ``head_dim ** -0.5``; window: as
        ``forward``).

        ``Phase.FORWARD``: returns ``(out, lse)``. ``Phase.BACKWARD`` (given the forward's
        ``out``/``lse`` and ``dout``): returns ``(dq, dk, dv)``. ``forward`` wraps both in
        autograd.
        """
        phase = Phase(phase)
        if self.ulysses is not None:
            raise ValueError(f"run() steps ring attention; this plan of strategy "
                             f"{self.plan.strategy!r} is Ulysses attention: call forward()")
        warm_up(self._groups, q.device)
        device = _canonical(q.device)
        self.prepare(device)
        self._prepare(device, window)
        by_window, lanes = self._prepared[device]
        waves = by_window[window]
        scale = next((s for s in (scale, self.scale) if s is not None), q.shape[-1] ** -0.5)
        band = None if window is None else (window, 0)
        whole = whole_buffer_call(waves, self.tokens, self.inter)
        kernel, probe = self._kernel(q), self.probe
        if probe is not None:
            probe.flops_per_square = float(q.shape[1] * (q.shape[2] + v.shape[2]))
            probe.window = window
            probe.calls_like(kernel, q, k, v, scale)
            started = probe.start()
        if whole is not None:  # one fused call over the whole buffer: its outputs, no copies
            if phase is Phase.FORWARD:
                result = kernel.forward(q, k, v, whole.pieces, True, scale, band)
            else:
                result = kernel.backward(dout, q, k, v, out, lse, whole.pieces, True, scale, band)
            if probe is not None:  # the call is the whole phase: the same span
                probe.attention(started, phase.name.lower(), whole.lengths, "local")
        else:
            result = self._run_waves(phase, waves, Tensors(q, k, v, out, lse, dout), kernel,
                                     scale, lanes, band)
        if probe is not None:
            probe.stop(started, ("engine",))
        return result

    def _run_waves(self, phase: Phase, waves: list, tensors: Tensors, kernel, scale: float,
                   lanes, band) -> tuple[torch.Tensor, ...]:
        """Every wave of one phase into fresh result buffers (``run``'s layouts)."""
        q, k, v = tensors.q, tensors.k, tensors.v
        if phase is Phase.FORWARD:
            result = (q.new_empty((*q.shape[:2], v.shape[2])),
                      torch.empty((q.shape[1], self.tokens), dtype=accum_dtype(q.dtype),
                                  device=q.device))
        else:
            result = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        lanes.begin()
        split = halo_split(q.device, self.halo_split)
        for index, wave in enumerate(waves):
            self._run_wave(WavePass(phase, index, wave, tensors, result, scale, kernel, lanes,
                                 band, split))
        lanes.join()
        return result

    def _run_wave(self, p: WavePass) -> None:
        """The wave's rounds (post, ring steps, LOCAL fill, completion), then the LOCAL rest."""
        with p.lanes.ring():
            self._begin_rings(p)
        queue = deque(p.wave.local)
        if p.lanes.concurrent:  # CUDA: the local stream fills the waits itself
            with p.lanes.local():
                while queue:
                    self._local(p, queue.popleft())
        global_steps = self.inter.num_steps(p.index, p.phase, p.window_size,
                                            p.split) if self.inter else 0
        probe = self.probe
        for r in range(max([run.steps(p.phase) for run in p.runs] + [global_steps])):
            round_s, busy = (time.perf_counter(), probe.busy_s) if probe else (0.0, 0.0)
            with p.lanes.ring():
                posted = self._post(p, r, global_steps)
                for ring, run in zip(p.wave.rings, p.runs):
                    if r < run.steps(p.phase):
                        started = probe.start() if probe else None
                        run.compute(p.phase, r)
                        if probe:  # a step: each sequence's s / G queries (cost model)
                            g, seqlens = len(ring.group.ring), self.plan.seqlens
                            probe.attention(started, p.phase.name.lower(),
                                            [seqlens[s] / g for s in ring.group.seqs],
                                            ring.group.tier.name.lower(),
                                            [seqlens[s] for s in ring.group.seqs])
            if queue:
                fill(queue, posted.in_flight, lambda call: self._local(p, call))
            with p.lanes.ring():
                self._complete(p, r, posted)
            if probe:
                probe.ring_round(round_s, busy)
        while queue:
            self._local(p, queue.popleft())
        with p.lanes.ring():
            self._end_rings(p)

    def _begin_rings(self, p: WavePass) -> None:
        t = p.tensors
        for ring in p.wave.rings:
            run = (HaloGroupRun if ring.halo else RingGroupRun)(ring.layout, p.scale, p.kernel,
                                                                ring.blocks)
            rows = ring.rows
            if p.phase is Phase.FORWARD:
                run.begin_forward(*(take(x, rows) for x in (t.q, t.k, t.v)))
            else:
                run.begin_backward(*(take(x, rows) for x in (t.dout, t.q, t.k, t.v, t.out)),
                                   take(t.lse, rows, 1))
            p.runs.append(run)

    def _end_rings(self, p: WavePass) -> None:
        dims = (0, 1) if p.phase is Phase.FORWARD else (0, 0, 0)  # lse [heads, tokens]
        for ring, run in zip(p.wave.rings, p.runs):
            ends = run.end_forward() if p.phase is Phase.FORWARD else run.end_backward()
            for target, value, dim in zip(p.result, ends, dims):
                _put(target, ring.rows, value, dim)

    def _local(self, p: WavePass, call: LocalCall) -> None:
        """One LOCAL call: its rows of the output and lse, or of dq, dk, dv."""
        t, rows = p.tensors, call.rows
        started = self.probe.start() if self.probe else None
        self._local_call(p, call, t, rows)
        if self.probe:
            self.probe.attention(started, p.phase.name.lower(), call.lengths, "local")

    def _local_call(self, p: WavePass, call: LocalCall, t: Tensors, rows) -> None:
        if p.phase is Phase.FORWARD:
            part_out, part_lse = p.kernel.forward(take(t.q, rows), take(t.k, rows),
                                                  take(t.v, rows), call.pieces, True, p.scale,
                                                  p.window)
            _put(p.result[0], rows, part_out)
            _put(p.result[1], rows, part_lse, dim=1)
        else:
            grads = p.kernel.backward(take(t.dout, rows), take(t.q, rows), take(t.k, rows),
                                      take(t.v, rows), take(t.out, rows), take(t.lse, rows, 1),
                                      call.pieces, True, p.scale, p.window)
            for target, grad in zip(p.result, grads):
                _put(target, rows, grad)

    def _post(self, p: WavePass, r: int, global_steps: int) -> PostedRound:
        """Post round ``r``: the ring P2P of every ring, in global group order, as one batch
        (``RingBatch``: one ``batch_isend_irecv``), then the global inter step (the hops
        across nodes, keyed as ``InterQueue.post`` reads them)."""
        pending, routed_sends = [], {}
        k, v = p.tensors.k, p.tensors.v
        batch = RingBatch(self.transport, self.group, self.timeout_s)
        for ring, run in zip(p.wave.rings, p.runs):
            out, into, like, routed = ring.by_way(run.sends(p.phase, r),
                                                  run.recv_like(p.phase, r))
            routed_sends.update(routed)
            request = None
            if any(out) or any(into):
                request = ring.comm.exchange_both(
                    out[0], into[0], out[1], into[1], r, phase=p.phase, device=k.device,
                    batch=batch) if ring.halo else ring.comm.exchange(
                    out[0], into[0], r, phase=p.phase, device=k.device, batch=batch)
            pending.append((request, like))
        batch.post(f"wave {p.index} {p.phase.value} step {r} (ring P2P of rank {self.rank})")
        future = None
        if r < global_steps:  # every rank of the pool takes part
            meta = ((k.shape[1], k.shape[2] + v.shape[2]), k.dtype,  # k and v side by side
                    p.window_size, p.split)
            future = self.inter.post(p.index, r, p.phase, routed_sends, meta, k.device)
        return PostedRound(pending, future)

    def _complete(self, p: WavePass, r: int, posted: PostedRound) -> None:
        """Complete round ``r``'s exchanges and hand each ring what it received."""
        routed = self.inter.complete(posted.inter) if posted.inter is not None else {}
        for ring, run, (request, like) in zip(p.wave.rings, p.runs, posted.requests):
            waited = time.perf_counter()
            got = request.wait() if request is not None else []
            if self.probe is not None and not self.probe.cuda and request is not None:
                sends = run.sends(p.phase, r)
                self._probe_link(ring, sends[0] + sends[1] if ring.halo else sends, posted.at,
                                 waited)
            received = ring.received(like, got, routed, p.tensors.k.device)
            if r < run.steps(p.phase):
                run.receive(p.phase, r, received)

    def _probe_link(self, ring: Ring, sends: list, posted_s: float, waited_s: float) -> None:
        """A direct ring exchange for the probe: its tier, bytes and time (CPU)."""
        if ring.routed_send or ring.routed_recv or ring.group.tier == Tier.LOCAL:
            return
        nbytes = sum(t.numel() * t.element_size() for t in sends)
        self.probe.link("intra" if ring.group.tier == Tier.INTRA else "inter", nbytes,
                        posted_s, time.perf_counter() - waited_s)


class _EngineFunction(torch.autograd.Function):
    """Autograd of ``AttentionEngine.forward``: both phases run the engine's rounds."""

    @staticmethod
    def forward(ctx, q, k, v, sink, engine, scale, window):
        with plain_ops():
            out, lse = engine.run(Phase.FORWARD, q.detach(), k.detach(), v.detach(),
                                  scale=scale, window=window)
            if sink is not None:  # the backward runs with the sink's out and lse
                out, lse = with_sink(out, lse, sink.detach())
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.engine, ctx.scale, ctx.window = engine, scale, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        with plain_ops():
            dq, dk, dv = ctx.engine.run(Phase.BACKWARD, q, k, v, out, lse, dout.contiguous(),
                                        scale=ctx.scale, window=ctx.window)
            dsink = sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[3] else None
        # one entry per forward input: q, k, v, sink, engine, scale, window
        return dq, dk, dv, dsink, None, None, None
