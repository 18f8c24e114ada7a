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
ranks). Groups of one rank are plain local calls. Times from the simulator's own profile.
"""
from __future__ import annotations

import numpy as np

from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim.profile import SimProfile


def ulysses_pass_times(plan: Plan, cost: CostModel, profile: SimProfile
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward seconds, forward compute, all-to-all seconds of one pass) per rank, one layer,
    with the simulator's profile (``profile.py``): a group's call runs the full length over
    ceil(heads / G) of the heads at the profile's rate for that length, plus one call's host
    work; the backward takes the profile's backward ratio x the compute and the same
    all-to-all bytes."""
    topo, cluster = plan.topology, cost.cluster
    world, gpn = topo.world_size, topo.gpus_per_node
    heads, kv_heads = cost.heads, cost.kv_heads
    pair_bytes = cost.model.pair_dim * cost.model.bytes_per_element
    compute = np.zeros(world)
    sent = np.zeros(world)  # bytes each rank sends (and receives) per pass, one layer
    cross = np.zeros(world)  # ... of them to other nodes
    groups = []
    call = profile.attention_call_us * 1e-6
    for group in plan.ring_groups:
        size = len(group.ring)
        members = np.asarray(group.ring)
        s = np.asarray([plan.seqlens[q] for q in group.seqs], dtype=np.float64)
        share = -(-heads // size) / heads
        flops = np.asarray([cost.attention_flops(x) for x in s]) * share
        compute[members] += (float(profile.attention_forward_s(flops, s).sum()) + call) * \
            profile.compute_scale
        if size == 1:
            continue
        tokens = float(s.sum()) / size
        per_token = (heads + max(kv_heads, size)) * pair_bytes
        nodes = members // gpn
        for r, node in zip(members, nodes):
            nbytes = per_token * tokens / size  # to each peer, q/k/v there + output back
            sent[r] += nbytes * (size - 1)
            cross[r] += nbytes * np.count_nonzero(nodes != node)
        groups.append(members)
    nic_key = (np.arange(world) // gpn * cluster.nics_per_node)[:, None] + \
        np.asarray(cluster.gpu_to_nic).reshape(gpn, cost.tp)[np.arange(world) % gpn]
    nic_load = np.bincount(nic_key.ravel(), np.repeat(cross, cost.tp),
                           cluster.nodes * cluster.nics_per_node)
    a2a = np.zeros(world)
    for members in groups:
        intra = (sent[members] - cross[members]).max() / (profile.intra_gbyte_per_s * 1e9)
        nic = nic_load[nic_key[members]].max() / (profile.inter_gbyte_per_s * 1e9)
        latency = profile.inter_latency_us if cross[members].any() else \
            profile.intra_latency_us
        a2a[members] = max(a2a[members].max(), max(intra, nic) + 2 * latency * 1e-6)
    return compute + a2a, compute, a2a
