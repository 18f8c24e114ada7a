"""Attention phases of plans whose attention is Ulysses (``Plan.attention_kind == "ulysses"``,
FlexSP's sequence parallelism), for the simulator.

A task's ranks form a Ulysses group: each rank holds s/G tokens of each of the group's
sequences; per layer the forward all-to-alls q, k, v to head-sharded full sequences, computes
attention at the full length over 1/G of the heads (one fused call per group), and all-to-alls
the output back; the backward reverses them (dout in, dq/dk/dv out). Nothing overlaps the
all-to-alls (DeepSpeed-Ulysses). Every group's all-to-all runs at once: a rank's bytes to
peers in its node take its NVLink, those to other nodes go through its GPU's own NIC, and a
NIC is shared by every GPU sending (or receiving) through it, so groups spanning nodes slow
each other down. KV heads are replicated up to the group size (GQA with fewer KV heads than
ranks), as ``CostKernel.ulysses_comm`` counts them. Groups of one rank are plain local calls.
"""
from __future__ import annotations

import numpy as np

from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan


def ulysses_pass_times(plan: Plan, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(forward seconds, compute seconds of the forward) per rank, one layer; the backward
    takes ``attention_bwd_ratio`` x the compute and the same all-to-all bytes."""
    topo, kernel, cluster = plan.topology, cost.kernel, cost.cluster
    world, gpn = topo.world_size, topo.gpus_per_node
    compute = np.zeros(world)
    sent = np.zeros(world)  # bytes each rank sends (and receives) per pass, one layer
    cross = np.zeros(world)  # ... of them to other nodes
    groups = []
    scale = 1.0 + cost.hardware.attention_bwd_ratio
    for group in plan.ring_groups:
        size = len(group.ring)
        members = np.asarray(group.ring)
        seconds = sum(kernel.ulysses_compute(plan.seqlens[s], size) for s in group.seqs)
        compute[members] += seconds / kernel.layers / scale
        if size == 1:
            continue
        tokens = sum(plan.seqlens[s] for s in group.seqs) / size
        per_token = (2 * kernel.heads + 2 * max(kernel.kv_heads, size)) * kernel.head_bytes
        nodes = members // gpn
        for r, node in zip(members, nodes):
            peers_out = np.count_nonzero(nodes != node)
            nbytes = per_token * tokens / size  # to each peer, q/k/v there + output back
            sent[r] += nbytes * (size - 1)
            cross[r] += nbytes * peers_out
        groups.append(members)
    tp = cost.tp  # a rank's tp GPUs each move their heads through their own NIC
    affinity = np.asarray(cluster.gpu_to_nic).reshape(gpn, tp)
    nic_key = (np.arange(world) // gpn * cluster.nics_per_node)[:, None] + \
        affinity[np.arange(world) % gpn]
    nic_load = np.bincount(nic_key.ravel(), np.repeat(cross, tp),
                           cluster.nodes * cluster.nics_per_node)
    a2a = np.zeros(world)
    for members in groups:
        nvlink = (sent[members] - cross[members]).max() / cluster.nvlink_byte_per_s
        nic = nic_load[nic_key[members]].max() / cluster.nic_byte_per_s
        latency = cluster.nic_latency_us if cross[members].any() else cluster.nvlink_latency_us
        a2a[members] = max(a2a[members].max(), max(nvlink, nic) + 2 * latency * 1e-6)
    return compute + a2a, compute
