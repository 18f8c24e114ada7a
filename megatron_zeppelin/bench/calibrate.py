"""``zeppelin calibrate``: measure what runs on this machine and write a hardware profile.

Measured (the simulator's and the planner's inputs, ``HardwareProfile`` fields):

* causal attention forward and backward time by document length through the engine's own
  block call (``kernels.select(backend)`` then ``backend.forward``/``backward`` on precomputed
  ``Pieces``, what a LOCAL call of the engine runs) with the selected backend -> the profile's
  ``kernel``, ``attention_tflops`` per length (forward FLOPs heads*(head_dim+v_head_dim)*s^2
  per document, the cost model's count) and ``attention_bwd_ratio`` (median over lengths >=
  1K). A call packs ``tokens_per_call // length`` documents of one length (at least one), as
  GPU-FACTS measured (64K tokens per call on CUDA); defaults: 128..128K tokens on CUDA (bf16),
  128..8K on CPU (fp32, one document per call);
* GEMM throughput -> ``gemm_tflops``: with ``--model``, the layer's own GEMMs (QKV, output
  projection, MLP in and out; forward, data and weight gradients) on ``gemm_tokens`` tokens;
  without, square ``gemm_size`` matmuls;
* one 64-token attention call -> ``kernel_overhead_us``;
* on CPU, point-to-point bandwidth and latency between 2 gloo processes (``p2p_link``) ->
  ``p2p_gbyte_per_s`` / ``p2p_latency_us`` and an emulated cluster YAML.

Every point is the fastest of its runs (robust to other processes sharing the cores). On CPU,
compute is measured in ``concurrency`` processes at once with ``threads`` threads each, the
way the emulated ranks of ``cpu-2x2`` (4 gloo ranks of 1 thread) share the machine's cores;
the per-process medians are the profile.

The profile goes to the path the user names (``--output``; default ``zeppelin-calibration/
<name>.yaml`` under the current folder), never into the shipped ``configs/`` and never over an
existing file without ``--force``.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace

import torch

from megatron_zeppelin.bench.p2p_link import DEFAULT_P2P_BYTES, P2PSample, fit_line, measure_p2p
from megatron_zeppelin.bench.workers import FORK, run_forked
from megatron_zeppelin.config import ClusterSpec, ModelSpec
from megatron_zeppelin.config_yaml import write_yaml
from megatron_zeppelin.hardware_profile import HardwareProfile

__all__ = ["CalibrateOptions", "ComputeSample", "P2PSample", "build_cluster", "build_profile",
           "calibrate", "fit_line", "measure_p2p", "time_attention", "time_gemm",
           "write_yaml"]

DEFAULT_LENGTHS = {"cpu": (128, 256, 512, 1024, 2048, 4096, 8192),
                   "cuda": tuple(1 << p for p in range(7, 18))}  # 128 .. 128K
DEFAULT_TOKENS_PER_CALL = {"cpu": 0, "cuda": 64 * 1024}  # 0: one document per call
OVERHEAD_TOKENS = 64


@dataclass(frozen=True)
class CalibrateOptions:
    """What to measure. backend: attention kernel backend (``auto``: what the engine picks);
    model: take heads, KV heads, head dims and GEMM shapes from it (else heads/kv_heads/
    head_dim/v_head_dim, None: head_dim, and square ``gemm_size`` GEMMs); lengths (None: the
    device's default) and tokens_per_call (None: the device's default; 0: one document per
    call); gemm_tokens: the
    token dimension of the model's GEMMs; concurrency: CPU processes measuring at once (in
    step: each point ``max_repeats`` runs); threads: torch threads per process; min_time_s:
    alone, measure each point for at least this long (at most ``max_repeats`` runs)."""

    device: str = "cpu"
    backend: str = "auto"
    model: ModelSpec | None = None
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int = 64
    v_head_dim: int | None = None
    lengths: tuple[int, ...] | None = None
    tokens_per_call: int | None = None
    gemm_size: int = 1024
    gemm_tokens: int = 4096
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
        if self.model is not None:
            object.__setattr__(self, "heads", self.model.num_attention_heads)
            object.__setattr__(self, "kv_heads", self.model.kv_heads)
            object.__setattr__(self, "head_dim", self.model.qk_dim)
            object.__setattr__(self, "v_head_dim", self.model.v_dim)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.lengths is None:
            object.__setattr__(self, "lengths", DEFAULT_LENGTHS[self.device])
        if self.tokens_per_call is None:
            object.__setattr__(self, "tokens_per_call", DEFAULT_TOKENS_PER_CALL[self.device])
        for key in ("heads", "kv_heads", "head_dim", "v_head_dim", "gemm_size", "gemm_tokens",
                    "concurrency", "threads", "max_repeats"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} is invalid: expected an integer >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} is invalid: expected a divisor of "
                             f"heads={self.heads}")
        if not self.lengths or min(self.lengths) < 16:
            raise ValueError(f"lengths={self.lengths!r} are invalid: expected lengths >= 16")
        if not isinstance(self.tokens_per_call, int) or self.tokens_per_call < 0:
            raise ValueError(f"tokens_per_call={self.tokens_per_call!r} is invalid: expected "
                             "an integer >= 0")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def documents(self, length: int) -> int:
        """Documents of ``length`` tokens packed into one measured call."""
        return max(1, self.tokens_per_call // length)


@dataclass(frozen=True)
class ComputeSample:
    """Per length: seconds of one causal attention forward and backward call (of
    ``opts.documents(length)`` documents); the GEMM throughput; one tiny call's seconds;
    the kernel the attention ran (``hardware_profile.ATTENTION_KERNELS``) and the backend's name."""

    lengths: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    gemm_tflops: float
    overhead_s: float
    kernel: str = "cpu"
    backend: str = "torch"


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


