"""``zeppelin bench overhead``: host CPU time per training step of each mode, where it goes.

Wall times on a shared machine say little; CPU time, which load hardly distorts, says where a
mode's host machinery costs. Every entry (``bench train``'s ``NAME[:FLAG=VALUE...]``: ``static``
is static mode) trains the tiny GPT of ``bench train`` on 4 gloo ranks (2 emulated nodes x 2)
on the same documents; each rank records, per training step after the warm-up:

* its process's CPU seconds (every thread), split by thread: the training (main) thread, the
  data iterator's worker (``zeppelin-plan``: awaits the plan, prepares its attention
  runtime), the planner service's reader (``zeppelin-planner-reader``: unpickles plans) and
  the threads Python does not know (gloo, torch's pools);
* its planner process's CPU seconds (``--zeppelin-planner-process``), per step and per planned
  micro-batch (the planner process plans every micro-batch on each rank of the pool).

Printed per entry: CPU seconds per step per rank (mean over the ranks and their spread),
the planner processes' share, the total over the 4 ranks and their planners (on a machine
with fewer cores than processes, that total is what the step waits for), the plans' candidates
(zeppelin's portfolio picks one per micro-batch) and the median wall step (load-distorted).
With ``--profile`` one more run per entry profiles rank 0's training thread (cProfile on its
thread CPU clock, or the wall clock with ``--profile wall``): its top functions per step, and
the functions costing more per step than in the first entry (the reference; by default
``static``). ``--before TREE`` measures a change: each round runs every entry from the checkout
TREE too (the code before the change), interleaved, and prints CPU before -> after per entry.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron_zeppelin.bench.flags import check_ports, port_number
from megatron_zeppelin.bench.train import (RANKS, RUN_TIMEOUT_S, Entry, check_flags,
                                           parse_entries, run_flags, train_in_world)
from megatron_zeppelin.bench.workers import free_port, run_spawned, training_rank_env
from megatron_zeppelin.options import nonempty
from megatron_zeppelin.output_paths import output_file

TOP = 12


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process so far, summed by kind: ``main``, a Python
    thread's name without its pool index (``zeppelin-plan``, ``zeppelin-inter``, ...), or
    ``native`` (threads Python did not start: gloo's, torch's); ``main-runqueue``: the seconds
    the main thread waited for a core (``/proc``'s schedstat), which a loaded machine adds."""
    names = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out = {"main": 0.0}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:  # a thread's CPU clock (Linux: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED))
            seconds = time.clock_gettime((~tid << 3) | 6)
        except OSError:  # it ended meanwhile
            continue
        kind = "main" if tid == main else names.get(tid, "native")
        out[kind] = out.get(kind, 0.0) + seconds
    with open(f"/proc/self/task/{main}/schedstat") as f:
        out["main-runqueue"] = int(f.read().split()[1]) / 1e9
    return out


