"""``zeppelin calibrate``: measure this machine and write a hardware profile + a cluster YAML.

Measured (the simulator's inputs, ``HardwareProfile`` fields):

* causal attention forward and backward time vs length (128..8K tokens) with torch SDPA (on CPU
  it dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, the kernel the
  attention engine's torch backend calls) -> ``attention_tflops`` per length (forward FLOPs
  2*heads*head_dim*s^2, the cost model's count) and ``attention_bwd_ratio``;
* GEMM throughput (square matmuls) -> ``gemm_tflops``;
* the time of a tiny attention call -> ``kernel_overhead_us``;
* point-to-point bandwidth and latency between 2 gloo processes on this host (ping-pong, least
  squares t = latency + bytes / bandwidth) -> ``p2p_gbyte_per_s`` / ``p2p_latency_us``.

Every point is the fastest of its runs (robust to other processes sharing the cores).

On CPU, compute is measured in ``concurrency`` processes at once with ``threads`` threads each,
the way the emulated ranks of ``cpu-2x2`` (4 gloo ranks of 1 thread) share the machine's cores;
the per-process medians are the profile. The cluster YAML emulates nodes of 2 "GPUs" with one
"NIC", both links at the measured gloo bandwidth and latency.
"""
from __future__ import annotations

import datetime
import math
import multiprocessing
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from megatron_zeppelin.config import ClusterSpec, HardwareProfile

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_P2P_BYTES = tuple(1 << p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB


@dataclass(frozen=True)
class CalibrateOptions:
    """What to measure. heads/head_dim: the attention shape (the fidelity check uses the same);
    concurrency: CPU processes measuring at once (in step: each point ``max_repeats`` runs);
    threads: torch threads per process; min_time_s: alone, measure each point for at least
    this long (at most ``max_repeats`` runs)."""

    device: str = "cpu"
    heads: int = 4
    head_dim: int = 64
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    gemm_size: int = 1024
    concurrency: int = 4
    threads: int = 1
    min_time_s: float = 0.3
    max_repeats: int = 3
    p2p_bytes: tuple[int, ...] = DEFAULT_P2P_BYTES

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is invalid: expected 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False")
        for key in ("heads", "head_dim", "gemm_size", "concurrency", "threads", "max_repeats"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} is invalid: expected an integer >= 1")
        if not self.lengths or min(self.lengths) < 16:
            raise ValueError(f"lengths={self.lengths!r} are invalid: expected lengths >= 16")


@dataclass(frozen=True)
class ComputeSample:
    """Per length: seconds of one causal attention forward and backward call."""

    lengths: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    gemm_tflops: float
    overhead_s: float


@dataclass(frozen=True)
class P2PSample:
    """Ping-pong one-way times (seconds) per message size (bytes) and the fitted link."""

    nbytes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    gbyte_per_s: float
    latency_us: float


def _sync(device: str) -> None:
    """Wait for queued CUDA work (timing)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, opts: CalibrateOptions, setup=None) -> float:
    """Fastest seconds of ``fn(state)`` after one warm-up, over runs lasting >= min_time_s
    (the minimum is robust to other processes taking the cores for a while); ``setup()``
    makes each run's state outside the timed region (None: no state)."""
    def once() -> float:
        state = setup() if setup else None
        _sync(opts.device)
        start = time.perf_counter()
        fn(state)
        _sync(opts.device)
        return time.perf_counter() - start

    once()
    times: list[float] = []
    while len(times) < opts.max_repeats and (len(times) < 2 or sum(times) < opts.min_time_s):
        times.append(once())
    return min(times)


def time_attention(length: int, opts: CalibrateOptions) -> tuple[float, float]:
    """(forward, backward) seconds of one causal SDPA call on ``length`` tokens, each timed
    on its own (the backward after an untimed forward)."""
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    shape = (1, opts.heads, length, opts.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=opts.device, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, dtype=dtype, device=opts.device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fwd = _timed(lambda _: sdpa(q, k, v, is_causal=True), opts)
    bwd = _timed(lambda out: out.backward(grad), opts,
                 setup=lambda: sdpa(q, k, v, is_causal=True))
    return fwd, bwd


def time_gemm(opts: CalibrateOptions) -> float:
    """Achieved TFLOP/s of an n x n x n matmul (fp32 on CPU, bf16 on CUDA)."""
    n = opts.gemm_size
    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=opts.device)
    b = torch.randn(n, n, dtype=dtype, device=opts.device)
    return 2.0 * n ** 3 / _timed(lambda _: a @ b, opts) / 1e12


def measure_compute(opts: CalibrateOptions, barrier=None) -> ComputeSample:
    """Attention, GEMM and launch overhead in this process. With ``barrier`` (concurrent
    workers) every point starts together and runs exactly ``max_repeats`` times, so the
    workers contend for the cores alike."""
    torch.set_num_threads(opts.threads)
    if barrier is not None:
        opts = replace(opts, min_time_s=float("inf"))
    fwd, bwd = [], []
    for length in opts.lengths:
        if barrier is not None:
            barrier.wait()
        f, b = time_attention(length, opts)
        fwd.append(f)
        bwd.append(b)
    overhead = time_attention(16, replace(opts, min_time_s=0.05))[0]
    if barrier is not None:
        barrier.wait()
    return ComputeSample(tuple(opts.lengths), tuple(fwd), tuple(bwd), time_gemm(opts), overhead)


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


def _compute_worker(opts: CalibrateOptions, barrier, queue) -> None:
    """Process body: measure in step with the other workers; report through ``queue``."""
    queue.put(measure_compute(opts, barrier))


def measure_compute_concurrent(opts: CalibrateOptions) -> ComputeSample:
    """``measure_compute`` in ``concurrency`` forked processes at once (CPU), medians of them."""
    if opts.device == "cuda" or opts.concurrency == 1:
        return measure_compute(opts)
    ctx = multiprocessing.get_context("fork")
    queue, barrier = ctx.Queue(), ctx.Barrier(opts.concurrency)
    procs = [ctx.Process(target=_compute_worker, args=(opts, barrier, queue))
             for _ in range(opts.concurrency)]
    for p in procs:
        p.start()
    samples = collect(queue, procs, len(procs), 600.0, "calibration worker")
    med = statistics.median
    points = range(len(opts.lengths))
    return ComputeSample(samples[0].lengths,
                         tuple(med([s.fwd_s[i] for s in samples]) for i in points),
                         tuple(med([s.bwd_s[i] for s in samples]) for i in points),
                         med([s.gemm_tflops for s in samples]),
                         med([s.overhead_s for s in samples]))


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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, sizes, repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    times = collect(queue, procs, 1, 300.0, "P2P measurement")[0]
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


def running_max(values: list[float]) -> list[float]:
    """Each value raised to the largest one before it (index order)."""
    out, best = [], float("-inf")
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


def build_profile(name: str, sample: ComputeSample, p2p: P2PSample | None,
                  opts: CalibrateOptions) -> HardwareProfile:
    """The hardware profile of the measurements (TFLOP/s, ratio, microseconds, GB/s).

    The kernel's throughput does not fall with the length (longer calls amortise more), so a
    point below a shorter one was slowed by other jobs: forward and backward throughputs are
    each raised to their running maximum over lengths before the table and the backward
    ratio (median over lengths >= 1K) are taken.
    """
    flops = [2.0 * opts.heads * opts.head_dim * n * n for n in sample.lengths]
    fwd = running_max([f / t for f, t in zip(flops, sample.fwd_s)])
    bwd = running_max([f / t for f, t in zip(flops, sample.bwd_s)])
    table = tuple((n, round(f / 1e12, 6)) for n, f in zip(sample.lengths, fwd))
    ratios = [f / b for n, f, b in zip(sample.lengths, fwd, bwd) if n >= 1024] or \
        [f / b for f, b in zip(fwd, bwd)]
    where = torch.cuda.get_device_name() if opts.device == "cuda" else platform.processor() \
        or platform.machine()
    source = (f"zeppelin calibrate on {platform.node()} ({where}, {os.cpu_count()} cores), "
              f"torch {torch.__version__}, {datetime.date.today().isoformat()}: SDPA causal "
              f"heads={opts.heads} head_dim={opts.head_dim}, {opts.concurrency} process(es) x "
              f"{opts.threads} thread(s), fastest runs, running max over lengths; GEMM "
              f"{opts.gemm_size}^3; gloo ping-pong P2P")
    return HardwareProfile(
        name=name, gemm_tflops=round(sample.gemm_tflops, 6), attention_tflops=table,
        attention_bwd_ratio=round(statistics.median(ratios), 3),
        kernel_overhead_us=round(sample.overhead_s * 1e6, 1),
        p2p_gbyte_per_s=round(p2p.gbyte_per_s, 4) if p2p else None,
        p2p_latency_us=round(p2p.latency_us, 1) if p2p else None, source=source)


def build_cluster(name: str, hardware: str, p2p: P2PSample, gpus_per_node: int = 2,
                  nodes: int = 2) -> ClusterSpec:
    """Emulated CPU nodes: ``gpus_per_node`` ranks and one NIC each, links at the gloo P2P."""
    return ClusterSpec(name=name, gpus_per_node=gpus_per_node, nics_per_node=1,
                       nvlink_gbyte_per_s=round(p2p.gbyte_per_s, 4),
                       nvlink_latency_us=round(p2p.latency_us, 1),
                       nic_gbit_per_s=round(p2p.gbyte_per_s * 8, 4),
                       nic_latency_us=round(p2p.latency_us, 1), nodes=nodes,
                       gpu_memory_gib=round(_memory_gib() / (gpus_per_node * nodes), 1),
                       hardware=hardware)


def _memory_gib() -> float:
    """Physical memory of this machine (GiB)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 8.0


def write_yaml(obj, path: str | Path, comment: str) -> Path:
    """A profile or cluster as YAML (the loaders' keys), with a comment header."""
    data = {}
    for key, value in obj.__dict__.items():
        if value is None:
            continue
        if key == "attention_tflops":
            value = {int(n): float(t) for n, t in value}
        elif isinstance(value, tuple):
            value = list(value)
        data[key] = value
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=100))
    return path