def attention_block(length: int, docs: int, opts: CalibrateOptions):
    """q, k, v, dout and the ``Pieces`` of a call of ``docs`` causal documents of ``length``
    tokens (built once, as the engine does per plan), and the backend that runs it."""
    from megatron_zeppelin.runtime import kernels

    gen = torch.Generator(device=opts.device).manual_seed(length)
    total = length * docs

    def rand(heads: int, dim: int) -> torch.Tensor:
        return torch.randn(total, heads, dim, generator=gen, device=opts.device,
                           dtype=opts.dtype)

    q, k = rand(opts.heads, opts.head_dim), rand(opts.kv_heads, opts.head_dim)
    v, dout = rand(opts.kv_heads, opts.v_head_dim), rand(opts.heads, opts.v_head_dim)
    cu = [length * i for i in range(docs + 1)]
    pieces = kernels.make_pieces(cu, cu, opts.device)
    return (q, k, v, dout), pieces, kernels.select(opts.backend, q)


def time_attention(length: int, opts: CalibrateOptions) -> tuple[float, float]:
    """(forward, backward) seconds of one block call of ``opts.documents(length)`` causal
    documents through the selected backend, each timed on its own (the backward given the
    forward's output and lse, as the engine calls it)."""
    (q, k, v, dout), pieces, backend = attention_block(length, opts.documents(length), opts)
    scale = opts.head_dim ** -0.5
    fwd = _timed(lambda _: backend.forward(q, k, v, pieces, True, scale), opts)
    out, lse = backend.forward(q, k, v, pieces, True, scale)
    bwd = _timed(lambda _: backend.backward(dout, q, k, v, out, lse, pieces, True, scale), opts)
    return fwd, bwd


def model_gemms(model: ModelSpec, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of one layer's GEMMs on ``tokens`` tokens: QKV, output projection, MLP in
    (doubled for SwiGLU) and out, each forward, data gradient and weight gradient."""
    h = model.hidden_size
    ffn_in = model.ffn * (2 if model.swiglu else 1)
    linears = model.attention_linears(model.num_attention_heads, model.kv_heads) + \
        [(h, ffn_in), (model.ffn, h)]
    shapes = []
    for k, n in linears:
        shapes += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]
    return shapes


def time_gemm(opts: CalibrateOptions) -> float:
    """Achieved TFLOP/s of the model's GEMMs (or of an n^3 matmul), bf16 on CUDA, fp32 on CPU."""
    shapes = (model_gemms(opts.model, opts.gemm_tokens) if opts.model is not None
              else [(opts.gemm_size,) * 3])
    flops = seconds = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=opts.dtype, device=opts.device)
        b = torch.randn(k, n, dtype=opts.dtype, device=opts.device)
        seconds += _timed(lambda _: a @ b, opts)
        flops += 2.0 * m * k * n
    return flops / seconds / 1e12


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
    tiny = replace(opts, min_time_s=0.05, tokens_per_call=0)
    overhead = time_attention(OVERHEAD_TOKENS, tiny)[0]
    if barrier is not None:
        barrier.wait()
    _, _, backend = attention_block(OVERHEAD_TOKENS, 1, tiny)
    return ComputeSample(tuple(opts.lengths), tuple(fwd), tuple(bwd), time_gemm(opts), overhead,
                         backend.kernel, backend.name)


def _compute_worker(rank: int, opts: CalibrateOptions, barrier) -> ComputeSample:
    """Worker ``rank``: measure in step with the other workers."""
    return measure_compute(opts, barrier)


