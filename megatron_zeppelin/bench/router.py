"""``zeppelin bench router``: router speed (C++ vs Python) and the modelled ring-step time.

(a) Router time, median of repeats, for 16 and 128 nodes x 8 GPUs (a800-4nic and h800-8nic
    topologies) on two flow sets of one inter-node ring step: ``rings`` (a few long sequences
    ringed over 2-4 nodes, 1-4 rings per node group, so 1-4 GPUs of a node send) and
    ``all-send`` (every GPU sends 16-64 MiB to a random GPU of another node: the worst case).
    ``cpp raw`` is the compiled ``route_raw`` call alone; ``cpp`` and ``python`` are the full
    ``route()`` (validation and Python ``RouteSchedule`` objects included).
(b) Modelled time of one inter-node ring step, direct (TE CP) vs routed, for the paper's three
    clusters (configs/clusters/*.yaml) and one 64K-token LLaMA-7B sequence ringed over
    2 nodes x 8 GPUs, next to the paper's figures (TE CP ~2.18 ms, routed ~0.41 ms). ``routed``
    is the pipelined step at the schedule's ``chunks``; ``1-chunk`` the same slices sent in
    three sequential phases; dispatch / nic / combine: each phase's time over all chunks.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable, Sequence

from megatron_zeppelin.config import load_cluster
from megatron_zeppelin.router import (Flow, RouterTopology, backend_name, load_cpp, route,
                                      get_route_raw)
from megatron_zeppelin.router.reference import make_raw_arguments

PAPER_DIRECT_MS = 2.18
PAPER_ROUTED_MS = 0.41
PAPER_CLUSTERS = ("a800-4nic", "h800-8nic", "h200-8nic")
LLAMA_7B = {"kv_heads": 32, "head_dim": 128, "bytes": 2}
MIB = 1 << 20


def compute_kv_chunk_bytes(seq_tokens: int, ring_size: int, kv_heads: int, head_dim: int,
                   element_bytes: int) -> int:
    """Bytes of one ring step's K and V chunk per layer: (s/G) * 2 * kv_heads * head_dim * B."""
    return seq_tokens // ring_size * 2 * kv_heads * head_dim * element_bytes


def make_ring_flows(ranks: Sequence[int], gpus_per_node: int, nbytes: int) -> list[Flow]:
    """The inter-node flows of one step of a ring over ``ranks`` (rank i sends to i+1)."""
    flows = []
    for i, rank in enumerate(ranks):
        nxt = ranks[(i + 1) % len(ranks)]
        if rank // gpus_per_node != nxt // gpus_per_node:
            flows.append(Flow(rank, nxt, nbytes))
    return flows


def make_rings_step(nodes: int, gpus: int, rng: random.Random) -> list[Flow]:
    """Long sequences ringed over groups of 2-4 nodes; each group holds 1, 2 or 4 rings, each on
    the same local GPUs of its nodes, with 2K-8K tokens per rank (LLaMA-7B KV: 32-128 MiB)."""
    flows: list[Flow] = []
    node = 0
    while node + 2 <= nodes:
        span = min(rng.randint(2, 4), nodes - node)
        rings = rng.choice([r for r in (1, 2, 4) if gpus % r == 0])
        width = gpus // rings
        for j in range(rings):
            ranks = [n * gpus + j * width + l for n in range(node, node + span)
                     for l in range(width)]
            tokens = rng.choice([2048, 4096, 8192]) * len(ranks)
            nbytes = compute_kv_chunk_bytes(tokens, len(ranks), **_llama_kv_kwargs())
            flows += make_ring_flows(ranks, gpus, nbytes)
        node += span
    return flows


