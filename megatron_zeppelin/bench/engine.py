"""Benchmark of the attention engine: against the same work done locally, and its overlap.

``zeppelin bench engine`` (``--device cpu``, the default) plans one batch on a 1 node x 2 ranks
pool (gpt-tiny cost model, the real planner), spawns 2 gloo processes (one intra-op thread
each) and times forward + backward of

* the engine on the plan (``engine``),
* the same engine with a transport that sends nothing (``compute``: ``NullTransport``, the
  received blocks are zeros) and with a kernel that computes nothing (``comm``: ``NoKernel``,
  same P2P; the merges and index gathers still run) -- both injected, the engine has no
  benchmark switch,
* the whole batch on one process: one causal varlen call over all sequences (``single``),
* the compute-only engine of each rank while the other rank idles (``compute_solo``: the
  slower rank), which shows the split of the work when the ranks do not share CPU cores.

Each figure is the median over iterations of the slowest rank's time. Communication hidden
behind compute: ``(compute + comm - engine) / comm`` (1 = fully hidden, 0 = fully exposed;
noise can push it outside [0, 1] when comm is small). Then, in this process, the engine on
the batch's local-only plan (one rank: every sequence LOCAL, one fused call) against the
backend's block call on the same batch (``engine_local``).

``--device cuda``: the local-only engine against the raw kernels (aten flash forward and
backward) on the same batch, bf16 (target: <= ``--max-local-ratio``, 1.10x), the ring path of a
``--ring-size`` ring with every position on the one GPU against the raw kernels of the same
blocks (``engine_ring``: target <= ``--max-ring-ratio``, 1.5x; overhead per block in us), and
the engine on a ``--ranks``-rank plan with every rank on the one GPU (gloo, staged transport)
against one process (no target: the ranks share one GPU). ``--parts`` picks what runs
(default: CPU ``cpu-ranks,local,ring``, CUDA ``local,ring,gpu-ranks``). On CPU no target is
checked unless one is given. Returns the figures as a dict with ``ok`` (False on a missed
target: ``zeppelin bench engine`` exits 1; None when none was checked).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_zeppelin.bench import engine_ring
from megatron_zeppelin.bench.engine_local import alternating, slowest_rank_seconds
from megatron_zeppelin.bench.flags import check_shape
from megatron_zeppelin.bench.workers import run_spawned
from megatron_zeppelin.options import integer
from megatron_zeppelin.runtime.kernels import accum_dtype
from megatron_zeppelin.runtime.transport import Pending, Transport

CPU = torch.device("cpu")
DEFAULTS = {"cpu": dict(lengths="3072,512,384,256,200,128,100,64,33,17,5,1", heads=8,
                        kv_heads=8, head_dim=64),
            "cuda": dict(lengths="16384,4096,4096,4096,4096" + ",1024" * 8, heads=32, kv_heads=8,
                         head_dim=128, max_local_ratio=1.10, max_ring_ratio=1.5,
                         parts="local,ring,gpu-ranks")}
DEFAULTS["cpu"].update(max_local_ratio=None, max_ring_ratio=None, parts="cpu-ranks,local,ring")
PARTS = ("cpu-ranks", "local", "ring", "gpu-ranks")
RANKS_PART = {"cpu": "cpu-ranks", "cuda": "gpu-ranks"}  # the multi-rank part each device runs
PLANNED = ("cpu-ranks", "local", "gpu-ranks")  # the parts that run make_bench_plan's plan
USED_BY = {"--ranks": ("gpu-ranks",), "--ring-size": ("ring",), "--ring-lengths": ("ring",),
           "--max-ring-ratio": ("ring",), "--max-local-ratio": ("local",),
           "--lengths": PLANNED, "--strategy": PLANNED, "--capacity-factor": PLANNED}


class NullTransport(Transport):
    """Sends nothing; every receive is zeros at once (the ``compute`` variant)."""

    name = "null"

    def post(self, ops, group, where, timeout_s) -> Pending:
        for op in ops:
            if not op.send:
                op.tensor.zero_()
        return Pending()


class NoKernel:
    """A kernel backend that computes nothing: zero outputs, ``-inf`` lse (``comm``)."""

    name, kernel, auto, description = "none", "cpu", False, "benchmark: no compute"

    def unavailable(self):
        return None

    def refuses(self, q):
        return None

    def forward(self, q, k, v, pieces, causal, scale, window=None):
        return q.new_zeros((*q.shape[:2], v.shape[-1])), torch.full((q.shape[1], q.shape[0]), float("-inf"),
                                               dtype=accum_dtype(q.dtype), device=q.device)

    def backward(self, dout, q, k, v, out, lse, pieces, causal, scale, window=None):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from megatron_zeppelin.options import Parser, int_at_least, number_at_least

    parser = Parser(prog="zeppelin bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sequence lengths (tokens) of the batch")
    parser.add_argument("--strategy", default="zeppelin",
                        help="planner strategy (zeppelin, static-cp, hybrid-dp, ...)")
    parser.add_argument("--capacity-factor", type=number_at_least(0), default=1.05,
                        help="capacity_tokens_per_gpu = factor x mean tokens per rank (small "
                             "values force rings); 0 lets the planner derive it")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=4,
                        help="CUDA: ranks sharing the one GPU (2 nodes x ranks/2)")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int_at_least(0), default=1)
    parser.add_argument("--forward-only", action="store_true", help="time the forward only")
    parser.add_argument("--ring-size", type=int, default=4, help="ring part: positions")
    parser.add_argument("--ring-lengths", default=None,
                        help="ring part: the group's sequence lengths (comma-separated)")
    parser.add_argument("--max-local-ratio", type=number_at_least(0, True), default=None,
                        help="target: local-only engine / raw kernels (CUDA 1.10)")
    parser.add_argument("--max-ring-ratio", type=number_at_least(0, True), default=None,
                        help="target: ring path / raw kernels of its blocks (CUDA 1.5)")
    parser.add_argument("--parts", default=None, help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    if args.ring_lengths is None:
        args.ring_lengths = engine_ring.DEFAULT_LENGTHS[args.device]
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    _check(parser, args)
    given = {t.partition("=")[0] for t in (sys.argv[1:] if argv is None else argv)}
    for flag, parts in USED_BY.items():
        if flag in given and not set(parts) & set(args.parts):
            parser.error(f"{flag} applies only to --parts {', '.join(parts)}, not to "
                         f"--parts {','.join(args.parts)}: it would be ignored (drop it)")
    if len(set(args.parts)) < len(args.parts):
        parser.error(f"--parts={','.join(args.parts)} lists a part twice")
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad flags (one line naming the flag, exit 2); ``args.parts`` becomes a list."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    if args.ranks < 2 or args.ranks % 2:
        parser.error(f"--ranks={args.ranks} must be an even number >= 2")
    for key in ("heads", "kv_heads", "head_dim", "iters", "ring_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    valid = [x for x in PARTS if not x.endswith("ranks") or x == RANKS_PART[args.device]]
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or any(x not in valid for x in parts):
        parser.error(f"--parts={args.parts!r} is invalid on {args.device}: expected some of "
                     f"{', '.join(valid)}")
    args.parts = parts
    args.ring_lengths = _lengths(parser, "--ring-lengths", args.ring_lengths)
    check_shape(parser, args, ("ring_lengths",))
    _check_plan(parser, args)


def _check_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a bad ``--lengths`` or ``--strategy`` before any part runs (``args.lengths``
    becomes the list)."""
    from megatron_zeppelin.planner import STRATEGIES

    args.lengths = _lengths(parser, "--lengths", args.lengths)
    if args.strategy not in STRATEGIES:
        parser.error(f"--strategy={args.strategy!r} is invalid: expected one of "
                     f"{list(STRATEGIES)}")


