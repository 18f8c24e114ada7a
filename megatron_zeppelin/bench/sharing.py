"""``zeppelin bench sharing``: how ranks that share this machine's cores finish unequal work
(issue 19: the estimate's ``shared_peak`` on the emulated CPU cluster, measured).

4 forked processes (one intra-op thread each, as the emulated cluster's ranks) start together
(a gloo barrier) and each runs ``counts[rank]`` units of a layer's compute (``contention.
layer_work``: the tiny GPT's GEMMs and non-GEMM kernels); the makespan is the slowest rank's
time, the median over ``--repeats``. The mix where every rank runs the same count gives the
time of one unit **while all ranks compute** (``u``): the basis of the CPU hardware profile,
which was fitted with all ranks busy. Each other mix is then predicted from ``counts x u``:

* ``estimate``: ``estimate.shared_peak`` with ``shared_by`` = ranks / cores (what the planner
  prices a wave of unequal per-rank work at);
* ``ideal``: the best schedule of the jobs on the cores, ``max(peak / shared_by, mean)`` (a
  scheduler that always runs the longest job; the estimate's formula until 2026-11-27);
* ``fair``: egalitarian processor sharing (Linux's CFS: every runnable rank gets
  ``min(1, cores / runnable)`` of a core), the simulator's ``sim/sharing.py`` timeline.

Printed per mix: measured makespan and each prediction's ratio (measured / predicted); then
each model's geometric-mean |log error| and largest error over the unequal mixes. Run it where
nothing else runs (``docs/benchmarks.md``: autogroup scheduling).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

RANKS = 4
MIXES = ((20, 20, 20, 20), (40, 20, 10, 10), (40, 40, 10, 10), (40, 10, 10, 10),
         (40, 0, 0, 0), (40, 30, 20, 10), (40, 40, 40, 0), (40, 35, 5, 5), (30, 30, 0, 0))


def _worker(rank: int, model, mixes: tuple, repeats: int) -> list[list[float]]:
    """One rank: per mix, per repeat, its own seconds (all ranks start at a barrier)."""
    import torch
    import torch.distributed as dist

    from megatron_zeppelin.bench.contention import layer_work

    torch.set_num_threads(1)
    work = layer_work(model)
    work()  # warm-up
    out = []
    for counts in mixes:
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(counts[rank]):
                work()
            times.append(time.perf_counter() - start)
        out.append(times)
    return out


def measure(model, mixes: tuple, repeats: int) -> list[float]:
    """Median makespan (seconds) of each mix on ``RANKS`` forked ranks."""
    from megatron_zeppelin.bench.workers import run_forked

    per_rank = run_forked(_worker, RANKS, (model, mixes, repeats), timeout_s=900.0,
                          gloo_timeout_s=600.0, what="core-sharing measurement")
    return [statistics.median(max(per_rank[r][m][i] for r in range(RANKS))
                              for i in range(repeats)) for m in range(len(mixes))]


def predictions(counts: tuple, unit_loaded_s: float, shared_by: float) -> dict[str, float]:
    """Each model's makespan of ``counts`` units per rank (module doc)."""
    from megatron_zeppelin.estimate import shared_peak
    from megatron_zeppelin.sim.sharing import shared_finish

    loaded = [c * unit_loaded_s for c in counts]
    alone = [s / shared_by for s in loaded]
    return {"estimate": shared_peak(loaded, shared_by),
            "ideal": max(max(alone), sum(loaded) / len(loaded)),
            "fair": max(shared_finish([0.0] * len(alone), alone, len(alone) / shared_by))}


def _check(p: argparse.ArgumentParser, args) -> tuple:
    """The mixes of ``--mixes`` (``a,b,c,d;...``), the first all equal; bad values exit 2."""
    try:
        mixes = tuple(tuple(int(c) for c in m.split(",")) for m in args.mixes.split(";"))
    except ValueError:
        mixes = ()
    if not mixes or any(len(m) != RANKS or min(m) < 0 or max(m) == 0 for m in mixes) or \
            len(set(mixes[0])) != 1:
        p.error(f"--mixes={args.mixes!r} is invalid: expected ';'-separated mixes of {RANKS} "
                "integers >= 0 (units per rank, not all 0), the first with all counts equal")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} is invalid: expected an integer >= 1")
    return mixes


def run(argv: list[str]) -> dict:
    from megatron_zeppelin.config import load_model

    from megatron_zeppelin.bench.flags import ExitParser
    from megatron_zeppelin.output_paths import output_file

    p = ExitParser(prog="zeppelin bench sharing", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixes", default=";".join(",".join(map(str, m)) for m in MIXES),
                   help="units of compute per rank, one mix per ';' (the first all equal)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each mix")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the rows here")
    args = p.parse_args(argv)
    mixes = _check(p, args)
    cores = len(os.sched_getaffinity(0))
    shared_by = max(1.0, RANKS / cores)
    load0 = os.getloadavg()[0]
    made = measure(load_model("gpt-tiny"), mixes, args.repeats)
    unit = made[0] / mixes[0][0]
    print(f"core sharing: {RANKS} processes on {cores} cores (shared_by {shared_by:g}), a unit "
          f"= one gpt-tiny layer's compute, {unit * 1e3:.2f} ms while all compute; "
          f"{args.repeats} repeats; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'units per rank':16} {'measured s':>10} {'/estimate':>9} {'/ideal':>7} {'/fair':>7}")
    rows, errors = [], {"estimate": [], "ideal": [], "fair": []}
    for counts, seconds in zip(mixes, made):
        pred = predictions(counts, unit, shared_by)
        rows.append({"counts": counts, "measured_s": seconds, **pred})
        print(f"{','.join(map(str, counts)):16} {seconds:10.3f} " +
              " ".join(f"{seconds / pred[k]:{w}.2f}x" for k, w in
                       (("estimate", 8), ("ideal", 6), ("fair", 6))))
        if len(set(counts)) > 1:
            for k in errors:
                errors[k].append(abs(math.log(seconds / pred[k])))
    summary = {k: (math.exp(statistics.fmean(v)) - 1, math.exp(max(v)) - 1)
               for k, v in errors.items() if v}
    for k, (mean, worst) in summary.items():
        print(f"{k}: geometric-mean |error| {mean:.1%}, largest {worst:.1%} "
              f"({len(errors[k])} unequal mixes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit_s": unit, "cores": cores, "rows": rows, "summary": summary,
                       "load": [load0, os.getloadavg()[0]]}, f, indent=1)
    return {"rows": rows, "summary": summary}


def register(targets) -> None:
    from megatron_zeppelin.bench import register_passthrough

    register_passthrough(targets, "sharing", "unequal work on ranks sharing the cores: "
                         "measured makespan vs the estimate's shared_peak (sharing.py)", run)
