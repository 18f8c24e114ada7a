"""``zeppelin bench decisions``: is the portfolio's pick the measured-fastest candidate?

Zeppelin's portfolio (``planner/portfolio.py``) scores every candidate plan of a micro-batch by
its step estimate and keeps the lowest. This benchmark measures every candidate instead: on 4
gloo ranks (the tiny GPT of ``bench train``, the same training flags and layout: by default 2
emulated nodes x 2, stated in the header line), for
``--batches`` micro-batches sampled from the corpus (every ``--stride``-th of the stream), each
candidate's plan runs a real training step through the engine (forward + backward of one
micro-batch and the gradient all-reduce, no optimizer step; the slowest rank's time). The
candidates run round-robin, ``--repeats`` times each after ``--warmup`` untimed rounds, so that
the machine's load hits them alike; a candidate's time is its median.

Printed per micro-batch: each candidate's estimate and measurement, the portfolio's pick
(``Plan.candidate``, the configured planner backend) and the measured fastest, the pick's regret
(its measured step / the fastest's - 1) and Spearman's rank correlation of estimates vs
measurements (ties share their mean rank). Summary: pick accuracy (the share of micro-batches
whose pick is the measured fastest; and within ``--tolerance`` of it, since candidates closer
than the machine's noise are a coin toss), the repeats' spread, median and geometric-mean
regret (geomean of 1 + regret, minus 1), median correlation. Then the pick against each
peer's own plan among the candidates (hybrid DP at Megatron's default cap, Hydraulis, static CP
at each size): its speedup over the same micro-batches, measured in the same rounds, so far
less noisy than whole training runs compared one after the other (``bench train``), though
without the optimizer step. ``--json FILE`` writes all of it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from megatron_zeppelin.bench.decisions_stats import ALPHA, TEST, indistinguishable, ranks, \
    smallest_p
from megatron_zeppelin.bench.measure_candidates import SAME
from megatron_zeppelin.bench.train import OWNED, RANKS, YAML, layout_line, refuse_owned
from megatron_zeppelin.bench.workers import free_port
from megatron_zeppelin.sim.report import geomean

NAME = "zeppelin"  # the strategy whose portfolio is judged
MEASURING = {"batches": 8, "stride": 3, "repeats": 5, "warmup": 1, "port": 0}  # defaults


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the ranks); None below 2 values or when
    either side is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} estimates but {len(ys)} measurements")
    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


@dataclass(frozen=True)
class Decision:
    """One micro-batch: candidates (names, estimated and measured median step seconds), the
    portfolio's pick, the measured fastest, the pick's regret and the rank correlation."""

    index: int
    lengths: tuple[int, ...]
    names: tuple[str, ...]
    estimated_s: tuple[float, ...]
    measured_s: tuple[float, ...]
    pick: str
    fastest: str
    regret: float
    spearman: float | None
    noise: float = 0.0  # median over candidates of (slowest - fastest repeat) / median
    repeats: tuple[tuple[float, ...], ...] = ()  # each candidate's timed steps; () if unknown

    @property
    def right(self) -> bool:
        return self.pick == self.fastest

    @property
    def tied(self) -> bool | None:
        """The pick is the fastest or not shown slower than it (``decisions_stats``); None
        without the repeats."""
        if self.right:
            return True
        if not self.repeats:
            return None
        return indistinguishable(self.repeats[self.names.index(self.pick)],
                                 self.repeats[self.names.index(self.fastest)])


def decide(index: int, lengths: Sequence[int], names: Sequence[str],
           estimated: Sequence[float], measured: Sequence[float], pick: str,
           noise: float = 0.0, repeats: Sequence[Sequence[float]] = ()) -> Decision:
    """Score one micro-batch's pick against the measurements (``names`` aligned with them
    and with ``repeats``, each candidate's timed steps, when given)."""
    if pick not in names:
        raise ValueError(f"the pick {pick!r} is not among the candidates {list(names)}")
    if repeats and len(repeats) != len(names):
        raise ValueError(f"{len(repeats)} candidates' repeats for {len(names)} candidates")
    best = min(range(len(names)), key=lambda i: (measured[i], i))
    regret = measured[names.index(pick)] / measured[best] - 1.0
    return Decision(index, tuple(lengths), tuple(names), tuple(estimated), tuple(measured),
                    pick, names[best], regret, spearman(estimated, measured), noise,
                    tuple(tuple(r) for r in repeats))


def summarize(decisions: Sequence[Decision], tolerance: float = 0.05) -> dict:
    """Pick accuracy (%), and the share of picks within ``tolerance`` of the measured fastest
    (candidates closer than the machine's noise are a coin toss), median and geomean regret,
    median and mean Spearman correlation, median noise of the repeats."""
    if not decisions:
        raise ValueError("no micro-batch measured")
    regrets = [d.regret for d in decisions]
    corr = [d.spearman for d in decisions if d.spearman is not None]
    return {"micro_batches": len(decisions),
            "pick_accuracy_pct": 100.0 * sum(d.right for d in decisions) / len(decisions),
            "tolerance": tolerance,
            "pick_within_tolerance_pct": 100.0 * sum(d.regret <= tolerance for d in decisions)
            / len(decisions),
            "median_noise": statistics.median(d.noise for d in decisions),
            "median_regret": statistics.median(regrets),
            "geomean_regret": geomean([1.0 + r for r in regrets]) - 1,
            "max_regret": max(regrets),
            "median_spearman": statistics.median(corr) if corr else None,
            "mean_spearman": statistics.fmean(corr) if corr else None} | _tied(decisions)


