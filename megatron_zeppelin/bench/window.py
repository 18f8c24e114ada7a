"""``zeppelin bench window``: what a sliding window saves on the rings of real plans.

For one batch planned by each strategy (zeppelin, static CP) and each window ``L``, over every
ring group (ring size > 1) and ring position, from the engine's own ring blocks
(``ZigzagLayout(..., window)``, the blocks the engine runs):

* attended (query, key) pairs with the window vs full causal attention (the kernels' work);
* ring steps whose compute is skipped (no block: the held KV lies wholly outside the window;
  runs round the ring only);
* KV relay per pass (forward; backward relays the same KV), in bytes: every KV block whole on
  every hop (no window, or a window without trimming) vs what the engine sends (each hop
  forwards only the rows some later position still reads, ``ZigzagLayout.held_rows``);
* the backward's dK/dV accumulators (fp32, ``G`` hops each, the last one home): whole vs what
  the engine sends (the rows some position after the owner reads, ``ZigzagLayout.dkv_rows``);
* the sequences run by halo exchange (``runtime/halo.py``: the window fits in each of their
  chunks on a ring of 3 or more, on any tier, an INTER ring's hops across nodes in the
  global steps where the strategy routes; "by halo", of the ring groups' sequences; a group
  split as the engine splits it on CUDA, ``schedule.HALO_SPLIT``): each position sends its
  neighbours the rows they read, once (one exchange forward, the dK/dV of those rows home
  backward) instead of relaying them round the ring; their KV and dK/dV "sent" are those
  rows.

Around the ring, skipping whole transfers saves nothing in the zigzag layout: position
``p - 1`` holds the chunk right after position ``p``'s mirror chunk, so the last hop of every
KV block is needed; trimming rows is what saves, and the halo exchange skips the hops.

Host arithmetic only (no timing), so the figures are the same on any machine.
"""
from __future__ import annotations

import argparse
import random

import torch

from megatron_zeppelin.config import load_setup
from megatron_zeppelin.cost_model import DKV_BYTES, CostModel
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.plan import Tier
from megatron_zeppelin.runtime.zigzag import ZigzagLayout
from megatron_zeppelin.sim.workloads import sample_batch
from megatron_zeppelin.zigzag_window import halo_parts


def block_pairs(block) -> int:
    """(query, key) pairs one block attends (END-aligned band of ``kernels.base``)."""
    left, right = block.window if block.window is not None else (
        -1, 0 if block.causal else -1)
    total = 0
    cq, ck = block.pieces.cu_q, block.pieces.cu_k
    for i in range(len(cq) - 1):
        tq, tk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        aligned = torch.arange(tq) + (tk - tq)
        lo = (aligned - left).clamp(min=0) if left >= 0 else torch.zeros(tq, dtype=torch.long)
        hi = (aligned + right).clamp(max=tk - 1) if right >= 0 else torch.full((tq,), tk - 1)
        total += int((hi - lo + 1).clamp(min=0).sum())
    return total


def needed_rows(layout: ZigzagLayout, step: int) -> set[int]:
    """Rows of the KV block held at ``step`` (held rows) that this position's blocks read."""
    rows: set[int] = set()
    for block in layout.blocks(step):
        if block.k_rows is None:
            return set(range(block.pieces.total_k))
        rows.update(block.k_rows.tolist())
    return rows


FIGURES = ("pairs", "steps", "skipped", "whole", "sent", "needed", "dkv_whole", "dkv_sent",
           "seqs", "halo")


def ring_figures(lengths: list[int], size: int, window: int | None,
                 halo_ok: bool = False, split: bool = True) -> dict[str, int]:
    """Pairs, skipped steps and relay tokens (sent / needed) of one ring group; ``halo_ok``:
    its sequences whose chunks hold the window run by halo exchange, the others round the
    ring (``runtime.waves.windowed``; without ``split``, as on CPU, only a group whose every
    sequence fits; False: every sequence round the ring, ``AttentionEngine(halo=False)``)."""
    out = dict.fromkeys(FIGURES, 0)
    for halo, seqs in halo_parts(lengths, size, window, split, halo_ok):
        if seqs:
            figures = _run_figures([lengths[i] for i in seqs], size, window, halo)
            out = {key: out[key] + figures[key] for key in FIGURES}
    return out