def make_all_send_step(nodes: int, gpus: int, rng: random.Random) -> list[Flow]:
    """Every GPU sends 16-64 MiB to a random GPU on another node."""
    flows = []
    for rank in range(nodes * gpus):
        other = (rank // gpus + rng.randrange(1, nodes)) % nodes
        flows.append(Flow(rank, other * gpus + rng.randrange(gpus), rng.randint(1, 4) * 16 * MIB))
    return flows


def _llama_kv_kwargs() -> dict:
    return {"kv_heads": LLAMA_7B["kv_heads"], "head_dim": LLAMA_7B["head_dim"],
            "element_bytes": LLAMA_7B["bytes"]}


def measure_median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_router(topo: RouterTopology, cluster: str, nodes: int, scenario: str, repeats: int,
                seed: int) -> str:
    """One line of table (a): router times in ms for one topology and flow set."""
    make = make_rings_step if scenario == "rings" else make_all_send_step
    flows = make(nodes, topo.gpus_per_node, random.Random(seed))
    cells = [f"{cluster:10s} {nodes:5d} {scenario:9s} {len(flows):6d}"]
    if load_cpp() is not None:
        args, raw = make_raw_arguments(topo, flows, 2), get_route_raw("cpp")
        raw_s = measure_median_seconds(lambda: raw(*args), repeats)
        cpp_s = measure_median_seconds(lambda: route(topo, flows, 2, backend="cpp"), repeats)
        cells.append(f"{raw_s * 1e3:9.3f} {cpp_s * 1e3:9.3f}")
    else:
        cells.append(f"{'n/a':>9s} {'n/a':>9s}")
    py_s = measure_median_seconds(lambda: route(topo, flows, 2, backend="python"),
                                  max(1, repeats // 10))
    schedule = route(topo, flows, 2)
    cells.append(f"{py_s * 1e3:9.1f} {schedule.direct_time_s * 1e3:9.3f} "
                 f"{schedule.estimated_time_s * 1e3:9.3f}")
    return " ".join(cells)


def model_paper_step(cluster: str) -> str:
    """One line of table (b): a 64K LLaMA-7B sequence ringed over 2 nodes x 8 GPUs."""
    topo = RouterTopology.from_cluster(load_cluster(cluster, nodes=2))
    ring = list(range(topo.world_size))
    nbytes = compute_kv_chunk_bytes(65536, len(ring), **_llama_kv_kwargs())
    schedule = route(topo, make_ring_flows(ring, topo.gpus_per_node, nbytes), align=2)
    return (f"{cluster:10s} {nbytes / MIB:6.1f} {schedule.direct_time_s * 1e3:9.3f} "
            f"{schedule.estimated_time_s * 1e3:9.3f} {schedule.chunks:6d} "
            f"{schedule.sequential_time_s * 1e3:9.3f} {schedule.dispatch_time_s * 1e3:8.3f} "
            f"{schedule.nic_time_s * 1e3:8.3f} {schedule.combine_time_s * 1e3:8.3f} "
            f"{schedule.speedup:6.2f}x {PAPER_DIRECT_MS:6.2f} {PAPER_ROUTED_MS:6.2f}")


def run(argv: Sequence[str] | None = None) -> None:
    """Print tables (a) and (b); see the module docstring. ``argv``: command-line options."""
    from megatron_zeppelin.options import Parser, int_at_least

    parser = Parser(prog="zeppelin bench router", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int_at_least(1), default=50,
                        help="timing repeats (default 50)")
    parser.add_argument("--nodes", type=int_at_least(2), nargs="+", default=[16, 128],
                        help="node counts for table (a) (default 16 128)")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        help="flow generator seed (default 0)")
    args = parser.parse_args(argv)
    table = [(cluster, nodes, RouterTopology.from_cluster(load_cluster(cluster, nodes=nodes)))
             for cluster in ("a800-4nic", "h800-8nic") for nodes in args.nodes]  # bad: no line
    print(f"(a) router time, ms (median of {args.repeats}; python: of "
          f"{max(1, args.repeats // 10)}); default backend: {backend_name()}")
    print(f"{'cluster':10s} {'nodes':>5s} {'flows':9s} {'count':>6s} {'cpp raw':>9s} "
          f"{'cpp':>9s} {'python':>9s} {'direct':>9s} {'routed':>9s}  (last two: modelled "
          "step ms)")
    for cluster, nodes, topo in table:
        for scenario in ("rings", "all-send"):
            print(time_router(topo, cluster, nodes, scenario, args.repeats, args.seed))
    print("\n(b) one inter-node ring step, 64K-token LLaMA-7B sequence over 2 nodes x 8 GPUs "
          "(KV chunk per layer), modelled ms (routed: pipelined in `chunks`)")
    print(f"{'cluster':10s} {'MiB':>6s} {'direct':>9s} {'routed':>9s} {'chunks':>6s} "
          f"{'1-chunk':>9s} {'dispatch':>8s} {'nic':>8s} {'combine':>8s} {'speedup':>7s} "
          f"{'paper TE CP':>6s} {'paper routed':>6s}")
    for cluster in PAPER_CLUSTERS:
        print(model_paper_step(cluster))


def register(targets) -> None:
    """``zeppelin bench router``: this module's own parser handles every flag (``run``)."""
    p = targets.add_parser("router", add_help=False,
                           help="router time (C++ vs Python) and routed ring-step model")
    p.set_defaults(func=_command, passthrough_flags=True)


def _command(args) -> int:
    run(args.passthrough)
    return 0
