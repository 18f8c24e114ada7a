#!/usr/bin/env python
"""Measure every strategy training the tiny GPT on the three corpora; write a Markdown table.

    python scripts/bench_corpora.py                      # the measurement (quiet machine!)
    python scripts/bench_corpora.py --smoke              # 3 steps, 1 round, no tuning: a try
    python scripts/bench_corpora.py --output docs/bench-corpora.md
    python scripts/bench_corpora.py --best-peers --rounds 5   # zeppelin vs the best peers only
    python scripts/bench_corpora.py --best-peers --control    # + zeppelin again: noise floor

For each corpus of ``scripts/make_corpora.py`` (written to ``--corpora`` first when missing)
this runs ``zeppelin bench train --tune --strategies ... -- --data-path CORPUS`` (4 gloo ranks
as 2 nodes x 2, every strategy on the same documents and seed, rounds interleaved, each peer's
knob swept by measurement first) and keeps its JSON next to the table. The table gives, per
corpus, each strategy's median step, tokens/s, zeppelin's speedup over it (its median step /
zeppelin's), how it placed the sequences (local / ring in a node / ring across nodes: where
zeppelin loses, this says why) and its tuning; then zeppelin's speedup over each peer across the corpora
(geometric mean and median) and its wins and losses per corpus. ``static`` (static mode: TE /
Megatron CP over the whole pool, i.e. both nodes) is the paper's baseline, reported but not
counted as a peer. A strategy that cannot run is listed with its reason.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_zeppelin.bench.paired import Paired, paired  # noqa: E402
from megatron_zeppelin.errors import ConfigError  # noqa: E402
from megatron_zeppelin.options import Parser, exit_status, int_at_least  # noqa: E402
from megatron_zeppelin.output_paths import make_folder, writable_folder  # noqa: E402
from megatron_zeppelin.sim.report import geomean  # noqa: E402

PROG = "bench_corpora.py"

BASELINE = "static"  # two-node TE CP: the paper's baseline, not a peer
STRATEGIES = ("static", "zeppelin", "static-cp", "static-cp-best", "hybrid-dp",
              "megatron-hybrid-cp", "megatron-dynamic-cp", "hydraulis", "flexsp")
# per corpus: the fastest peers measured (docs/bench-corpora.md), at their tuned knobs:
# --best-peers measures zeppelin against these alone, without the sweep
HYBRID_4K = "hybrid-dp:max-seqlen-per-dp-cp-rank=4096"
BEST_PEERS = {"longtail": ["static-cp:zeppelin-cp-size=1", HYBRID_4K],
              "arxiv": ["static-cp:zeppelin-cp-size=1", HYBRID_4K],
              "prolong": ["static-cp:zeppelin-cp-size=2", HYBRID_4K]}
# per corpus: flags that keep a micro-batch at 16K tokens and its longest documents whole
CORPUS_FLAGS = {"longtail": [], "arxiv": [],
                "prolong": ["--seq-length", "8192", "--micro-batch-size", "2"]}


def strategies() -> list[str]:
    """The strategies measured: ``STRATEGIES`` minus megatron-dynamic-cp where the installed
    megatron-core lacks it (said in the table)."""
    from megatron_zeppelin.planner import STRATEGIES as REGISTERED

    return [s for s in STRATEGIES if s == BASELINE or s in REGISTERED]


def ensure_corpora(folder: Path, corpora: list[str]) -> None:
    """Write those of ``corpora`` missing from ``folder`` (``make_corpora.py``)."""
    missing = [name for name in corpora if not (folder / f"{name}.idx").exists()]
    if missing:
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_corpora.py"),
                               "--output", str(folder), "--corpus", *missing])
        if done.returncode:
            raise SystemExit(f"{PROG}: make_corpora.py failed (exit status {done.returncode})")


def measure(corpus: str, folder: Path, out: Path, args: argparse.Namespace) -> dict:
    """``zeppelin bench train`` on one corpus; its JSON."""
    chosen = ["zeppelin", *BEST_PEERS[corpus]] if args.best_peers else strategies()
    command = [sys.executable, "-m", "megatron_zeppelin.cli", "bench", "train",
               "--strategies", ",".join(chosen), "--iterations", str(args.iterations),
               "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--json", str(out),
               *(["--control"] if args.control else []),
               *(["--tune"] if args.tune and not args.best_peers else []), "--",
               "--data-path", str(folder / corpus),
               *CORPUS_FLAGS[corpus]]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT)
    if done.returncode not in (0, 1):  # 1: the losses differ, which the table shows
        raise SystemExit(f"bench train on {corpus} failed (exit status {done.returncode})")
    return json.loads(out.read_text())


def corpus_table(corpus: str, result: dict) -> list[str]:
    """One corpus: a row per strategy (zeppelin's speedup over it: its median / zeppelin's)."""
    ran, refused = result["strategies"], result.get("refused", {})
    zeppelin = ran["zeppelin"]["median_step_s"] if "zeppelin" in ran else None
    lines = [f"### {corpus}", "", "| strategy | median step (s) | tokens/s | zeppelin speedup "
             "| paired, step by step | per round | final loss "
             "| sequences local / intra / inter | tuning |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in ran.items():
        label = f"{name} (the paper's baseline: TE CP over both nodes)" if name == BASELINE \
            else name
        speedup = f"{r['median_step_s'] / zeppelin:.2f}x" if zeppelin else "-"
        tiers = " / ".join(map(str, r.get("sequences_local_intra_inter", ["-"] * 3)))
        spread = round_ratios(result, name)
        spread = f"{min(spread):.2f}-{max(spread):.2f}x" if spread else "-"
        pair = paired_speedup(result, name)
        lines.append(f"| {label} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{speedup} | {pair.text() if pair else '-'} | {spread} | "
                     f"{r['final_loss']:.5f} | {tiers} | "
                     f"{r['tuning'] or 'as given'} |")
    for name, reason in refused.items():
        lines.append(f"| {name} | not run | | | | | | | {reason} |")
    return lines + [""]


def paired_speedup(result: dict, name: str) -> Paired | None:
    """Zeppelin's speedup over ``name`` step by step (``bench/paired.py``: the same steps'
    times divided, summarised per round; with its 95% confidence interval); None for zeppelin
    itself or a run that stopped short."""
    ran = result["strategies"]
    mine, theirs = (ran.get(n, {}).get("steps_s") for n in ("zeppelin", name))
    if name == "zeppelin" or not mine or not theirs or len(mine) != len(theirs):
        return None
    return paired(theirs, mine, result["iterations"] - result["warmup"])


def round_ratios(result: dict, name: str) -> list[float]:
    """Zeppelin's speedup over ``name`` in each interleaved round (the strategy's median step
    of the round / zeppelin's): the spread the machine's load left (empty for zeppelin)."""
    ran = result["strategies"]
    if name == "zeppelin" or "steps_s" not in ran.get("zeppelin", {}):
        return []
    per = result["iterations"] - result["warmup"]

    def rounds(steps: list[float]) -> list[float]:
        return [statistics.median(steps[i:i + per]) for i in range(0, len(steps), per)]

    return [a / b for a, b in zip(rounds(ran[name]["steps_s"]),
                                  rounds(ran["zeppelin"]["steps_s"]))]


def median_speedup(result: dict, name: str) -> float | None:
    """Zeppelin's speedup over ``name``: its median step / zeppelin's."""
    ran = result["strategies"]
    return ran[name]["median_step_s"] / ran["zeppelin"]["median_step_s"]


def paired_ratio(result: dict, name: str) -> float | None:
    """Zeppelin's paired speedup over ``name`` (``paired_speedup``), the ratio alone."""
    pair = paired_speedup(result, name)
    return pair.ratio if pair else None


