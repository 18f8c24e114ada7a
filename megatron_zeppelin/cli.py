"""The ``zeppelin`` command: plan | simulate | bench | calibrate.

Each subcommand parses its flags here and calls one function of the layer that owns the work.
Bad input exits with status 2 and a message naming the value (no traceback).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from typing import TYPE_CHECKING, Sequence

from megatron_zeppelin.config import ConfigError, PipelineSpec, ZeppelinConfig, load_setup
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.limits import refuse_untrainable
from megatron_zeppelin.plan import OverlongReport
from megatron_zeppelin.options import (Parser, add_flags, exit_status, from_flags, int_at_least,
                                       nonempty)
from megatron_zeppelin.output_paths import output_file

if TYPE_CHECKING:
    from megatron_zeppelin.plan import Topology
    from megatron_zeppelin.planner.registry import Strategy


def add_setup_args(p: argparse.ArgumentParser, nodes_nargs: str | None = None) -> None:
    """--model --cluster --nodes --hardware --tp and the planner options."""
    p.add_argument("--model", type=nonempty, required=True,
                   help="model YAML path or shipped name (llama-7b)")
    p.add_argument("--cluster", type=nonempty, required=True,
                   help="cluster YAML path or shipped name")
    p.add_argument("--nodes", type=int_at_least(1), nargs=nodes_nargs, default=None,
                   help="number of nodes (default: the cluster YAML's)")
    p.add_argument("--hardware", type=nonempty, default=None, help="hardware profile YAML "
                   "(default: the cluster's `hardware:` entry)")
    p.add_argument("--tp", type=int_at_least(1), default=1,
                   help="tensor-parallel size per rank (divides the GPUs per node)")
    add_flags(p.add_argument_group("planner options"), ZeppelinConfig)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--workload --lengths --global-batch-tokens --seed (defaults filled by
    ``sampling_or_lengths``)."""
    from megatron_zeppelin.sim.workloads import WORKLOADS, token_count

    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="built-in workload the batch is sampled from (default github)")
    p.add_argument("--lengths", type=nonempty, default=None, help="file with one document "
                   "length per line: the batch (replaces --workload, --global-batch-tokens and "
                   "--seed)")
    p.add_argument("--global-batch-tokens", type=token_count, default=None,
                   help="tokens per global batch (2M, 512K; default 2M)")
    p.add_argument("--seed", type=int_at_least(0), default=None,
                   help="sampling seed (default 0)")


def sampling_or_lengths(args: argparse.Namespace, defaults: dict[str, tuple[str, object]]
                        ) -> None:
    """``--lengths FILE`` is the batch: the sampling flags of ``defaults`` (flag: (dest,
    default)) given with it are refused, naming one; without it their defaults are filled."""
    given = [flag for flag, (dest, _) in defaults.items() if getattr(args, dest) is not None]
    if args.lengths and given:
        raise ConfigError(f"--lengths {args.lengths!r} with {given[0]}: the file is the batch "
                          f"(all of its documents); drop {given[0]}")
    for dest, default in defaults.values():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


SAMPLING = {"--workload": ("workload", "github"),
            "--global-batch-tokens": ("global_batch_tokens", 2 << 20), "--seed": ("seed", 0)}


def zeppelin_config(args: argparse.Namespace) -> ZeppelinConfig:
    return from_flags(ZeppelinConfig, args)


def batch_lengths(args: argparse.Namespace) -> list[int]:
    """The documents of one global batch: from --lengths (all of them) or sampled."""
    from megatron_zeppelin.sim.workloads import read_lengths, sample_batch

    sampling_or_lengths(args, SAMPLING)
    if args.lengths:
        return read_lengths(args.lengths)
    return sample_batch(args.workload, args.global_batch_tokens, random.Random(args.seed))


def add_strategy_args(p: argparse.ArgumentParser) -> None:
    """--strategy and one flag per strategy option (``--cp-size``, ...), generated from the
    registered strategies' settings (``registry.add_option_flags``)."""
    from megatron_zeppelin.planner.registry import STRATEGIES, add_option_flags

    p.add_argument("--strategy", nargs="+", default=list(STRATEGIES),
                   help=f"strategies to compare: {list(STRATEGIES)}")
    add_option_flags(p.add_argument_group("strategy options (each applies to the strategies "
                                          "that take it)"))


