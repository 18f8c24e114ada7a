"""What a routed inter-node transfer costs: the one definition.

A message between two nodes is split over the r NIC rails of a node, r - 1 slices relayed
through proxy GPUs over NVLink, one slice per rail, and pipelined in chunks. The cost model's
per-message times (``cost_model.CostKernel.routed``, tabulated from ``routed_message_seconds``)
and the simulator's analytic step use it; the router's integer-tick search
(``router/model.py``) imports its pipeline formula and chunk rule, and ``csrc/router_model.h``
is that module's C++ twin. Cost-model layer (numpy, no torch).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from megatron_zeppelin.config import ClusterSpec

DEFAULT_MAX_CHUNKS = 8  # chunks a routed slice is pipelined in, at most
DEFAULT_MIN_CHUNK_BYTES = 1 << 20  # ... while a chunk of the largest slice keeps 1 MiB


def chunk_cap(largest_bytes: int, max_chunks: int = DEFAULT_MAX_CHUNKS,
              min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> int:
    """Most chunks a routed step whose largest slice has ``largest_bytes`` bytes may use."""
    return min(max_chunks, max(1, largest_bytes // min_chunk_bytes))


def pipeline_time(d, n, m, f, chunks: int):
    """A routed step pipelined in ``chunks`` chunks (batch t: dispatch legs of chunk t, NIC
    legs of chunk t-1, combine legs of chunk t-2), from the per-chunk times of its busiest
    dispatch, NIC and combine resources (d, n, m) and f, the most any resource carries in a
    full batch (a NIC, or a GPU's NVLink direction with dispatch and combine legs at once).
    Integers in, integers out (the router's ticks) or floats (seconds)."""
    if chunks == 1:
        return d + n + m
    if chunks == 2:
        return d + max(d, n) + max(n, m) + m
    return d + max(d, n) + (chunks - 2) * f + max(n, m) + m


class RoutedLoad(NamedTuple):
    """The busiest resource of each phase of a routed step: the seconds its bytes take over the
    whole step (``*_s``) and the messages it serves per chunk (``*_msgs``; every message pays
    its link's latency once per chunk). ``shared``: a GPU's NVLink direction carrying its
    dispatch and combine legs together (what a full pipeline batch waits for)."""

    dispatch_s: float
    dispatch_msgs: float
    nic_s: float
    nic_msgs: float
    combine_s: float
    combine_msgs: float
    shared_s: float
    shared_msgs: float


def pipelined_seconds(load: RoutedLoad, cluster: ClusterSpec, largest_slice_bytes: float
                      ) -> float:
    """Seconds of a routed step at its best chunk count (1 .. ``chunk_cap``), ``pipeline_time``
    on the per-chunk phase times of ``load``."""
    lv, ln = cluster.nvlink_latency_us * 1e-6, cluster.nic_latency_us * 1e-6
    best = float("inf")
    for c in range(1, chunk_cap(int(largest_slice_bytes)) + 1):
        d = load.dispatch_s / c + load.dispatch_msgs * lv
        n = load.nic_s / c + load.nic_msgs * ln
        m = load.combine_s / c + load.combine_msgs * lv
        f = max(n, load.shared_s / c + load.shared_msgs * lv)
        best = min(best, pipeline_time(d, n, m, f, c))
    return best


def routed_message_seconds(cluster: ClusterSpec, nbytes: float) -> float:
    """One inter-node message of ``nbytes`` through the routing layer: split evenly over r NIC
    rails (r - 1 slices relayed through proxy GPUs over NVLink, one slice per rail) and
    pipelined (``pipelined_seconds``); the best r. r = 1 is the direct NIC, so the result never
    exceeds a direct send."""
    rails = len(set(cluster.gpu_to_nic))
    nv, nic = cluster.nvlink_byte_per_s, cluster.nic_byte_per_s
    best = nbytes / nic + cluster.nic_latency_us * 1e-6
    for r in range(2, rails + 1):
        relay = (r - 1) * nbytes / (r * nv)  # the source's dispatch and the sink's combine
        load = RoutedLoad(relay, r - 1, nbytes / (r * nic), 1, relay, r - 1, relay, r - 1)
        best = min(best, pipelined_seconds(load, cluster, nbytes / r))
    return best


@lru_cache(maxsize=64)
def routed_table(cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """``routed_message_seconds`` on a log grid of sizes (1 KiB .. 8 GiB), as logs."""
    sizes = np.logspace(10, 33, 93, base=2.0)
    times = [routed_message_seconds(cluster, float(b)) for b in sizes]
    return np.log(sizes), np.log(times)