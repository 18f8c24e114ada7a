"""Per-micro-batch measurements for the online profile fit (``fit.py``), and the agreement of
the fitted coefficients over ranks.

``Probe`` times what the estimate predicts while the engine runs (``AttentionEngine.probe``):
each attention kernel call (LOCAL calls and ring steps: phase, query chunk length, forward
FLOPs, tier), each ring exchange's host wait (exposed communication) and, when the ring
waited, its transfer (tier, bytes, seconds post -> completion), the engine's host work per
ring step (host round time minus the kernel calls and waits timed on the host), per
micro-batch the ring rounds' host work and waits together with their count, each remap
all-to-all (``RemapIndex.probe``), and the micro-batch's linear time (``linear``: its span
less the engine's and the remap's). On CPU every span is timed twice around synchronous work:
``time.perf_counter`` (wall: what waits, exchanges and ring rounds record) and the rank's own
CPU seconds (its work: what kernel calls and the linear remainder record). Ranks that share
cores compute at a speed that depends on how many of them compute at that moment (a rank whose
peers wait runs up to ``shared_by`` times faster), so a wall time is not a rate of the
hardware: the CPU seconds are, and the fit turns them into the profile's per-rank seconds
while all ranks compute (``fit.summarize``). The work clock is this thread's CPU time when
torch computes on one intra-op thread (the training ranks: torchrun's default), else the
process's. On CUDA a span is two events recorded on the current stream; they are read
one micro-batch later (``take`` queries them: an event not yet done stays queued), so the
probe adds no host synchronisation; ring exchanges are not timed there (the transfer runs on
NCCL's stream), so links come from ``ping_links`` at each refit only.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin import fit
from megatron_zeppelin.cost_model import window_work
from megatron_zeppelin.runtime.kernels.base import make_pieces
from megatron_zeppelin.runtime.transport import collective_device


class Probe:
    """One rank's measurements since the last ``take`` (module doc)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.data = fit.Measurements()
        self._queued: list[tuple[object, object, tuple]] = []  # CUDA: (start, end, record)
        self.busy_s = 0.0  # host seconds inside timed kernel calls and waits (CPU)
        self.engine_s = 0.0  # engine work this micro-batch (linear is the remainder)
        self.rounds = [0.0, 0]  # this micro-batch's ring rounds: host work + waits, count
        self._work_clock = time.thread_time if torch.get_num_threads() == 1 else \
            time.process_time  # CPU: the rank's own compute seconds (module doc)

    def start(self):
        """A span's start: (perf_counter, work clock) on CPU, an event recorded on the current
        stream on CUDA."""
        if not self.cuda:
            return time.perf_counter(), self._work_clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started, record: tuple) -> None:
        """End the span begun at ``started``; ``record``: ("attention", phase, length,
        squares, tier), ("engine",) (a whole engine phase), ("remap", bytes sent) or
        ("linear", tokens) (a micro-batch: its time less the engine's and the remap's; it takes
        the micro-batch's ring rounds, timed on the host, with it: on CUDA its span is read a
        micro-batch later)."""
        if record[0] == "linear":
            record, self.rounds = (*record, tuple(self.rounds)), [0.0, 0]
        if not self.cuda:
            seconds = time.perf_counter() - started[0]
            if record[0] == "attention":
                self.busy_s += seconds
            self._add(record, seconds, self._work_clock() - started[1])
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._queued.append((started, end, record))

    def attention(self, started, phase: str, lengths: Sequence[float], tier: str,
                  whole: Sequence[float] | None = None) -> None:
        """End a kernel call over query chunks of ``lengths`` tokens (each causal, its own
        keys) of ``tier``: length = sum of squares over sum, FLOPs per unit head (scaled in
        ``_add``). With the call's sliding window (``window``) the FLOPs count each square
        times the share of its sequence's pairs the window keeps (``cost_model.window_work``
        of the sequence's ``whole`` length; default: the chunk is the sequence), as the
        estimate prices it; the length stays the chunks' (the estimate's rate lookup)."""
        whole = lengths if whole is None else whole
        share = 0.0 if self.window is None else 1.0
        squares = sum(n * n for n in lengths)
        work = sum(n * n * window_work(w, self.window or 0, share)
                   for n, w in zip(lengths, whole))
        self.stop(started, ("attention", phase, squares / max(1.0, sum(lengths)), work, tier))

    def link(self, tier: str, nbytes: float, posted_s: float, waited_s: float) -> None:
        """A ring exchange (CPU): posted at ``posted_s`` (perf_counter), completed now after a
        host wait of ``waited_s`` (exposed); a transfer time only when the ring waited."""
        self.busy_s += waited_s
        self.rounds[0] += waited_s
        self.data.exposed.append((tier, waited_s))
        if waited_s > 0.0 and nbytes > 0:
            self.data.link.append((tier, float(nbytes), time.perf_counter() - posted_s))

    def ring_round(self, started_s: float, busy_before: float) -> None:
        """End of a ring round begun at host time ``started_s``: its host work."""
        host = max(0.0, time.perf_counter() - started_s - (self.busy_s - busy_before))
        self.data.ring_host.append(host)
        self.rounds[0] += host
        self.rounds[1] += 1

    def _add(self, record: tuple, seconds: float, work: float | None = None) -> None:
        """One span: ``seconds`` of wall (CUDA: device) time, ``work`` the rank's own compute
        in it (CPU; None: the device time is the work)."""
        work = seconds if work is None else work
        if record[0] == "attention":
            _, phase, length, squares, tier = record
            self.data.attention.append((phase, length, self.flops_per_square * squares,
                                        work, tier))
        elif record[0] == "engine":
            self.engine_s += work
        elif record[0] == "remap":
            self.engine_s += work
            self.data.remap.append((record[1], seconds))
        else:
            self.data.linear.append((record[1], max(0.0, work - self.engine_s)))
            self.engine_s = 0.0
            total, count = record[2]  # the micro-batch's ring rounds: their total, their count
            if count:
                self.data.ring_rounds.append((total, count))

    flops_per_square = 0.0  # heads x (q head dim + v head dim) of this rank's calls (engine)
    window: int | None = None  # the sliding window of the engine's current calls
    _like: tuple = ()  # (kernel, heads, kv heads, head dim, value head dim, dtype, device, scale)

    def calls_like(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> None:
        """The engine's calls (kernel backend, tensor shapes, softmax scale): what
        ``ping_attention`` times."""
        self._like = (kernel, q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype,
                      q.device, scale)

    def ping_attention(self, lengths: Sequence[int]) -> list[tuple]:
        """Active samples of the attention kernel, taken at a refit where a length of the
        profile's table had no call (``fit.unmeasured_lengths``): a plan that never attends
        at some length (a wrong profile rating it slow) would otherwise never correct it. Per
        length, ``PING_REPEATS`` forward calls of one causal sequence of that many tokens with
        the engine's kernel, shapes and scale (random data; one untimed call first), timed as
        the engine's calls are (CPU: the rank's work; CUDA: events, synchronised: a refit
        blocks anyway). Returns ``fit.Measurements.attention`` records (tier ``local``);
        nothing before the engine's first call."""
        if not self._like or not lengths:
            return []
        kernel, heads, kv_heads, dim, v_dim, dtype, device, scale = self._like
        samples = []
        for n in lengths:
            q = torch.randn(n, heads, dim, dtype=dtype, device=device)
            k = torch.randn(n, kv_heads, dim, dtype=dtype, device=device)
            v = torch.randn(n, kv_heads, v_dim, dtype=dtype, device=device)
            pieces = make_pieces((0, n), (0, n), device)
            for repeat in range(PING_REPEATS + 1):
                start = self.start()
                kernel.forward(q, k, v, pieces, True, scale)
                if self.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3
                else:
                    seconds = self._work_clock() - start[1]
                if repeat:
                    samples.append(("forward", float(n), self.flops_per_square * n * n,
                                    seconds, "local"))
        return samples

    def take(self) -> fit.Measurements:
        """What completed since the last call (CUDA: the spans whose events are done by now,
        in the order they were recorded: a micro-batch's engine spans before its linear one,
        which subtracts them; none waited)."""
        done = 0
        for started, end, record in self._queued:
            if not end.query():
                break
            self._add(record, started.elapsed_time(end) / 1e3)
            done += 1
        del self._queued[:done]
        out, self.data = self.data, fit.Measurements()
        return out


PING_BYTES = (1 << 14, 1 << 18, 1 << 21)  # the active link samples' message sizes
PING_REPEATS = 3


def _partner(index: int, count: int) -> int | None:
    """Pairs (0, 1), (2, 3), ... of ``count``; None for the last of an odd count."""
    other = index + 1 if index % 2 == 0 else index - 1
    return other if other < count else None


def ping_links(group: dist.ProcessGroup, gpus_per_node: int) -> list[tuple[str, float, float]]:
    """Active link samples, taken at a refit (every rank of ``group`` calls it): each rank
    ping-pongs ``PING_BYTES`` messages with a partner in its node (``intra``) and one in a
    paired node (``inter``), so that a link no plan uses (believed too slow) is measured
    too. Returns (tier, bytes, one-way seconds) samples; blocking (on CUDA: synchronised),
    which is why it runs only at a refit. Layout: pool ranks node-major, ``gpus_per_node``
    per node."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    node, local = divmod(rank, gpus_per_node)
    partners = {"intra": _partner(local, gpus_per_node)}
    other_node = _partner(node, world // gpus_per_node)
    partners["inter"] = None if other_node is None else other_node * gpus_per_node + local
    partners["intra"] = None if partners["intra"] is None else node * gpus_per_node + \
        partners["intra"]
    device = collective_device(group)
    cuda = device.type == "cuda"
    samples = []
    for tier, peer in partners.items():
        if peer is None:
            continue
        peer_global = dist.get_global_rank(group, peer)
        for nbytes in PING_BYTES:
            buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            for _ in range(PING_REPEATS + 1):  # the first round warms the pair up
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                first, second = (dist.send, dist.recv) if rank < peer else (dist.recv, dist.send)
                first(buf, peer_global, group=group)
                second(buf, peer_global, group=group)
                if cuda:
                    torch.cuda.synchronize()
                samples.append((tier, float(nbytes), (time.perf_counter() - started) / 2))
            del samples[-PING_REPEATS - 1]
    return samples


def agree(summary: Sequence[float], group: dist.ProcessGroup) -> list[float]:
    """Every rank's ``fit.summarize`` vector -> the combined coefficients, computed on the
    group's first rank and broadcast from it: every rank returns the same doubles. A
    collective over ``group`` (bounded by its timeout); float64 on the host (gloo) or on the
    current CUDA device (NCCL)."""
    device = collective_device(group)
    mine = torch.tensor(list(summary), dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    first = dist.get_global_rank(group, 0)
    out = torch.tensor(fit.combine([t.tolist() for t in every]), dtype=torch.float64,
                       device=device) if dist.get_rank() == first else torch.empty_like(mine)
    dist.broadcast(out, src=first, group=group)
    return out.tolist()