@dataclass(frozen=True)
class Calibration:
    profile: HardwareProfile
    cluster: ClusterSpec | None
    compute: ComputeSample
    p2p: P2PSample | None
    seconds: float


def calibrate(opts: CalibrateOptions, name: str = "cpu", cluster_name: str = "cpu-2x2",
              measure_links: bool = True) -> Calibration:
    """Measure compute (and gloo P2P on CPU); return the profile and the emulated cluster."""
    started = time.perf_counter()
    compute = measure_compute_concurrent(opts)
    p2p = measure_p2p(opts.p2p_bytes) if measure_links else None
    profile = build_profile(name, compute, p2p, opts)
    cluster = build_cluster(cluster_name, name, p2p) if p2p and opts.device == "cpu" else None
    return Calibration(profile, cluster, compute, p2p, time.perf_counter() - started)


def format_calibration(cal: Calibration) -> str:
    """A short report of what was measured."""
    lines = [f"calibrated in {cal.seconds:.1f} s: GEMM {cal.profile.gemm_tflops * 1e3:.1f} "
             f"GFLOP/s, kernel overhead {cal.profile.kernel_overhead_us:.0f} us, attention "
             f"bwd/fwd {cal.profile.attention_bwd_ratio:.2f}",
             f"{'length':>8} {'fwd ms':>10} {'bwd ms':>10} {'profile GFLOP/s':>16}"]
    for (length, tflops), f, b in zip(cal.profile.attention_tflops, cal.compute.fwd_s,
                                      cal.compute.bwd_s):
        lines.append(f"{length:>8} {f * 1e3:>10.2f} {b * 1e3:>10.2f} {tflops * 1e3:>16.1f}")
    if cal.p2p:
        lines.append(f"gloo P2P: {cal.p2p.gbyte_per_s:.2f} GB/s, latency "
                     f"{cal.p2p.latency_us:.0f} us (sizes {min(cal.p2p.nbytes)}.."
                     f"{max(cal.p2p.nbytes)} B)")
    return "\n".join(lines)


