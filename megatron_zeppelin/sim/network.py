"""Communication models of the simulator: ring steps across nodes, the remap, the gradient sync.

All functions return seconds and take bytes that one GPU sends (the cost model's per-rank
bytes are per GPU: with tensor parallelism each of a rank's ``tp`` GPUs moves its own heads).

* ``inter_step_time``: one pool-wide inter-node ring step (every inter-node ring of the wave
  exchanges its KV block at once, as ``runtime/routed_p2p.py`` does). This is the one seam to the
  routing layer: ``megatron_zeppelin.router.route`` when it imports (its schedule's routed time,
  pipelined in the schedule's chunks, and its direct time), else an analytic NIC-contention
  model built from the cluster's links (routed: the same pipeline over an even spread).
* ``remap_time``: one all-to-all of the remap (linear <-> attention layout) over the static
  GPU->NIC affinity (an ``all_to_all_single``; NCCL sends through each GPU's own NIC), as
  ``estimate.remap_a2a_seconds`` prices it; the gradient all-reduce is
  ``estimate.grad_allreduce_seconds``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from megatron_zeppelin.config import ClusterSpec
from megatron_zeppelin.cost_model import CostModel, RoutedLoad, pipelined_seconds
from megatron_zeppelin.estimate import plan_moves, remap_a2a_seconds
from megatron_zeppelin.plan import Plan

# How the simulator times a routed or direct inter-node step: the router's schedule when it
# imports (``auto``), or the analytic model below. (Not ``env.ROUTER_BACKENDS``, which picks
# the router's implementation.)
STEP_TIME_MODELS = ("auto", "analytic")

# (source GPU, destination GPU) -> bytes of one ring step; GPUs are node * gpus_per_node + local
FlowBytes = Mapping[tuple[int, int], float]


@dataclass(frozen=True)
class GpuMap:
    """Where the GPUs of planner rank ``r`` (one tensor-parallel group of ``tp`` GPUs) sit."""

    cluster: ClusterSpec
    tp: int

    @property
    def ranks_per_node(self) -> int:
        return self.cluster.gpus_per_node // self.tp

    def gpus(self, rank: int) -> range:
        """Global GPU indices of ``rank`` (node-major, as the router numbers them)."""
        node, local = divmod(rank, self.ranks_per_node)
        first = node * self.cluster.gpus_per_node + local * self.tp
        return range(first, first + self.tp)

    def nic(self, gpu: int) -> tuple[int, int]:
        """(node, NIC index) a GPU sends through under the static affinity."""
        node, local = divmod(gpu, self.cluster.gpus_per_node)
        return node, self.cluster.gpu_to_nic[local]


def router_available() -> bool:
    """Whether ``megatron_zeppelin.router`` imports (it is the routing layer's seam)."""
    try:
        import megatron_zeppelin.router  # noqa: F401
    except ImportError:
        return False
    return True


def inter_step_time(cluster: ClusterSpec, flows: FlowBytes, routed: bool,
                    backend: str = "auto") -> float:
    """Seconds until every cross-node flow of one ring step has arrived.

    backend ``auto``: the router's schedule (``estimated_time_s`` routed: the chunked,
    pipelined step of ``runtime/routed_p2p.py``; ``direct_time_s`` direct) when the router
    imports, else the analytic model; ``analytic``: always the analytic model. Routed is never
    slower than direct in either model.
    """
    if backend not in STEP_TIME_MODELS:
        raise ValueError(f"router backend {backend!r} is invalid: expected one of "
                         f"{list(STEP_TIME_MODELS)}")
    items = [(src, dst, nbytes) for (src, dst), nbytes in flows.items() if nbytes > 0]
    if not items:
        return 0.0
    if backend == "auto" and router_available():
        return _router_step_time(cluster, items, routed)
    direct = _direct_step_time(cluster, items)
    return min(direct, _routed_step_time(cluster, items)) if routed else direct


def _router_step_time(cluster: ClusterSpec, items: list[tuple[int, int, float]],
                      routed: bool) -> float:
    """The router's schedule time of the step: routed, or the same flows sent direct."""
    from megatron_zeppelin.router import Flow, route

    topology = _router_topology(cluster)
    flows = [Flow(src, dst, max(1, math.ceil(nbytes))) for src, dst, nbytes in items]
    schedule = route(topology, flows)
    return schedule.estimated_time_s if routed else schedule.direct_time_s


@lru_cache(maxsize=64)
def _router_topology(cluster: ClusterSpec):
    """The router's view of the cluster (cached per cluster)."""
    from megatron_zeppelin.router import RouterTopology

    return RouterTopology.from_cluster(cluster)


def _direct_step_time(cluster: ClusterSpec, items: list[tuple[int, int, float]]) -> float:
    """Each flow through its source GPU's NIC and its destination GPU's NIC; a NIC serves its
    messages one after the other (bytes / bandwidth + latency each)."""
    gpn, nic_bw, lat = cluster.gpus_per_node, cluster.nic_byte_per_s, cluster.nic_latency_us * 1e-6
    egress: dict[tuple[int, int], float] = {}
    ingress: dict[tuple[int, int], float] = {}
    for src, dst, nbytes in items:
        out_key = (src // gpn, cluster.gpu_to_nic[src % gpn])
        in_key = (dst // gpn, cluster.gpu_to_nic[dst % gpn])
        egress[out_key] = egress.get(out_key, 0.0) + nbytes / nic_bw + lat
        ingress[in_key] = ingress.get(in_key, 0.0) + nbytes / nic_bw + lat
    return max(max(egress.values()), max(ingress.values()))


def _routed_step_time(cluster: ClusterSpec, items: list[tuple[int, int, float]]) -> float:
    """Every flow spread evenly over the usable NICs of both nodes, priced by the cost model's
    routed-transfer definition (``cost_model.pipelined_seconds``): per flow, ``nics - 1``
    slices relayed over NVLink and one slice per NIC; the busiest GPU, NIC and NVLink direction
    set each phase, and in full batches a GPU's NVLink direction carries its dispatch and its
    share of the node's relayed combine (the reverse for ingress)."""
    gpn = cluster.gpus_per_node
    nics = len(set(cluster.gpu_to_nic))
    nic_bw, nv_bw = cluster.nic_byte_per_s, cluster.nvlink_byte_per_s
    node_out: dict[int, float] = {}
    node_in: dict[int, float] = {}
    gpu_out: dict[int, float] = {}
    gpu_in: dict[int, float] = {}
    sends: dict[int, int] = {}  # flows per source GPU, per destination GPU, per node
    recvs: dict[int, int] = {}
    per_node: dict[int, int] = {}
    for src, dst, nbytes in items:
        node_out[src // gpn] = node_out.get(src // gpn, 0.0) + nbytes
        node_in[dst // gpn] = node_in.get(dst // gpn, 0.0) + nbytes
        gpu_out[src] = gpu_out.get(src, 0.0) + nbytes
        gpu_in[dst] = gpu_in.get(dst, 0.0) + nbytes
        sends[src] = sends.get(src, 0) + 1
        recvs[dst] = recvs.get(dst, 0) + 1
        per_node[src // gpn] = per_node.get(src // gpn, 0) + 1
    spread = (nics - 1) / nics
    g_out, g_in = max(gpu_out.values()) * spread / nv_bw, max(gpu_in.values()) * spread / nv_bw
    shared = max(max(gpu_out.values()) * spread + max(node_in.values()) / gpn,
                 max(gpu_in.values()) * spread + max(node_out.values()) / gpn) / nv_bw
    out_msgs, in_msgs = (nics - 1) * max(sends.values()), (nics - 1) * max(recvs.values())
    load = RoutedLoad(g_out, out_msgs,
                      max(max(node_out.values()), max(node_in.values())) / (nics * nic_bw),
                      max(per_node.values()), g_in, in_msgs, shared, out_msgs + in_msgs)
    return pipelined_seconds(load, cluster, max(nbytes for _, _, nbytes in items) / nics)


def remap_time(plan: Plan, cost: CostModel) -> float:
    """Seconds of one remap all-to-all of ``plan`` (the estimate's ``remap_a2a_seconds``:
    NVLink inside a node, the static NICs across, the busiest link setting the time)."""
    return remap_a2a_seconds(plan_moves(plan), plan.topology, cost)
