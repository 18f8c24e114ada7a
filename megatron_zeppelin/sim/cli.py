"""``zeppelin simulate`` (registered by ``cli._extra_commands``).

Plan + simulate every strategy variant over node counts x workloads; print a table per setting
and a summary; ``--plot DIR`` writes speedup bars and per-rank loads. (Measured figures, the
fidelity check and calibration, live in ``megatron_zeppelin.bench``.)
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.options import add_flags, from_flags, given, int_at_least, nonempty
from megatron_zeppelin.output_paths import output_folder
from megatron_zeppelin.sim.workloads import WORKLOADS, token_count


def _add_simulate_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``zeppelin simulate``."""
    from megatron_zeppelin.sim.sweep import DEFAULT_VARIANTS, MAX_MEGATRON_SEQUENCES, VARIANTS

    p.add_argument("--model", type=nonempty, help="model YAML path or shipped name (llama-7b)")
    p.add_argument("--cluster", type=nonempty,
                   help="cluster YAML path or shipped name (a800-4nic)")
    p.add_argument("--nodes", type=int_at_least(1), nargs="+", default=None,
                   help="node counts to sweep (default: the cluster YAML's)")
    p.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel size per rank")
    p.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=None,
                   help="built-in workloads (default github)")
    p.add_argument("--lengths", type=nonempty, default=None, help="file with one document "
                   "length per line: one batch (replaces --workload, the token flags, --batches "
                   "and --seed)")
    p.add_argument("--global-batch-tokens", type=token_count, default=None,
                   help="tokens per global batch (2M, 512K; replaces --tokens-per-gpu)")
    p.add_argument("--tokens-per-gpu", type=token_count, default=None,
                   help="tokens per GPU per global batch (default 64K)")
    p.add_argument("--batches", type=int_at_least(1), default=None,
                   help="global batches per setting, their mean reported (default 2)")
    p.add_argument("--seed", type=int_at_least(0), default=None,
                   help="sampling seed (default 0)")
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_VARIANTS),
                   help=f"variants to simulate: {list(VARIANTS)}")
    p.add_argument("--baseline", default="static-cp", help="variant speedups are relative to")
    add_flags(p.add_argument_group("planner options"), ZeppelinConfig,
              skip=("routing", "remap"))  # switched per variant
    p.add_argument("--max-megatron-sequences", type=int_at_least(0), default=MAX_MEGATRON_SEQUENCES,
                   help="skip megatron-hybrid-cp above this many documents per batch")
    from megatron_zeppelin.cli import add_pipeline_args

    add_pipeline_args(p)
    p.add_argument("--compare-orders", action="store_true",
                   help="with --pp: also simulate arrival-order micro-batches")
    p.add_argument("--plot", type=output_folder, default=None,
                   help="folder for speedup and per-rank load PNGs (made if missing)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _settings(args: argparse.Namespace):
    """The sweep's settings from the flags; raises ValueError naming a bad flag."""
    from megatron_zeppelin.cli import SAMPLING, refuse_repeats, sampling_or_lengths
    from megatron_zeppelin.config import load_cluster
    from megatron_zeppelin.sim.sweep import settings_from_args

    missing = [flag for flag, value in (("--model", args.model), ("--cluster", args.cluster))
               if not value]
    if missing:
        raise ValueError(f"{' and '.join(missing)}: required")
    for flag, values in (("--nodes", args.nodes), ("--workload", args.workload),
                         ("--strategies", getattr(args, "strategies", None))):
        refuse_repeats(flag, values)
    nodes = args.nodes or [load_cluster(args.cluster).nodes]
    if args.global_batch_tokens is not None and args.tokens_per_gpu is not None:
        raise ValueError(f"--global-batch-tokens {args.global_batch_tokens} with "
                         f"--tokens-per-gpu {args.tokens_per_gpu}: pass one (the batch's size "
                         "or its share per GPU)")
    sampling_or_lengths(args, {**SAMPLING, "--workload": ("workload", ["github"]),
                               "--global-batch-tokens": ("global_batch_tokens", 0),
                               "--tokens-per-gpu": ("tokens_per_gpu", 64 << 10),
                               "--batches": ("batches", 2)})
    return settings_from_args(args.model, args.cluster, nodes, args.workload, args.tp,
                              args.global_batch_tokens, args.tokens_per_gpu, args.batches,
                              args.seed, args.lengths)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the sweep and print / plot the results."""
    from megatron_zeppelin.sim import report
    from megatron_zeppelin.sim.sweep import resolve_variants, run_setting

    variants = resolve_variants(args.strategies)
    if args.baseline not in [v.label for v in variants]:
        raise ValueError(f"--baseline {args.baseline!r} (what the others are compared with; "
                         f"default static-cp) is not among --strategies {args.strategies}: add "
                         "it to --strategies or pass --baseline as one of them")
    from megatron_zeppelin.cli import pipeline_spec

    spec = pipeline_spec(args)
    _refuse_unused(args, variants, spec)
    settings = _settings(args)
    config = from_flags(ZeppelinConfig, args, routing=True, remap=True)
    if spec.pp > 1:
        return _simulate_pipeline(args, variants, settings, config, spec)
    bar = _progress(len(settings) * len(variants) * args.batches, args.no_progress)
    results = [run_setting(s, variants, config, args.max_megatron_sequences, bar.update)
               for s in settings]
    bar.close()
    if args.json:
        print(json.dumps([_to_json(r) for r in results], indent=2))
    else:
        for r in results:
            print(report.format_setting(r, args.baseline) + "\n")
        print(report.format_summary(results, args.baseline))
        batches = sum(len(r.results[0].batch_s) for r in results if r.results)
        print(f"\nper batch ({batches} batches: {args.batches} per setting from --seed "
              f"{args.seed}), zeppelin vs each peer, judged by the simulator's own step model; "
              "a batch within 1% is a tie:")
        print(report.format_win_loss(results))
        print(report.describe_profiles(results))
    if args.plot:
        _write_plots(results, Path(args.plot), args.baseline)
    return 0


def _refuse_unused(args: argparse.Namespace, variants, spec) -> None:
    """ValueError for a flag given that would change nothing: --compare-orders without
    --pp, --max-megatron-sequences without megatron-hybrid-cp among the variants (or with
    --pp, whose sweep does not skip), --microbatch-order with --compare-orders (which runs
    both orders)."""
    from megatron_zeppelin.sim.sweep import MAX_MEGATRON_SEQUENCES

    if args.compare_orders and spec.pp == 1:
        raise ValueError("--compare-orders applies only with --pp >= 2")
    if given(args, "--max-megatron-sequences", MAX_MEGATRON_SEQUENCES) and (
            spec.pp > 1 or "megatron-hybrid-cp" not in [v.strategy.name for v in variants]):
        raise ValueError(f"--max-megatron-sequences={args.max_megatron_sequences} is invalid "
                         "here: it applies only to megatron-hybrid-cp among --strategies, "
                         "without --pp (it would be ignored: drop it)")
    if args.compare_orders and given(args, "--microbatch-order", "balanced"):
        raise ValueError(f"--microbatch-order={args.microbatch_order} is invalid with "
                         "--compare-orders, which simulates both orders (drop one)")


def _simulate_pipeline(args, variants, settings, config, spec) -> int:
    """``zeppelin simulate --pp N``: the pipeline sweep (``sim/pipeline.py``)."""
    from megatron_zeppelin.sim import pipeline

    if args.plot or args.json:
        raise ValueError("--plot and --json are not available with --pp (tables only)")
    orders = ("balanced", "arrival") if args.compare_orders else (spec.microbatch_order,)
    bar = _progress(len(settings) * len(variants) * len(orders), args.no_progress)
    results = [pipeline.run_pipeline_setting(s, variants, config, spec, orders, bar.update)
               for s in settings]
    bar.close()
    for r in results:
        print(pipeline.format_pipeline_setting(r, args.baseline) + "\n")
    print(pipeline.format_pipeline_summary(results, args.baseline))
    return 0


def _progress(total: int, disabled: bool):
    """A tqdm bar on stderr (off for tiny sweeps or with --no-progress)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="plan+simulate", unit="run", file=sys.stderr,
                disable=disabled or total < 4, leave=False)


