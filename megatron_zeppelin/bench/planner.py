"""``zeppelin bench planner``: median plan time of zeppelin vs megatron-core's BalancedCPScheduler."""
from __future__ import annotations

import argparse
import random
from typing import Callable

from megatron_zeppelin.bench import median_ms
from megatron_zeppelin.config import ZeppelinConfig, load_setup
from megatron_zeppelin.cost_model import CostModel

PLANNER_SIZES = ((64, 512), (1024, 4096))  # (GPUs, sequences)


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
    from megatron_zeppelin.planner import get_strategy
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
        zeppelin = get_strategy("zeppelin")
        ours, _ = median_ms(lambda: zeppelin.plan(lengths, cost, config), args.repeats, 60.0)
        capacity = resolve_capacity(tuple(lengths), cost.cluster.topology(), config)
        theirs, runs = median_ms(megatron_scheduler_call(lengths, gpus, capacity),
                                  args.megatron_repeats, args.megatron_budget)
        print(f"{gpus:>6} x {nseq:<6} {sum(lengths):>10} {ours:>12.1f} {theirs:>12.1f} "
              f"{theirs / ours:>17.1f}x  (megatron runs: {runs})")
    return 0


def register(targets: argparse._SubParsersAction) -> None:
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
