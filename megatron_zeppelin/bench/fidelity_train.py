"""``zeppelin bench fidelity``: measured FULL training steps vs the simulator's predicted steps.

Every strategy trains the tiny GPT on the CPU cluster (``bench/train.py``'s runner: 4 gloo
ranks as 2 emulated nodes x 2, same flags, seed and documents; strategies interleaved in
rounds so that drifting load hits them alike). Each step's log carries its micro-batches'
sequence lengths (``StepLog.seqlens``); the bench re-plans them with the run's own planner
(``train.make_planner``: the same strategy, options and cost model, deterministic) and asks the
simulator's step model (``sim/step_model.py``, profile ``configs/sim/cpu-2x2.yaml`` unless
``--sim-profile``) for the step: micro-batches back to back, gradient all-reduce, optimizer.

Printed per strategy: measured median step, simulated median step (over the same steps),
error = simulated / measured - 1, the spread of the measured steps (p90 / p10 - 1) and the
machine's load average; overall: the mean |error| and the largest, then what the host's speed
does not move (the host factor, geomean measured / simulated; each error with it taken out; the
pairs of strategies ordered as measured: a profile calibrated on a faster hour misses every
strategy alike). Exit status 1 when a
strategy's |error| exceeds the target (15 percent); ``--json FILE`` writes every step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_zeppelin.bench.flags import check_ports, port_number, refuse_given
from megatron_zeppelin.options import given, nonempty
from megatron_zeppelin.output_paths import output_file

TARGET_ERROR = 0.15
DEFAULT_SIM_PROFILE = "cpu-2x2"  # configs/sim/: the emulated cluster the runs train on
DEFAULT_STRATEGIES = ("static,zeppelin,static-cp:zeppelin-cp-size=1,static-cp:zeppelin-cp-size=2,"
                      "hybrid-dp,hydraulis")
# the flags of the training runs and their defaults (unused by --resimulate and --engine)
MEASURING = {"--strategies": DEFAULT_STRATEGIES, "--iterations": 6, "--warmup": 2,
             "--rounds": 2, "--port": 29651}
# the keys of a --json file (``to_json``): the whole file's, and each strategy's
SAVED_KEYS = ("strategies", "load_average", "target", "profile", "iterations", "warmup",
              "rounds", "flags")
ROW_KEYS = ("measured_s", "simulated_s", "chosen", "refused", "seqlens", "median_measured_s",
            "median_simulated_s", "error", "spread")


@dataclass
class StrategyFidelity:
    """One strategy: per measured step, its seconds and the simulator's."""

    label: str
    measured_s: list[float] = field(default_factory=list)
    simulated_s: list[float] = field(default_factory=list)
    chosen: list[str] = field(default_factory=list)
    refused: str = ""
    seqlens: list[list[list[int]]] = field(default_factory=list)  # per step, per micro-batch

    @property
    def measured(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def simulated(self) -> float:
        return statistics.median(self.simulated_s)

    @property
    def error(self) -> float:
        """simulated / measured - 1 of the medians."""
        return self.simulated / self.measured - 1.0

    @property
    def spread(self) -> float:
        """p90 / p10 - 1 of the measured steps (the measurement noise)."""
        if len(self.measured_s) < 2:
            return 0.0
        q = statistics.quantiles(self.measured_s, n=10)
        return q[-1] / q[0] - 1.0


def replay(entry, extra: list[str], iterations: int, logs: list[dict], profile_name
           ) -> list[float]:
    """The simulator's step for every logged step of ``entry``: its micro-batches re-planned
    with the run's own planner and cost model, then ``step_model.step_time``;
    ``profile_name``: a ``configs/sim/`` name, a YAML path or a ``SimProfile``."""
    from megatron_zeppelin.bench.train import run_flags
    from megatron_zeppelin.megatron.loop import args as train_args, train
    from megatron_zeppelin.planner.registry import strategy_class
    from megatron_zeppelin.sim.profile import SimProfile, load_sim_profile
    from megatron_zeppelin.sim.step_model import StepOptions, step_time

    args = train_args.parse_args(run_flags(entry, iterations, extra))
    layout = train_args.validate_args(args, 4, 4)
    cost = train.make_cost_model(args, train.model_spec(args), layout)
    planner = train.make_planner(args, cost, layout)
    routed = strategy_class(planner.strategy).routed and args.zeppelin_routing and \
        cost.cluster.nodes > 1
    options = StepOptions(inter_mode="routed" if routed else "ring",
                          overlap_grad_reduce=bool(args.overlap_grad_reduce),
                          device=args.device)  # the measured runs' engine
    profile = profile_name if isinstance(profile_name, SimProfile) else \
        load_sim_profile(profile_name)
    out = []
    for log in logs:
        plans = [planner(list(lengths)) for lengths in log["seqlens"]]
        out.append(step_time(plans, cost, profile, options).seconds)
    return out


def run(args: argparse.Namespace) -> tuple[list[StrategyFidelity], tuple[float, float]]:
    """Measure every strategy (``--rounds`` interleaved rounds) and replay its steps."""
    from megatron_zeppelin.bench.train import parse_entry, rotated, run_entries

    entries = [parse_entry(s) for s in args.strategies.split(",") if s.strip()]
    results = {e.label: StrategyFidelity(e.label) for e in entries}
    load_before = os.getloadavg()[0]
    port = args.port
    for round_ in range(args.rounds):
        todo = [e for e in rotated(entries, round_) if not results[e.label].refused]
        for entry, (logs, refused) in zip(todo, run_entries(todo, args.iterations, args.extra,
                                                            port)):
            fid = results[entry.label]
            fid.refused = refused
            kept = logs[args.warmup:]
            if not kept:
                continue
            fid.measured_s += [log["seconds"] for log in kept]
            fid.chosen += [log.get("chosen", "") for log in kept]
            fid.seqlens += [[list(map(int, m)) for m in log["seqlens"]] for log in kept]
            fid.simulated_s += replay(entry, args.extra, args.iterations, kept,
                                      args.sim_profile)
        port += 1
    return list(results.values()), (load_before, os.getloadavg()[0])


def format_report(rows: list[StrategyFidelity], load: tuple[float, float], seconds: float,
                  profile: str) -> tuple[list[str], bool]:
    """The table and whether every strategy is within the target."""
    lines = [f"fidelity on full training steps: tiny GPT, 4 gloo ranks as 2 nodes x 2, "
             f"simulator profile {profile}; {seconds:.0f} s, load average {load[0]:.1f} -> "
             f"{load[1]:.1f} on {os.cpu_count()} cores; error = simulated / measured - 1 of "
             "the median step; spread = p90 / p10 - 1 of the measured steps",
             f"{'strategy':<34} {'steps':>5} {'measured s':>10} {'simulated s':>11} "
             f"{'error':>7} {'spread':>7}"]
    ran = [r for r in rows if r.measured_s]
    ok = bool(ran)
    for r in rows:
        if not r.measured_s:
            lines.append(f"{r.label:<34} not run: {r.refused or 'no step after the warm-up'}")
            continue
        within = abs(r.error) <= TARGET_ERROR
        ok &= within
        lines.append(f"{r.label:<34} {len(r.measured_s):>5} {r.measured:>10.3f} "
                     f"{r.simulated:>11.3f} {r.error:>+7.1%} {r.spread:>7.0%}"
                     + ("" if within else "  OUTSIDE"))
    if ran:
        errors = [abs(r.error) for r in ran]
        lines.append(f"overall: mean |error| {statistics.mean(errors):.1%}, largest "
                     f"{max(errors):.1%}; target {TARGET_ERROR:.0%} per strategy: "
                     + ("met" if ok else "MISSED"))
        lines += relative_lines(ran)
    return lines, ok


def relative_lines(ran: list[StrategyFidelity]) -> list[str]:
    """What the host's speed does not move: the machine's factor (geomean measured /
    simulated: the host ran that much slower than the profile was calibrated at), each
    strategy's error once that factor is taken out (its simulated / measured ratio over the
    factor) and the pairs of strategies the simulator orders as measured."""
    if len(ran) < 2:
        return []
    from megatron_zeppelin.sim.report import geomean

    factor = geomean([r.measured / r.simulated for r in ran])
    relative = {r.label: r.simulated * factor / r.measured - 1.0 for r in ran}
    pairs = [(a, b) for i, a in enumerate(ran) for b in ran[i + 1:]]
    agree = sum((a.simulated < b.simulated) == (a.measured < b.measured) for a, b in pairs)
    worst = max(relative, key=lambda k: abs(relative[k]))
    return [f"host factor (geomean measured / simulated) {factor:.3f}; errors with it taken "
            "out: " + ", ".join(f"{k} {v:+.1%}" for k, v in relative.items()),
            f"  mean |error| {statistics.mean(abs(v) for v in relative.values()):.1%}, largest "
            f"{worst} {relative[worst]:+.1%}; pairs of strategies ordered as measured: "
            f"{agree} / {len(pairs)}"]


def to_json(rows: list[StrategyFidelity], load: tuple[float, float], args) -> dict:
    return {"strategies": {r.label: {"measured_s": r.measured_s, "simulated_s": r.simulated_s,
                                     "chosen": r.chosen, "refused": r.refused,
                                     "seqlens": r.seqlens,
                                     **({"median_measured_s": r.measured,
                                         "median_simulated_s": r.simulated,
                                         "error": r.error, "spread": r.spread}
                                        if r.measured_s else {})}
                           for r in rows},
            "load_average": list(load), "target": TARGET_ERROR, "profile": args.sim_profile,
            "iterations": args.iterations, "warmup": args.warmup, "rounds": args.rounds,
            "flags": args.extra}


def rows_from_json(data: dict) -> list[StrategyFidelity]:
    """The rows of a ``--json`` file (``to_json``)."""
    return [StrategyFidelity(label, list(v["measured_s"]), list(v["simulated_s"]),
                             list(v.get("chosen", [])), v.get("refused", ""),
                             [list(map(list, step)) for step in v.get("seqlens", [])])
            for label, v in data["strategies"].items()]


def resimulate(path: str, profile_name) -> tuple[list[StrategyFidelity], tuple[float, float]]:
    """The rows of a ``--json`` file with every step re-simulated under ``profile_name`` (the
    measured steps as they were): the logged micro-batch lengths re-planned and priced by
    today's step model; ValueError naming the file when a strategy's steps lack them."""
    from megatron_zeppelin.bench.train import parse_entry

    data, rows = read_saved(path)
    for row in rows:
        if row.measured_s and len(row.seqlens) != len(row.measured_s):
            raise ValueError(f"--resimulate={path}: strategy {row.label} has no micro-batch "
                             "lengths (seqlens) for its steps: written before bench fidelity "
                             "saved them, it cannot be re-simulated")
        row.simulated_s = replay(parse_entry(row.label), list(data["flags"]),
                                 int(data["iterations"]),
                                 [{"seqlens": step} for step in row.seqlens], profile_name)
    return rows, tuple(data.get("load_average", (0.0, 0.0)))


def read_saved(path: str) -> tuple[dict, list[StrategyFidelity]]:
    """(the data, the rows) of a ``--json`` file; ValueError naming ``--resimulate``, the
    file and what is wrong: unreadable, a key ``to_json`` does not write (it would be
    ignored), a missing one, no strategy."""
    def bad(why: str) -> ValueError:
        return ValueError(f"--resimulate={path} is invalid: {why} (expected a `bench fidelity "
                          "--json` file)")

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise bad(str(exc)) from None
    if not isinstance(data, dict) or not isinstance(data.get("strategies"), dict):
        raise bad("no mapping 'strategies'")
    for where, keys, allowed in [("", data, SAVED_KEYS)] + [
            (f"strategy {label!r}: ", row, ROW_KEYS) for label, row in data["strategies"].items()
            if isinstance(row, dict)]:
        unknown = [k for k in keys if k not in allowed]
        if unknown:
            raise bad(f"{where}unknown key {unknown[0]!r}; valid keys: {list(allowed)}")
    if not data["strategies"]:
        raise bad("no strategies")
    missing = [k for k in ("flags", "iterations") if k not in data]
    if missing:
        raise bad(f"no key {missing[0]!r}")
    try:
        return data, rows_from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"{type(exc).__name__}: {exc}") from None


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad or unused flags before anything runs (ValueError naming the flag)."""
    from megatron_zeppelin.bench.train import check_flags, parse_entries

    for name, value, least in (("--iterations", args.iterations, 1), ("--rounds", args.rounds, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            raise ValueError(f"{name}={value} is invalid: expected an integer >= {least}")
    if args.resimulate and args.json:
        raise ValueError(f"--json={args.json} is invalid with --resimulate: the re-simulated "
                         "report is printed, the measured file stays as it was")
    if args.resimulate:
        unless = f"with --resimulate {args.resimulate} (its runs, as they were measured)"
        refuse_given(args, MEASURING, unless)
        if args.extra:
            raise ValueError(f"training flags after -- ({' '.join(args.extra)}) are invalid "
                             f"{unless}: they would be ignored (drop them)")
        return
    check_flags(parse_entries(args.strategies), args.iterations, args.extra)
    check_ports("--port", args.port, args.rounds)  # one world per round
    if args.warmup >= args.iterations:
        raise ValueError(f"--warmup={args.warmup} is invalid: expected < --iterations "
                         f"{args.iterations}")


def calibrate_first(args: argparse.Namespace) -> None:
    """``--calibrate FILE``: ``zeppelin calibrate-sim`` on this machine now (the tiny GPT,
    attention up to the runs' --seq-length), written to FILE and judged with
    (``args.sim_profile`` becomes FILE): a profile from the same hour as the steps it
    predicts, where the host's speed drifts (docs/benchmarks.md)."""
    from megatron_zeppelin.bench.calibrate_sim import calibrate_sim
    from megatron_zeppelin.bench.train import training_shape

    if args.resimulate:
        raise ValueError(f"--calibrate={args.calibrate} is invalid with --resimulate: nothing "
                         "is measured to judge")
    if given(args, "--sim-profile", DEFAULT_SIM_PROFILE):
        raise ValueError(f"--calibrate={args.calibrate} is invalid with --sim-profile="
                         f"{args.sim_profile}: the calibration is the profile; pass one")
    seq_length, _ = training_shape(args.extra, args.iterations)
    started = time.perf_counter()
    profile = calibrate_sim("gpt-tiny", DEFAULT_SIM_PROFILE, max(4096, seq_length))
    profile.to_yaml(args.calibrate, "The simulator's own profile, measured by `zeppelin bench "
                    "fidelity --calibrate` before its rounds.\n" + profile.source)
    print(f"calibrated {args.calibrate} in {time.perf_counter() - started:.0f} s", flush=True)
    args.sim_profile = args.calibrate


def bench_fidelity_train(args: argparse.Namespace) -> int:
    from megatron_zeppelin.sim.profile import load_sim_profile

    check_flags(args)
    if args.calibrate:
        calibrate_first(args)
    load_sim_profile(args.sim_profile)  # a bad profile is refused before any training
    started = time.perf_counter()
    rows, load = resimulate(args.resimulate, args.sim_profile) if args.resimulate else run(args)
    lines, ok = format_report(rows, load, time.perf_counter() - started, args.sim_profile)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(rows, load, args), indent=2) + "\n")
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategies", default=MEASURING["--strategies"],
                   help="comma-separated NAME[:FLAG=VALUE...] as `bench train` takes them")
    p.add_argument("--iterations", type=int, default=MEASURING["--iterations"],
                   help="steps per run")
    p.add_argument("--warmup", type=int, default=MEASURING["--warmup"],
                   help="first steps of each run dropped")
    p.add_argument("--rounds", type=int, default=MEASURING["--rounds"],
                   help="interleaved runs per strategy")
    p.add_argument("--sim-profile", type=nonempty, default=DEFAULT_SIM_PROFILE,
                   help="the simulator's profile (configs/sim/ name or YAML path)")
    p.add_argument("--calibrate", type=output_file(), default=None,
                   metavar="FILE", help="run `zeppelin calibrate-sim` first (minutes), write "
                   "its profile to FILE and judge with it instead of --sim-profile")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write every step here")
    p.add_argument("--resimulate", type=nonempty, default=None, metavar="FILE",
                   help="train nothing: re-simulate the steps of a --json FILE under "
                   "--sim-profile and report against its measured steps")
    p.add_argument("--port", type=port_number(), default=MEASURING["--port"],
                   help="first rendezvous port (one per round, counting up)")
