"""How long ``--zeppelin-microbatch-order balanced`` takes per global batch on the training
thread: ``microbatch_order.Regrouper`` (``balance_global_batch`` plus its tally; rank 0 also
estimates the arrival and balanced steps for the run summary) on global batches of a long-tail
workload packed as the data loader packs them (greedy, ``--seq-length`` tokens per micro-batch).

    python scripts/bench_microbatch_order.py [--micro-batches 64 128 256 512] [--pools 2]
        [--pp 4] [--workload longtail] [--repeats 3]

Prints one row per global-batch size: documents, the median seconds of the grouping alone
(every rank) and with rank 0's estimate, and the per-iteration share that is of a step
estimated by the pipeline cost model (``idle_share`` of the balanced grouping).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from megatron_zeppelin.config import load_cluster, load_hardware, load_model
from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.options import Parser, exit_status, int_at_least
from megatron_zeppelin.planner.microbatches import idle_share
from megatron_zeppelin.sim.workloads import WORKLOADS, get_workload

PROG = "bench_microbatch_order.py"


def arrival_batches(workload: str, seq_length: int, count: int, seed: int) -> list[list[int]]:
    """``count`` micro-batches of at most ``seq_length`` tokens, packed greedily from the
    workload's documents (clipped to ``seq_length``, as ``--zeppelin-overlong split`` cuts)."""
    rng, source = random.Random(seed), get_workload(workload)
    out, batch, total = [], [], 0
    while len(out) < count:
        n = min(seq_length, source.draw(rng))
        if batch and total + n > seq_length:
            out.append(batch)
            batch, total = [], 0
        batch.append(n)
        total += n
    return out


def timed(regroup, batches: list[list[list[int]]]) -> tuple[list[float], list]:
    """Seconds of ``regroup`` on each global batch in turn (one Regrouper over the run, as in
    training: its cost function's cache warms up over the batches); the last grouping."""
    times, dealt = [], None
    for arrival in batches:
        started = time.perf_counter()
        dealt = regroup(arrival)
        times.append(time.perf_counter() - started)
    return times, dealt


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every value checked before any work (a bad one: ``ConfigError``)."""
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int_at_least(1), nargs="+",
                        default=[64, 128, 256, 512],
                        help="micro-batches per global batch, all pools together (each a "
                             "multiple of --pools)")
    parser.add_argument("--pools", type=int_at_least(1), default=2, help="data-parallel pools")
    parser.add_argument("--pp", type=int_at_least(1), default=4, help="pipeline stages")
    parser.add_argument("--cp", type=int_at_least(1), default=8,
                        help="ranks of a pool (one node)")
    parser.add_argument("--seq-length", type=int_at_least(1), default=32768)
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--cluster", default="h200-8nic")
    parser.add_argument("--workload", default="longtail", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int_at_least(1), default=5,
                        help="global batches per size")
    args = parser.parse_args(argv)
    for total in args.micro_batches:
        if total % args.pools:
            raise ConfigError(f"--micro-batches={total} is invalid: expected a multiple of "
                              f"--pools {args.pools} (each pool runs the same number)")
    return args


def load(args: argparse.Namespace) -> CostModel:
    """The cost model of ``--model`` on a pool of ``--cp`` ranks of ``--cluster``; a bad name
    or file is ``ConfigError`` naming its flag."""
    try:
        model = load_model(args.model)
    except ConfigError as exc:
        raise ConfigError(f"--model={args.model!r}: {exc}") from None
    try:
        cluster = load_cluster(args.cluster, nodes=1)
    except ConfigError as exc:
        raise ConfigError(f"--cluster={args.cluster!r}: {exc}") from None
    try:
        cluster = cluster.with_topology(1, args.cp)
    except ConfigError as exc:
        raise ConfigError(f"--cp={args.cp} on --cluster {args.cluster}: {exc}") from None
    return CostModel(model, cluster, load_hardware(cluster.hardware))


def run(args: argparse.Namespace, cost: CostModel) -> None:
    from megatron_zeppelin.megatron.loop.microbatch_order import Regrouper  # imports torch

    print(f"{args.model} on {args.cluster}, a pool of {args.cp} ranks, PP {args.pp}, "
          f"{args.pools} pool(s), {args.seq_length:,} tokens per micro-batch, {args.workload}")
    print("ms per global batch, median (max) over --repeats batches; first: the first batch")
    print(f"{'micro-batches':>13} {'documents':>9} {'grouping ms':>16} {'first':>7} "
          f"{'rank 0 (+ estimate) ms':>22} {'est. step ms':>12} {'grouping / step':>15}")
    for total in args.micro_batches:
        micro = total // args.pools
        batches = [arrival_batches(args.workload, args.seq_length, micro * args.pools,
                                   total * 1000 + i) for i in range(args.repeats)]
        ranks = dict(cost=cost, ranks=args.cp, micro=micro, pools=args.pools,
                     capacity=args.seq_length, pp=args.pp, vpp=1)
        alone, dealt = timed(Regrouper(**ranks, estimate=False), batches)
        first, _ = timed(Regrouper(**ranks, estimate=True), batches)
        work, arrival = Regrouper(**ranks, estimate=False).cost, batches[-1]
        lengths = [n for batch in arrival for n in batch]
        rows = [[work([lengths[i] for i in batch]) for batch in pool] for pool in dealt]
        step, _ = idle_share(rows, args.pp, 1, FWD_BWD_LINEAR - 1.0)
        steady, ranked = alone[1:] or alone, first[1:] or first
        median = statistics.median(steady)
        print(f"{total:>13} {sum(map(len, arrival)):>9} {median * 1e3:>8.1f} "
              f"({max(steady) * 1e3:>5.1f}) {alone[0] * 1e3:>7.1f} "
              f"{statistics.median(ranked) * 1e3:>14.1f} ({max(ranked) * 1e3:>5.1f}) "
              f"{step * 1e3:>12.0f} {median / step:>15.2%}")


def main(argv=None) -> int:
    """The table; bad input is one line on stderr and exit status 2 (checked before any
    work)."""
    def work() -> None:
        args = parse_args(argv)
        run(args, load(args))

    return exit_status(PROG, work)


if __name__ == "__main__":
    sys.exit(main())
