"""How much slower compute runs when the emulated cluster's ranks share this machine's cores.

The simulator's profile measures every compute term alone, as one thread's least CPU time
(``calibrate_sim``), and multiplies them by ``compute_scale``. Assuming that scale is ranks /
cores misses what sharing costs beyond the cores' count (caches, memory bandwidth, the
scheduler, a typical run against the fastest one). Here it is measured: a layer's compute (its
GEMMs and its non-GEMM kernels, forward and backward, the model's shape) timed alone in this
process as ``calibrate_sim`` times it, then by ``ranks`` forked processes at once, each the
median wall time of its runs; the scale is the median over ranks of that median over the time
alone (at least 1), and with the simulator's own sharing (``shared_cores``) over the fair share
of the cores. ``measure_one_rank``: the same work in one forked process with nothing beside it
(what a rank computing alone takes; stated in the profile's source).
"""
from __future__ import annotations

import statistics
import time

import torch

from megatron_zeppelin.bench.workers import run_forked
from megatron_zeppelin.config import ModelSpec

WORK_TOKENS = 1024  # tokens of the layer's compute timed (the CPU cluster's micro-batch scale)


def layer_work(model: ModelSpec):
    """A no-argument callable running one layer's compute on ``WORK_TOKENS`` tokens: the GEMMs
    of ``calibrate.model_gemms`` and ``calibrate_sim.nongemm_layer`` (fresh inputs per call
    are made outside it: the inputs are re-used, their gradients accumulate)."""
    from megatron_zeppelin.bench.calibrate import model_gemms
    from megatron_zeppelin.bench.calibrate_sim import layer_inputs, nongemm_layer

    gemms = [(torch.randn(m, k), torch.randn(k, n))
             for m, k, n in model_gemms(model, WORK_TOKENS)]
    inputs = layer_inputs(model, WORK_TOKENS)

    def run() -> None:
        for a, b in gemms:
            a @ b
        nongemm_layer(inputs)
    return run


def _worker(rank: int, model: ModelSpec, runs: int) -> float:
    """One emulated rank: the median wall seconds of ``runs`` runs, started together (a gloo
    barrier after the warm-up)."""
    import torch.distributed as dist

    work = layer_work(model)
    work()  # warm-up
    dist.barrier()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute_scale(model: ModelSpec, ranks: int, alone_s: float, runs: int = 20,
                          cores: float = 0.0) -> tuple[float, list[float]]:
    """(scale, per-rank median seconds): ``ranks`` processes run ``layer_work`` at once;
    ``alone_s``: its least CPU time in one thread with nothing beside it. ``cores`` > 0: the
    simulator shares them itself (``SimProfile.shared_cores``), so the scale is what remains
    beyond the fair share ``max(1, ranks / cores)``."""
    shared = run_forked(_worker, ranks, (model, runs), timeout_s=300.0, gloo_timeout_s=120.0,
                        what="compute-sharing measurement")
    fair = max(1.0, ranks / cores) if cores > 0 else 1.0
    return max(1.0, statistics.median(shared) / alone_s / fair), shared


def measure_one_rank(model: ModelSpec, runs: int = 20) -> float:
    """Median wall seconds of ``layer_work`` in one forked process, nothing beside it."""
    return run_forked(_worker, 1, (model, runs), timeout_s=300.0, gloo_timeout_s=120.0,
                      what="one-rank compute measurement")[0]
