"""The attention engine of one rank: every ring group of a plan, three queues, overlapped.

``AttentionEngine(plan, rank, group).forward(q, k, v)`` computes causal self-attention of the
rank's attention buffer (``Plan.attention[rank]`` order; q ``[tokens, heads, head_dim]``, k/v
``[tokens, kv_heads, head_dim]``), with autograd, exactly as if every sequence ran alone.

Queues and overlap. The rank's groups of a wave run in global order (``Plan.rank_groups``):
INTER rings, then INTRA rings, then LOCAL sequences. A wave runs in rounds ``r = 0, 1, ...``:

1. post the round's exchanges, in global group order: every INTER and INTRA ring's step-``r``
   P2P (``RingComm``, async) and, with ``inter_mode`` ``direct``/``routed``, the wave's global
   inter-node step ``r`` on the worker thread (``inter.InterQueue``);
2. compute step ``r`` of every ring (INTER first, then INTRA);
3. fill the wait with LOCAL work: while some exchange of the round is still in flight, run the
   next LOCAL call (``local_calls``: LOCAL sequences, shortest first, short ones batched into
   calls of at least the work of one ``local_call_tokens``-token sequence); on CUDA at most one
   LOCAL call is queued on the stream ahead of the host. (In a wave where the rank has no
   traffic at all, its LOCAL sequences are one fused call: there is no wait to fill.)
4. wait for the exchanges (at most the timeout) and hand the received blocks to the rings.

The LOCAL calls left after the last round run back to back. So each ring's traffic flies while
the later queues (and the other rings) compute, and a ring step waits for at most one LOCAL
call once its data has arrived. Shortest first: a call started just before the exchanges
complete delays the next ring step by its own length, so the short calls fill the waits and
the long sequences that fit no wait run at the end, where they stall no ring. Backward runs the
same rounds with the backward rings (KV forward, dKV back to the owner) and the LOCAL
gradients. Waves run one after another.

Polling. While LOCAL work is left, a round's ring requests are waited on a helper thread from
the post on (``P2PRequest.wait``: gloo works complete only inside it; with CUDA, on a side
stream that the compute stream joins afterwards); the round is in flight until that wait and
the global inter-node step (a future) are done. A failed peer makes the helper's wait time out
with the error naming the ring, the step and the peer, raised by the rank at step 4.

Exactness does not depend on timing: which round runs a LOCAL call varies with the traffic, but
the calls themselves (their sequences and order) are fixed by the plan, each LOCAL sequence is
attended alone, and every call writes its own rows of the output (forward) or of dq, dk, dv
(backward), disjoint from each other and from the rings' rows.

Deadlock freedom. Each exchange is a set of P2P ops between ring neighbours of one group,
tagged with the group's global index. Every rank posts its exchanges in one global total order,
``(phase, wave, round, group key)``, the same order on every rank, and a rank waits for its
round-``r`` exchanges before it posts round ``r+1``; between a post and its wait it only
computes (ring steps and LOCAL calls: finite work, no communication, and a helper thread that
only waits for ops already posted). Take the smallest exchange in that order that has not
completed: every member of its group has completed all smaller exchanges (by minimality), so
each member gets past its earlier waits, computes finitely long and posts it; its ops then
match (same peers, same tag, same sizes: both sides derive them from the plan) and it
completes. So every exchange completes: no deadlock, also on NCCL, where the P2P of one
communicator runs in issue order. Global inter-node steps run on ``route_group`` in the same
(wave, round) order on every rank of the pool (all of them take part, with or without
inter-node rings), waited within the same round, so the argument holds for them as well.
With NCCL, the first ``run`` issues a barrier on each NCCL group (a collective must precede a
communicator's first P2P batch), so every rank must make its first call together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.plan import Plan, RingGroup, Tier, local_call_groups
from megatron_zeppelin.router import RouterTopology
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.attention import RingGroupRun, ZigzagLayout, accum_dtype
from megatron_zeppelin.runtime.inter import InterQueue
from megatron_zeppelin.runtime.utils import P2PRequest, RingComm

INTER_MODES = ("ring", "direct", "routed")
WORKS = ("all", "compute", "comm")
LOCAL_CALL_TOKENS = 2048  # sim/rounds.py's LOCAL_CALL_TOKENS twins this default
POLL_S = 50e-6  # CUDA: host sleep between polls while a LOCAL call runs


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


class LocalCall(NamedTuple):
    """One causal varlen call of LOCAL sequences.

    key: unique per engine (caches the rows per device); lengths: tokens of its sequences in
    call order; rows: their rows of the rank's buffer in that order (a slice when contiguous,
    else int64 indices on CPU); cu: ``(0, n_1, n_1 + n_2, ...)``; work: sum of s^2.
    """

    key: int
    lengths: tuple[int, ...]
    rows: slice | torch.Tensor
    cu: tuple[int, ...]
    work: int


@dataclasses.dataclass
class _Wave:
    rings: list[_Ring]
    local: list[LocalCall]  # in run order


def local_calls(lengths: Sequence[int], min_tokens: int) -> list[tuple[int, ...]]:
    """The LOCAL sequences (indices into ``lengths``) of each call, in run order
    (``plan.local_call_groups``: the rule the simulator models too)."""
    return local_call_groups([n * n for n in lengths], min_tokens)


def fill(queue: deque, in_flight: Callable[[], bool], run: Callable[[LocalCall], None],
         device: torch.device) -> int:
    """Run calls from the front of ``queue`` while ``in_flight()``; the number run.

    ``in_flight`` is asked before every call, so the wait that follows is delayed by at most
    one call after the round's exchanges complete. On CUDA the host waits (polling) until the
    call it queued has run or the exchanges are done before it queues the next one.
    """
    ran = 0
    while queue and in_flight():
        run(queue.popleft())
        ran += 1
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            while not done.query() and in_flight():
                time.sleep(POLL_S)
    return ran


def _wait_all(requests: list[P2PRequest | None], stream) -> list[list[torch.Tensor]]:
    """Helper thread: wait for a round's ring requests in order (CUDA: on ``stream``)."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return [request.wait() if request is not None else [] for request in requests]