def selected_strategies(args: argparse.Namespace, pool: Topology) -> list[Strategy]:
    """The ``--strategy`` objects with the options given on the command line (a bad value is
    refused naming its flag, as is an option ``pool`` cannot run); an option
    none of them takes is refused, naming it and the strategies that take it, as is a
    planner setting none of them reads (``--balance-slack`` without zeppelin)."""
    from megatron_zeppelin.planner.registry import refuse_unread_settings, strategies_from_flags

    refuse_repeats("--strategy", args.strategy)
    chosen = strategies_from_flags(args.strategy, args, pool=pool)
    refuse_unread_settings(zeppelin_config(args), [type(s) for s in chosen],
                           f"--strategy {' '.join(args.strategy)}")
    return chosen


def refuse_repeats(flag: str, values) -> None:
    """A ValueError naming ``flag`` when a value is listed twice (each would run twice)."""
    values = list(values or ())
    repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
    if repeated:
        raise ValueError(f"{flag} lists {', '.join(map(str, repeated))} more than once: each "
                         "runs once")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """--pp --vpp --microbatches --microbatch-order (``PipelineSpec``)."""
    add_flags(p.add_argument_group("pipeline parallelism (priced by planner/pipeline.py)"),
              PipelineSpec)


def pipeline_spec(args: argparse.Namespace) -> PipelineSpec:
    """The ``PipelineSpec`` of the flags; the micro-batch flags are refused without --pp."""
    spec = from_flags(PipelineSpec, args)
    if spec.pp == 1 and (args.microbatches is not None or args.microbatch_order != "balanced"):
        raise ValueError("--microbatches and --microbatch-order apply only with --pp >= 2")
    return spec


def cmd_plan(args: argparse.Namespace) -> int:
    from megatron_zeppelin.planner.report import format_table, summarize

    config = zeppelin_config(args)
    spec = pipeline_spec(args)
    setup = load_setup(args.model, args.cluster, args.nodes, args.hardware, config, args.tp)
    strategies = selected_strategies(args, setup.cluster.topology(setup.tp))
    cost = CostModel(setup.model, setup.cluster, setup.hardware, setup.tp)
    lengths = batch_lengths(args)
    refuse_untrainable(lengths, setup.model, setup.cluster, args.lengths or "the batch")
    if spec.pp > 1:
        given = [flag for flag, value in (("--plot", args.plot), ("--validate", args.validate))
                 if value]
        if given:
            raise ValueError(f"{' and '.join(given)}: only without --pp (with --pp the report "
                             "is the pipeline's per-stage table)")
        return plan_pipeline(lengths, strategies, cost, config, spec, args.json)
    plans, routed = [], []
    for strategy in strategies:
        plan = strategy.plan(lengths, cost, config)
        if args.validate:
            plan.validate()
        plans.append(plan)
        routed.append(config.routing and strategy.routed)
    names = [strategy.name for strategy in strategies]
    summaries = [summarize(plan, cost, r, name) for plan, r, name in zip(plans, routed, names)]
    if args.plot:
        print(f"wrote {plot_plans(plans, routed, names, cost, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": setup.model.name, "cluster": setup.cluster.name,
                          "nodes": setup.cluster.nodes, "documents": len(lengths),
                          "tokens": sum(lengths), "plans": [s.to_dict() for s in summaries]},
                         indent=2))
    else:
        print(f"{setup.model.name} on {setup.cluster.nodes} x {setup.cluster.name} "
              f"({setup.cluster.world_size} GPUs, TP={setup.tp}): {len(lengths)} documents, "
              f"{sum(lengths)} tokens, longest {max(lengths)}{overlong_note(plans[0].overlong)}")
        print(format_table(summaries))
    return 0


def overlong_note(report: OverlongReport) -> str:
    """What ``--overlong`` did to the batch, for the report's header ("" when nothing)."""
    if report.dropped_sequences:
        return (f"; --overlong drop left out {report.dropped_sequences} of them "
                f"({report.dropped_tokens} tokens)")
    if report.split_sequences:
        return (f"; --overlong split cut {report.split_sequences} of them into "
                f"{report.split_pieces} pieces")
    return ""


