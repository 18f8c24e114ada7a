"""Fidelity check. ``zeppelin bench fidelity`` times FULL training steps against the simulator
(``fidelity_train.py``); ``--engine`` (this module) times the attention engine alone:
the real attention engine on gloo ranks vs the simulator's attention, same plans.

``run_fidelity`` forks 4 CPU processes (the emulated ``cpu-2x2`` cluster: 2 nodes x 2 ranks,
one thread each), plans the same batches with every strategy, and on every rank times
``AttentionEngine`` forward + backward (``runtime/engine.py``; with the remap around it when the
plan has one, ``runtime/remap.py``). The measured time of a plan is the slowest rank's, the
fastest of ``repeats`` runs after one warm-up; runs go round-robin over the plans so that other
jobs on the cores slow every plan alike. The simulated time is
``simulator.attention_time`` with the simulator's own profile (``configs/sim/cpu-2x2.yaml``,
written by ``zeppelin calibrate-sim``) on the emulated cluster (``configs/clusters/cpu-2x2``).

The attention shape (4 heads of 16, fp32: the tiny GPT's, the profile's) has one layer.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

from megatron_zeppelin.config import ModelSpec, ZeppelinConfig, load_cluster, load_hardware
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner import STRATEGIES
from megatron_zeppelin.bench.workers import run_forked
from megatron_zeppelin.sim.simulator import SimOptions, attention_time
from megatron_zeppelin.sim.workloads import sample_batch

TARGET_ERROR = 0.25  # the engine-only mode's target (full steps: fidelity_train.TARGET_ERROR)


@dataclass(frozen=True)
class FidelityOptions:
    """batches: global batches; tokens: tokens per batch; workload/max_len: how documents are
    drawn (clipped to ``max_len`` tokens, CPU-sized); repeats: timed runs per plan."""

    batches: int = 2
    tokens: int = 32 * 1024
    workload: str = "longtail"
    max_len: int = 8192
    seed: int = 0
    repeats: int = 3
    heads: int = 4
    head_dim: int = 16
    hardware: str = "cpu"
    cluster: str = "cpu-2x2"

    def __post_init__(self) -> None:
        for key in ("batches", "tokens", "max_len", "repeats", "heads", "head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} is invalid: expected an integer >= 1")


@dataclass(frozen=True)
class FidelityRow:
    """One plan: measured (fastest run) and simulated seconds of attention forward + backward
    (one layer); ``spread``: slowest / fastest run - 1, the measurement noise."""

    strategy: str
    batch: int
    measured_s: float
    simulated_s: float
    spread: float = 0.0

    @property
    def error(self) -> float:
        """(simulated - measured) / measured."""
        return (self.simulated_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class FidelityReport:
    """The rows, the run time (s), documents per batch, the 1-minute load average of the
    machine before and after the measurement (other jobs on the cores)."""

    rows: tuple[FidelityRow, ...]
    seconds: float
    documents: tuple[int, ...]
    load: tuple[float, float] = (0.0, 0.0)

    def mean_abs_error(self, strategy: str | None = None) -> float:
        """Mean |error| over the rows of ``strategy`` (all rows when None)."""
        errors = [abs(r.error) for r in self.rows if strategy in (None, r.strategy)]
        return sum(errors) / len(errors)


def fidelity_cost(opts: FidelityOptions) -> CostModel:
    """One fp32 attention layer of the calibrated shape on the emulated CPU cluster."""
    model = ModelSpec(name="fidelity", num_layers=1, hidden_size=opts.heads * opts.head_dim,
                      num_attention_heads=opts.heads, ffn_hidden_size=opts.heads * opts.head_dim,
                      vocab_size=1, bytes_per_element=4)
    return CostModel(model, load_cluster(opts.cluster), load_hardware(opts.hardware))


def fidelity_plans(opts: FidelityOptions, cost: CostModel) -> list[tuple[str, int, str, Plan]]:
    """(strategy, batch, inter mode, plan) for every batch and every registered strategy; the
    engine measures the plans of the strategies it runs (``Strategy.runs_on_engine``)."""
    rng = random.Random(opts.seed)
    out = []
    for batch in range(opts.batches):
        lengths = sample_batch(opts.workload, opts.tokens, rng, max_len=opts.max_len)
        for name, cls in STRATEGIES.items():
            strategy = cls()
            config = ZeppelinConfig(routing=cls.routed)
            out.append((name, batch, "routed" if cls.routed else "ring",
                        strategy.plan(lengths, cost, config)))
    return out


def engine_plans(plans: list[tuple[str, int, str, Plan]]) -> list[tuple[str, int, str, Plan]]:
    """The plans the attention engine can run (``Strategy.runs_on_engine``: ring attention and
    FlexSP's Ulysses attention)."""
    return [p for p in plans if STRATEGIES[p[0]]().runs_on_engine]


class _PlanRun:
    """One plan on this rank: its engine, remap index and input tensors, built once."""

    def __init__(self, plan: Plan, rank: int, mode: str, opts: FidelityOptions, groups) -> None:
        import torch

        from megatron_zeppelin.router import RouterTopology
        from megatron_zeppelin.runtime.engine import AttentionEngine
        from megatron_zeppelin.runtime.remap import build_remap_index

        group, route_group, cluster = groups
        self.group = group
        self.engine = AttentionEngine(plan, rank, group, inter_mode=mode,
                                      route_group=route_group if mode != "ring" else None,
                                      router_topology=RouterTopology.from_cluster(cluster))
        self.remapped = plan.remaps
        self.index = build_remap_index(plan, rank) if self.remapped else None
        rows = plan.linear_tokens()[rank] if self.remapped else plan.attention_tokens()[rank]
        gen = torch.Generator().manual_seed(rank)
        self.qkv = [torch.randn(rows, opts.heads, opts.head_dim, generator=gen,
                                requires_grad=True) for _ in range(3)]

    def time_once(self) -> float:
        """Seconds of the slowest rank's forward + backward (remap included), one run."""
        import torch
        import torch.distributed as dist

        from megatron_zeppelin.runtime.remap import to_attention_layout, to_linear_layout

        dist.barrier(self.group)
        start = time.perf_counter()
        ins = [to_attention_layout(x, self.index, self.group) for x in self.qkv] \
            if self.remapped else self.qkv
        out = self.engine(*ins)
        out = to_linear_layout(out, self.index, self.group) if self.remapped else out
        out.sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=self.group)
        return float(elapsed)