class _Posted:
    """A posted round: per ring ``(request, recv_like)``, the global step's future, and the
    requests' wait on the helper thread (``watch``; None: waited inline by ``received``)."""

    def __init__(self, requests: list, inter: Future | None) -> None:
        self.requests, self.inter = requests, inter
        self.watch: Future | None = None
        self.stream = None  # CUDA: the side stream of the helper's waits

    def in_flight(self) -> bool:
        return any(f is not None and not f.done() for f in (self.watch, self.inter))

    def received(self) -> list[list[torch.Tensor]]:
        """Per ring, what its request received (raises the request's timeout error)."""
        if self.watch is None:
            return [request.wait() if request is not None else []
                    for request, _ in self.requests]
        got = self.watch.result()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return got


def _take(x: torch.Tensor, rows, dim: int = 0) -> torch.Tensor:
    """Rows ``rows`` (slice or int64 indices) of ``x`` along ``dim``."""
    if isinstance(rows, slice):
        return x[rows] if dim == 0 else x[:, rows]
    return x.index_select(dim, rows)


def _put(x: torch.Tensor, rows, value: torch.Tensor, dim: int = 0) -> None:
    """Write ``value`` into rows ``rows`` (slice or int64 indices) of ``x`` along ``dim``."""
    if isinstance(rows, slice):
        if dim == 0:
            x[rows] = value
        else:
            x[:, rows] = value
    else:
        x.index_copy_(dim, rows, value.to(x.dtype))


