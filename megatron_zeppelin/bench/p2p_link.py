"""Point-to-point link measurement between 2 gloo processes on this host (``zeppelin calibrate``
on CPU): ping-pong one-way times per message size, fitted as ``t = latency + bytes / bandwidth``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_zeppelin.bench.workers import run_forked

DEFAULT_P2P_BYTES = tuple(1 << p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB


@dataclass(frozen=True)
class P2PSample:
    """Ping-pong one-way times (seconds) per message size (bytes) and the fitted link."""

    nbytes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    gbyte_per_s: float
    latency_us: float


def _p2p_worker(rank: int, sizes: tuple[int, ...], repeats: int) -> tuple[float, ...] | None:
    """Gloo rank ``rank`` of 2: ping-pong every size ``repeats`` times; rank 0 returns the
    one-way seconds per size."""
    import torch.distributed as dist

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
    return tuple(times) if rank == 0 else None


def measure_p2p(sizes: tuple[int, ...] = DEFAULT_P2P_BYTES, repeats: int = 5) -> P2PSample:
    """One-way gloo send/recv time between 2 processes on this host; fitted bandwidth/latency."""
    times = run_forked(_p2p_worker, 2, (sizes, repeats), timeout_s=300.0,
                       what="P2P measurement", gloo_timeout_s=120.0)[0]
    latency, per_byte = fit_line([float(n) for n in sizes], list(times))
    return P2PSample(tuple(sizes), times, 1e-9 / per_byte, max(0.0, latency) * 1e6)


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