def _rank_main(rank: int, plans, opts: FidelityOptions) -> list[list[float]] | None:
    """One gloo rank: time every plan, round-robin over the plans ``repeats`` times after a
    warm-up round (so that other load on the cores hits every plan alike); rank 0 returns
    every plan's run times."""
    import torch.distributed as dist

    world = dist.get_world_size()
    groups = (dist.group.WORLD, dist.new_group(list(range(world))), load_cluster(opts.cluster))
    runs = [_PlanRun(plan, rank, mode, opts, groups) for _, _, mode, plan in plans]
    times: list[list[float]] = [[] for _ in runs]
    for it in range(opts.repeats + 1):
        for run, mine in zip(runs, times):
            seconds = run.time_once()
            if it:
                mine.append(seconds)
    for run in runs:
        run.engine.close()
    return times if rank == 0 else None


def measure(plans, opts: FidelityOptions, world: int) -> list[list[float]]:
    """Per plan, the seconds of each timed run on ``world`` forked gloo processes."""
    return run_forked(_rank_main, world, (plans, opts), timeout_s=1800.0, what="fidelity rank",
                      gloo_timeout_s=600.0)[0]


def run_fidelity(opts: FidelityOptions = FidelityOptions()) -> FidelityReport:
    """Plan, measure on gloo ranks, simulate; one row per (strategy, batch)."""
    started = time.perf_counter()
    cost = fidelity_cost(opts)
    plans = engine_plans(fidelity_plans(opts, cost))
    load_before = os.getloadavg()[0]
    measured = measure(plans, opts, cost.cluster.world_size)
    load_after = os.getloadavg()[0]
    rows = []
    for (strategy, batch, mode, plan), runs in zip(plans, measured):
        simulated = attention_time(plan, cost, SimOptions(inter_mode=mode))
        rows.append(FidelityRow(strategy, batch, min(runs), simulated, max(runs) / min(runs) - 1))
    documents = tuple(len(p.seqlens) for s, _, _, p in plans if s == plans[0][0])
    return FidelityReport(tuple(rows), time.perf_counter() - started, documents,
                          (load_before, load_after))


