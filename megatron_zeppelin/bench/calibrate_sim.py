"""``zeppelin calibrate-sim``: micro-measurements on this machine -> the simulator's own profile
(``sim/profile.py``, e.g. ``configs/sim/cpu-2x2.yaml``).

Compute is measured for a model shape (``--model``, default the tiny GPT the CPU cluster
trains) in this process, one thread, as the least CPU time (``time.thread_time``) of a few runs:
other jobs on the cores do not inflate it. The emulated cluster runs 4 ranks of one thread on
this machine's cores: ``shared_cores`` is their count (the cores this process may run on), and
the step model shares them between the ranks that compute (``sim/sharing.py``);
``compute_scale`` is what 4 ranks computing at once cost beyond that fair share, measured
(``contention.py``: a layer's compute run by 4 processes at once against alone).

* attention forward and backward through the engine's block call (``calibrate.attention_block``)
  at query lengths 16..``--max-length``: the forward TFLOP/s table and the backward / forward
  ratio *per length*; one 16-token call -> ``attention_call_us``;
* the layer's GEMMs (``calibrate.model_gemms``) -> ``gemm_tflops``; one 16-token GEMM ->
  ``gemm_call_us``;
* a layer's non-GEMM kernels (two RMSNorms, rotary on q and k, SwiGLU, two residual adds),
  forward + backward, at two token counts -> ``nongemm_layer_us`` + ``nongemm_ns_per_token``;
* the head's (embedding, final RMSNorm, cross-entropy over the logits) likewise;
* Adam (+ gradient-norm clipping) over 1x and 4x the model's parameters -> the optimizer line.

On 4 gloo ranks: ``all_reduce`` at three sizes -> the all-reduce line; P2P ping-pong
(``p2p_link``) -> the links (one host: intra = inter); the attention engine on a plan of short
documents in a 4-rank ring, whose time beyond the model of everything else is the engine's host
work per ring step (``ring_step_us``); the tiny GPT trained on 128-token micro-batches (compute
small), at 1 and 8 micro-batches per step, whose steps beyond the model are the training loop's
host work per step and per micro-batch (``step_host_us``, ``micro_batch_host_us``); then the
tiny GPT on its full-length micro-batches under static CP 1, 2 and 4 (another seed than
``bench fidelity``'s), whose steps beyond the model are fitted as a cost per ring round on the
critical path (``ring_step_us``, which replaces the short-document figure) and per token
(``token_host_ns``); see ``training_ring_token_fit``.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import replace

import torch

from megatron_zeppelin.bench.calibrate import CalibrateOptions, attention_block, model_gemms
from megatron_zeppelin.bench.contention import (layer_work, measure_compute_scale,
                                                 measure_one_rank)
from megatron_zeppelin.bench.p2p_link import fit_line, measure_p2p
from megatron_zeppelin.bench.workers import run_forked
from megatron_zeppelin.config import ModelSpec, load_model
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.sim.profile import SimProfile

CALL_TOKENS = 16
RANKS = 4  # the emulated cluster's gloo ranks (cpu-2x2), one thread each
LINE_TOKENS = (1024, 4096)


REPEATS = 5


def _timed(fn, opts: CalibrateOptions | None = None, setup=None) -> float:
    """The least CPU time of this thread over ``REPEATS`` runs of ``fn(setup())`` after a
    warm-up (setup outside the timed region). CPU time, not wall time: other processes on the
    cores do not inflate it (the profile's ``compute_scale`` states how the emulated ranks
    share the cores)."""
    best = float("inf")
    for i in range(REPEATS + 1):
        state = setup() if setup else None
        start = time.thread_time()
        fn(state)
        if i:
            best = min(best, time.thread_time() - start)
    return best


def time_attention(length: int, opts: CalibrateOptions) -> tuple[float, float]:
    """(forward, backward) CPU seconds of the engine's block call on one causal document of
    ``length`` tokens (``calibrate.attention_block``; the backward given the forward's output
    and lse, as the engine calls it)."""
    (q, k, v, dout), pieces, backend = attention_block(length, 1, opts)
    scale = opts.head_dim ** -0.5
    fwd = _timed(lambda _: backend.forward(q, k, v, pieces, True, scale))
    out, lse = backend.forward(q, k, v, pieces, True, scale)
    bwd = _timed(lambda _: backend.backward(dout, q, k, v, out, lse, pieces, True, scale))
    return fwd, bwd


def time_gemm(model: ModelSpec, tokens: int) -> float:
    """Achieved TFLOP/s (CPU time) of the layer's GEMMs on ``tokens`` tokens, fp32."""
    flops = seconds = 0.0
    for m, k, n in model_gemms(model, tokens):
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += _timed(lambda _: a @ b)
        flops += 2.0 * m * k * n
    return flops / seconds / 1e12


