"""Routing-layer data: the node topology, the flows of one ring step and the routed schedule.

Units: ranks are positions in the routing pool (``node * gpus_per_node + local``), byte counts
are integers, bandwidths are bytes per second per direction, latencies seconds per message.

Both router backends compute in integer *ticks* (femtoseconds, ``TICKS_PER_S`` per second) so
that they agree bit for bit on every platform: the per-byte cost of a link is
``round(TICKS_PER_S / byte_per_s)`` ticks (relative rounding error <= 5e-4 for links up to
1 TB/s) and a message's latency ``round(latency_s * TICKS_PER_S)`` ticks. Times in a
``RouteSchedule`` are those tick counts converted to seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Sequence

from megatron_zeppelin.router.model import MAX_CHUNKS_LIMIT

if TYPE_CHECKING:
    from megatron_zeppelin.config import ClusterSpec

TICKS_PER_S = 10**15
MAX_NODES = 1_000_000
MAX_GPUS_PER_NODE = 256
MAX_NICS_PER_NODE = 256
MIN_BYTE_PER_S = 1e6
MAX_BYTE_PER_S = 1e13
MAX_LATENCY_S = 1.0
MAX_TICKS = 2**53  # every modelled resource time stays below this (exact in float64 too)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(what: str, value: object, low: int, high: int) -> None:
    if not (_is_int(value) and low <= value <= high):
        raise ValueError(f"router topology {what}={value!r} is invalid: expected an integer "
                         f"in [{low}, {high}]")


def _check_real(what: str, value: object, low: float, high: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        raise ValueError(f"router topology {what}={value!r} is invalid: expected a number "
                         f"in [{low:g}, {high:g}]")


@dataclass(frozen=True)
class RouterTopology:
    """Nodes of ``gpus_per_node`` GPUs sharing ``nics_per_node`` NICs.

    gpu_to_nic[i]: the NIC (local index) GPU ``i`` of every node sends and receives
    inter-node traffic through. nvlink_byte_per_s: NVLink bandwidth of one GPU per direction;
    nic_byte_per_s: bandwidth of one NIC per direction; *_latency_s: cost of one message.
    """

    nodes: int
    gpus_per_node: int
    nics_per_node: int
    gpu_to_nic: tuple[int, ...]
    nvlink_byte_per_s: float
    nvlink_latency_s: float
    nic_byte_per_s: float
    nic_latency_s: float

    def __post_init__(self) -> None:
        _check_int("nodes", self.nodes, 1, MAX_NODES)
        _check_int("gpus_per_node", self.gpus_per_node, 1, MAX_GPUS_PER_NODE)
        _check_int("nics_per_node", self.nics_per_node, 1, MAX_NICS_PER_NODE)
        object.__setattr__(self, "gpu_to_nic", tuple(self.gpu_to_nic))
        if len(self.gpu_to_nic) != self.gpus_per_node:
            raise ValueError(f"router topology gpu_to_nic={list(self.gpu_to_nic)} is invalid: "
                             f"expected {self.gpus_per_node} NIC indices (one per GPU)")
        for nic in self.gpu_to_nic:
            if not (_is_int(nic) and 0 <= nic < self.nics_per_node):
                raise ValueError(f"router topology gpu_to_nic={list(self.gpu_to_nic)} is invalid:"
                                 f" entry {nic!r} is not a NIC index in [0, {self.nics_per_node})")
        for key in ("nvlink_byte_per_s", "nic_byte_per_s"):
            _check_real(key, getattr(self, key), MIN_BYTE_PER_S, MAX_BYTE_PER_S)
        for key in ("nvlink_latency_s", "nic_latency_s"):
            _check_real(key, getattr(self, key), 0.0, MAX_LATENCY_S)

    @classmethod
    def from_cluster(cls, cluster: "ClusterSpec") -> "RouterTopology":
        """The routing view of a ``ClusterSpec`` (GB/s, Gb/s and microseconds converted)."""
        return cls(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
                   nics_per_node=cluster.nics_per_node, gpu_to_nic=tuple(cluster.gpu_to_nic),
                   nvlink_byte_per_s=cluster.nvlink_byte_per_s,
                   nvlink_latency_s=cluster.nvlink_latency_us * 1e-6,
                   nic_byte_per_s=cluster.nic_byte_per_s,
                   nic_latency_s=cluster.nic_latency_us * 1e-6)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nic_of(self, rank: int) -> int:
        """Local index of the NIC rank ``rank`` sends through."""
        return self.gpu_to_nic[rank % self.gpus_per_node]

    def usable_nics(self) -> tuple[int, ...]:
        """NICs (local indices) that at least one GPU is attached to, ascending."""
        return tuple(sorted(set(self.gpu_to_nic)))

    def cost_ticks(self) -> tuple[int, int, int, int]:
        """(NVLink ticks/byte, NVLink ticks/message, NIC ticks/byte, NIC ticks/message)."""
        return (round(TICKS_PER_S / self.nvlink_byte_per_s),
                round(self.nvlink_latency_s * TICKS_PER_S),
                round(TICKS_PER_S / self.nic_byte_per_s),
                round(self.nic_latency_s * TICKS_PER_S))


@dataclass(frozen=True)
class Flow:
    """``nbytes`` bytes from rank ``src`` to rank ``dst`` (on another node) in one ring step."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Slice:
    """Bytes ``[offset, offset + nbytes)`` of flow ``flow`` relayed src -> src_proxy (NVLink),
    src_proxy -> dst_proxy (NICs), dst_proxy -> dst (NVLink). ``src_proxy == src`` means no
    dispatch leg, ``dst_proxy == dst`` no combine leg; both means the slice goes direct."""

    flow: int
    src_proxy: int
    dst_proxy: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RouteSchedule:
    """A routed ring step: its slices and the model's view of it.

    slice_table: the slices flat, ``(flow, src_proxy, dst_proxy, offset, nbytes)`` repeated,
    ordered by flow then offset (``slices`` gives them as ``Slice`` objects).
    nic_egress_bytes / nic_ingress_bytes: bytes through each NIC, index
    ``node * nics_per_node + nic``. dispatch_time_s / nic_time_s / combine_time_s: modelled
    seconds of each phase over the whole step (its busiest resource, all chunks).
    chunks: how many chunks the runtime pipelines every slice in (``model.chunk_span``).
    estimated_time_s: the modelled step time, the pipeline of ``chunks`` chunks (``model``);
    sequential_time_s: the same slices in one chunk (dispatch + nic + combine).
    direct_time_s: the same flows all sent direct (one chunk); estimated <= direct.
    nic_load_ratio: max / mean NIC load over the usable NICs of nodes that send (egress) or
    receive (ingress) inter-node traffic; 1.0 is perfect balance (and the value without flows).
    align: the byte granularity every slice offset and size (and chunk) is a multiple of.
    """

    slice_table: tuple[int, ...]
    nic_egress_bytes: tuple[int, ...]
    nic_ingress_bytes: tuple[int, ...]
    dispatch_time_s: float
    nic_time_s: float
    combine_time_s: float
    chunks: int
    estimated_time_s: float
    sequential_time_s: float
    direct_time_s: float
    nic_load_ratio: float
    align: int

    @cached_property
    def slices(self) -> tuple[Slice, ...]:
        """The slices, ordered by (flow, offset)."""
        return unflatten_slices(self.slice_table)

    @property
    def num_slices(self) -> int:
        """How many slices (messages on the NIC phase) the step has."""
        return len(self.slice_table) // 5

    @property
    def speedup(self) -> float:
        """Modelled direct time over routed time (1.0 when there is nothing to send)."""
        return self.direct_time_s / self.estimated_time_s if self.estimated_time_s else 1.0


