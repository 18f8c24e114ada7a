"""Zeppelin's hierarchical sequence partitioner (paper s.4; design brief s.5).

Two levels, longest sequence first, balancing estimated attention time (not tokens):

1. Inter-node step: a sequence whose work (or tokens) one node cannot take within the
   per-rank target W* = total/N (1 + slack) spans the fewest whole nodes that bring its
   per-rank time (compute plus ring traffic not hidden, routed over all NICs) under W*.
   It goes to the least-loaded nodes. Every other sequence goes whole to the least-loaded
   node with room (LPT with a heap).
2. Intra-node step, per node: inter-node shares first (every GPU of the node in the ring);
   then a sequence stays LOCAL on the least-loaded GPU with room when its time is under W*,
   otherwise it is ringed over the fewest GPUs of the node that bring it under W* (INTRA).

Sharded sequences use the zigzag split. Per-rank attention tokens never exceed the capacity.
The steps are ``inter_node_step.py`` and ``intra_node_step.py`` (the state both share:
``placement_state.py``). The ``zeppelin`` strategy (``portfolio.py``) scores this placement
with and without the remap against the peers' plans of the same batch.
"""
from __future__ import annotations

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import AttentionTask
from megatron_zeppelin.planner.common import Batch
from megatron_zeppelin.planner.inter_node_step import assign_nodes
from megatron_zeppelin.planner.intra_node_step import assign_gpus, place_leftovers
from megatron_zeppelin.planner.placement_state import Placement
from megatron_zeppelin.twin_arithmetic import add_up


def place_hierarchical(batch: Batch, cost: CostModel, config: ZeppelinConfig,
                       with_linear: bool = False) -> list[AttentionTask]:
    """Zeppelin's hierarchical placement of ``batch`` (module doc): one task per sequence.

    with_linear: balance each rank's attention plus the linear modules of the tokens it holds
    (a plan without the remap runs its linear modules on the attention layout); otherwise
    attention alone, with tokens balanced per node for the remap (``_place_light``).
    """
    per_token = cost.kernel.linear_per_token if with_linear else 0.0
    local_time = cost.attention_times(batch.seqlens)
    if with_linear:
        local_time = [t + per_token * s for t, s in zip(local_time, batch.seqlens)]
    world = batch.topology.world_size
    total = add_up(local_time)
    state = Placement(batch, cost, config.routing, total / world * (1.0 + config.balance_slack),
                      local_time, config.balance_slack, total, per_token)
    order = sorted(range(len(batch.seqlens)), key=lambda i: -batch.seqlens[i])
    inter, per_node = assign_nodes(state, order)
    tasks: list[AttentionTask | None] = [None] * len(batch.seqlens)
    nodes, leftovers = [], []
    for node in range(batch.topology.nodes):
        placed, left, gpus = assign_gpus(state, node, inter, per_node[node])
        nodes.append(gpus)
        leftovers.extend(left)
        for task in placed:
            tasks[task.seq] = task
    for task in place_leftovers(state, leftovers, nodes):
        tasks[task.seq] = task
    return tasks