def _line(setup, fn, opts: CalibrateOptions, sizes) -> tuple[float, float]:
    """(intercept s, slope s per unit) of the fastest times of ``fn(setup(size))`` at
    ``sizes`` (the inputs made outside the timed region)."""
    times = [_timed(fn, opts, lambda n=n: setup(n)) for n in sizes]
    slope = (times[-1] - times[0]) / (sizes[-1] - sizes[0])
    return max(0.0, times[0] - slope * sizes[0]), max(slope, 0.0)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def layer_inputs(model: ModelSpec, tokens: int) -> tuple:
    """Inputs of a layer's non-GEMM kernels on ``tokens`` tokens: x [tokens, hidden], the norm
    weight, q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim], cos/sin, the MLP's
    [tokens, 2 ffn]."""
    h, d = model.hidden_size, model.head_dim
    return (torch.randn(tokens, h, requires_grad=True), torch.ones(h, requires_grad=True),
            torch.randn(tokens, model.num_attention_heads, d, requires_grad=True),
            torch.randn(tokens, model.kv_heads, d, requires_grad=True),
            torch.randn(tokens, 1, d), torch.randn(tokens, 1, d),
            torch.randn(tokens, 2 * model.ffn, requires_grad=True))


def nongemm_layer(inputs: tuple) -> None:
    """Forward + backward of a layer's non-GEMM kernels (``layer_inputs``): two RMSNorms and
    residual adds, rotary on q and k, SwiGLU."""
    x, w, q, k, cos, sin, mlp = inputs
    a, b = mlp.chunk(2, dim=-1)
    y = _rms(x, w) + x
    y = _rms(y, w) + y
    out = y.sum() + _rotary(q, cos, sin).sum() + _rotary(k, cos, sin).sum() + \
        (torch.nn.functional.silu(a) * b).sum()
    out.backward()


def head_inputs(model: ModelSpec, tokens: int) -> tuple:
    """The embedding table, token ids, norm weight and [tokens, vocab] logits."""
    return (torch.randn(model.vocab_size, model.hidden_size, requires_grad=True),
            torch.randint(0, model.vocab_size, (tokens,)),
            torch.ones(model.hidden_size, requires_grad=True),
            torch.randn(tokens, model.vocab_size, requires_grad=True))


def head_kernels(inputs: tuple) -> None:
    """Forward + backward of the head's non-GEMM work: embedding lookup, final RMSNorm,
    cross-entropy over the logits."""
    table, ids, w, logits = inputs
    out = _rms(table[ids], w).sum() + torch.nn.functional.cross_entropy(logits, ids)
    out.backward()


