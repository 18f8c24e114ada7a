"""Communication models of the simulator: ring steps across nodes, the remap, the gradient sync.

All functions return seconds and take bytes that one GPU sends (the cost model's per-rank
bytes are per GPU: with tensor parallelism each of a rank's ``tp`` GPUs moves its own heads).

* ``inter_step_time``: one pool-wide inter-node ring step (every inter-node ring of the wave
  exchanges its KV block at once, as ``runtime/routed_p2p.py`` does). This is the one seam to the
  routing layer: ``megatron_zeppelin.router.route`` when it imports (its schedule's routed time,
  pipelined in the schedule's chunks, and its direct time), else an analytic NIC-contention
  model built from the cluster's links (routed: the same pipeline over an even spread).
The remap's all-to-all and the gradient all-reduce are ``step_model.py``'s. Nothing here is
the planner's estimate (``estimate.py``) or the cost model's routed-transfer formula: the
analytic routed step is this module's own (``ROUTED_CHUNKS``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from megatron_zeppelin.config import ClusterSpec

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


ROUTED_CHUNKS = 4  # the analytic model's pipeline depth of a routed step (an assumption)


def _routed_step_time(cluster: ClusterSpec, items: list[tuple[int, int, float]]) -> float:
    """Every flow spread evenly over the usable NICs of both nodes: ``nics - 1`` slices relayed
    over NVLink to proxy GPUs (dispatch), one slice per NIC, relayed again at the far node
    (combine). Phases: the busiest GPU's NVLink out (dispatch), the busiest NIC (the node's
    bytes over its NICs), the busiest GPU's NVLink in (combine); pipelined in
    ``ROUTED_CHUNKS`` chunks, the slowest phase runs throughout and the others add one chunk
    each; every phase pays its link's latency per chunk."""
    gpn = cluster.gpus_per_node
    nics = len(set(cluster.gpu_to_nic))
    nic_bw, nv_bw = cluster.nic_byte_per_s, cluster.nvlink_byte_per_s
    node_out: dict[int, float] = {}
    node_in: dict[int, float] = {}
    gpu_out: dict[int, float] = {}
    gpu_in: dict[int, float] = {}
    for src, dst, nbytes in items:
        node_out[src // gpn] = node_out.get(src // gpn, 0.0) + nbytes
        node_in[dst // gpn] = node_in.get(dst // gpn, 0.0) + nbytes
        gpu_out[src] = gpu_out.get(src, 0.0) + nbytes
        gpu_in[dst] = gpu_in.get(dst, 0.0) + nbytes
    spread = (nics - 1) / nics
    lat_nv, lat_nic = cluster.nvlink_latency_us * 1e-6, cluster.nic_latency_us * 1e-6
    phases = [max(gpu_out.values()) * spread / nv_bw,
              max(max(node_out.values()), max(node_in.values())) / (nics * nic_bw),
              max(gpu_in.values()) * spread / nv_bw]
    chunks = ROUTED_CHUNKS if nics > 1 else 1
    latency = (2 * lat_nv + lat_nic) if nics > 1 else lat_nic
    slowest = max(phases)
    return slowest + (sum(phases) - slowest) / chunks + chunks * latency