def _tied(decisions: Sequence[Decision]) -> dict:
    """The share of picks indistinguishable from the measured fastest (``TEST`` at ``ALPHA``
    on the repeats; None when a micro-batch has no repeats) and the test's resolution."""
    tied = [d.tied for d in decisions]
    sizes = [len(r) for d in decisions for r in d.repeats]
    return {"test": f"{TEST}, alpha {ALPHA}",
            "pick_indistinguishable_pct": None if None in tied else
            100.0 * sum(tied) / len(tied),
            "test_smallest_p": smallest_p(min(sizes), min(sizes)) if sizes else None}


PEER_PREFIXES = ("hybrid-dp", "hydraulis", "static-cp(")  # the peers' own plans


def peer_plans(decision: Decision) -> dict[str, int]:
    """``{peer's plan: index of the measured candidate that is it}`` for the candidates that
    are a peer's plan at a setting fixed across micro-batches (hybrid DP at Megatron's default
    cap, Hydraulis, static CP at each size; not hybrid DP at a cap derived from the batch's
    longest document, whose setting changes from batch to batch). A measured candidate
    standing for several names (the same plan: ``SAME``) counts for each."""
    out = {}
    for i, merged in enumerate(decision.names):
        for name in merged.split(SAME):
            if name.startswith(PEER_PREFIXES) and "(cap=" not in name:
                out[name] = i
    return out


def versus_peers(decisions: Sequence[Decision]) -> dict[str, dict]:
    """Per peer's plan (``peer_plans``): the pick's measured speedup over it on the same
    micro-batches (its median step / the pick's, measured interleaved), geomean and median
    over the micro-batches, and where the pick is faster or slower, in all and shown by the
    rank-sum test on the repeats (``decisions_stats``)."""
    rows: dict[str, list[tuple[float, bool | None]]] = {}
    for d in decisions:
        mine = d.names.index(d.pick)
        for peer, i in peer_plans(d).items():
            shown = None if not d.repeats else \
                not indistinguishable(d.repeats[mine], d.repeats[i])
            rows.setdefault(peer, []).append((d.measured_s[i] / d.measured_s[mine], shown))
    return {peer: {"micro_batches": len(got), "geomean": geomean([r for r, _ in got]),
                   "median": statistics.median(r for r, _ in got),
                   "faster": sum(r > 1 for r, _ in got), "slower": sum(r < 1 for r, _ in got),
                   "faster_shown": sum(r > 1 and bool(t) for r, t in got),
                   "slower_shown": sum(r < 1 and bool(t) for r, t in got)}
            for peer, got in rows.items()}


def peer_lines(peers: dict[str, dict]) -> list[str]:
    """One line per peer's plan (``versus_peers``)."""
    return [f"the pick vs {peer}, the same {v['micro_batches']} micro-batch(es) measured "
            f"interleaved: geomean {v['geomean']:.3f}x, median {v['median']:.3f}x (> 1: the "
            f"pick is faster); faster in {v['faster']} ({v['faster_shown']} shown by the "
            f"test), slower in {v['slower']} ({v['slower_shown']} shown)"
            for peer, v in sorted(peers.items())]


def lines_of(decision: Decision) -> list[str]:
    """The printed block of one micro-batch."""
    rho = "n/a" if decision.spearman is None else f"{decision.spearman:+.2f}"
    head = (f"micro-batch {decision.index}: {len(decision.lengths)} sequences, longest "
            f"{max(decision.lengths)}; pick {decision.pick} "
            f"({'the measured fastest' if decision.right else 'fastest: ' + decision.fastest}"
            f"), regret {100 * decision.regret:+.1f}%, Spearman {rho}; repeats' spread "
            f"{100 * decision.noise:.0f}%")
    width = max(len(n) for n in decision.names)
    rows = [f"  {n:>{width}}: estimate {1e3 * e:8.1f} ms, measured {1e3 * m:8.1f} ms "
            f"({m / e:4.2f}x)" + (" <- pick" if n == decision.pick else "")
            for n, e, m in zip(decision.names, decision.estimated_s, decision.measured_s)]
    return [head, *rows]


def summary_line(s: dict) -> str:
    corr = "n/a" if s["median_spearman"] is None else \
        f"{s['median_spearman']:+.2f} (mean {s['mean_spearman']:+.2f})"
    return (f"{s['micro_batches']} micro-batches: pick = measured fastest in "
            f"{s['pick_accuracy_pct']:.0f}%, within {100 * s['tolerance']:.0f}% of it in "
            f"{s['pick_within_tolerance_pct']:.0f}%; regret median "
            f"{100 * s['median_regret']:+.1f}%, "
            f"geomean {100 * s['geomean_regret']:+.1f}%, max {100 * s['max_regret']:+.1f}%; "
            f"Spearman estimate vs measured: median {corr}; repeats' spread (median) "
            f"{100 * s['median_noise']:.0f}%; " + tied_line(s))