def validate_flows(topology: RouterTopology, flows: Sequence[Flow], align: int,
                   max_chunks: int = 1) -> None:
    """Raise ValueError naming the first bad flow (or ``align``) and what is allowed; the
    flows' modelled times must fit the router's range at up to ``max_chunks`` chunks."""
    if not (_is_int(align) and align >= 1):
        raise ValueError(f"align={align!r} is invalid: expected an integer >= 1 (bytes)")
    world, gpus = topology.world_size, topology.gpus_per_node
    per_node = [0] * topology.nodes
    for index, flow in enumerate(flows):
        s, d, nb = (flow.src, flow.dst, flow.nbytes) if isinstance(flow, Flow) else (0, 0, 0)
        if (type(s) is int and type(d) is int and type(nb) is int and 0 <= s < world
                and 0 <= d < world and s // gpus != d // gpus and nb > 0 and nb % align == 0):
            per_node[s // gpus] += nb
            per_node[d // gpus] += nb
        else:
            raise_flow_error(topology, index, flow, align)
    check_tick_range(topology, max(per_node), len(flows), max_chunks)


def validate_chunking(max_chunks: object, min_chunk_bytes: object,
                      chunks: object = None) -> None:
    """Raise ValueError naming a bad chunk setting: ``max_chunks`` (and ``chunks`` unless None)
    an integer in ``[1, MAX_CHUNKS_LIMIT]``, ``min_chunk_bytes`` a positive integer (bytes)."""
    for key, value in (("max_chunks", max_chunks), ("chunks", chunks)):
        if (key == "max_chunks" or value is not None) and not (
                _is_int(value) and 1 <= value <= MAX_CHUNKS_LIMIT):
            raise ValueError(f"{key}={value!r} is invalid: expected an integer in "
                             f"[1, {MAX_CHUNKS_LIMIT}] (chunks per slice)")
    if not (_is_int(min_chunk_bytes) and min_chunk_bytes >= 1):
        raise ValueError(f"min_chunk_bytes={min_chunk_bytes!r} is invalid: expected an "
                         "integer >= 1 (bytes)")


def raise_flow_error(topology: RouterTopology, index: int, flow: Flow, align: int) -> None:
    """Raise the ValueError that names what is wrong with ``flow`` (the ``index``-th)."""
    world = topology.world_size
    if not isinstance(flow, Flow):
        raise ValueError(f"flow {index} = {flow!r} is invalid: expected a Flow")
    for key in ("src", "dst"):
        rank = getattr(flow, key)
        if not (_is_int(rank) and 0 <= rank < world):
            raise ValueError(f"flow {index} {flow}: {key}={rank!r} is out of range: expected "
                             f"a rank in [0, {world})")
    if topology.node_of(flow.src) == topology.node_of(flow.dst):
        raise ValueError(f"flow {index} {flow}: src and dst are both on node "
                         f"{topology.node_of(flow.src)}; routed flows must cross nodes")
    raise ValueError(f"flow {index} {flow}: nbytes={flow.nbytes!r} is invalid: expected "
                     f"a positive multiple of align={align}")


def check_tick_range(topology: RouterTopology, busiest: int, num_flows: int,
                     max_chunks: int = 1) -> None:
    """Raise unless every modelled resource time, in ticks times the chunk count (``model``:
    every message pays its latency once per chunk), stays below ``MAX_TICKS`` for up to
    ``max_chunks`` chunks (exact integers in both backends).

    busiest: the most bytes any node sends plus receives; num_flows: flows in the step.
    """
    cv, lv, cn, ln = topology.cost_ticks()
    messages = num_flows * (len(topology.usable_nics()) + 1)
    worst = busiest * max(cv, cn) + max_chunks * messages * max(lv, ln)
    if worst >= MAX_TICKS:
        raise ValueError(f"flows move {busiest} bytes through one node: the modelled time "
                         f"{worst / TICKS_PER_S:.3g} s (at {max_chunks} chunks) exceeds the "
                         f"router's range {MAX_TICKS / TICKS_PER_S:.3g} s; route fewer bytes "
                         "per step")


def compute_nic_load_ratio(topology: RouterTopology, egress: Sequence[int],
                   ingress: Sequence[int]) -> float:
    """Max over mean NIC load (see ``RouteSchedule.nic_load_ratio``)."""
    usable = topology.usable_nics()
    k = topology.nics_per_node
    loads: list[int] = []
    for per_nic in (egress, ingress):
        for node in range(topology.nodes):
            node_loads = [per_nic[node * k + nic] for nic in usable]
            if any(node_loads):
                loads.extend(node_loads)
    if not loads:
        return 1.0
    return max(loads) * len(loads) / sum(loads)


def unflatten_slices(flat: Sequence[int]) -> tuple[Slice, ...]:
    """Slices from the backends' flat list ``[flow, src_proxy, dst_proxy, offset, nbytes]*``."""
    it = iter(flat)
    return tuple(Slice(*fields) for fields in zip(it, it, it, it, it))


def build_schedule(topology: RouterTopology, flows: Sequence[Flow], align: int,
                   raw: tuple) -> RouteSchedule:
    """Build a ``RouteSchedule`` from a backend's raw result (shared by both backends).

    raw = (flat slices, NIC egress bytes, NIC ingress bytes, (dispatch, nic, combine) ticks,
    direct ticks, chunks, pipelined ticks), as returned by ``reference.route_raw`` and
    ``_router_cpp.route_raw``.
    """
    flat, egress, ingress, phases, direct_ticks, chunks, ticks = raw
    dispatch, nic, combine = phases
    return RouteSchedule(
        slice_table=tuple(flat), nic_egress_bytes=tuple(egress),
        nic_ingress_bytes=tuple(ingress), dispatch_time_s=dispatch / TICKS_PER_S,
        nic_time_s=nic / TICKS_PER_S, combine_time_s=combine / TICKS_PER_S, chunks=chunks,
        estimated_time_s=ticks / TICKS_PER_S,
        sequential_time_s=(dispatch + nic + combine) / TICKS_PER_S,
        direct_time_s=direct_ticks / TICKS_PER_S,
        nic_load_ratio=compute_nic_load_ratio(topology, egress, ingress), align=align)


def split_flow_fields(flows: Iterable[Flow]) -> tuple[list[int], list[int], list[int]]:
    """(src ranks, dst ranks, byte counts) as plain lists, the backends' input layout."""
    flows = list(flows)
    return [f.src for f in flows], [f.dst for f in flows], [f.nbytes for f in flows]