def check_finite(cal: Calibration) -> None:
    """Raise if a measurement is not a positive finite number (a broken timer or a crash)."""
    values = [cal.profile.gemm_tflops, *(t for _, t in cal.profile.attention_tflops)]
    if any(not (math.isfinite(v) and v > 0) for v in values):
        raise RuntimeError(f"calibration produced a non-positive or non-finite value: {values}")


# ----------------------------------------------------------------------------- command line

def cmd_calibrate(args) -> int:
    """Measure this machine and write the profile (and, on CPU, the emulated cluster)."""
    opts = CalibrateOptions(device=args.device, heads=args.heads, head_dim=args.head_dim,
                            concurrency=args.concurrency if args.device == "cpu" else 1,
                            threads=args.threads, min_time_s=args.min_time)
    cal = calibrate(opts, name=args.name, measure_links=args.device == "cpu")
    check_finite(cal)
    print(format_calibration(cal))
    path = write_yaml(cal.profile, args.hardware_out, f"Measured by `zeppelin calibrate` "
                      f"(megatron_zeppelin/bench/calibrate.py).\n{cal.profile.source}")
    print(f"wrote {path}")
    if cal.cluster is not None:
        path = write_yaml(cal.cluster, args.cluster_out, "Emulated CPU cluster: 2 nodes x 2 "
                          "gloo ranks, 1 'NIC' per node; links at the measured gloo P2P "
                          "bandwidth/latency (written by `zeppelin calibrate`).")
        print(f"wrote {path}")
    return 0


def calibrate_defaults():
    """The arguments of a plain ``zeppelin calibrate`` (for scripts)."""
    import argparse

    parser = argparse.ArgumentParser()
    _add_calibrate_args(parser)
    return parser.parse_args([])


def _add_calibrate_args(c) -> None:
    """Flags of ``zeppelin calibrate``."""
    from megatron_zeppelin.config import configs_dir

    c.add_argument("--device", default="cpu", help="cpu | cuda")
    c.add_argument("--name", default="cpu", help="profile name")
    c.add_argument("--heads", type=int, default=4)
    c.add_argument("--head-dim", type=int, default=64)
    c.add_argument("--concurrency", type=int, default=4,
                   help="CPU: processes measuring at once (the emulated ranks sharing the cores)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per process")
    c.add_argument("--min-time", type=float, default=0.3, help="seconds per measured point")
    c.add_argument("--hardware-out", default=str(configs_dir() / "hardware" / "cpu.yaml"),
                   help="where to write the hardware profile")
    c.add_argument("--cluster-out", default=str(configs_dir() / "clusters" / "cpu-2x2.yaml"),
                   help="where to write the emulated CPU cluster (CPU only)")


def register(sub) -> None:
    """Add ``calibrate`` to the ``zeppelin`` command."""
    c = sub.add_parser("calibrate", help="measure this machine; write hardware/cluster YAMLs")
    _add_calibrate_args(c)
    c.set_defaults(func=cmd_calibrate)