def _to_json(result) -> dict:
    """A setting's results as JSON-ready data (per-rank arrays left out)."""
    out = {"setting": asdict(result.setting), "gpus": result.gpus,
           "documents": result.documents, "tokens": result.tokens,
           "lower_bound_s": result.lower_bound_s, "skipped": [list(s) for s in result.skipped],
           "results": []}
    if out["setting"].pop("lengths"):  # the file's batch: no sampling sizes
        for key in ("tokens", "tokens_per_gpu", "batches"):
            out["setting"].pop(key)
    for r in result.results:
        first = asdict(r.first)
        for key in ("rank_linear_s", "rank_attention_s", "rank_wait_s"):
            first.pop(key)
        out["results"].append({"label": r.label, "iteration_s": r.iteration_s,
                               "plan_ms": r.plan_ms, "plan": r.note, "batch_s": list(r.batch_s),
                               "first_batch": first})
    return out


def _write_plots(results, folder: Path, baseline: str) -> None:
    """Speedup bars per model x cluster, and one per-rank load chart."""
    from megatron_zeppelin.sim import report

    groups: dict[str, list] = {}
    for r in results:
        s = r.setting
        tag = f"{s.model_name}-{s.cluster_name}" + (f"-tp{s.tp}" if s.tp > 1 else "")
        groups.setdefault(tag, []).append(r)
    for tag, mine in groups.items():
        path = report.plot_speedups(mine, folder / f"speedup-{tag}.png", baseline)
        print(f"wrote {path}")
    path = report.plot_rank_loads(pick_load_setting(results, baseline), folder / "rank-load.png")
    print(f"wrote {path}")


def pick_load_setting(results, baseline: str):
    """The setting whose per-rank loads are worth a chart: zeppelin's largest speedup."""
    return max(results, key=lambda r: r.speedup("zeppelin", baseline) or 0.0)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``simulate`` to the ``zeppelin`` command."""
    p = sub.add_parser("simulate", help="simulate strategies over cluster sizes and workloads",
                       description=__doc__)
    _add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)