def plan_pipeline(lengths: list[int], strategies: list[Strategy], cost: CostModel,
                  config: ZeppelinConfig, spec: PipelineSpec, as_json: bool) -> int:
    """``zeppelin plan --pp N``: each strategy's estimated step under the pipeline, with
    ``spec``'s micro-batch order and with arrival order."""
    from dataclasses import replace

    from megatron_zeppelin.planner.pipeline_cost import estimate_pipeline

    rows = []
    for strategy in strategies:
        mine = estimate_pipeline(lengths, strategy, cost, config, spec)
        arrival = estimate_pipeline(lengths, strategy, cost, config,
                                    replace(spec, microbatch_order="arrival"))
        rows.append({"strategy": strategy.name, "step_s": mine.step_s, "bubble": mine.bubble,
                     "grad_s": mine.grad_s, "arrival_step_s": arrival.step_s,
                     "microbatches": [list(g) for g in mine.microbatches]})
    if as_json:
        print(json.dumps({"pp": spec.pp, "vpp": spec.vpp, "order": spec.microbatch_order,
                          "plans": rows}, indent=2))
        return 0
    print(f"{cost.model.name} on {cost.cluster.nodes} x {cost.cluster.name} PP={spec.pp} "
          f"VPP={spec.vpp}: {len(lengths)} documents in {spec.num_microbatches} micro-batches "
          f"({spec.microbatch_order}), estimated")
    print(f"{'strategy':20} {'step s':>9} {'bubble':>7} {'grad s':>7} {'arrival s':>10}")
    for r in rows:
        print(f"{r['strategy']:20} {r['step_s']:9.3f} {r['bubble']:7.1%} {r['grad_s']:7.3f} "
              f"{r['arrival_step_s']:10.3f}")
    return 0


def plot_plans(plans, routed: list[bool], names: list[str], cost: CostModel, path: str):
    """``zeppelin plan --plot FILE``: every plan simulated, ranks x time side by side, each
    under the strategy asked for (and its ``plan_label``, as the table shows it)."""
    from megatron_zeppelin.planner.report import plan_label
    from megatron_zeppelin.sim import report
    from megatron_zeppelin.sim.simulator import SimOptions, simulate

    results = []
    for plan, r, name in zip(plans, routed, names):
        label = plan_label(plan, name)
        results.append(simulate(plan, cost, SimOptions(inter_mode="routed" if r else "ring"),
                                label=name + (f" ({label})" if label else "")))
    return report.plot_timelines(results, path, f"{cost.model.name} on {cost.cluster.nodes} x "
                                 f"{cost.cluster.name}: {len(plans[0].seqlens)} sequences")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="zeppelin", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan one global batch with several strategies")
    add_setup_args(p)
    add_workload_args(p)
    add_strategy_args(p)
    add_pipeline_args(p)
    p.add_argument("--validate", action="store_true", help="also run Plan.validate()")
    p.add_argument("--plot", type=output_file((".png", ".svg", ".pdf")), default=None,
                   metavar="FILE", help="draw the batch as ranks x time for every strategy "
                   "side by side (.png, .svg or .pdf; simulated: linear, attention, exposed "
                   "communication)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_plan)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands owned by other layers (bench, simulate, calibrate)."""
    from megatron_zeppelin import bench
    from megatron_zeppelin.sim import cli as sim_cli

    return [bench.register, sim_cli.register]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``zeppelin`` command: bad input is one line on stderr and exit status 2."""
    def work() -> int:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "passthrough_flags", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.passthrough = unknown
        return args.func(args)

    return exit_status("zeppelin", work, SETTING_FLAGS)


# The planner's and the configs' setting names that messages use, and the flag that sets each
# here (messages shown by ``zeppelin`` name its flags; training's name its own).
SETTING_FLAGS = {"tensor_model_parallel_size": "--tp", "cp_size": "--cp-size",
                 "max_seqlen": "--max-seqlen", "capacity_tokens_per_gpu":
                 "--capacity-tokens-per-gpu", "capacity_factor": "--capacity-factor",
                 "max_seqlen_per_rank": "--max-seqlen-per-dp-cp-rank",
                 "the overlong policy": "--overlong", "num_microbatches": "--microbatches",
                 "max_cp_size": "--max-cp-size", "cluster.nodes": "--nodes"}


if __name__ == "__main__":
    sys.exit(main())
