"""``zeppelin bench converge``: a run started from a wrong hardware profile, fitting itself
online, reaches the decisions of a run started right, and by which iteration (issue 19 item 3).

Three zeppelin runs of the tiny GPT in one world (``bench train``'s runner: 4 gloo ranks, same
flags, seed and documents, so the same micro-batches in the same order), each refitting its
profile every ``--interval`` iterations (``--zeppelin-fit-interval``):

* ``right`` and ``right-again``: from the profile the run would use (``--zeppelin-hardware``,
  else the device's shipped one); two of them, because the fit measures a noisy machine, so two
  right starts need not pick the same plan for every micro-batch: their agreement is the floor;
* ``wrong``: from that profile made ``--attention`` x too fast on attention, ``--links`` x too
  fast inside a node and too slow across nodes, with no host work per ring step (what an
  unmeasured cluster looks like to a shipped profile).

Per micro-batch the plan each run ran (``StepLog.plan_names``, the portfolio's pick by
``Plan.name``); per window of ``--interval`` iterations (the first planned with the starting
profiles, the others after each refit): the share of micro-batches on which ``wrong`` picked
what the right runs picked (mean over the two), the right runs' agreement with each other, and
each run's median measured / estimated step. The wrong start has converged from the first
window after which its agreement stays within ``--tolerance`` of the floor; the target is
iteration 20. A first window where the wrong start already decides like the right ones is said:
that corpus and profile cannot show the convergence.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from collections import Counter

from megatron_zeppelin.bench.flags import port_number
from megatron_zeppelin.options import int_at_least, number_at_least, require
from megatron_zeppelin.output_paths import output_file

RUNS = ("right", "right-again", "wrong")
TARGET_ITERATION = 20


def wrong_profile(true, attention: float, links: float):
    """``true`` (a ``HardwareProfile``) wrong as the module doc says."""
    return dataclasses.replace(
        true, attention_tflops=tuple((n, t * attention) for n, t in true.attention_tflops),
        intra_gbyte_per_s=None if true.intra_gbyte_per_s is None else true.intra_gbyte_per_s * links,
        inter_gbit_per_s=None if true.inter_gbit_per_s is None else true.inter_gbit_per_s / links,
        ring_step_overhead_us=0.0,
        source=f"bench converge: {attention:g}x on attention, {links:g}x on links, no ring-step "
               f"host work, from {true.name}")


def agreement(a: list[dict], b: list[dict]) -> list[float]:
    """Per iteration, the share of micro-batches on which two runs' logs ran plans of the same
    name. ValueError when the runs saw other micro-batches (not the same documents)."""
    out = []
    for x, y in zip(a, b):
        if [list(s) for s in x["seqlens"]] != [list(s) for s in y["seqlens"]]:
            raise ValueError(f"iteration {x['iteration']}: the runs planned other micro-batches "
                             "(their documents differ): no decision to compare")
        same = sum(p == q for p, q in zip(x["plan_names"], y["plan_names"]))
        out.append(same / max(1, len(x["plan_names"])))
    return out


def windows(logs: dict[str, list[dict]], interval: int) -> list[dict]:
    """Per window of ``interval`` iterations: agreements and measured / estimated (module doc)."""
    right, again, wrong = (logs[name] for name in RUNS)
    floor = agreement(right, again)
    wrong_agrees = [(p + q) / 2 for p, q in zip(agreement(wrong, right), agreement(wrong, again))]
    rows = []
    for start in range(0, len(floor), interval):
        part = slice(start, start + interval)
        rows.append({"first": start + 1, "last": min(len(floor), start + interval),
                     "wrong": statistics.fmean(wrong_agrees[part]),
                     "floor": statistics.fmean(floor[part]),
                     **{f"step_{name}": statistics.median(r["seconds"] for r in logs[name][part])
                        for name in RUNS},
                     **{f"picks_{name}": picks(logs[name][part]) for name in RUNS},
                     **{f"ratio_{name}": statistics.median(
                         r["seconds"] / r["estimated_s"] for r in logs[name][part]
                         if r["estimated_s"] > 0) for name in RUNS}})
    return rows


def picks(logs: list[dict]) -> str:
    """The plans run in ``logs``, most used first: ``hybrid-dp 14, hierarchical 6``."""
    counts = Counter(name for r in logs for name in r["plan_names"])
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def converged_at(rows: list[dict], tolerance: float) -> int | None:
    """The first iteration of the first window from which the wrong start's agreement stays
    within ``tolerance`` of the floor (None: it never does)."""
    at = None
    for row in rows:
        if row["wrong"] >= row["floor"] - tolerance:
            at = row["first"] if at is None else at
        else:
            at = None
    return at


def bench_converge(args: argparse.Namespace) -> int:
    from megatron_zeppelin import fit
    from megatron_zeppelin.bench.train import (FIT_OWNED, Entry, layout_line, refuse_owned,
                                               run_entries, training_shape)

    require(args.interval >= 1, "--interval", args.interval, "an integer >= 1")
    require(args.iterations >= 3 * args.interval, "--iterations", args.iterations,
            f"at least 3 x --interval = {3 * args.interval} (windows before and after refits)")
    for flag, value in (("--attention", args.attention), ("--links", args.links)):
        require(value > 0, flag, value, "a number > 0")
    require(0 <= args.tolerance < 1, "--tolerance", args.tolerance, "in [0, 1)")
    refuse_owned(args.extra, FIT_OWNED)
    _, layout = training_shape(args.extra, args.iterations)
    from megatron_zeppelin.bench.decisions_rejudge import planner_of

    true = planner_of(args.extra).cost.hardware
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "wrong.yaml")
        fit.save_profile(wrong_profile(true, args.attention, args.links), path)
        fitted = {name: os.path.join(tmp, f"{name}.yaml") for name in RUNS}
        entries = [Entry("zeppelin", {"zeppelin-fit-interval": str(args.interval),
                                      "zeppelin-profile-out": fitted[name],
                                      **({"zeppelin-hardware": path} if name == "wrong" else {})})
                   for name in RUNS]
        print(f"tiny GPT, zeppelin mode, {layout_line(layout)}, {args.iterations} iterations "
              f"per run, refit every {args.interval}; right start: {true.name}; wrong start: "
              f"attention {args.attention:g}x, links {args.links:g}x, no ring-step host work",
              flush=True)
        results = run_entries(entries, args.iterations, args.extra, args.port)
        profiles = {name: open(f).read() for name, f in fitted.items() if os.path.exists(f)}
    logs = {}
    for name, (run_logs, refused) in zip(RUNS, results):
        if refused:
            raise SystemExit(f"zeppelin bench converge: {name}: {refused}")
        logs[name] = run_logs
    rows = windows(logs, args.interval)
    return report(rows, args, logs, profiles)


def report(rows: list[dict], args: argparse.Namespace, logs: dict | None = None,
           profiles: dict | None = None) -> int:
    """Print the windows (agreement, measured / estimated step, median step, the plans each
    run ran) and the verdict; ``--json`` (with every run's logs and last fitted profile, as
    YAML text that ``--zeppelin-hardware`` reads)."""
    print(f"{'iterations':>10} {'wrong agrees':>12} {'right vs right':>14} "
          f"{'measured/est: right':>19} {'again':>6} {'wrong':>6} {'step s: right':>13} "
          f"{'again':>6} {'wrong':>6}")
    for r in rows:
        print(f"{r['first']:>4}-{r['last']:<5} {r['wrong']:12.0%} {r['floor']:14.0%} "
              f"{r['ratio_right']:18.2f}x {r['ratio_right-again']:5.2f}x {r['ratio_wrong']:5.2f}x"
              f" {r['step_right']:13.2f} {r['step_right-again']:6.2f} {r['step_wrong']:6.2f}")
        print(f"{'':10} plans: right {r['picks_right']}; wrong {r['picks_wrong']}")
    at = converged_at(rows, args.tolerance)
    if rows[0]["wrong"] >= rows[0]["floor"] - args.tolerance:
        print("the wrong start decided like the right ones before any refit: this corpus and "
              "profile cannot show convergence")
    verdict = "never" if at is None else f"from iteration {at}"
    ok = at is not None and at <= TARGET_ITERATION + 1
    print(f"wrong start agrees with the right starts (within {args.tolerance:.0%} of their "
          f"agreement with each other): {verdict}; target: by iteration {TARGET_ITERATION}: "
          f"{'met' if ok else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "converged_at": at, "flags": args.extra,
                       "runs": {name: [{k: r[k] for k in ("iteration", "plan_names", "seconds",
                                                          "estimated_s", "seqlens")}
                                       for r in run] for name, run in (logs or {}).items()},
                       "profiles": profiles or {}},
                      f, indent=1)
    return 0


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("converge", help="a run started from a wrong profile reaches the "
                           "right decisions by fitting online: by which iteration (CPU, 4 ranks)")
    p.add_argument("--iterations", type=int_at_least(1), default=30)
    p.add_argument("--interval", type=int_at_least(1), default=5,
                   help="refit every N iterations")
    p.add_argument("--attention", type=number_at_least(0, exclusive=True), default=2.0,
                   help="the wrong start's attention rates: this many times too fast")
    p.add_argument("--links", type=number_at_least(0, exclusive=True), default=3.0,
                   help="the wrong start's links: this many times too fast inside a node, "
                   "too slow across nodes")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="agreement this close to the floor counts as converged")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the windows here")
    p.add_argument("--port", type=port_number(), default=29751)
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    p.set_defaults(func=bench_converge)