def _run_figures(lengths: list[int], size: int, window: int | None,
                 halo: bool) -> dict[str, int]:
    """``ring_figures`` of one run: by halo exchange, or round the ring."""
    layouts = [ZigzagLayout(lengths, size, p, window) for p in range(size)]
    out = dict.fromkeys(FIGURES, 0)
    out["seqs"], out["halo"] = len(lengths), len(lengths) if halo else 0
    for p, layout in enumerate(layouts):
        for step in range(size):
            blocks = layout.blocks(step)
            out["pairs"] += sum(block_pairs(b) for b in blocks)
            if not halo:  # ring steps (a halo exchange has none to skip)
                out["steps"] += step > 0
                out["skipped"] += step > 0 and not blocks
                out["sent"] += layout.relay_tokens(step) if step else 0  # what arrives
        out["dkv_whole"] += size * layout.tokens()  # rounds 1..G carry p's accumulator
        if halo:  # what its neighbours read, once each way; their dK/dV come back
            read = sum(len(layout.read_rows((p + d) % size, p)) for d in (1, -1))
            out["sent"], out["dkv_sent"] = out["sent"] + read, out["dkv_sent"] + read
        else:
            out["dkv_sent"] += size * layout.dkv_tokens(p)
    for source in range(size):  # the KV block of ``source`` hops source -> source+1 -> ...
        later: set[int] = set()
        for step in range(size - 1, 0, -1):  # the hop into ``step`` carries what is needed
            position = layouts[(source + step) % size]  # at steps >= it (full-buffer rows)
            held = position.held_rows(source, step)
            later |= {r if held is None else held[r] for r in needed_rows(position, step)}
            out["whole"] += layouts[source].tokens()
            out["needed"] += len(later)
    return out


def plan_figures(plan, window: int | None) -> dict[str, int]:
    """``ring_figures`` summed over the plan's ring groups, as the engine runs them."""
    total = dict.fromkeys(FIGURES, 0)
    for group in plan.ring_groups:
        if group.tier == Tier.LOCAL or len(group.ring) == 1:
            continue
        figures = ring_figures([plan.seqlens[s] for s in group.seqs], len(group.ring), window,
                               halo_ok=True)
        for key, value in figures.items():
            total[key] += value
    return total


def bench_window(args: argparse.Namespace) -> int:
    from megatron_zeppelin.cli import refuse_repeats

    refuse_repeats("--windows", args.windows)
    setup = load_setup(args.model, args.cluster, nodes=args.nodes)
    cost = CostModel(setup.model, setup.cluster, setup.hardware, 1)
    world = setup.cluster.world_size
    cp = world if args.cp is None else args.cp
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    if cp not in divisors:
        raise ValueError(f"--cp={cp} is invalid: expected a divisor of the {world} GPUs of "
                         f"{args.nodes} x {args.cluster}: one of {divisors}")
    lengths = sample_batch(args.workload, args.tokens, random.Random(args.seed))
    plans = [(strategy, make_plan(strategy, lengths, cost, setup.zeppelin, **options))
             for strategy, options in (("zeppelin", {}), ("static-cp", {"cp_size": cp}))]
    spec = setup.model
    token_bytes = spec.kv_heads * spec.pair_dim * spec.bytes_per_element  # k and v
    print(f"{args.model} on {args.nodes} x {args.cluster}, {len(lengths)} documents "
          f"({sum(lengths):,} tokens, longest {max(lengths):,}) of {args.workload}; KV "
          f"{token_bytes} bytes/token; ring groups only (LOCAL sequences have no ring)")
    print(f"{'strategy':>10} {'window':>7} {'pairs vs full':>14} {'steps skipped':>14} "
          f"{'KV whole GB':>12} {'KV sent GB':>17} {'dKV whole GB':>13} {'dKV sent GB':>17} "
          f"{'by halo':>13}")
    dkv_bytes = token_bytes / spec.bytes_per_element * DKV_BYTES  # the fp32 accumulator
    for strategy, plan in plans:  # planned before the first line: a refusal prints nothing
        full = plan_figures(plan, None)
        for window in args.windows:
            got = plan_figures(plan, window)
            share = got["pairs"] / full["pairs"] if full["pairs"] else 0.0
            skipped = f"{got['skipped']}/{got['steps']}"
            whole, sent = got["whole"] * token_bytes / 1e9, got["sent"] * token_bytes / 1e9
            dkv_whole, dkv_sent = (got[k] * dkv_bytes / 1e9 for k in ("dkv_whole", "dkv_sent"))
            print(f"{strategy:>10} {window:>7} {share:>13.1%} {skipped:>14} {whole:>12.3f} "
                  f"{sent:>10.3f} {_less(sent, whole)} {dkv_whole:>13.3f} {dkv_sent:>10.3f} "
                  f"{_less(dkv_sent, dkv_whole)} {got['halo']:>6}/{got['seqs']:<6}")
    return 0


def _less(part: float, whole: float) -> str:
    return f"({1 - part / whole if whole else 0.0:>4.0%} less)"


def register(targets: argparse._SubParsersAction) -> None:
    from megatron_zeppelin.options import int_at_least
    from megatron_zeppelin.sim.workloads import WORKLOADS, token_count

    p = targets.add_parser("window", help="sliding window: ring compute and KV relay saved")
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--cluster", default="h200-8nic")
    p.add_argument("--nodes", type=int_at_least(1), default=2)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="github")
    p.add_argument("--tokens", type=token_count, default=262144,
                   help="tokens of the batch (256K, 2M; default 256K)")
    p.add_argument("--cp", type=int_at_least(1), default=None,
                   help="static CP size, a divisor of the GPUs (default: all of them)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--windows", type=int_at_least(0), nargs="+", default=[512, 4096],
                   help="window sizes in tokens")
    p.set_defaults(func=bench_window)
