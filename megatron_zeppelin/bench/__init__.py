"""All measurement: ``zeppelin bench TARGET`` and ``zeppelin calibrate`` (figures, side by side).

Speed claims live here, never in timed tests. One module per target, each with a
``register(targets)`` that adds its subcommand (``kernels`` and ``engine`` exit 1 on a missed
target):

planner    plan time of every strategy (zeppelin portfolio, peers, FlexSP MILP)     (planner.py)
planning   CPU step with planning alongside (process, thread) vs precomputed  (planning.py)
router     C++ vs Python router time; modelled ring step with and without routing (router.py)
engine     attention engine vs the same work done locally; local-only and ring path vs raw
           kernels (engine.py, engine_local.py, engine_ring.py)
kernels    our block call vs the raw kernel, same inputs (ratio, us per call)    (kernels.py)
train      per-step time of every strategy training the tiny GPT, same data    (train.py)
fidelity   measured full training steps vs the simulator's step model (fidelity_train.py;
           --engine: the attention engine alone, fidelity.py); exits 1 on a missed target
online     online profile fit: probe overhead, estimate error before/after      (online.py)
window     sliding window: ring compute skipped, KV relay sent vs needed          (window.py)
halo       windowed ring: halo exchange vs round the ring, measured on gloo ranks  (halo.py)
remap      step time with and without the remapping layer where it should pay    (remap.py)
decisions  the portfolio's pick vs every candidate measured per micro-batch     (decisions.py)
overhead   host CPU seconds per training step by thread and planner process, profiled
           (overhead.py)
rings      a ring round's cost beyond its compute and its exchange on shared cores, rings of
           2 and of 4 processes (rings.py)
converge   a run started from a wrong profile reaches the right decisions by fitting
           online: by which iteration (converge.py)
sharing    unequal work on ranks sharing the cores: measured makespan vs the estimate's
           shared_peak, the ideal schedule and fair sharing (sharing.py)

``zeppelin calibrate`` (calibrate.py, flags: calibrate_cli.py) measures this machine and writes
a hardware profile;
``zeppelin calibrate-sim`` (calibrate_sim.py) the simulator's own profile (``configs/sim/``).
This package is the top of the layer order: it may import every other layer.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time
from typing import Callable

TARGETS = ("planner", "planning", "router", "engine", "kernels", "train", "fidelity", "online",
           "window", "halo", "remap", "decisions", "overhead", "rings", "sharing", "converge")


def median_ms(fn: Callable[[], object], repeats: int, budget_s: float) -> tuple[float, int]:
    """Median wall time of ``fn`` in ms over ``repeats`` runs, fewer if ``budget_s`` runs out."""
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times) * 1e3, len(times)


def register_passthrough(targets, name: str, help_text: str,
                         run: Callable[[list[str]], object]) -> None:
    """Add target ``name`` whose module parses every flag itself: ``run(argv)``. The command
    exits 1 when ``run`` returns figures with ``ok`` False (a missed target), else 0."""
    def command(args) -> int:
        figures = run(args.passthrough)
        return 1 if isinstance(figures, dict) and figures.get("ok") is False else 0

    p = targets.add_parser(name, add_help=False, help=help_text)
    p.set_defaults(func=command, passthrough_flags=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench TARGET`` (every module of ``TARGETS``) and ``calibrate`` to ``zeppelin``."""
    p = sub.add_parser("bench", help="benchmarks (figures, side by side)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = p.add_subparsers(dest="target", required=True)
    for name in TARGETS:
        importlib.import_module(f"megatron_zeppelin.bench.{name}").register(targets)
    from megatron_zeppelin.bench import calibrate_cli, calibrate_sim

    calibrate_cli.register(sub)
    calibrate_sim.register(sub)
