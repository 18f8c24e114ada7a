"""``zeppelin bench halo``: a windowed ring group by halo exchange vs round the ring, measured.

One ring group (``--lengths``, static CP over ``--ranks`` gloo processes: an INTRA ring on one
node, or with ``--nodes`` an INTER ring whose hops across nodes are ring P2P or, with
``--inter-mode direct|routed``, the global inter-node steps) attends with each sliding window
of ``--windows``, forward + backward through the
attention engine, twice per window: as the engine runs it (the sequences whose zigzag chunks
hold the window by halo exchange, ``runtime/halo.py``, the others round the ring beside them;
on CPU only a group whose every sequence fits, unless ``--split``: ``schedule.HALO_SPLIT``)
and with the halo exchange off (``AttentionEngine(..., halo=False)``: every sequence round the
ring, its hops trimmed to the rows later positions read). The two alternate within every iteration
(``engine_local.alternating``), so that the machine's load hits them alike; each iteration's
time is the slowest rank's, and the median is reported, with the ratio (ring / halo: > 1, the
halo exchange is faster), the exchange rounds per pass and the KV and dK/dV rows each pass
sends (``bench.window.ring_figures``, the engine's own layouts). On CPU a round's cost is
mostly the gloo exchange's fixed cost, so the ratio is about rounds; bytes matter on GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_zeppelin.schedule import HALO_SPLIT, Phase, exchange_rounds, halo_steps

MAX_RANKS = 16  # gloo processes the benchmark spawns on this machine
WORKER_FLAGS = ("ranks", "windows", "heads", "kv_heads", "head_dim", "iters", "warmup",
                "forward_only", "split", "inter_mode")  # what the spawned ranks read


def _cost(args: argparse.Namespace):
    from megatron_zeppelin.bench.engine import bench_cost

    return bench_cost(args.nodes, args.ranks // args.nodes)


def _plan(lengths: list[int], cost):
    """Static CP over every rank of ``cost``'s cluster: the whole batch one ring group (INTRA
    on one node, else INTER)."""
    from megatron_zeppelin.planner import make_plan

    return make_plan("static-cp", lengths, cost, cp_size=cost.cluster.world_size)


def _worker(rank: int, store: str, out_path: str, args: argparse.Namespace, plan,
            topology) -> None:
    from megatron_zeppelin.bench.engine_local import (alternating, engine_step,
                                                      slowest_rank_seconds)
    from megatron_zeppelin.runtime.engine import AttentionEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=600))
    routing = dict(inter_mode=args.inter_mode, router_topology=topology, route_group=(
        dist.new_group(backend="gloo") if args.inter_mode != "ring" else None))
    gen = torch.Generator().manual_seed(rank)
    tokens = plan.attention_tokens()[rank]
    tensors = [torch.randn(tokens, h, args.head_dim, generator=gen)
               for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
    figures = {}
    for window in args.windows:
        engines = {name: AttentionEngine(plan, rank, dist.group.WORLD, windows=(window,),
                                         halo=name == "halo", halo_split=args.split or None,
                                         **routing)
                   for name in ("halo", "ring")}
        variants = {name: engine_step(engine, tensors, args.forward_only, window)
                    for name, engine in engines.items()}
        figures[str(window)] = alternating(
            variants, args.iters, args.warmup,
            lambda fn: slowest_rank_seconds(fn, torch.device("cpu")), statistics.median)
        for engine in engines.values():
            engine.close()
    if rank == 0:
        Path(out_path).write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    from megatron_zeppelin.bench.window import ring_figures
    from megatron_zeppelin.bench.workers import run_spawned

    from megatron_zeppelin.router import RouterTopology

    cost = _cost(args)
    plan, where = _plan(args.lengths, cost), "INTRA" if args.nodes == 1 else (
        f"INTER over {args.nodes} nodes, hops across nodes "
        f"{'ring P2P' if args.inter_mode == 'ring' else args.inter_mode + ' global steps'}")
    print(f"one ring group of {args.ranks} gloo ranks (static CP, {where}), lengths "
          f"{','.join(map(str, args.lengths))}; q {args.heads} heads, kv {args.kv_heads}, head "
          f"dim {args.head_dim}; median of {args.iters} alternating iterations "
          f"({'forward' if args.forward_only else 'forward + backward'}, slowest rank)"
          f"{'; a group only partly fitting split as on CUDA' if args.split else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "figures.json")
        worker_args = argparse.Namespace(**{key: getattr(args, key) for key in WORKER_FLAGS})
        run_spawned(_worker, args.ranks, (os.path.join(tmp, "store"), out_path, worker_args,
                                          plan, RouterTopology.from_cluster(cost.cluster)),
                    timeout_s=1800.0, what="bench halo")
        measured = json.loads(Path(out_path).read_text())
    ring_rounds = [exchange_rounds(args.ranks, phase) for phase in Phase]
    print(f"{'window':>7} {'by halo':>8} {'halo ms':>9} {'ring ms':>9} {'ring/halo':>9} "
          f"{'rounds fwd/bwd halo, ring':>26} {'KV rows/pass halo, ring':>24}")
    for window in args.windows:
        times = measured[str(window)]
        halo = ring_figures(args.lengths, args.ranks, window, halo_ok=True,
                            split=args.split or HALO_SPLIT["cpu"])
        ring = ring_figures(args.lengths, args.ranks, window)
        whole = halo["halo"] == halo["seqs"]  # else a ring run still makes every round
        rounds = [halo_steps(phase) - 1 for phase in Phase] if whole else ring_rounds
        print(f"{window:>7} {halo['halo']:>3}/{halo['seqs']:<4} {times['halo'] * 1e3:>9.2f} "
              f"{times['ring'] * 1e3:>9.2f} {times['ring'] / times['halo']:>8.2f}x "
              f"{'%d/%d, %d/%d' % (*rounds, *ring_rounds):>26} "
              f"{'%d, %d' % (halo['sent'], ring['sent']):>24}")
    return 0


def register(targets: argparse._SubParsersAction) -> None:
    from megatron_zeppelin.options import int_at_least
    from megatron_zeppelin.sim.workloads import token_count

    def lengths(text: str) -> list[int]:
        return [token_count(part) for part in text.split(",")]

    p = targets.add_parser("halo", help="windowed ring: halo exchange vs round the ring, measured")
    p.add_argument("--ranks", type=int_at_least(3), default=4,
                   help="ring positions, gloo processes (default 4)")
    p.add_argument("--nodes", type=int_at_least(1), default=1,
                   help="emulated nodes the ranks are spread over (default 1: an INTRA ring)")
    p.add_argument("--inter-mode", choices=("ring", "direct", "routed"), default="ring",
                   help="with --nodes > 1: the hops across nodes by ring P2P or in the global "
                        "inter-node steps, direct or routed through proxies (default ring)")
    p.add_argument("--lengths", type=lengths, default=[8192, 4096, 2048],
                   help="the group's sequence lengths, comma-separated")
    p.add_argument("--windows", type=int_at_least(0), nargs="+", default=[64, 256],
                   help="sliding windows in tokens (default 64 256)")
    p.add_argument("--heads", type=int_at_least(1), default=4)
    p.add_argument("--kv-heads", type=int_at_least(1), default=2)
    p.add_argument("--head-dim", type=int_at_least(1), default=32)
    p.add_argument("--iters", type=int_at_least(1), default=20)
    p.add_argument("--warmup", type=int_at_least(0), default=3)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--split", action="store_true",
                   help="split a group whose sequences only partly fit, as on CUDA")
    p.set_defaults(func=lambda args: (_check(p, args), run(args))[1])


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` naming a flag the benchmark cannot run: shapes beyond the benchmarks'
    (``check_shape``), more ranks than ``MAX_RANKS``, a window no sequence's chunks hold (the
    halo exchange would not run: nothing to compare), ``--split`` where every sequence holds
    every window (it would change nothing)."""
    from megatron_zeppelin.bench.flags import check_shape
    from megatron_zeppelin.cli import refuse_repeats
    from megatron_zeppelin.zigzag_window import halo_fits

    check_shape(parser, args, ("lengths",))
    if args.ranks > MAX_RANKS:
        parser.error(f"--ranks={args.ranks} is invalid: expected at most {MAX_RANKS} (one "
                     "process each on this machine)")
    if args.ranks % args.nodes:
        parser.error(f"--nodes={args.nodes} is invalid with --ranks {args.ranks}: expected a "
                     "divisor of the ranks (as many ranks on every node)")
    if args.inter_mode != "ring" and args.nodes == 1:
        parser.error(f"--inter-mode={args.inter_mode} is invalid with --nodes 1: one node has "
                     "no hops across nodes (give --nodes 2 or more)")
    try:
        refuse_repeats("--windows", args.windows)
    except ValueError as exc:
        parser.error(str(exc))
    for window in args.windows:
        if not any(halo_fits([n], args.ranks, window) for n in args.lengths):
            parser.error(f"--windows {window} is invalid with --ranks {args.ranks}: no sequence "
                         f"of --lengths holds {window} tokens in each of its {2 * args.ranks} "
                         f"zigzag chunks (a halo exchange needs a length >= "
                         f"{2 * args.ranks * window})")
    if args.split and all(halo_fits(args.lengths, args.ranks, w) for w in args.windows):
        parser.error(f"--split is invalid with --lengths {','.join(map(str, args.lengths))} "
                     f"--windows {' '.join(map(str, args.windows))}: every sequence holds "
                     "every window, so no group only partly fits (nothing to split; drop "
                     "--split, or add a shorter length)")
