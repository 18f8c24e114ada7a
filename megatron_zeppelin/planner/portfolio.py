"""The ``zeppelin`` strategy: candidate plans of one batch, the fastest by the step estimate.

Zeppelin's plan space contains the peers' plans (all-local placement is hybrid DP, one ring
per node is static CP), so rather than trusting one heuristic the strategy builds several
plans of the same batch and returns the one with the lowest ``estimate.estimate_tasks`` (the
closed form of what the simulator models):

* ``hierarchical+remap``: the hierarchical placement (``zeppelin.py``) balancing attention,
  with the remap's linear layout (``linear_layout``); where that placement is already
  token-balanced the layout moves nothing and logs name the plan ``hierarchical``
  (``Plan.name``: named by what the plan does);
* ``hierarchical``: the hierarchical placement balancing each rank's attention plus the linear
  modules of its tokens, without the remap (the linear modules then run where attention does).
  The remap is thus decided per batch (only ``hierarchical`` when ``config.remap`` is off);
* the peers' plans as fallbacks, when they keep every rank within the capacity: ``hybrid-dp``
  (``baselines.HybridDP``) at Megatron's default cap and at the capacity (``hybrid-dp(cap=C)``,
  where wider than the default), ``hydraulis`` (``hydraulis.Hydraulis``: heterogeneous CP
  replicas) and static CP (``baselines.StaticCP``) at every CP size that divides the pool, up
  to two nodes (wider static CP never won in the report's settings and costs the most to
  build); last, hybrid DP at the other caps its users sweep (``swept_hybrid_caps``: tuned
  hybrid DP beat the portfolio by up to 5.5% in simulated windowed settings when it held
  only the default cap and the capacity). A cap that gives every document as many ranks as
  an earlier cap does (the same plan, ``hybrid_candidates``) is not a candidate again.

The plan records which candidate won (``Plan.candidate``, the key into ``estimates``; what
logs call it: ``Plan.name``) and every candidate's estimate
(``Plan.estimates``, fastest first; ``Plan.margin`` is the runner-up's over the winner's).
Ties go to the earlier candidate in the order above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import Move, estimate_tasks
from megatron_zeppelin.options import setting
from megatron_zeppelin.plan import (REMAP_SUFFIX, AttentionTask, Layout, Plan,
                                    attention_layout_of, ring_groups_of, zigzag_share_bound)
from megatron_zeppelin.planner.baselines import (default_max_seqlen_per_rank, hybrid_dp_tasks,
                                                 ranks_per_document, static_cp_tasks,
                                                 swept_caps)
from megatron_zeppelin.planner.hydraulis import hydraulis_tasks
from megatron_zeppelin.planner.common import (Batch, CapacityError, assemble, prepare,
                                              within_capacity)
from megatron_zeppelin.planner import native
from megatron_zeppelin.planner.linear_layout import linear_plan, rank_targets, rank_tokens
from megatron_zeppelin.planner.registry import Strategy, register
from megatron_zeppelin.planner.zeppelin import place_hierarchical

FALLBACK_MAX_NODES = 2  # static CP fallbacks: CP sizes up to this many nodes
REMAPPED = "hierarchical" + REMAP_SUFFIX  # the attention-balanced placement with the remap


class Candidate(NamedTuple):
    """One plan of the batch: its tasks, and with the remap its linear layout and moves."""

    name: str
    tasks: list[AttentionTask]
    linear: Layout | None = None
    moves: tuple[Move, ...] = ()


@register
@dataclass(frozen=True)
class Zeppelin(Strategy):
    """Zeppelin's hierarchical partitioner with the routing and remapping layers, scored
    against the peers' plans of the same batch (module doc)."""

    name = "zeppelin"
    summary = ("hierarchical partitioning (local / intra-node / inter-node rings), remap and "
               "routing; the fastest of it and the peers' plans by the estimate")
    routed = True
    reads = ("routing", "remap", "balance_slack")
    portfolio: bool = setting(True, "zeppelin: score the remap per batch and the peers' plans "
                              "as fallbacks (off: the hierarchical plan alone, with the remap "
                              "as configured)")

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
        if not self.portfolio:
            tasks = hierarchical_tasks(batch, cost, config, False)
            chosen = (remapped(batch, cost, tasks, REMAPPED)
                      if config.remap else Candidate("hierarchical", tasks))
            return assemble("zeppelin", batch, chosen.tasks, chosen.linear)
        names, estimates, winner, tasks, linear = choose(batch, cost, config)
        ranked = sorted(range(len(names)), key=lambda i: (estimates[i], i))
        return assemble("zeppelin", batch, tasks, linear, candidate=names[winner],
                        estimates=tuple((names[i], estimates[i]) for i in ranked))