def speedups(results: dict[str, dict], measure=median_speedup, baseline: bool = False
             ) -> dict[str, dict[str, float]]:
    """``{peer: {corpus: zeppelin's speedup by measure}}`` over every peer that ran (not the
    baseline: ``baseline=True`` gives it alone; not zeppelin's A/A control)."""
    out: dict[str, dict[str, float]] = {}
    for corpus, result in results.items():
        ran = result["strategies"]
        if "zeppelin" not in ran:
            continue
        for name in ran:
            skip = name.startswith("zeppelin") or (name == BASELINE) != baseline
            value = None if skip else measure(result, name)
            if value is not None:
                out.setdefault(name, {})[corpus] = value
    return out


def summary(results: dict[str, dict], measure=median_speedup) -> list[str]:
    """Zeppelin vs each peer across corpora (geomean, median, wins/losses), vs the best peer
    of each corpus, and vs the paper's baseline, by ``measure``."""
    per_peer = speedups(results, measure)
    baseline = speedups(results, measure, baseline=True).get(BASELINE)
    corpora = list(results)
    lines = ["| zeppelin vs | " + " | ".join(corpora) + " | geomean | median | wins / losses |",
             "|---" * (len(corpora) + 4) + "|"]
    rows = dict(per_peer)
    best = {c: min(v[c] for v in per_peer.values() if c in v) for c in corpora
            if any(c in v for v in per_peer.values())}
    rows["best peer of each corpus"] = best
    if baseline:
        rows[f"{BASELINE} (paper's baseline)"] = baseline
    for name, values in rows.items():
        got = list(values.values())
        wins, losses = sum(v > 1 for v in got), sum(v < 1 for v in got)
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.2f}x" if c in values else "-"
                                                  for c in corpora) +
                     f" | {geomean(got):.2f}x | {statistics.median(got):.2f}x | "
                     f"{wins} / {losses} |")
    return lines