def format_fidelity(report: FidelityReport) -> str:
    """Per plan measured vs simulated, then the mean absolute error per strategy."""
    lines = [f"fidelity: {len(report.rows)} plans, batches of {report.documents} documents, "
             f"{report.seconds:.0f} s, load average {report.load[0]:.1f} -> "
             f"{report.load[1]:.1f} on {os.cpu_count()} cores; error = (simulated - measured) "
             "/ measured; spread = slowest / fastest run - 1",
             f"{'strategy':<20} {'batch':>5} {'measured s':>11} {'simulated s':>12} "
             f"{'error':>8} {'spread':>7}"]
    for r in report.rows:
        lines.append(f"{r.strategy:<20} {r.batch:>5} {r.measured_s:>11.3f} "
                     f"{r.simulated_s:>12.3f} {r.error:>+8.1%} {r.spread:>7.0%}")
    for strategy in dict.fromkeys(r.strategy for r in report.rows):
        err = report.mean_abs_error(strategy)
        lines.append(f"mean |error| {strategy:<20} {err:6.1%}  "
                     f"{'within' if err <= TARGET_ERROR else 'OUTSIDE'} the "
                     f"{TARGET_ERROR:.0%} target")
    lines.append(f"mean |error| over all plans {report.mean_abs_error():.1%}")
    return "\n".join(lines)


ENGINE_FLAGS = {"--batches": 2, "--tokens": 32 * 1024, "--seed": 0}  # --engine's, defaults


def _cmd_fidelity(args) -> int:
    """``zeppelin bench fidelity``: full training steps (default) or ``--engine`` alone; a
    flag of the other mode is refused (it would be ignored)."""
    from megatron_zeppelin.bench import fidelity_train
    from megatron_zeppelin.bench.flags import refuse_given

    if not args.engine:
        refuse_given(args, ENGINE_FLAGS, "without --engine")
        return fidelity_train.bench_fidelity_train(args)
    refuse_given(args, {**fidelity_train.MEASURING, "--sim-profile":
                        fidelity_train.DEFAULT_SIM_PROFILE, "--calibrate": None, "--json": None,
                        "--resimulate": None}, "with --engine")
    if args.extra:
        raise ValueError(f"training flags after -- ({' '.join(args.extra)}) are invalid with "
                         "--engine: it trains nothing (drop them)")
    report = run_fidelity(FidelityOptions(batches=args.batches, tokens=args.tokens,
                                          seed=args.seed))
    print(format_fidelity(report))
    return 0 if all(report.mean_abs_error(s) <= TARGET_ERROR
                    for s in dict.fromkeys(r.strategy for r in report.rows)) else 1


def register(targets) -> None:
    from megatron_zeppelin.bench import fidelity_train
    from megatron_zeppelin.options import int_at_least
    from megatron_zeppelin.sim.workloads import token_count

    p = targets.add_parser("fidelity", help="measured full training steps (4 gloo ranks as 2 "
                           "nodes x 2) vs the simulator's step model, same micro-batches and "
                           "plans; --engine: the attention engine alone",
                           description=fidelity_train.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    fidelity_train.add_arguments(p)
    p.add_argument("--engine", action="store_true", help="time the attention engine alone "
                   f"(target {TARGET_ERROR * 100:.0f} percent) instead of full training steps")
    p.add_argument("--batches", type=int_at_least(1), default=ENGINE_FLAGS["--batches"],
                   help="--engine: global batches (default 2)")
    p.add_argument("--tokens", type=token_count, default=ENGINE_FLAGS["--tokens"],
                   help="--engine: tokens per batch (default 32K)")
    p.add_argument("--seed", type=int_at_least(0), default=ENGINE_FLAGS["--seed"],
                   help="--engine: batch seed (default 0)")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags for the training runs "
                   "(after --)")
    p.set_defaults(func=_cmd_fidelity)