def process_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` so far (its process CPU clock); 0 without one."""
    if pid is None:
        return 0.0
    try:
        return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        return 0.0


class Recorder:
    """Snapshots after every training step (``Logger.step``): this rank's CPU by thread, its
    planner process's CPU, the wall clock, the plans of the step; cProfile of the training
    thread from step ``warmup`` on when ``profile``."""

    def __init__(self, warmup: int, iterations: int, profile: str | None) -> None:
        """profile: None, or the profiler's clock: ``cpu`` (the thread's CPU clock) or
        ``wall`` (where the thread also waits: peers, data)."""
        self.warmup, self.iterations, self.profile = warmup, iterations, profile
        self.snapshots: list[dict] = []
        self.data = None  # the run's ZeppelinDataIterator (its planner service)
        self.profiler = None

    def snapshot(self, plans) -> None:
        service = getattr(self.data, "service", None)
        self.snapshots.append({"threads": thread_cpu(), "process": time.process_time(),
                               "planner": process_cpu(service.pid if service else None),
                               "wall": time.perf_counter(),
                               "candidates": [p.candidate or p.strategy for p in plans],
                               "planned": getattr(self.data, "submitted", 0)})
        if self.profile and len(self.snapshots) == self.warmup + 1:
            import cProfile

            clock = time.thread_time if self.profile == "cpu" else time.perf_counter
            self.profiler = cProfile.Profile(clock)
            self.profiler.enable()
        elif self.profiler is not None and len(self.snapshots) == self.iterations + 1:
            self.profiler.disable()

    def steps(self) -> dict:
        """Per measured step (after the warm-up): CPU seconds by thread, process, planner."""
        s = self.snapshots[self.warmup:]
        diff = lambda key: [b[key] - a[key] for a, b in zip(s, s[1:])]  # noqa: E731
        kinds = {k for snap in s for k in snap["threads"]}
        return {"process": diff("process"), "planner": diff("planner"), "wall": diff("wall"),
                "threads": {k: [b["threads"].get(k, 0.0) - a["threads"].get(k, 0.0)
                                for a, b in zip(s, s[1:])] for k in sorted(kinds)},
                "planned": s[-1]["planned"] - s[0]["planned"] if s else 0,
                "candidates": [c for snap in s[1:] for c in snap["candidates"]]}

    def profile_rows(self) -> list[list]:
        """[file:line(function), calls, tottime, cumtime, its costliest caller] of the
        profiled steps."""
        if self.profiler is None:
            return []
        self.profiler.disable()  # (already, unless the run ended early)
        import pstats

        def label(f, line, fn) -> str:
            return f"{Path(f).name}:{line}({fn})"

        stats = pstats.Stats(self.profiler).stats
        return [[label(*key), cc, tt, ct,
                 label(*max(callers, key=lambda c: callers[c][3])) if callers else ""]
                for key, (cc, nc, tt, ct, callers) in stats.items()]


def instrument(recorder: Recorder) -> None:
    """Route ``train.loop``'s logger and data iterator through ``recorder`` (this process)."""
    from megatron_zeppelin.megatron.loop import train

    original = getattr(train.loop, "__wrapped__", train.loop)

    def loop(args, layout, run, data, logger, start, online=None):
        recorder.data = data
        step = logger.step

        def recorded(*a, **k):
            plans = list(logger.plans)
            out = step(*a, **k)
            recorder.snapshot(plans)
            return out

        logger.step = recorded
        recorder.snapshot([])
        return original(args, layout, run, data, logger, start, online)

    loop.__wrapped__ = original
    train.loop = loop


def _rank(rank: int, world: int, port: int, runs: list[tuple[list[str], str | None]], warmup: int,
          iterations: int, out: str) -> None:
    """One rank: every run (flags, profiler clock or None) in order in one gloo world; writes
    its records to ``out/rank{rank}.json``."""
    training_rank_env(rank, world, port)
    import torch.distributed as dist

    from megatron_zeppelin.megatron.loop import args as train_args, train

    train.init_process_group(train_args.parse_args(runs[0][0]))
    records = []
    for argv, profiled in runs:
        recorder = Recorder(warmup, iterations, profiled if rank == 0 else None)
        instrument(recorder)
        _, refused = train_in_world(argv, world)
        records.append({"refused": refused} if refused else
                       {"steps": recorder.steps(), "profile": recorder.profile_rows()})
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


def run_world(runs: list[tuple[list[str], str | None]], warmup: int, iterations: int, port: int
              ) -> list[list[dict]]:
    """Every run on ``RANKS`` spawned ranks (one world); per rank, its records of every run."""
    with tempfile.TemporaryDirectory() as tmp:
        run_spawned(_rank, RANKS, (RANKS, port, runs, warmup, iterations, tmp),
                    timeout_s=RUN_TIMEOUT_S * len(runs), what="bench overhead")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(RANKS)]


def summarize(per_rank: list[dict]) -> dict:
    """One entry's figures from its ranks' records of every round (``steps`` each)."""
    steps = [r["steps"] for r in per_rank]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    process = [mean(s["process"]) for s in steps]  # per rank: CPU s per step
    planner = [mean(s["planner"]) for s in steps]
    per_batch = [sum(s["planner"]) / s["planned"] for s in steps if s["planned"]]
    kinds = sorted({k for s in steps for k in s["threads"]})
    threads = {k: mean([mean(s["threads"].get(k, [])) for s in steps]) for k in kinds}
    threads["main-blocked"] = mean([mean(s["wall"]) for s in steps]) - threads["main"] - \
        threads.get("main-runqueue", 0.0)
    candidates: dict[str, int] = {}
    for c in steps[0]["candidates"]:
        candidates[c] = candidates.get(c, 0) + 1
    return {"rank_cpu_s": process, "planner_cpu_s": planner,
            "planner_cpu_per_microbatch_s": mean(per_batch),
            "threads_cpu_s": threads, "total_cpu_s": sum(process) + sum(planner),
            "wall_s": statistics.median([w for s in steps for w in s["wall"]] or [0.0]),
            "candidates": candidates}


def merge_rounds(records: list[dict]) -> dict:
    """The records of one rank over rounds -> one record (lists concatenated)."""
    out = {"process": [], "planner": [], "wall": [], "candidates": [], "planned": 0,
           "threads": {}}
    for r in records:
        s = r["steps"]
        for key in ("process", "planner", "wall", "candidates"):
            out[key] += s[key]
        out["planned"] += s["planned"]
        for k, values in s["threads"].items():
            out["threads"].setdefault(k, []).extend(values)
    return {"steps": out}


def entry_lines(label: str, f: dict) -> list[str]:
    ranks = f["rank_cpu_s"]
    threads = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in f["threads_cpu_s"].items())
    picks = ", ".join(f"{k} x{v}" for k, v in sorted(f["candidates"].items(),
                                                     key=lambda kv: -kv[1]))
    return [f"{label}:",
            f"  CPU s per step per rank: mean {statistics.fmean(ranks):.3f} (ranks "
            + " ".join(f"{x:.3f}" for x in ranks) + ")",
            f"  by thread, CPU ms per step per rank: {threads}",
            "  (main-runqueue: the main thread waiting for a core; main-blocked: the rest of "
            "the wall step it did not run: waiting for peers, data, plans)",
            f"  planner process: {statistics.fmean(f['planner_cpu_s']) * 1e3:.1f} ms CPU per "
            f"step per rank, {f['planner_cpu_per_microbatch_s'] * 1e3:.1f} ms per micro-batch",
            f"  total CPU per step (4 ranks + their planner processes): {f['total_cpu_s']:.3f} s;"
            f" median wall step {f['wall_s']:.3f} s (load-distorted)",
            f"  plans: {picks or '-'}"]


def _line(own: float, cum: float, calls: float, name: str, per: int, sign: str = "") -> str:
    return f"  {own / per * 1e3:{sign}8.2f} own {cum / per * 1e3:8.2f} cum {calls / per:8.0f} " \
        f"calls  {name}"


def profile_lines(label: str, rows: list[list], steps: int, reference: dict | None
                  ) -> list[str]:
    """Top functions of one profile per step (all; Python functions only); with ``reference``
    ({function: tottime per step} of the reference entry) the functions costing most over it,
    each with its costliest caller."""
    per = max(steps, 1)
    python = [r for r in rows if not r[0].startswith("~")]
    lines = [f"{label}: rank 0's training thread, ms per step (cProfile; {steps} steps): top "
             "by own time"]
    lines += [_line(tt, ct, calls, name, per)
              for name, calls, tt, ct, *_ in sorted(rows, key=lambda r: -r[2])[:TOP]]
    lines.append(f"{label}: top Python functions by own time (ms per step)")
    lines += [_line(tt, ct, calls, name, per)
              for name, calls, tt, ct, *_ in sorted(python, key=lambda r: -r[2])[:TOP]]
    if reference is not None:
        extra = sorted(((tt - reference.get(name, 0.0) * per, ct, calls, name,
                         (rest or [""])[0]) for name, calls, tt, ct, *rest in rows),
                       reverse=True)[:TOP]
        lines.append(f"{label}: top own time over the reference's (ms per step)")
        lines += [_line(d, ct, calls, name, per, "+") + (f" <- {caller}" if caller else "")
                  for d, ct, calls, name, caller in extra]
    return lines


def check(args: argparse.Namespace) -> list[Entry]:
    """The entries of ``--strategies``; a bad flag refused naming it."""
    args.profile = None if args.profile == "none" else args.profile
    if args.iterations < 2 or not 0 <= args.warmup < args.iterations - 1:
        raise ValueError(f"--iterations {args.iterations} / --warmup {args.warmup}: expected "
                         "0 <= warmup < iterations - 1 (two steps measured at least)")
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds} is invalid: expected an integer >= 1")
    if args.before and not (Path(args.before) / "megatron_zeppelin" / "bench" /
                            "overhead.py").is_file():
        raise ValueError(f"--before {args.before!r}: not a checkout with this benchmark "
                         "(megatron_zeppelin/bench/overhead.py missing)")
    entries = parse_entries(args.strategies)
    check_flags(entries, args.iterations, args.extra)
    check_ports("--port", args.port, 2 * args.rounds + 1)  # one world per run, at most
    return entries


def measure(entries: list[Entry], args: argparse.Namespace, rounds: int, profile: str | None,
            port: int | None) -> dict:
    """``{label: figures}`` of every entry run here (``rounds`` unprofiled runs each, then
    one profiled run each when ``profile``); a refused entry: ``{"refused": reason}``."""
    flags = [run_flags(e, args.iterations, args.extra) for e in entries]
    runs = [(f, None) for _ in range(rounds) for f in flags]
    runs += [(f, profile) for f in flags] if profile else []
    ranks = run_world(runs, args.warmup, args.iterations, port or free_port())
    n, result = len(entries), {}
    for i, entry in enumerate(entries):
        mine = [[rank[j] for j in range(i, n * rounds, n)] for rank in ranks]
        refused = next((r["refused"] for r in mine[0] if "refused" in r), None)
        if refused:
            result[entry.label] = {"refused": refused}
            continue
        result[entry.label] = summarize([merge_rounds(records) for records in mine]) \
            if rounds else {}
        if profile:
            result[entry.label]["profile"] = ranks[0][n * rounds + i]["profile"]
    return result


def measure_before(args: argparse.Namespace, port: int | None) -> dict:
    """One unprofiled round of every entry from the ``--before`` checkout (its own
    ``zeppelin bench overhead``, its own code); its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "before.json")
        tree = str(Path(args.before).resolve())
        command = [sys.executable, "-m", "megatron_zeppelin.cli", "bench", "overhead",
                   "--strategies", args.strategies, "--iterations", str(args.iterations),
                   "--warmup", str(args.warmup), "--profile", "none", "--json", out,
                   "--port", str(port or free_port()), "--", *args.extra]
        subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def compare_lines(label: str, before: list[dict], after: list[dict]) -> list[str]:
    """Before / after of one entry, round by round (interleaved) and on average."""
    lines = [f"{label}: before -> after (--before tree -> this tree; rounds interleaved)"]
    for key, what in (("rank_cpu_s", "CPU s per step per rank"),
                      ("total_cpu_s", "total CPU s per step, 4 ranks + planners"),
                      ("planner_cpu_per_microbatch_s", "planner process CPU s per micro-batch")):
        pick = lambda f: statistics.fmean(f[key]) if isinstance(f[key], list) else f[key]  # noqa: E731
        b = [pick(f) for f in before if key in f]
        a = [pick(f) for f in after if key in f]
        if b and a:
            lines.append(f"  {what}: {statistics.fmean(b):.4f} -> {statistics.fmean(a):.4f} "
                         f"({statistics.fmean(a) / statistics.fmean(b):.3f}x; per round "
                         + ", ".join(f"{x:.4f}->{y:.4f}" for x, y in zip(b, a)) + ")")
    return lines


def bench_overhead(args: argparse.Namespace) -> int:
    entries = check(args)
    print(f"tiny GPT, 4 gloo ranks as 2 nodes x 2, {' '.join(args.extra) or 'no flags'}; "
          f"{args.rounds} round(s) of {args.iterations} steps per entry, first {args.warmup} "
          "dropped" + ("; then one profiled run each" if args.profile else "") +
          (f"; each round also from --before {args.before}" if args.before else ""), flush=True)
    if args.before:
        port = (lambda i: args.port + i if args.port else None)  # noqa: E731
        rounds = [(measure_before(args, port(2 * r + 1)), measure(entries, args, 1, None,
                                                                  port(2 * r)))
                  for r in range(args.rounds)]
        figures = {e.label: [(b.get(e.label, {}), a.get(e.label, {})) for b, a in rounds]
                   for e in entries}
        for label, pairs in figures.items():
            print("\n".join(compare_lines(label, [b for b, _ in pairs], [a for _, a in pairs])),
                  flush=True)
        result = measure(entries, args, 0, args.profile, port(2 * args.rounds)) \
            if args.profile else {}
        for label, pairs in figures.items():
            result.setdefault(label, {})["rounds"] = pairs
    else:
        result = measure(entries, args, args.rounds, args.profile, args.port)
        for label, figures in result.items():
            print("\n".join([f"{label}: not run: {figures['refused']}"] if "refused" in figures
                            else entry_lines(label, figures)), flush=True)
    print_profiles(result, args.iterations - args.warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if any("refused" not in f for f in result.values()) else 1


def print_profiles(result: dict, steps: int) -> None:
    """Each entry's profile; the first entry's is the reference of the others'."""
    profiled = [(label, f["profile"]) for label, f in result.items() if f.get("profile")]
    if not profiled:
        return
    reference = {row[0]: row[2] / steps for row in profiled[0][1]}
    for i, (label, rows) in enumerate(profiled):
        print("\n".join([""] + profile_lines(label, rows, steps, reference if i else None)))


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("overhead", help="host CPU seconds per training step of each mode, "
                           "by thread and planner process, profiled (CPU, 4 ranks)",
                           description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="static,zeppelin",
                   help="comma-separated NAME[:FLAG=VALUE...] as bench train (the first is "
                        "the profiles' reference)")
    p.add_argument("--iterations", type=int, default=8, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run dropped")
    p.add_argument("--rounds", type=int, default=1, help="unprofiled runs per entry")
    p.add_argument("--profile", choices=("cpu", "wall", "none"), default="cpu",
                   help="one more run per entry under cProfile on rank 0's training thread, "
                        "timed by its CPU clock (cpu) or the wall clock (wall: waits too)")
    p.add_argument("--before", type=nonempty, default=None, metavar="TREE",
                   help="a checkout of this repository before the change to measure (with "
                        "this benchmark; its C++ extensions built): each round runs every "
                        "entry there too, interleaved; printed: CPU before -> after")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the figures here")
    p.add_argument("--port", type=port_number(), default=None,
                   help="first rendezvous port of the runs (default: a free one per world)")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    p.set_defaults(func=bench_overhead)