def optimizer_line(model: ModelSpec, opts: CalibrateOptions) -> tuple[float, float]:
    """(fixed s, s per parameter) of an Adam step with gradient-norm clipping."""
    params = model.parameter_count()
    results = []
    for scale in (1, 4):
        tensors = [torch.nn.Parameter(torch.randn(params * scale // 8)) for _ in range(8)]
        for t in tensors:
            t.grad = torch.randn_like(t)
        adam = torch.optim.Adam(tensors, lr=1e-3)

        def step(_):
            torch.nn.utils.clip_grad_norm_(tensors, 1.0)
            adam.step()
        results.append((params * scale, _timed(step, opts)))
    (n0, t0), (n1, t1) = results
    slope = max((t1 - t0) / (n1 - n0), 0.0)
    return max(0.0, t0 - slope * n0), slope


def measure_kernels(model: ModelSpec, lengths: tuple[int, ...], opts: CalibrateOptions) -> dict:
    """Every compute figure of the profile in this process (see the module doc)."""
    torch.set_num_threads(1)
    att = [time_attention(n, opts) for n in lengths]
    call = time_attention(CALL_TOKENS, opts)[0]
    h = model.hidden_size
    small = torch.randn(CALL_TOKENS, h), torch.randn(h, h)
    gemm_call = _timed(lambda _: small[0] @ small[1], opts)
    nongemm = _line(lambda n: layer_inputs(model, n), nongemm_layer, opts, LINE_TOKENS)
    head = _line(lambda n: head_inputs(model, n), head_kernels, opts, LINE_TOKENS)
    return {"fwd": [f for f, _ in att], "bwd": [b for _, b in att], "call": call,
            "gemm_tflops": time_gemm(model, opts.gemm_tokens), "gemm_call": gemm_call, "nongemm": nongemm,
            "head": head, "optimizer": optimizer_line(model, opts)}


ALLREDUCE_BYTES = (4096, 1048576, 4194304)


def _allreduce_worker(rank: int, repeats: int) -> list[float] | None:
    """One gloo rank: fastest seconds of an ``all_reduce`` per size of ``ALLREDUCE_BYTES``
    (rank 0 returns them)."""
    import torch.distributed as dist

    out = []
    for nbytes in ALLREDUCE_BYTES:
        x = torch.ones(nbytes // 4)
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - start)
        out.append(best)
    return out if rank == 0 else None


def measure_allreduce(world: int = 4, repeats: int = 20) -> tuple[float, float]:
    """(latency us per ring step, bus GB/s) of a gloo all-reduce over ``world`` processes."""
    times = run_forked(_allreduce_worker, world, (repeats,), timeout_s=300.0,
                       what="all-reduce measurement", gloo_timeout_s=300.0)[0]
    intercept, per_byte = fit_line([float(n) for n in ALLREDUCE_BYTES], times)
    steps = 2 * (world - 1)
    return max(0.0, intercept) / steps * 1e6, steps / world / per_byte / 1e9


def ring_step_host_us(model: ModelSpec, profile: SimProfile, cluster: str) -> float:
    """Host work of the engine per ring step: short documents in one 4-rank ring on 4 gloo
    ranks (``bench.fidelity``'s engine timing, one layer, forward + backward), the measured
    time beyond the step model's attention with no host work per ring step, per ring step
    (and per the cores' fair share: the step model shares this host work too)."""
    from megatron_zeppelin.bench.fidelity import FidelityOptions, fidelity_cost, measure
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.planner.baselines import StaticCP
    from megatron_zeppelin.sim.step_model import StepOptions, attention_ends, shared_ends

    opts = FidelityOptions(heads=model.num_attention_heads, head_dim=model.head_dim,
                           repeats=7, cluster=cluster)
    cost = fidelity_cost(opts)
    world = cost.cluster.world_size
    plan = StaticCP(cp_size=world).plan([CALL_TOKENS * world] * 2, cost, ZeppelinConfig())
    measured = min(measure([("static-cp", 0, "ring", plan)], opts, world)[0])
    base = replace(profile, ring_step_us=0.0)
    ends, = attention_ends(plan, cost, base, StepOptions())
    steps = 2 * world  # one call per ring step, forward and backward
    model = float(shared_ends(ends.fwd + ends.bwd, ends.compute, base).max())
    # the ring's ranks run their host work at once: on shared cores each gets its fair share
    return max(0.0, measured - model) / steps / base.fair_share(world) * 1e6


HOST_FLAGS = ["--seq-length", "128", "--micro-batch-size", "1"]
HOST_MICRO_BATCHES = (1, 8)  # global batch sizes of the two runs (micro-batches per step)


def training_host_us(profile: SimProfile, port: int = 29691) -> tuple[float, float]:
    """(per step, per micro-batch) host work of the training loop outside what the step model
    counts (Megatron's schedule and modules in Python, data, DDP hooks, the optimizer
    wrapper): the tiny GPT trained with 128-token micro-batches (compute small), static CP of
    size 1, at 1 and 8 micro-batches per step; the measured median step beyond the step
    model's prediction for the same micro-batches, fitted as a line in micro-batches."""
    from megatron_zeppelin.bench.fidelity_train import replay
    from megatron_zeppelin.bench.train import Entry, run_entries

    entries = [Entry("static-cp", {"zeppelin-cp-size": "1", "global-batch-size": str(n)})
               for n in HOST_MICRO_BATCHES]
    iterations, warmup = 8, 3
    residual = []
    for entry, (logs, refused) in zip(entries, run_entries(entries, iterations, HOST_FLAGS,
                                                            port)):
        if refused or len(logs) <= warmup:
            raise RuntimeError(f"calibrate-sim: the host-work training run failed: {refused}")
        kept = logs[warmup:]
        simulated = replay(entry, HOST_FLAGS, iterations, kept, profile)
        residual.append(statistics.median(log["seconds"] - sim
                                          for log, sim in zip(kept, simulated)))
    per_micro = max(0.0, (residual[1] - residual[0]) /
                    (HOST_MICRO_BATCHES[1] - HOST_MICRO_BATCHES[0]))
    return max(0.0, residual[0] - per_micro * HOST_MICRO_BATCHES[0]) * 1e6, per_micro * 1e6


FIT_FLAGS = ["--seed", "4321"]  # full-length micro-batches, other documents than the bench's
FIT_CP_SIZES = (1, 2, 4)  # no ring, 2-rank rings (in a node), 4-rank rings (across nodes)
FIT_STEP = (1000.0, 1000.0)  # finite-difference steps: ring_step_us (us), token_host_ns (ns)


def training_ring_token_fit(profile: SimProfile, port: int = 29695) -> tuple[float, float]:
    """(``ring_step_us``, ``token_host_ns``) fitted to full-length training steps: the tiny
    GPT (``FIT_FLAGS``: its YAML's micro-batches, another seed than ``bench fidelity``'s)
    under static CP of sizes ``FIT_CP_SIZES``; per kept step, the measured step less the step
    model's (``profile``'s ring term, no per-token term) is fitted as a non-negative
    least-squares line in the model's own sensitivities to the two terms (finite
    differences: the ring rounds on each step's critical path, the tokens of its slowest
    ranks). The ring term is what a ring round costs in training (the engine's host work,
    ranks waiting for each other at its exchanges on shared cores); it replaces the short-
    document engine measurement, which counts neither the long waits nor the preemptions."""
    from megatron_zeppelin.bench.fidelity_train import replay
    from megatron_zeppelin.bench.train import Entry, run_entries

    entries = [Entry("static-cp", {"zeppelin-cp-size": str(g)}) for g in FIT_CP_SIZES]
    iterations, warmup = 6, 2
    base = replace(profile, token_host_ns=0.0)
    probes = (base, replace(base, ring_step_us=base.ring_step_us + FIT_STEP[0]),
              replace(base, token_host_ns=FIT_STEP[1]))
    rows = []
    for entry, (logs, refused) in zip(entries, run_entries(entries, iterations, FIT_FLAGS,
                                                            port)):
        if refused or len(logs) <= warmup:
            raise RuntimeError(f"calibrate-sim: the training run {entry.label} failed: "
                               f"{refused}")
        kept = logs[warmup:]
        sims = [replay(entry, FIT_FLAGS, iterations, kept, p) for p in probes]
        rows += [(log["seconds"] - s0, (s1 - s0) / FIT_STEP[0], (s2 - s0) / FIT_STEP[1])
                 for log, s0, s1, s2 in zip(kept, *sims)]
    ring, token = nonnegative_fit(rows)
    return base.ring_step_us + ring, token


def nonnegative_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum (y - a x1 - b x2)^2 over ``rows`` (y, x1, x2); a term whose
    unconstrained fit is negative is 0 and the other refitted alone (a ring term of -a us
    lowers the measured engine figure by at most that: the result is offset from it)."""
    import numpy as np

    y, x = np.asarray([r[0] for r in rows]), np.asarray([r[1:] for r in rows])
    solution = np.linalg.lstsq(x, y, rcond=None)[0]
    if (solution >= 0).all():
        return float(solution[0]), float(solution[1])
    best = (0.0, 0.0)
    for k in (0, 1):
        col = x[:, k]
        value = max(0.0, float(col @ y / (col @ col))) if col.any() else 0.0
        pair = (value, 0.0) if k == 0 else (0.0, value)
        if ((y - x @ np.asarray(pair)) ** 2).sum() < ((y - x @ np.asarray(best)) ** 2).sum():
            best = pair
    return best


def build_sim_profile(name: str, model: ModelSpec, lengths: tuple[int, ...], k: dict,
                      p2p, allreduce: tuple[float, float], source: str) -> SimProfile:
    """The profile from the measured figures (ring host work left 0: measured afterwards)."""
    call = k["call"]
    flops = [2.0 * model.num_attention_heads * model.head_dim * n * n for n in lengths]
    tflops = [(n, f / max(t - call, 1e-3 * t) / 1e12)
              for n, f, t in zip(lengths, flops, k["fwd"])]
    ratio = [(n, b / f) for n, f, b in zip(lengths, k["fwd"], k["bwd"])]
    return SimProfile(
        name=name, source=source, attention_tflops=tuple(tflops),
        attention_bwd_ratio=tuple(ratio), attention_call_us=call * 1e6,
        gemm_tflops=k["gemm_tflops"], gemm_call_us=k["gemm_call"] * 1e6,
        nongemm_layer_us=k["nongemm"][0] * 1e6, nongemm_ns_per_token=k["nongemm"][1] * 1e9,
        head_us=k["head"][0] * 1e6, head_ns_per_token=k["head"][1] * 1e9,
        optimizer_us=k["optimizer"][0] * 1e6, optimizer_ns_per_param=k["optimizer"][1] * 1e9,
        ring_step_us=0.0, intra_gbyte_per_s=p2p.gbyte_per_s, intra_latency_us=p2p.latency_us,
        inter_gbyte_per_s=p2p.gbyte_per_s, inter_latency_us=p2p.latency_us,
        allreduce_gbyte_per_s=allreduce[1], allreduce_latency_us=allreduce[0],
        nvlink_contention=1.0, compute_scale=k["compute_scale"],
        shared_cores=k.get("shared_cores", 0.0),
        measured_hidden=model.hidden_size, measured_vocab=model.vocab_size, unmeasured=("nvlink_contention",))


def calibrate_sim(model_name: str, cluster: str, max_length: int) -> SimProfile:
    """Measure everything (module doc) and return the profile, named after ``cluster``."""
    model = load_model(model_name)
    lengths = tuple(n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
                    if n <= max_length)
    opts = CalibrateOptions(model=model, lengths=lengths, tokens_per_call=0, min_time_s=0.2,
                            max_repeats=5, concurrency=4)
    kernels = measure_kernels(model, lengths, opts)
    alone = _timed(lambda _, work=layer_work(model): work())
    cores = float(len(os.sched_getaffinity(0)))
    kernels["compute_scale"], shared = measure_compute_scale(model, RANKS, alone, cores=cores)
    kernels["shared_cores"], one_rank = cores, measure_one_rank(model)
    p2p = measure_p2p()
    allreduce = measure_allreduce()
    day = datetime.date.today().isoformat()
    source = (f"zeppelin calibrate-sim on {platform.node()} ({platform.machine()}, "
              f"{os.cpu_count()} cores), torch {torch.__version__}, {day}: model {model.name} "
              f"(heads {model.num_attention_heads}/{model.kv_heads}, head_dim "
              f"{model.head_dim}, hidden {model.hidden_size}, vocab {model.vocab_size}), fp32, "
              f"compute as one thread's least CPU time of {REPEATS} runs, shared by the "
              f"ranks computing on {cores:g} cores (shared_cores) x compute_scale "
              f"{kernels['compute_scale']:.2f}: a layer's compute {alone * 1e3:.1f} ms alone "
              f"(CPU time), {one_rank * 1e3:.1f} ms (median wall) in one process alone, "
              f"{statistics.median(shared) * 1e3:.1f} ms (median) when {RANKS} processes run it "
              f"at once; gloo "
              "P2P ping-pong, 4-rank all-reduce; ring round and per-token host work fitted to "
              "full-length training steps of static CP 1, 2 and 4 (seed 4321); "
              f"load average {os.getloadavg()[0]:.1f}")
    profile = build_sim_profile(cluster, model, lengths, kernels, p2p, allreduce, source)
    profile = replace(profile, ring_step_us=ring_step_host_us(model, profile, cluster))
    step_us, micro_us = training_host_us(profile)
    profile = replace(profile, step_host_us=step_us, micro_batch_host_us=micro_us)
    ring_us, token_ns = training_ring_token_fit(profile)
    return replace(profile, ring_step_us=ring_us, token_host_ns=token_ns)


DEFAULT_OUTPUT = "zeppelin-calibration/sim-cpu-2x2.yaml"


def check_setup(model_name: str, cluster: str) -> None:
    """``--model`` and ``--cluster`` load, and the cluster is the emulated one of ``RANKS``
    ranks (ConfigError naming the flag) before anything is measured."""
    from megatron_zeppelin.config import load_cluster

    try:
        load_model(model_name)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--model={model_name!r} is invalid: {exc}") from None
    try:
        world = load_cluster(cluster).world_size
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--cluster={cluster!r} is invalid: {exc}") from None
    if world != RANKS:
        raise ConfigError(f"--cluster={cluster!r} is invalid: expected an emulated cluster of "
                          f"{RANKS} ranks (this machine runs them), it has {world}")


def cmd_calibrate_sim(args) -> int:
    from megatron_zeppelin.bench.calibrate_cli import output_path

    path = output_path(args.output or DEFAULT_OUTPUT, args.force, "--output")
    check_setup(args.model, args.cluster)
    started = time.perf_counter()
    profile = calibrate_sim(args.model, args.cluster, args.max_length)
    profile.to_yaml(path, "The simulator's own profile (megatron_zeppelin/sim/profile.py), "
                    "measured by `zeppelin calibrate-sim` (bench/calibrate_sim.py).\n"
                    + profile.source)
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s); ring step host work "
          f"{profile.ring_step_us:.0f} us, host per token {profile.token_host_ns:.0f} ns, "
          f"shared cores {profile.shared_cores:g} x compute_scale {profile.compute_scale:.2f}, "
          "attention call "
          f"{profile.attention_call_us:.0f} us, "
          f"GEMM {profile.gemm_tflops * 1e3:.1f} GFLOP/s")
    return 0


def register(sub) -> None:
    from megatron_zeppelin.options import int_at_least
    from megatron_zeppelin.output_paths import output_file

    c = sub.add_parser("calibrate-sim", help="measure this machine for the simulator's own "
                       "profile (configs/sim/)", description=__doc__)
    c.add_argument("--model", default="gpt-tiny", help="model YAML (name or path) whose shape "
                   "is measured")
    c.add_argument("--cluster", default="cpu-2x2", help="the emulated cluster (its name names "
                   "the profile)")
    c.add_argument("--max-length", type=int_at_least(16), default=4096,
                   help="longest attention length (at least 16)")
    c.add_argument("--output", type=output_file(), default=None, metavar="FILE",
                   help=f"where to write the profile (default {DEFAULT_OUTPUT})")
    c.add_argument("--force", action="store_true", help="overwrite --output")
    c.set_defaults(func=cmd_calibrate_sim)