class AttentionEngine:
    """Causal attention of a plan's attention layout on one rank (see the module docstring).

    plan/rank: the plan and this rank (a rank of ``group``); group: the pool's process group
    (its ranks are the plan's ranks); backend: kernel backend (None: ``env``); timeout_s: the
    most a P2P wait may take (None: ``env.p2p_timeout_s()``); scale: softmax scale (None:
    head_dim ** -0.5); inter_mode: ``ring`` (inter-node rings use direct ring P2P like intra
    ones), ``direct`` or ``routed`` (global inter-node steps through ``inter.exchange`` on
    ``route_group``, a second process group over the same ranks; ``routed`` needs
    ``router_topology``); local_call_tokens: LOCAL sequences shorter than this are batched
    into calls of at least the work of one sequence of this length (``local_calls``); work:
    ``all``, or a measurement switch for overlap benchmarks: ``compute`` (no P2P: received
    blocks are zeros) or ``comm`` (no kernels); the results of both are wrong.
    """

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup, *,
                 backend: str | None = None, timeout_s: float | None = None,
                 scale: float | None = None, inter_mode: str = "ring",
                 route_group: dist.ProcessGroup | None = None,
                 router_topology: RouterTopology | None = None,
                 local_call_tokens: int = LOCAL_CALL_TOKENS, work: str = "all") -> None:
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
        if not (isinstance(local_call_tokens, int) and local_call_tokens >= 1):
            raise ValueError(f"local_call_tokens={local_call_tokens!r} is invalid: expected an "
                             "integer >= 1")
        self.plan, self.rank, self.group = plan, rank, group
        self.backend, self.scale, self.inter_mode, self.work = backend, scale, inter_mode, work
        self.local_call_tokens = local_call_tokens
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
        self._helper: ThreadPoolExecutor | None = None  # waits of rounds that LOCAL work fills
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._rows: dict[tuple[int, str], torch.Tensor] = {}  # (call key, device) -> rows

    def _build_waves(self) -> list[_Wave]:
        waves = [_Wave([], []) for _ in range(self.plan.num_waves)]
        index = {g.key: i for i, g in enumerate(self.plan.ring_groups)}
        offset, local = 0, []
        for group in self.plan.rank_groups[self.rank]:
            lengths = [self.plan.seqlens[s] for s in group.seqs]
            position = group.ring.index(self.rank)
            layout = ZigzagLayout(lengths, len(group.ring), position)
            start, offset = offset, offset + layout.tokens()
            if group.tier == Tier.LOCAL:
                local.append((group.wave, lengths, start))
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
        keys = itertools.count()
        for wave, lengths, start in local:
            quiet = not waves[wave].rings and not (self.inter and self.inter.num_steps(wave,
                                                                                   "forward"))
            waves[wave].local.extend(self._local_calls(lengths, start, quiet, keys))
        return waves

    def _local_calls(self, lengths: list[int], start: int, fused: bool,
                     keys: Iterator[int]) -> list[LocalCall]:
        """The calls of a LOCAL group whose buffer rows begin at ``start`` (run order):
        ``local_calls``, or one call of the whole group (``fused``: a wave in which this rank
        has no traffic, so no wait to fill); ``keys`` gives each call its key."""
        if not lengths:
            return []
        starts = list(itertools.accumulate(lengths, initial=start))
        groups = [tuple(range(len(lengths)))] if fused else local_calls(lengths,
                                                                         self.local_call_tokens)
        calls = []
        for seqs in groups:
            ranges = [(starts[i], starts[i + 1]) for i in seqs]
            if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
                rows = slice(ranges[0][0], ranges[-1][1])
            else:
                rows = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])
            sizes = tuple(lengths[i] for i in seqs)
            calls.append(LocalCall(next(keys), sizes, rows,
                                   tuple(itertools.accumulate(sizes, initial=0)),
                                   sum(n * n for n in sizes)))
        return calls

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
        """Stop the inter-node worker thread and the wait helper thread, if any."""
        if self.inter is not None:
            self.inter.close()
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

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
        """The wave's rounds (post, ring steps, LOCAL fill, wait), then the LOCAL rest."""
        steps = [run.forward_steps if phase == "forward" else run.backward_steps for run in runs]
        global_steps = self.inter.num_steps(wave_index, phase) if self.inter else 0
        device = tensors[0].device
        queue = deque(wave.local if self.work != "comm" else ())

        def run_local(call: LocalCall) -> None:
            self._local(phase, call, tensors, result, scale)

        for r in range(max(steps + [global_steps])):
            posted = self._post(phase, wave_index, wave, runs, r, global_steps, tensors[1])
            if queue:
                self._watch(posted, device)
            for run, n in zip(runs, steps):
                if r < n:
                    _calls(run, phase).compute(r)
            if queue:
                fill(queue, posted.in_flight, run_local, device)
            self._complete(phase, wave, runs, r, posted, device)
        while queue:
            run_local(queue.popleft())

    def _local(self, phase: str, call: LocalCall, tensors, result, scale) -> None:
        """One LOCAL call: its rows of the output and lse, or of dq, dk, dv."""
        rows = call.rows
        if not isinstance(rows, slice):
            device = tensors[0].device
            key = (call.key, str(device))
            if key not in self._rows:
                self._rows[key] = rows.to(device)
            rows = self._rows[key]
        q, k, v, out, lse, dout = tensors
        if phase == "forward":
            part_out, part_lse = kernels.block_forward(_take(q, rows), _take(k, rows),
                                                       _take(v, rows), call.cu, call.cu, True,
                                                       scale, self.backend)
            _put(result[0], rows, part_out)
            _put(result[1], rows, part_lse, dim=1)
        else:
            grads = kernels.block_backward(
                _take(dout, rows), _take(q, rows), _take(k, rows), _take(v, rows),
                _take(out, rows), _take(lse, rows, 1), call.cu, call.cu, True, scale,
                self.backend)
            for target, grad in zip(result, grads):
                _put(target, rows, grad)

    def _post(self, phase, wave_index, wave, runs, r, global_steps, k) -> _Posted:
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
        return _Posted(pending, future)

    def _watch(self, posted: _Posted, device: torch.device) -> None:
        """Wait for the round's ring requests on the helper thread, so that ``fill`` can poll."""
        requests = [request for request, _ in posted.requests]
        if all(request is None for request in requests):
            return
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="zeppelin-p2p-wait")
        if device.type == "cuda":
            if str(device) not in self._streams:
                self._streams[str(device)] = torch.cuda.Stream(device)
            posted.stream = self._streams[str(device)]
        posted.watch = self._helper.submit(_wait_all, requests, posted.stream)

    def _complete(self, phase, wave, runs, r, posted: _Posted, device) -> None:
        """Wait for round ``r``'s exchanges and hand each ring what it received."""
        routed = posted.inter.result() if posted.inter is not None else {}
        for ring, run, (_, like), received in zip(wave.rings, runs, posted.requests,
                                                  posted.received()):
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
