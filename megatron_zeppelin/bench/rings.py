"""``zeppelin bench rings``: what a ring round costs beyond its compute and its bytes when
the emulated cluster's ranks share this machine's cores (issue 19: the hypothesis that every
ring round is a synchronisation that grows with ring size and tier).

4 forked gloo processes (one thread each, as the emulated cluster's ranks) run ``--rounds``
rounds in each of three layouts, at each compute size:

* ``none``: every process computes, no exchange (the compute under sharing: the baseline);
* ``2x2``: two 2-process rings (0, 1) and (2, 3) (an intra-node ring per emulated node);
* ``1x4``: one 4-process ring (the cross-node ring of the 2 x 2 cluster).

A ring round is the engine's: post the exchange of the next KV chunk (isend to the next rank,
irecv from the previous, ``--bytes``), run the round's compute (a matmul loop of a known CPU
time, measured alone first), wait for both. Per (layout, compute) the median over ranks of
each rank's mean round time (total over rounds: a round preempted for a scheduler slice
counts); the **sync** is that minus the ``none`` layout's round time at the same
compute and minus the exchange alone (the ring at compute 0 less ``none`` at compute 0, i.e.
the link). Printed per ring size with its spread (min..max over repeats) and the load
average; ``--json`` writes the rows. On Linux with autogroup scheduling other sessions' jobs
share the cores whatever their ``nice`` (see ``docs/benchmarks.md``): run it where nothing
else runs, or from a session whose group is raised.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatron_zeppelin.bench.workers import run_forked
from megatron_zeppelin.options import integer

RANKS = 4
LAYOUTS = {"none": (), "2x2": ((0, 1), (2, 3)), "1x4": ((0, 1, 2, 3),)}
MATMUL = 128  # [MATMUL, MATMUL] fp32 matmul: the unit of compute (~50 us on one core)


def _unit() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)


def unit_seconds(repeats: int = 200) -> float:
    """Least CPU time of one compute unit in this thread (one intra-op thread)."""
    torch.set_num_threads(1)
    a, b = _unit()
    for _ in range(10):
        a @ b
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(repeats):
            a @ b
        best = min(best, (time.thread_time() - start) / repeats)
    return best


def _peers(layout: tuple, rank: int) -> tuple[int, int] | None:
    for ring in layout:
        if rank in ring:
            i = ring.index(rank)
            return ring[(i + 1) % len(ring)], ring[i - 1]
    return None


def _round(dist, peers, send, recv, a, b, units: int) -> None:
    """One engine-style round: post the exchange, compute ``units`` matmuls, wait."""
    ops = [] if peers is None else [dist.isend(send, peers[0]), dist.irecv(recv, peers[1])]
    for _ in range(units):
        a @ b
    for op in ops:
        op.wait()


def _worker(rank: int, units: tuple[int, ...], rounds: int, repeats: int, nbytes: int) -> dict:
    """This rank's mean round seconds per (layout, units, repeat) (the mean: a round
    preempted for a scheduler slice counts; a median would hide it)."""
    import torch.distributed as dist

    a, b = _unit()
    send, recv = torch.zeros(max(1, nbytes // 4)), torch.zeros(max(1, nbytes // 4))
    out = {}
    for rep in range(repeats):
        for name, layout in LAYOUTS.items():
            peers = _peers(layout, rank)
            for n in units:
                dist.barrier()
                _round(dist, peers, send, recv, a, b, n)  # warm-up round
                start = time.perf_counter()
                for _ in range(rounds):
                    _round(dist, peers, send, recv, a, b, n)
                out[(name, n, rep)] = (time.perf_counter() - start) / rounds
    return out


def measure(units: tuple[int, ...], rounds: int, repeats: int, nbytes: int) -> dict:
    """{(layout, units): [per-repeat median over ranks of each rank's mean round s]}."""
    per_rank = run_forked(_worker, RANKS, (units, rounds, repeats, nbytes), timeout_s=600.0,
                          what="ring-round measurement", gloo_timeout_s=300.0)
    table: dict = {}
    for (name, n, rep), _ in sorted(per_rank[0].items()):
        table.setdefault((name, n), []).append(
            statistics.median(r[(name, n, rep)] for r in per_rank))
    return table


def sync_rows(table: dict, unit_s: float) -> list[dict]:
    """Per ring layout and compute size: round, baseline, link and the sync beyond them (s)."""
    rows = []
    units = sorted({n for _, n in table})
    for name in ("2x2", "1x4"):
        link = statistics.median(table[(name, units[0])]) - \
            statistics.median(table[("none", units[0])])
        for n in units:
            ring, base = table[(name, n)], table[("none", n)]
            sync = [r - statistics.median(base) - link for r in ring]
            rows.append({"layout": name, "ring_size": len(LAYOUTS[name][0]), "units": n,
                         "compute_alone_s": n * unit_s, "none_s": statistics.median(base),
                         "round_s": statistics.median(ring), "link_s": link,
                         "sync_s": statistics.median(sync), "sync_min_s": min(sync),
                         "sync_max_s": max(sync)})
    return rows


MAX_BYTES = 1 << 30  # per exchange: a GiB each way and rank is beyond any ring hop


def _units(p: argparse.ArgumentParser, args) -> tuple[int, ...]:
    """The checked ``--units`` (and the other counts); a bad value exits 2 naming the flag."""
    try:
        given = [integer(u) for u in args.units.split(",")]
    except ValueError:
        given = []
    units = tuple(sorted(set(given)))
    if len(units) < 2 or units[0] != 0 or len(units) < len(given):
        p.error(f"--units={args.units!r} is invalid: expected distinct integers >= 0, "
                "comma-separated, 0 among them and at least one above it")
    for name, value, least in (("--rounds", args.rounds, 1), ("--repeats", args.repeats, 1),
                               ("--bytes", args.bytes, 4)):
        if value < least:
            p.error(f"{name}={value} is invalid: expected an integer >= {least}")
    if args.bytes % 4 or args.bytes > MAX_BYTES:
        p.error(f"--bytes={args.bytes} is invalid: expected a multiple of 4 (fp32 elements) "
                f"up to {MAX_BYTES}")
    return units


def run(argv: list[str]) -> dict:
    from megatron_zeppelin.bench.flags import ExitParser
    from megatron_zeppelin.output_paths import output_file

    p = ExitParser(prog="zeppelin bench rings", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", default="0,10,40,160", help="compute per round, in matmul units "
                   "(comma list, the first is the exchange alone: use 0)")
    p.add_argument("--rounds", type=int, default=40, help="rounds per measurement")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the whole table")
    p.add_argument("--bytes", type=int, default=65536, help="bytes each rank sends per round")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the rows here")
    args = p.parse_args(argv)
    units = _units(p, args)
    load0 = os.getloadavg()[0]
    unit_s = unit_seconds()
    table = measure(units, args.rounds, args.repeats, args.bytes)
    rows = sync_rows(table, unit_s)
    print(f"ring sync: {RANKS} gloo processes on {os.cpu_count()} cores, {args.rounds} rounds x "
          f"{args.repeats} repeats, {args.bytes} B per exchange, compute unit "
          f"{unit_s * 1e6:.0f} us alone; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'layout':6} {'units':>5} {'alone ms':>8} {'none ms':>8} {'round ms':>8} "
          f"{'link ms':>7} {'sync ms':>8} {'min..max':>14} {'sync/none':>9}")
    for r in rows:
        print(f"{r['layout']:6} {r['units']:5d} {r['compute_alone_s'] * 1e3:8.2f} "
              f"{r['none_s'] * 1e3:8.2f} {r['round_s'] * 1e3:8.2f} {r['link_s'] * 1e3:7.2f} "
              f"{r['sync_s'] * 1e3:8.2f} {r['sync_min_s'] * 1e3:6.2f}..{r['sync_max_s'] * 1e3:6.2f}"
              f" {r['sync_s'] / max(r['none_s'], 1e-9):9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit_s": unit_s, "rows": rows, "load": [load0, os.getloadavg()[0]]},
                      f, indent=1)
    return {"rows": rows}


def register(targets) -> None:
    from megatron_zeppelin.bench import register_passthrough

    register_passthrough(targets, "rings", "a ring round's cost beyond compute and link on "
                         "shared cores, rings of 2 and 4 processes (rings.py)", run)