def choose(batch: Batch, cost: CostModel, config: ZeppelinConfig
           ) -> tuple[list[str], list[float], int, list[AttentionTask], Layout | None]:
    """(candidate names, their estimated step seconds, the winner's index, its tasks, its
    linear layout) from the configured backend (``native``). The linear layout is None when
    the Python reference picks a plan without the remap (``assemble`` derives it); the twin
    always returns it."""
    cpp = native.cpp_module(None)
    if cpp is not None:
        names, estimates, winner, tasks, linear = cpp.portfolio(
            native.problem_args(batch.seqlens, batch.capacity, cost, config))
        return names, estimates, winner, tasks, linear
    names, estimates, best = [], [], None
    for candidate in candidates(batch, cost, config):
        linear = None if candidate.linear is None else rank_tokens(candidate.linear)
        step = estimate_tasks(candidate.tasks, batch.seqlens, batch.topology, cost,
                              config.routing, linear, candidate.moves).step_s
        names.append(candidate.name)
        estimates.append(step)
        if best is None or step < estimates[best[0]]:
            best = (len(names) - 1, candidate)
    return names, estimates, best[0], best[1].tasks, best[1].linear


def hierarchical_tasks(batch: Batch, cost: CostModel, config: ZeppelinConfig,
                       with_linear: bool) -> list[AttentionTask]:
    """``zeppelin.place_hierarchical`` on the configured backend."""
    tasks = native.twin_tasks("hierarchical", batch.seqlens, batch.capacity, cost, config,
                              with_linear)
    return tasks if tasks is not None else place_hierarchical(batch, cost, config, with_linear)


def candidates(batch: Batch, cost: CostModel, config: ZeppelinConfig) -> list[Candidate]:
    """The candidate plans of ``batch`` (module doc), in tie-break order (Python reference)."""
    out = []
    if config.remap:
        out.append(remapped(batch, cost, place_hierarchical(batch, cost, config), REMAPPED))
    out.append(Candidate("hierarchical", place_hierarchical(batch, cost, config, True)))
    per_rank, placed = default_max_seqlen_per_rank(batch), set()
    caps = [(per_rank, "hybrid-dp")]
    if batch.capacity > per_rank:
        caps.append((batch.capacity, widest_hybrid(batch)))
    out += hybrid_candidates(batch, cost, caps, placed)
    try:
        out.append(Candidate("hydraulis", hydraulis_tasks(batch, cost)[0]))
    except CapacityError:
        pass
    topo = batch.topology
    for cp in range(1, min(topo.world_size, FALLBACK_MAX_NODES * topo.gpus_per_node) + 1):
        if topo.world_size % cp == 0 and \
                zigzag_share_bound(max(batch.seqlens), cp) <= batch.capacity:
            out.append(Candidate(f"static-cp(cp={cp})", static_cp_tasks(batch, cp)))
    out += hybrid_candidates(batch, cost, [(cap, f"hybrid-dp(cap={cap})")
                                           for cap in swept_hybrid_caps(batch)], placed)
    return [c for c in out if within_capacity(c.tasks, batch)]


def hybrid_candidates(batch: Batch, cost: CostModel, caps: Sequence[tuple[int, str]],
                      placed: set[tuple[tuple[int, int], ...]]) -> list[Candidate]:
    """Hybrid DP at each (cap, name) of ``caps``, except at a cap that cannot place the batch
    or places it as a cap already tried does (its ``baselines.ranks_per_document`` in
    ``placed``, which gains the new ones): the same plan is not built and estimated twice."""
    out, lengths = [], sorted(set(batch.seqlens), reverse=True)
    for cap, name in caps:
        counts = ranks_per_document(lengths, cap, batch.topology)
        if counts is None or counts in placed:
            continue
        placed.add(counts)
        try:
            out.append(Candidate(name, hybrid_dp_tasks(batch, cost, cap)))
        except CapacityError:
            pass  # no fallback where hybrid DP cannot place the batch within the capacity
    return out


def swept_hybrid_caps(batch: Batch) -> list[int]:
    """The caps hybrid DP's users sweep (``baselines.swept_caps``: the longest document over
    1, 2, 4, ... ranks) that hold within the capacity: so that the portfolio holds hybrid DP
    as tuned per batch, not only at its default cap."""
    return [cap for cap in swept_caps(max(batch.seqlens), batch.topology.world_size)
            if cap <= batch.capacity]


def widest_hybrid(batch: Batch) -> str:
    """The name of hybrid DP at the widest per-rank cap, the capacity (every sequence that
    fits one rank local: the cap its users tune to on the CPU cluster, docs/bench-corpora.md)."""
    return f"hybrid-dp(cap={batch.capacity})"


def remapped(batch: Batch, cost: CostModel, tasks: list[AttentionTask], name: str
             ) -> Candidate:
    """``tasks`` with the remap's linear layout: token balance inside nodes, across nodes only
    where the linear time saved outweighs the remap traffic (``linear_layout``)."""
    topo = batch.topology
    attention = attention_layout_of(ring_groups_of(tasks, topo), batch.seqlens, topo.world_size)
    per_rank = rank_tokens(attention)
    targets = rank_targets(per_rank, topo, cost.linear_time(1), cost.remap_seconds_per_token())
    linear, moves = linear_plan(attention, topo, targets, per_rank)
    return Candidate(name, tasks, linear, tuple(moves))
