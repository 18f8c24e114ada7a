"""Cost model: FLOPs, bytes and time per sequence and tier; crossover chunk lengths.

Notation (per rank, i.e. per tensor-parallel group): a query heads, g KV heads, d head dim,
h hidden, f FFN, B bytes per element, L layers. All times are seconds for a whole training
step of the sequence (forward + backward, all layers).

* Attention forward FLOPs of a causal sequence of s tokens: 2*a*d*s^2 (QK^T and PV, halved by
  the causal mask); backward costs ``attention_bwd_ratio`` x the forward time.
* Linear forward FLOPs per token: 2*(h*(a+2g)*d + a*d*h + m*h*f) with m = 3 for SwiGLU (2
  otherwise); MoE multiplies the FFN part by top-k. Forward + backward = 3x forward.
* A zigzag ring over G ranks runs G steps; per step each rank computes 2*a*d*(s/G)^2 forward
  FLOPs and sends the KV of s/G tokens, (s/G)*2*g*d*B bytes per layer; backward sends KV again
  and dK/dV as the fp32 accumulator, so a step moves (s/G)*2*g*d*(2B + 4) bytes in all.
  Communication is hidden when a step's compute exceeds its transfer; that defines the
  crossover chunk length of each tier.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Sequence

import numpy as np

from megatron_zeppelin.config import ClusterSpec, HardwareProfile, ModelSpec
from megatron_zeppelin.plan import Plan, Tier

FWD_BWD_LINEAR = 3.0  # backward of a GEMM is two GEMMs of the forward's size
DKV_BYTES = 4  # the engine accumulates dK/dV in fp32 and sends the accumulator


@dataclass(frozen=True)
class Link:
    """One transfer path: bytes/s and seconds of latency per message."""

    byte_per_s: float
    latency_s: float


@dataclass(frozen=True)
class CostModel:
    """Per-rank costs of sequences for one model on one cluster and hardware profile."""

    model: ModelSpec
    cluster: ClusterSpec
    hardware: HardwareProfile
    tp: int = 1

    def __post_init__(self) -> None:
        if self.model.num_attention_heads % self.tp or self.cluster.gpus_per_node % self.tp:
            raise ValueError(f"tensor_model_parallel_size={self.tp} must divide "
                             f"num_attention_heads={self.model.num_attention_heads} and "
                             f"gpus_per_node={self.cluster.gpus_per_node}")

    # ------------------------------------------------------------------ dimensions
    @property
    def heads(self) -> int:
        return self.model.num_attention_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return max(1, self.model.kv_heads // self.tp)

    def kv_bytes(self, tokens: float) -> float:
        """Bytes of K and V for ``tokens`` tokens, one layer."""
        return tokens * 2 * self.kv_heads * self.model.head_dim * self.model.bytes_per_element

    def qkvo_bytes(self, tokens: float) -> float:
        """Bytes of q, k, v in and the attention output back, one layer, forward."""
        m = self.model
        return tokens * (2 * self.heads + 2 * self.kv_heads) * m.head_dim * m.bytes_per_element

    # ------------------------------------------------------------------ compute
    def attention_flops(self, seqlen: float) -> float:
        """Causal attention forward FLOPs of one sequence, one layer."""
        return 2.0 * self.heads * self.model.head_dim * seqlen * seqlen

    def attention_time(self, seqlen: float, ring: int = 1) -> float:
        """Forward + backward attention compute of one rank's share of a sequence.

        With ``ring`` > 1 the share is 1/ring of the sequence's work, run as ring-step calls
        whose query length is seqlen/ring; the achieved FLOP/s depends on that length.
        """
        hw = self.hardware
        chunk = seqlen / ring
        per_layer = self.attention_flops(seqlen) / ring / hw.attention_flops_per_s(chunk)
        return per_layer * (1.0 + hw.attention_bwd_ratio) * self.model.num_layers

    def attention_times(self, seqlens: Sequence[int]) -> list[float]:
        """``attention_time(s)`` of many whole sequences at once (same interpolation, numpy)."""
        s = np.asarray(seqlens, dtype=np.float64)
        table = self.hardware.attention_tflops
        flops_per_s = np.interp(np.log(s), np.log([length for length, _ in table]),
                                [tflops * 1e12 for _, tflops in table])
        per_layer = 2.0 * self.heads * self.model.head_dim * s * s / flops_per_s
        scale = (1.0 + self.hardware.attention_bwd_ratio) * self.model.num_layers
        return (per_layer * scale).tolist()

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's linear modules (QKV, proj, MLP)."""
        m = self.model
        d, h = m.head_dim, m.hidden_size
        ffn_mats = 3 if m.swiglu else 2
        experts = m.moe_router_topk if m.num_experts else 1
        qkv_proj = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        mlp = ffn_mats * h * m.ffn * experts / self.tp
        return 2.0 * (qkv_proj + mlp)

    def linear_time(self, tokens: float) -> float:
        """Forward + backward time of the linear modules and the LM head for ``tokens`` tokens."""
        m = self.model
        flops = tokens * (self.linear_flops_per_token() * m.num_layers
                          + 2.0 * m.hidden_size * m.vocab_size / self.tp)
        return FWD_BWD_LINEAR * flops / (self.hardware.gemm_tflops * 1e12)

    # ------------------------------------------------------------------ communication
    def link(self, tier: Tier) -> Link:
        """The direct path of a ring step: NVLink inside a node, the GPU's own NIC across."""
        c = self.cluster
        if tier == Tier.INTRA:
            return Link(c.nvlink_byte_per_s, c.nvlink_latency_us * 1e-6)
        return Link(c.nic_byte_per_s, c.nic_latency_us * 1e-6)

    def routed_seconds(self, nbytes):
        """Time of one routed inter-node message of ``nbytes`` (a number or numpy array):
        the router's pipelined model for a single flow (``routed_message_seconds``),
        tabulated once on a log grid of sizes and interpolated."""
        log_sizes, log_times = _routed_table(self.cluster)
        return np.exp(np.interp(np.log(nbytes), log_sizes, log_times))

    def step_comm_seconds(self, chunk_tokens, tier: Tier, routed: bool):
        """Transfer time of one ring step, all layers, forward (KV) + backward (KV and the
        fp32 dK/dV accumulator), for chunks of ``chunk_tokens`` tokens per rank (a number or
        a numpy array). Routed inter-node messages use every NIC of the node."""
        m = self.model
        fwd = self.kv_bytes(1) * np.asarray(chunk_tokens, dtype=np.float64)
        bwd = fwd * (m.bytes_per_element + DKV_BYTES) / m.bytes_per_element
        if tier == Tier.INTER and routed and len(set(self.cluster.gpu_to_nic)) > 1:
            per_layer = self.routed_seconds(fwd) + self.routed_seconds(bwd)
        else:
            link = self.link(tier)
            per_layer = (fwd + bwd) / link.byte_per_s + 2 * link.latency_s
        return per_layer * m.num_layers

    def remap_seconds_per_token(self) -> float:
        """Cross-node remap time of one token, all layers, forward + backward: q, k, v there
        and the output back. The remap's all-to-all is not routed, so a token leaves through
        the sending rank's own NIC (static affinity): one GPU's share of the node's NICs."""
        c = self.cluster
        nbytes = 2.0 * self.qkvo_bytes(1) * self.model.num_layers
        return nbytes / (c.nic_byte_per_s * c.nics_per_node / c.gpus_per_node * self.tp)

    def ring_step_bytes(self, seqlen: float, ring: int) -> float:
        """Bytes one rank sends in one ring step, one layer, forward + backward: KV forward,
        KV again and the fp32 dK/dV accumulator backward."""
        b = self.model.bytes_per_element
        return self.kv_bytes(seqlen / ring) * (2 * b + DKV_BYTES) / b

    def ring_step_comm_time(self, seqlen: float, ring: int, tier: Tier, routed: bool) -> float:
        """Forward + backward transfer time of one ring step, all layers."""
        return float(self.step_comm_seconds(seqlen / ring, tier, routed))

    def ring_bytes(self, seqlen: float, ring: int) -> float:
        """Bytes one rank sends over a whole ring (forward + backward, all layers)."""
        if ring == 1:
            return 0.0
        return self.ring_step_bytes(seqlen, ring) * (ring - 1) * self.model.num_layers

    def task_time(self, seqlen: float, ring: int, tier: Tier, routed: bool = True) -> float:
        """One rank's time for its share of a sequence, counting ring traffic not hidden.

        A ring of G ranks computes G steps; the transfer of step i overlaps the compute of
        step i, so each of the G-1 transfer steps exposes max(0, comm - compute).
        """
        compute = self.attention_time(seqlen, ring)
        if ring == 1:
            return compute
        step_compute = compute / ring
        step_comm = self.ring_step_comm_time(seqlen, ring, tier, routed)
        return compute + (ring - 1) * max(0.0, step_comm - step_compute)

    def task_times(self, seqlen: int, rings: Sequence[int], tier: Tier,
                   routed: bool = True) -> list[float]:
        """``task_time(seqlen, G, tier, routed)`` for every G of ``rings`` at once (numpy; the
        planner compares many spans of one sequence)."""
        g = np.asarray(rings, dtype=np.float64)
        hw, m = self.hardware, self.model
        table = hw.attention_tflops
        flops_per_s = np.interp(np.log(seqlen / g), np.log([n for n, _ in table]),
                                [t * 1e12 for _, t in table])
        compute = self.attention_flops(seqlen) / g / flops_per_s * (1.0 + hw.attention_bwd_ratio)
        compute *= m.num_layers
        comm = self.step_comm_seconds(seqlen / g, tier, routed)
        exposed = np.where(g > 1, (g - 1) * np.maximum(0.0, comm - compute / g), 0.0)
        return (compute + exposed).tolist()

    def crossover_chunk(self, tier: Tier, routed: bool = False) -> int:
        """Smallest per-rank chunk (tokens) whose ring-step compute hides its transfer.

        Analytically c ~ g*(2B+4)*F/(3.5*a*bw) for forward + backward; solved numerically
        because the achieved attention FLOP/s F depends on the chunk length.
        """
        if tier == Tier.LOCAL:
            return 0
        lo, hi = 1, 1 << 26
        if self._step_hidden(hi, tier, routed) is False:
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if self._step_hidden(mid, tier, routed):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _step_hidden(self, chunk: int, tier: Tier, routed: bool) -> bool:
        ring = 2
        seqlen = chunk * ring
        step_compute = self.attention_time(seqlen, ring) / ring
        return step_compute >= self.ring_step_comm_time(seqlen, ring, tier, routed)


