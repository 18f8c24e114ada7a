"""Point-to-point link measurement between 2 gloo processes on this host (``zeppelin calibrate``
on CPU): ping-pong one-way times per message size, fitted as ``t = latency + bytes / bandwidth``.
"""
from __future__ import annotations

import datetime
import multiprocessing
import time
from dataclasses import dataclass

import torch

DEFAULT_P2P_BYTES = tuple(1 << p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB


@dataclass(frozen=True)
class P2PSample:
    """Ping-pong one-way times (seconds) per message size (bytes) and the fitted link."""

    nbytes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    gbyte_per_s: float
    latency_us: float


def collect(queue, procs, count: int, timeout_s: float, what: str) -> list:
    """``count`` results from ``queue``, failing fast (RuntimeError naming the exit status) if
    a process dies first, or after ``timeout_s`` seconds; joins the processes."""
    import queue as queue_module

    results, deadline = [], time.monotonic() + timeout_s
    try:
        while len(results) < count:
            try:
                results.append(queue.get(timeout=1.0))
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: a process exited with status {dead} before "
                                       f"reporting" if dead else f"{what}: no result within "
                                       f"{timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def _p2p_worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int, queue) -> None:
    """Process body: ping-pong every size ``repeats`` times; rank 0 reports one-way seconds."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        times = []
        for nbytes in sizes:
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            runs = []
            for it in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if it:
                    runs.append((time.perf_counter() - start) / 2)
            times.append(min(runs))
        if rank == 0:
            queue.put(tuple(times))
    finally:
        dist.destroy_process_group()


def measure_p2p(sizes: tuple[int, ...] = DEFAULT_P2P_BYTES, repeats: int = 5) -> P2PSample:
    """One-way gloo send/recv time between 2 processes on this host; fitted bandwidth/latency."""
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, sizes, repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    times = collect(queue, procs, 1, 300.0, "P2P measurement")[0]
    latency, per_byte = fit_line([float(n) for n in sizes], list(times))
    return P2PSample(tuple(sizes), times, 1e-9 / per_byte, max(0.0, latency) * 1e6)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of forked/spawned gloo ranks)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x; raises if the slope is not positive."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    slope = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx
    if not slope > 0:
        raise RuntimeError(f"P2P times {y} do not grow with message size {x}: cannot fit a "
                           "bandwidth (is the machine overloaded?)")
    return my - slope * mx, slope