def tuning_note(args: argparse.Namespace) -> str:
    if args.best_peers:
        return ", no tuning; zeppelin vs the best peers of each corpus at their tuned knobs"
    return ", each peer tuned by measurement first" if args.tune else ", no tuning"


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    head = ["## Measured: every strategy training the tiny GPT on CPU (4 gloo ranks, 2 x 2)", "",
            f"`python scripts/bench_corpora.py` ({args.rounds} interleaved rounds of "
            f"{args.iterations} steps per strategy, first {args.warmup} dropped"
            f"{tuning_note(args)}). "
            "Speedup = the strategy's median step / zeppelin's (> 1: zeppelin is faster). "
            "Paired = the strategy's time of each step / zeppelin's time of the same step "
            "(the same documents), geometric mean per round, then over the rounds, with its "
            "95% confidence interval over the rounds: it cancels what each batch costs, "
            "which the medians do not. "
            + ("`zeppelin (A/A control)` is zeppelin measured a second time: its row is the "
               "machine's noise floor. " if args.control else "") +
            f"`{BASELINE}` is static mode, TE/Megatron CP over the whole pool (both nodes): "
            "the paper's baseline, not counted as a peer.", ""]
    body = [line for corpus, result in results.items() for line in corpus_table(corpus, result)]
    return "\n".join(head + body + ["### Across corpora, by median step", ""] +
                     summary(results) + ["", "### Across corpora, paired step by step", ""] +
                     summary(results, paired_ratio)) + "\n"


SMOKE = {"iterations": 3, "warmup": 1, "rounds": 1}  # --smoke, and no tuning
DEFAULTS = {"iterations": 12, "warmup": 2, "rounds": 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, their values and relations checked before any corpus is written or any run
    starts (a bad one: ``ConfigError`` naming it)."""
    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--corpora", default=str(ROOT / "build" / "corpora"))
    p.add_argument("--corpus", nargs="+", default=list(CORPUS_FLAGS), choices=list(CORPUS_FLAGS))
    p.add_argument("--output", default=str(ROOT / "build" / "bench" / "corpora.md"))
    p.add_argument("--iterations", type=int_at_least(1), default=None,
                   help=f"steps per run (default {DEFAULTS['iterations']})")
    p.add_argument("--warmup", type=int_at_least(0), default=None,
                   help=f"first steps of each run dropped, < --iterations (default "
                        f"{DEFAULTS['warmup']})")
    p.add_argument("--rounds", type=int_at_least(1), default=None,
                   help=f"interleaved runs per strategy (default {DEFAULTS['rounds']})")
    p.add_argument("--no-tune", dest="tune", action="store_false")
    p.add_argument("--smoke", action="store_true", help="3 steps, 1 round, no tuning")
    p.add_argument("--control", action="store_true",
                   help="measure zeppelin twice (bench train --control): the A/A row gives "
                        "the machine's noise floor")
    p.add_argument("--best-peers", action="store_true",
                   help="zeppelin vs each corpus's fastest peers only (BEST_PEERS, tuned knobs "
                        "fixed, no sweep)")
    args = p.parse_args(argv)
    for name, value in (SMOKE if args.smoke else DEFAULTS).items():
        if args.smoke and getattr(args, name) is not None:
            raise ConfigError(f"--{name}={getattr(args, name)} is invalid with --smoke (it "
                              f"sets --{name} {value}): drop one of them")
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.tune = args.tune and not args.smoke
    if args.warmup >= args.iterations:
        raise ConfigError(f"--warmup={args.warmup} is invalid: expected < --iterations "
                          f"{args.iterations} (at least one step is measured)")
    twice = sorted({c for c in args.corpus if args.corpus.count(c) > 1})
    if twice:
        raise ConfigError(f"--corpus lists {', '.join(twice)} more than once: expected each "
                          "corpus at most once")
    if Path(args.output).is_dir():
        raise ConfigError(f"--output={args.output!r} is a folder: expected a file path")
    return args


def check_runs(folder: Path, args: argparse.Namespace) -> None:
    """The flags of every corpus's training runs, checked as ``bench train`` checks them (so
    that ``--iterations`` the training flags refuse fails here, not after the corpora)."""
    from megatron_zeppelin.bench.train import training_shape

    for corpus in args.corpus:
        try:
            training_shape(["--data-path", str(folder / corpus), *CORPUS_FLAGS[corpus]],
                           args.iterations)
        except ValueError as exc:
            raise ConfigError(f"--iterations={args.iterations} is invalid for the training "
                              f"runs: {exc}") from None


def run(args: argparse.Namespace) -> None:
    # absolute: the training runs start in the repository (bench train's cwd), not here
    folder = writable_folder("--corpora", args.corpora).resolve()
    output = Path(args.output).resolve()
    writable_folder("--output", str(output.parent), args.output)
    check_runs(folder, args)
    ensure_corpora(folder, args.corpus)
    make_folder("--output", output.parent)
    results = {c: measure(c, folder, output.with_name(f"{output.stem}-{c}.json"), args)
               for c in args.corpus}
    text = report(results, args)
    output.write_text(text)
    print(text + f"\nwrote {output}")


def main(argv: list[str] | None = None) -> int:
    """The measurement; bad input is one line on stderr and exit status 2, before any work."""
    return exit_status(PROG, lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