def _lengths(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """The comma-separated positive lengths ``text`` of ``flag``, or the parser's error."""
    try:
        lengths = [integer(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        parser.error(f"{flag}={text!r} is invalid: expected positive integers")
    return lengths


def bench_cost(nodes: int, gpus_per_node: int):
    """The engine benchmarks' cost model: the tiny GPT on ``nodes`` x ``gpus_per_node`` GPUs
    (one NIC each) of the H200 cluster's profile."""
    from megatron_zeppelin.config import load_setup
    from megatron_zeppelin.cost_model import CostModel

    setup = load_setup("gpt-tiny", "h200-8nic", nodes=nodes)
    cluster = dataclasses.replace(setup.cluster, gpus_per_node=gpus_per_node,
                                  nics_per_node=gpus_per_node, gpu_to_nic=None)
    return CostModel(setup.model, cluster, setup.hardware, 1)


def make_bench_plan(args: argparse.Namespace, nodes: int = 1, gpus_per_node: int = 2):
    """The plan of the benchmark batch on ``nodes`` x ``gpus_per_node`` ranks."""
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.planner import make_plan

    lengths = args.lengths  # parsed and checked by parse_args
    cost = bench_cost(nodes, gpus_per_node)
    world = nodes * gpus_per_node
    capacity = (max(math.ceil(sum(lengths) / world * args.capacity_factor), 1)
                if args.capacity_factor > 0 else None)
    return make_plan(args.strategy, lengths, cost,
                     ZeppelinConfig(capacity_tokens_per_gpu=capacity))


def _medians(variants: dict[str, Callable[[], None]], iters: int, warmup: int) -> dict:
    """Median seconds of each variant on the slowest rank (``engine_local.alternating``)."""
    return alternating(variants, iters, warmup, lambda fn: slowest_rank_seconds(fn, CPU),
                       statistics.median)


def _inputs(plan, rank: int, args) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    tokens = plan.attention_tokens()[rank]
    shapes = [(tokens, args.heads, args.head_dim), (tokens, args.kv_heads, args.head_dim),
              (tokens, args.kv_heads, args.head_dim), (tokens, args.heads, args.head_dim)]
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _single(plan, args) -> Callable[[], None]:
    """The whole batch on this process: one causal varlen call (forward + backward)."""
    from megatron_zeppelin.runtime import kernels

    total, cu = sum(plan.seqlens), [0]
    for n in plan.seqlens:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(total, args.heads, args.head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(total, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
    scale = args.head_dim ** -0.5

    def step() -> None:
        out, lse = kernels.block_forward(q, k, v, cu, cu, True, scale)
        if not args.forward_only:
            kernels.block_backward(dout, q, k, v, out, lse, cu, cu, True, scale)
    return step


def _worker(rank: int, store: str, out_path: str, args: argparse.Namespace, plan) -> None:
    from megatron_zeppelin.bench.engine_local import engine_step
    from megatron_zeppelin.runtime.engine import AttentionEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    tensors = _inputs(plan, rank, args)
    engines = {"all": AttentionEngine(plan, rank, dist.group.WORLD),
               "compute": AttentionEngine(plan, rank, dist.group.WORLD,
                                          transport=NullTransport()),
               "comm": AttentionEngine(plan, rank, dist.group.WORLD, backend=NoKernel())}
    idle = (lambda: None)
    variants = {"engine": engine_step(engines["all"], tensors, args.forward_only),
                "compute": engine_step(engines["compute"], tensors, args.forward_only),
                "comm": engine_step(engines["comm"], tensors, args.forward_only),
                "single": _single(plan, args) if rank == 0 else idle}
    for active in range(2):  # each rank's kernels alone: no CPU sharing
        variants[f"solo{active}"] = variants["compute"] if rank == active else idle
    figures = _medians(variants, args.iters, args.warmup)
    figures["compute_solo"] = max(figures.pop("solo0"), figures.pop("solo1"))
    if rank == 0:
        Path(out_path).write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def run(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); print and return the figures."""
    from megatron_zeppelin.bench import engine_local

    args = parse_args(argv)
    figures = two_cpu_ranks(args) if "cpu-ranks" in args.parts else {}
    if "local" in args.parts:
        local = figures["local_only"] = engine_local.local_only(args, make_bench_plan)
        limit = args.max_local_ratio
        local["target"] = None if limit is None else dict(limit=limit,
                                                          ok=local["ratio"] <= limit)
    if "ring" in args.parts:
        figures["ring"] = engine_ring.ring_vs_raw(args)
    if "gpu-ranks" in args.parts:
        figures["one_gpu"] = engine_local.one_gpu_ranks(args, make_bench_plan)
    checked = [part["target"]["ok"] for part in (figures.get("local_only"), figures.get("ring"))
               if part and part["target"]]
    figures["ok"] = all(checked) if checked else None
    _print(figures, args)
    return figures


def two_cpu_ranks(args: argparse.Namespace) -> dict:
    """The 2-rank gloo measurement on CPU (see the module docstring)."""
    plan = make_bench_plan(args)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "figures.json")
        run_spawned(_worker, 2, (os.path.join(tmp, "store"), out_path, args, plan),
                    timeout_s=1800.0, what="bench engine")
        figures = json.loads(Path(out_path).read_text())
    figures["speedup"] = figures["single"] / figures["engine"]
    figures["speedup_solo"] = figures["single"] / figures["compute_solo"]
    figures["hidden_fraction"] = ((figures["compute"] + figures["comm"] - figures["engine"])
                                  / figures["comm"])
    figures["plan"] = {"strategy": plan.strategy, "tiers": plan.tier_counts(),
                       "rings": [list(g.ring) for g in plan.ring_groups if len(g.ring) > 1],
                       "tokens_per_rank": plan.attention_tokens()}
    return figures


def _print(figures: dict, args: argparse.Namespace) -> None:
    what = "forward" if args.forward_only else "forward + backward"
    dtype = "bf16" if args.device == "cuda" else "fp32"
    print(f"attention engine bench on {args.device}, {what}, {dtype}, heads "
          f"{args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, median of {args.iters}")
    if "plan" in figures:
        plan = figures["plan"]
        print(f"  2 gloo ranks (1 node x 2), plan {plan['strategy']}: tiers {plan['tiers']}, "
              f"rings {plan['rings']}, tokens per rank {plan['tokens_per_rank']}")
        print(f"  single process, whole batch  {figures['single'] * 1e3:9.2f} ms")
        print(f"  engine, 2 ranks              {figures['engine'] * 1e3:9.2f} ms   "
              f"speedup {figures['speedup']:.2f}x")
        print(f"  engine, compute only         {figures['compute'] * 1e3:9.2f} ms")
        print(f"  engine, compute only, each rank alone {figures['compute_solo'] * 1e3:9.2f} ms"
              f"   speedup {figures['speedup_solo']:.2f}x (what free cores would allow)")
        print(f"  engine, communication only   {figures['comm'] * 1e3:9.2f} ms")
        print(f"  communication hidden         {figures['hidden_fraction'] * 100:9.1f} %   "
              "(compute + comm - engine) / comm")
    if "local_only" in figures:
        local, target = figures["local_only"], figures["local_only"]["target"]
        raw = "raw aten flash kernels" if args.device == "cuda" else "the torch backend's call"
        verdict = ("not checked (no --max-local-ratio)" if target is None else
                   f"target <= {target['limit']:g}x: {'PASS' if target['ok'] else 'FAIL'}")
        print(f"  local-only plan (1 rank, {local['calls']} call(s)): engine "
              f"{local['engine'] * 1e3:.2f} ms vs {raw} {local['raw'] * 1e3:.2f} ms: "
              f"{local['ratio']:.3f}x, {(local['engine'] - local['raw']) * 1e6:.1f} us extra "
              f"({verdict})")
    if "ring" in figures:
        print("\n".join(engine_ring.describe(figures["ring"])))
    if "one_gpu" in figures:
        one = figures["one_gpu"]
        print(f"  {args.ranks} ranks on one GPU (gloo, staged transport), tiers {one['tiers']}: "
              f"engine {one['engine'] * 1e3:.2f} ms (slowest rank) vs one process, raw kernels "
              f"{one['single'] * 1e3:.2f} ms: {one['ratio']:.2f}x (shared GPU: not a speedup)")


def register(targets) -> None:
    """``zeppelin bench engine``: this module's own parser handles every flag (``run``)."""
    from megatron_zeppelin.bench import register_passthrough

    register_passthrough(targets, "engine", "attention engine vs the same work on one "
                         "process; local-only plan and ring path vs raw kernels; exit 1 on a "
                         "missed target", run)