def tied_line(s: dict) -> str:
    """The statistical figure, beside the strict one (never instead of it)."""
    if s["pick_indistinguishable_pct"] is None:
        return f"indistinguishable from the fastest ({s['test']}): unavailable (no repeats stored)"
    line = (f"pick indistinguishable from the measured fastest ({s['test']} on the repeats) "
            f"in {s['pick_indistinguishable_pct']:.0f}%")
    if s["test_smallest_p"] is not None and s["test_smallest_p"] >= ALPHA:
        line += (f" (at these repeats the smallest p is {s['test_smallest_p']:.2f}: the test "
                 "cannot separate any two candidates)")
    return line


def bench_decisions(args: argparse.Namespace) -> int:
    from megatron_zeppelin.bench.measure_candidates import run_world

    if not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance={args.tolerance} is invalid: expected 0 <= it < 1")
    if args.rejudge:
        from megatron_zeppelin.bench.decisions_rejudge import rejudge

        for name, default in MEASURING.items():
            if getattr(args, name) != default:
                raise ValueError(f"--{name}={getattr(args, name)} measures: --rejudge "
                                 f"{args.rejudge} takes the file's measurements (drop one)")
        if args.json and Path(args.json).resolve() == Path(args.rejudge).resolve():
            raise ValueError(f"--json={args.json} is invalid: it is the --rejudge file (the "
                             "measurements would be overwritten); name another file")
        return report(rejudge(args.rejudge, args.extra), args, {"rejudged": args.rejudge})
    for name in ("batches", "stride", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: expected an "
                             "integer >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} is invalid: expected an integer >= 0")
    refuse_owned(args.extra, {**OWNED, "--train-iters": "it measures --batches sampled "
                              "micro-batches, no training steps"})
    argv = ["--yaml-cfg", str(YAML), *args.extra, "--context-parallel-mode", "zeppelin",
            "--zeppelin-strategy", NAME]
    layout = _validate(argv)
    print(f"tiny GPT ({YAML.name} + {' '.join(args.extra) or 'no flags'}), "
          f"{layout_line(layout)}; {args.batches} micro-batch(es), every {args.stride}th of the stream; "
          f"each candidate {args.repeats} timed step(s) round-robin after {args.warmup} "
          "untimed round(s); fwd + bwd + grad all-reduce, slowest rank, median", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "decisions.json")
        run_world(argv, vars(args) | {"extra": None, "func": None, "port": args.port or
                                      free_port()}, out)
        measured = json.loads(Path(out).read_text())
    return report([decide(**m) for m in measured], args, {
        "batches": args.batches, "stride": args.stride, "repeats": args.repeats,
        "warmup": args.warmup})


def report(decisions: Sequence[Decision], args: argparse.Namespace, meta: dict) -> int:
    """Print every micro-batch's block and the summary; ``--json``: write them with ``meta``."""
    for d in decisions:
        print("\n".join(lines_of(d)))
    s = summarize(decisions, args.tolerance)
    peers = versus_peers(decisions)
    print("\n".join([summary_line(s), *peer_lines(peers)]))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "summary": s, "versus_peers": peers,
            "micro_batches": [asdict(d) | {"right": d.right} for d in decisions],
            "flags": args.extra} | meta, indent=2) + "\n")
    return 0


def _validate(argv: list[str]):
    """The training flags, checked once before any process starts (ConfigError: exit 2);
    their pool layout."""
    from megatron_zeppelin.megatron.loop import args as train_args

    args = train_args.parse_args(argv)
    return train_args.validate_args(args, RANKS, RANKS)


def register(targets: argparse._SubParsersAction) -> None:
    from megatron_zeppelin.bench.flags import port_number
    from megatron_zeppelin.options import nonempty
    from megatron_zeppelin.output_paths import output_file

    p = targets.add_parser("decisions", help="the portfolio's pick vs every candidate "
                           "measured per micro-batch (CPU, 4 ranks)", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=MEASURING["batches"],
                   help="micro-batches measured")
    p.add_argument("--stride", type=int, default=MEASURING["stride"],
                   help="measure every STRIDE-th micro-batch of the stream")
    p.add_argument("--repeats", type=int, default=MEASURING["repeats"],
                   help="timed steps per candidate")
    p.add_argument("--warmup", type=int, default=MEASURING["warmup"],
                   help="untimed rounds first")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="a pick within this fraction of the measured fastest is also counted")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the results here")
    p.add_argument("--rejudge", type=nonempty, default=None, metavar="FILE",
                   help="no training: re-estimate the candidates of a --json FILE's "
                   "micro-batches with the current model and judge them on its measurements "
                   "(training flags: the file's, or those given after --)")
    p.add_argument("--port", type=port_number(free=True), default=MEASURING["port"],
                   help="the ranks' rendezvous port (0: a free one)")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    p.set_defaults(func=bench_decisions)
