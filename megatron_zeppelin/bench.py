"""``zeppelin bench TARGET``: benchmarks that print figures (speed claims live here, not in tests).

planner  median plan time of zeppelin vs megatron-core's BalancedCPScheduler, same input
router   C++ vs Python router time; modelled ring step with and without routing
engine   attention engine vs the same work done locally (CPU, gloo ranks)
train    per-step time of zeppelin vs static mode for the tiny GPT (CPU, 4 gloo ranks)
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

from megatron_zeppelin.config import ZeppelinConfig, load_setup
from megatron_zeppelin.cost_model import CostModel

PLANNER_SIZES = ((64, 512), (1024, 4096))  # (GPUs, sequences)


def _median_ms(fn: Callable[[], object], repeats: int, budget_s: float) -> tuple[float, int]:
    """Median wall time of ``fn`` in ms over ``repeats`` runs, fewer if ``budget_s`` runs out."""
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times) * 1e3, len(times)


def megatron_scheduler_call(lengths: list[int], world: int, capacity: int) -> Callable[[], object]:
    """A call of megatron-core's BalancedCPScheduler on ``lengths`` (what hybrid CP runs)."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from megatron_zeppelin.planner.baselines import _PoolGroup

    def call():
        scheduler = BalancedCPScheduler(max_seq_len_per_rank=capacity,
                                        dp_cp_group=_PoolGroup(world))
        return scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)

    return call


def bench_planner(args: argparse.Namespace) -> int:
    from megatron_zeppelin.planner import plan_zeppelin
    from megatron_zeppelin.planner.common import resolve_capacity
    from megatron_zeppelin.sim.workloads import get_workload

    workload = get_workload(args.workload)
    print(f"planner time, workload {workload.name}, model {args.model}, cluster {args.cluster}; "
          f"median of up to {args.repeats} runs (megatron: up to {args.megatron_repeats}, "
          f"{args.megatron_budget:.0f} s budget)")
    print(f"{'GPUs x seqs':>14} {'tokens':>10} {'zeppelin ms':>12} {'megatron ms':>12} "
          f"{'megatron/zeppelin':>18}")
    for gpus, nseq in PLANNER_SIZES:
        setup = load_setup(args.model, args.cluster, nodes=1)
        setup = load_setup(args.model, args.cluster, nodes=gpus // setup.cluster.gpus_per_node)
        cost = CostModel(setup.model, setup.cluster, setup.hardware)
        rng = random.Random(args.seed)
        lengths = [workload.draw(rng) for _ in range(nseq)]
        config = ZeppelinConfig()
        ours, _ = _median_ms(lambda: plan_zeppelin(lengths, cost, config), args.repeats, 60.0)
        capacity = resolve_capacity(tuple(lengths), cost.cluster.topology(), config)
        theirs, runs = _median_ms(megatron_scheduler_call(lengths, gpus, capacity),
                                  args.megatron_repeats, args.megatron_budget)
        print(f"{gpus:>6} x {nseq:<6} {sum(lengths):>10} {ours:>12.1f} {theirs:>12.1f} "
              f"{theirs / ours:>17.1f}x  (megatron runs: {runs})")
    return 0


def _engine_bench(args: argparse.Namespace) -> int:
    from megatron_zeppelin.runtime import bench as engine_bench

    engine_bench.run(args.passthrough)
    return 0


def _router_bench(args: argparse.Namespace) -> int:
    from megatron_zeppelin.router import bench as router_bench

    router_bench.run(["--repeats", str(args.repeats), "--seed", str(args.seed),
                      "--nodes", *map(str, args.nodes)])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (figures, side by side)",
                       description=__doc__)
    targets = p.add_subparsers(dest="target", required=True)
    q = targets.add_parser("planner", help="plan time: zeppelin vs BalancedCPScheduler")
    q.add_argument("--model", default="llama-7b")
    q.add_argument("--cluster", default="h200-8nic")
    q.add_argument("--workload", default="github")
    q.add_argument("--repeats", type=int, default=21)
    q.add_argument("--megatron-repeats", type=int, default=5)
    q.add_argument("--megatron-budget", type=float, default=120.0,
                   help="seconds after which megatron's scheduler is not run again")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=bench_planner)
    r = targets.add_parser("router", help="router time (C++ vs Python) and routed ring-step model")
    r.add_argument("--repeats", type=int, default=50)
    r.add_argument("--nodes", type=int, nargs="+", default=[16, 128])
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_router_bench)
    e = targets.add_parser("engine", add_help=False,  # its own parser handles every flag
                           help="attention engine vs the same work on one process (CPU, 2 ranks)")
    e.set_defaults(func=_engine_bench, passthrough_flags=True)
    from megatron_zeppelin.megatron import bench as train_bench

    train_bench.register(targets)
