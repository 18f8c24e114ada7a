"""``zeppelin bench online``: what the online profile fit costs and what it corrects.

The tiny GPT of ``bench train`` (4 gloo ranks, same layout, same seed: the same documents)
in zeppelin mode, three ways, ``--repeats`` rounds alternating so that load drifts hit all:

* ``off``: no measurement (``--zeppelin-fit-interval 0``);
* ``measure``: the probe on every micro-batch, no refit inside the run (interval past the
  end): the measurement overhead alone, same plans as ``off``;
* ``fit``: measured and refitted every ``--interval`` iterations (plans change after each
  switch).

Per way: the median step time (first ``--warmup`` iterations dropped), its overhead over
``off``, and the median of measured / estimated step time before the first refit and after
the last (the estimate's error the fit removes). ``--profile-out`` keeps the last fitted
profile (pass it as ``--zeppelin-hardware`` or ``zeppelin plan --hardware``).
"""
from __future__ import annotations

import argparse
import statistics

from megatron_zeppelin.bench.train import (FIT_OWNED, Entry, layout_line, refuse_owned,
                                           run_entries, training_shape)
from megatron_zeppelin.bench.flags import check_ports, port_number
from megatron_zeppelin.options import int_at_least, require
from megatron_zeppelin.output_paths import output_file


def _ratio(logs: list[dict]) -> str:
    ratios = [r["seconds"] / r["estimated_s"] for r in logs if r.get("estimated_s")]
    return f"{statistics.median(ratios):.2f}x" if ratios else "n/a"


def bench_online(args: argparse.Namespace) -> int:
    require(args.interval >= 1, "--interval", args.interval, "an integer >= 1")
    require(args.iterations >= 2 * args.interval, "--iterations", args.iterations,
            f"at least 2 x --interval = {2 * args.interval} (a refit, then iterations after it)")
    require(0 <= args.warmup < args.iterations, "--warmup", args.warmup,
            f"in [0, --iterations={args.iterations})")
    check_ports("--port", args.port, args.repeats)  # one world per round
    ways = {"off": {"zeppelin-fit-interval": "0"},
            "measure": {"zeppelin-fit-interval": str(args.iterations + 1)},
            "fit": {"zeppelin-fit-interval": str(args.interval),
                    **({"zeppelin-profile-out": args.profile_out} if args.profile_out else {})}}
    refuse_owned(args.extra, FIT_OWNED)
    _, layout = training_shape(args.extra, args.iterations)
    print(f"tiny GPT, zeppelin mode, {layout_line(layout)}, {args.iterations} steps per "
          f"run, first {args.warmup} dropped, {args.repeats} rounds alternating")
    steps: dict[str, list[float]] = {way: [] for way in ways}
    logs: dict[str, list[dict]] = {}
    names = list(ways)
    for round_ in range(args.repeats):  # one world per round; each way first in turn
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        results = run_entries([Entry("zeppelin", ways[way]) for way in order], args.iterations,
                              args.extra, args.port + round_)
        for way, (run_logs, refused) in zip(order, results):
            if refused:
                raise SystemExit(f"zeppelin bench online: {way}: {refused}")
            logs[way] = run_logs
            steps[way].extend(r["seconds"] for r in run_logs[args.warmup:])
    base = statistics.median(steps["off"])
    for way in ways:
        median = statistics.median(steps[way])
        print(f"{way:>8}: median step {median:.4f} s, overhead {100 * (median / base - 1):+.2f}%"
              f" vs off; measured/estimated step: first {args.interval} iterations "
              f"{_ratio(logs[way][:args.interval])}, last {args.interval} "
              f"{_ratio(logs[way][-args.interval:])}")
    print("measure vs off is the probe's cost (same plans); the target is under 1%")
    return 0


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("online", help="online profile fit: probe overhead and estimate "
                           "error before/after (CPU, 4 ranks)")
    p.add_argument("--iterations", type=int_at_least(1), default=16)
    p.add_argument("--warmup", type=int_at_least(0), default=2)
    p.add_argument("--interval", type=int_at_least(1), default=4,
                   help="refit every N iterations (fit)")
    p.add_argument("--repeats", type=int_at_least(1), default=3)
    p.add_argument("--profile-out", type=output_file(), default=None,
                   metavar="FILE", help="write the fitted profile here (YAML)")
    p.add_argument("--port", type=port_number(), default=29711,
                   help="first rendezvous port (one per round, counting up)")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    p.set_defaults(func=bench_online)