@dataclass(frozen=True)
class PlanEstimate:
    """Estimated per-rank times (seconds per training step) and bytes of one plan.

    attention_s / linear_s: per rank, summed over waves. step_s: the step time the plan
    implies (slowest rank per phase; waves add up). Bytes are forward + backward, all layers.
    """

    attention_s: tuple[float, ...]
    linear_s: tuple[float, ...]
    step_s: float
    ring_cross_node_bytes: float
    remap_cross_node_bytes: float
    remap_bytes: float


def estimate_plan(plan: Plan, cost: CostModel, routed: bool = True) -> PlanEstimate:
    """Per-rank attention and linear time of ``plan`` and the bytes it moves across nodes."""
    world, waves = plan.topology.world_size, plan.num_waves
    att = [[0.0] * world for _ in range(waves)]
    for task in plan.tasks:
        t = cost.task_time(plan.seqlens[task.seq], len(task.ring), task.tier, routed)
        for rank in task.ring:
            att[task.wave][rank] += t
    remapped = plan.linear != plan.attention
    lin = [[0.0] * world for _ in range(waves)]
    if remapped:
        lin[0] = [cost.linear_time(n) for n in plan.linear_tokens()]
    else:
        for task in plan.tasks:
            for rank in task.ring:
                lin[task.wave][rank] += cost.linear_time(plan.seqlens[task.seq] / len(task.ring))
    if remapped:
        step = sum(max(a) for a in att) + sum(max(li) for li in lin)
    else:
        step = sum(max(a + li for a, li in zip(aw, lw)) for aw, lw in zip(att, lin))
    per_token = 2.0 * cost.qkvo_bytes(1) * cost.model.num_layers  # forward and backward
    moved = sum(t.end - t.start for t in plan.transfers if t.src != t.dst)
    return PlanEstimate(
        attention_s=tuple(map(sum, zip(*att))), linear_s=tuple(map(sum, zip(*lin))),
        step_s=step, ring_cross_node_bytes=ring_cross_node_bytes(plan, cost),
        remap_cross_node_bytes=plan.remap_cross_node_tokens() * per_token,
        remap_bytes=moved * per_token)


def ring_cross_node_bytes(plan: Plan, cost: CostModel) -> float:
    """Bytes the plan's rings send between nodes (forward + backward, all layers)."""
    node = plan.topology.node_of
    total = 0.0
    for task in plan.tasks:
        if task.tier != Tier.INTER:
            continue
        ring = task.ring
        hops = sum(node(a) != node(b) for a, b in zip(ring, ring[1:] + ring[:1]))
        total += hops * cost.ring_bytes(plan.seqlens[task.seq], len(ring))
    return total


# ----------------------------------------------------------------------------- routed transfers
# The one definition of what a routed transfer costs (the cost model's per-message times and the
# simulator's analytic step use it; the router's integer-tick search ``router/model.py`` imports
# its pipeline formula and chunk rule, and ``csrc/router_model.h`` is that module's C++ twin).

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
def _routed_table(cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """``routed_message_seconds`` on a log grid of sizes (1 KiB .. 8 GiB), as logs."""
    sizes = np.logspace(10, 33, 93, base=2.0)
    times = [routed_message_seconds(cluster, float(b)) for b in sizes]
    return np.log(sizes), np.log(times)