def measure_compute_concurrent(opts: CalibrateOptions) -> ComputeSample:
    """``measure_compute`` in ``concurrency`` forked processes at once (CPU), medians of them."""
    if opts.device == "cuda" or opts.concurrency == 1:
        return measure_compute(opts)
    samples = run_forked(_compute_worker, opts.concurrency,
                         (opts, FORK.Barrier(opts.concurrency)), timeout_s=600.0,
                         what="calibration worker")
    med = statistics.median
    points = range(len(opts.lengths))
    return replace(samples[0], fwd_s=tuple(med([s.fwd_s[i] for s in samples]) for i in points),
                   bwd_s=tuple(med([s.bwd_s[i] for s in samples]) for i in points),
                   gemm_tflops=med([s.gemm_tflops for s in samples]),
                   overhead_s=med([s.overhead_s for s in samples]))


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
    flops = [opts.documents(n) * opts.heads * (opts.head_dim + opts.v_head_dim) * n * n
             for n in sample.lengths]
    fwd = running_max([f / t for f, t in zip(flops, sample.fwd_s)])
    bwd = running_max([f / t for f, t in zip(flops, sample.bwd_s)])
    table = tuple((n, round(f / 1e12, 6)) for n, f in zip(sample.lengths, fwd))
    ratios = [f / b for n, f, b in zip(sample.lengths, fwd, bwd) if n >= 1024] or \
        [f / b for f, b in zip(fwd, bwd)]
    where = torch.cuda.get_device_name() if opts.device == "cuda" else platform.processor() \
        or platform.machine()
    processes = opts.concurrency if opts.device == "cpu" else 1
    per_call = (f"{opts.tokens_per_call} tokens per call" if opts.tokens_per_call
                else "one document per call")
    gemm = (f"GEMM {opts.model.name} layer shapes on {opts.gemm_tokens} tokens"
            if opts.model is not None else f"GEMM {opts.gemm_size}^3")
    source = (f"zeppelin calibrate on {platform.node()} ({where}, {os.cpu_count()} cores), "
              f"torch {torch.__version__}, {datetime.date.today().isoformat()}: attention "
              f"backend {sample.backend} (kernel {sample.kernel}) causal {opts.dtype} "
              f"heads={opts.heads}/{opts.kv_heads} head_dim={opts.head_dim}"
              f"{'' if opts.v_head_dim == opts.head_dim else f'/{opts.v_head_dim}'}, "
              f"{per_call}, {processes} "
              f"process(es) x {opts.threads} thread(s), fastest runs, running max over "
              f"lengths; {gemm}"
              + ("; gloo ping-pong P2P" if p2p else ""))
    return HardwareProfile(
        name=name, gemm_tflops=round(sample.gemm_tflops, 6), attention_tflops=table,
        attention_bwd_ratio=round(statistics.median(ratios), 3),
        kernel_overhead_us=round(sample.overhead_s * 1e6, 1),
        p2p_gbyte_per_s=round(p2p.gbyte_per_s, 4) if p2p else None,
        p2p_latency_us=round(p2p.latency_us, 1) if p2p else None, source=source,
        kernel=sample.kernel)


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


@dataclass(frozen=True)
class Calibration:
    profile: HardwareProfile
    cluster: ClusterSpec | None
    compute: ComputeSample
    p2p: P2PSample | None
    seconds: float


def calibrate(opts: CalibrateOptions, name: str = "cpu", cluster_name: str = "cpu-2x2",
              measure_links: bool = True, profile_ref: str | None = None) -> Calibration:
    """Measure compute (and gloo P2P on CPU); return the profile and the emulated cluster,
    whose ``hardware`` is ``profile_ref`` (where the profile will be written; default
    ``name``)."""
    started = time.perf_counter()
    compute = measure_compute_concurrent(opts)
    p2p = measure_p2p(opts.p2p_bytes) if measure_links else None
    profile = build_profile(name, compute, p2p, opts)
    cluster = (build_cluster(cluster_name, profile_ref or name, p2p)
               if p2p and opts.device == "cpu" else None)
    return Calibration(profile, cluster, compute, p2p, time.perf_counter() - started)


def format_calibration(cal: Calibration) -> str:
    """A short report of what was measured."""
    lines = [f"calibrated in {cal.seconds:.1f} s: backend {cal.compute.backend} (kernel "
             f"{cal.compute.kernel}), GEMM {cal.profile.gemm_tflops:.4g} TFLOP/s, kernel "
             f"overhead {cal.profile.kernel_overhead_us:.0f} us, attention bwd/fwd "
             f"{cal.profile.attention_bwd_ratio:.2f}",
             f"{'length':>8} {'fwd ms':>10} {'bwd ms':>10} {'profile TFLOP/s':>16}"]
    for (length, tflops), f, b in zip(cal.profile.attention_tflops, cal.compute.fwd_s,
                                      cal.compute.bwd_s):
        lines.append(f"{length:>8} {f * 1e3:>10.3f} {b * 1e3:>10.3f} {tflops:>16.4g}")
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
