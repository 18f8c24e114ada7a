"""``zeppelin bench planner``: plan time of every strategy on the same batches, side by side.

Per size (GPUs x documents, github-shaped lengths): the median wall time of a whole
``Strategy.plan`` call (checks, overlong policy, placement, and for zeppelin its portfolio of
candidates scored by the estimate, up to the finished ``Plan``) for zeppelin on the C++ twin
and on the Python reference (``ZEPPELIN_PLANNER_BACKEND``), and for the peers: hybrid DP,
static CP at one node and at its best size, Hydraulis, FlexSP (its MILP on scipy's HiGHS,
whose time the FlexSP paper reports in seconds) and Megatron's hybrid CP
(megatron-core's ``BalancedCPScheduler``, run as is). Slow planners run fewer times, within
``--budget`` seconds per strategy and size; a strategy is left out of a size where one call
would exceed ``--budget`` (said so).
"""
from __future__ import annotations

import argparse
import os
import random

from megatron_zeppelin.bench import median_ms
from megatron_zeppelin.config import ZeppelinConfig, load_setup
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.options import integer

SIZES = ((64, 512), (1024, 4096), (1024, 38000))  # (GPUs, documents)
COLUMNS = (("zeppelin", "cpp"), ("zeppelin", "python"), ("hybrid-dp", "cpp"),
           ("static-cp", "cpp"), ("static-cp-best", "cpp"), ("hydraulis", "cpp"),
           ("flexsp", "cpp"), ("megatron-hybrid-cp", "cpp"))
# where a single call is known to take minutes on 2 cores: (strategy, backend, documents above)
TOO_SLOW = {("zeppelin", "python"): 5000, ("megatron-hybrid-cp", "cpp"): 5000}


def time_strategy(name: str, backend: str, lengths: list[int], cost: CostModel, repeats: int,
                  budget_s: float) -> tuple[float, int]:
    """(median ms, runs) of ``name`` planning ``lengths`` on ``backend``."""
    from megatron_zeppelin.planner import get_strategy

    strategy, config = get_strategy(name), ZeppelinConfig()
    before = os.environ.get("ZEPPELIN_PLANNER_BACKEND")
    os.environ["ZEPPELIN_PLANNER_BACKEND"] = backend
    try:
        return median_ms(lambda: strategy.plan(lengths, cost, config), repeats, budget_s)
    finally:
        if before is None:
            os.environ.pop("ZEPPELIN_PLANNER_BACKEND")
        else:
            os.environ["ZEPPELIN_PLANNER_BACKEND"] = before


def bench_planner(args: argparse.Namespace) -> int:
    from megatron_zeppelin.cli import refuse_repeats
    from megatron_zeppelin.sim.workloads import get_workload

    refuse_repeats("--sizes", [f"{gpus}x{documents}" for gpus, documents in args.sizes])

    workload = get_workload(args.workload)
    setups = [(gpus, documents, _setup(args, gpus, documents)) for gpus, documents in args.sizes]
    load = os.getloadavg()[0]
    print(f"plan time (median ms, runs), workload {workload.name}, model {args.model}, cluster "
          f"{args.cluster}; up to {args.repeats} runs within {args.budget:.0f} s per cell; load "
          f"average {load:.1f} on {os.cpu_count()} cores")
    heads = [f"{name}/{backend}" if name == "zeppelin" else name for name, backend in COLUMNS]
    print(f"{'GPUs x docs':>14} " + " ".join(f"{h:>16}" for h in heads))
    for gpus, documents, setup in setups:  # every size checked before the first line
        cost = CostModel(setup.model, setup.cluster, setup.hardware)
        rng = random.Random(args.seed)
        lengths = [workload.draw(rng) for _ in range(documents)]
        cells = []
        for name, backend in COLUMNS:
            if documents > TOO_SLOW.get((name, backend), documents):
                cells.append("(too slow)")
                continue
            ms, runs = time_strategy(name, backend, lengths, cost, args.repeats, args.budget)
            cells.append(f"{ms:.1f} ({runs})")
        print(f"{gpus:>6} x {documents:<6} " + " ".join(f"{c:>16}" for c in cells), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


def _setup(args: argparse.Namespace, gpus: int, documents: int):
    """The setup of ``gpus`` GPUs of ``--cluster`` (whole nodes; ValueError naming --sizes)."""
    per_node = load_setup(args.model, args.cluster, nodes=1).cluster.gpus_per_node
    if gpus % per_node:
        raise ValueError(f"--sizes {gpus}x{documents} is invalid: expected GPUs a multiple of "
                         f"the {per_node} GPUs per node of {args.cluster}")
    return load_setup(args.model, args.cluster, nodes=gpus // per_node)


MAX_GPUS, MAX_DOCUMENTS = 1 << 20, 1 << 24  # far beyond any cluster and global batch


def _size(text: str) -> tuple[int, int]:
    try:
        gpus, documents = (integer(x) for x in text.lower().split("x"))
    except ValueError:
        gpus = documents = 0
    if not (1 <= gpus <= MAX_GPUS and 1 <= documents <= MAX_DOCUMENTS):
        raise argparse.ArgumentTypeError(f"size {text!r} is invalid: expected GPUSxDOCUMENTS, "
                                         f"GPUs in [1, {MAX_GPUS}] and documents in [1, "
                                         f"{MAX_DOCUMENTS}], e.g. 1024x4096")
    return gpus, documents


def register(targets: argparse._SubParsersAction) -> None:
    from megatron_zeppelin.options import int_at_least, number_at_least
    from megatron_zeppelin.sim.workloads import WORKLOADS

    q = targets.add_parser("planner", help="plan time of every strategy, side by side")
    q.add_argument("--model", default="llama-7b")
    q.add_argument("--cluster", default="h200-8nic")
    q.add_argument("--workload", choices=sorted(WORKLOADS), default="github")
    q.add_argument("--sizes", type=_size, nargs="+", default=list(SIZES),
                   help="GPUSxDOCUMENTS (default: 64x512 1024x4096 1024x38000)")
    q.add_argument("--repeats", type=int_at_least(1), default=21,
                   help="runs per cell at most (default 21)")
    q.add_argument("--budget", type=number_at_least(0), default=30.0,
                   help="seconds after which a cell is not run again")
    q.add_argument("--seed", type=int_at_least(0), default=0)
    q.set_defaults(func=bench_planner)
