"""Cost model: FLOPs, bytes and time per sequence and tier; crossover chunk lengths.

Notation (per rank, i.e. per tensor-parallel group): a query heads, g KV heads, P = q/k head
dim + v head dim (``ModelSpec.pair_dim``: 2d with head dim d, qk + rope + v dims under
multi-latent attention), h hidden, f FFN, B bytes per element, L layers. All times are seconds
for a whole training step of the sequence (forward + backward, all layers).

* Attention forward FLOPs of a causal sequence of s tokens: a*P*s^2 (QK^T and PV, halved by
  the causal mask); backward costs ``attention_bwd_ratio`` x the forward time. A sliding window
  of W tokens keeps ``s (W + 1) - W (W + 1) / 2`` of the ``s^2 / 2`` pairs once s > W + 1
  (``window_work``, on the model's share of windowed layers).
* Linear forward FLOPs per token: 2*(attention weights + m*h*f) with m = 3 for SwiGLU (2
  otherwise; attention weights ``ModelSpec.attention_weights``: h*(a+2g)*d + a*d*h, or MLA's
  low-rank projections); MoE multiplies the FFN part by top-k. Forward + backward = 3x forward.
* A zigzag ring over G ranks runs G steps; per step each rank computes a*P*(s/G)^2 forward
  FLOPs and sends the KV of s/G tokens, (s/G)*g*P*B bytes per layer; backward sends KV again
  and dK/dV as the fp32 accumulator, so a step moves (s/G)*g*P*(2B + 4) bytes in all (a
  sliding window trims the rows a hop carries: ``CostKernel.relayed``).
  Communication is hidden when a step's compute exceeds its transfer; that defines the
  crossover chunk length of each tier.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, Sequence

import numpy as np

from megatron_zeppelin.config import ClusterSpec, ModelSpec
from megatron_zeppelin.hardware_profile import HardwareProfile
from megatron_zeppelin.twin_arithmetic import interp
from megatron_zeppelin.plan import Tier

FWD_BWD_LINEAR = 3.0  # backward of a GEMM is two GEMMs of the forward's size
DKV_BYTES = 4  # the engine accumulates dK/dV in fp32 and sends the accumulator


def window_work(seqlen, window: int, share: float):
    """The fraction of a causal sequence's attention work (``s^2``, the dense model's count)
    its layers do when ``share`` of them attend a sliding window of ``window`` tokens
    (Megatron's ``window_size=(window, 0)``): ``(1 - share) + share * kept``, where a windowed
    layer keeps ``(2 s (W + 1) - W (W + 1)) / s^2`` of it (at most 1; 1 while s <= W + 1).
    ``seqlen``: a number or a numpy array; 1.0 without a window (``share`` 0). The C++
    planner twin (``Costs::window_work``) evaluates the same expression."""
    if share <= 0.0:
        return 1.0
    if isinstance(seqlen, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):  # short ones take 1.0
            kept = np.minimum(1.0, _window_kept(seqlen, window))
        return (1.0 - share) + share * np.where(seqlen > window + 1.0, kept, 1.0)
    if seqlen <= window + 1.0:
        return 1.0
    return (1.0 - share) + share * min(1.0, _window_kept(seqlen, window))


def _window_kept(seqlen, window: int):
    """``(2 s (W + 1) - W (W + 1)) / s^2``: a windowed layer's share of the dense count, valid
    once s > W + 1 (before the cap at 1)."""
    w = window + 1.0
    return (2.0 * seqlen * w - window * w) / (seqlen * seqlen)


@dataclass(frozen=True)
class CostModel:
    """Per-rank costs of sequences for one model on one cluster and hardware profile."""

    model: ModelSpec
    cluster: ClusterSpec
    hardware: HardwareProfile
    tp: int = 1
    kernel: "CostKernel" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model.num_attention_heads % self.tp or self.cluster.gpus_per_node % self.tp:
            raise ValueError(f"tensor_model_parallel_size={self.tp} must divide "
                             f"num_attention_heads={self.model.num_attention_heads} and "
                             f"gpus_per_node={self.cluster.gpus_per_node}")
        # a measured profile's link figures replace the cluster's nominal ones everywhere
        object.__setattr__(self, "cluster", self.hardware.links(self.cluster))
        object.__setattr__(self, "kernel", CostKernel.of(self))  # derived once, at construction

    # ------------------------------------------------------------------ dimensions
    @property
    def heads(self) -> int:
        return self.model.num_attention_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return max(1, self.model.kv_heads // self.tp)

    def kv_bytes(self, tokens: float) -> float:
        """Bytes of K and V for ``tokens`` tokens, one layer."""
        return tokens * self.kv_heads * self.model.pair_dim * self.model.bytes_per_element

    def qkvo_bytes(self, tokens: float) -> float:
        """Bytes of q, k, v in and the attention output back, one layer, forward."""
        m = self.model
        return tokens * (self.heads + self.kv_heads) * m.pair_dim * m.bytes_per_element

    # ------------------------------------------------------------------ compute
    def attention_flops(self, seqlen: float) -> float:
        """Causal attention forward FLOPs of one sequence, one layer on average (the model's
        sliding window on its share of layers: ``window_work``); ``seqlen`` may be an array."""
        k = self.kernel
        return self.heads * self.model.pair_dim * seqlen * seqlen * \
            window_work(seqlen, k.window, k.window_share)

    def attention_time(self, seqlen: float, ring: int = 1) -> float:
        """Forward + backward attention compute of one rank's share of a sequence.

        With ``ring`` > 1 the share is 1/ring of the sequence's work, run as ring-step calls
        whose query length is seqlen/ring; the achieved FLOP/s depends on that length.
        """
        return self.kernel.compute(seqlen, ring)

    def attention_times(self, seqlens: Sequence[int]) -> list[float]:
        """``attention_time(s)`` of many whole sequences."""
        compute = self.kernel.compute
        return [compute(s, 1) for s in seqlens]

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's linear modules (QKV, proj, MLP)."""
        m = self.model
        ffn_mats = 3 if m.swiglu else 2
        experts = m.moe_router_topk if m.num_experts else 1
        mlp = ffn_mats * m.hidden_size * m.ffn * experts / self.tp
        return 2.0 * (m.attention_weights(self.heads, self.kv_heads) + mlp)

    def linear_time(self, tokens: float) -> float:
        """Forward + backward time of the linear modules and the LM head for ``tokens`` tokens."""
        m = self.model
        flops = tokens * (self.linear_flops_per_token() * m.num_layers
                          + 2.0 * m.hidden_size * m.vocab_size / self.tp)
        return FWD_BWD_LINEAR * flops / (self.hardware.gemm_tflops * 1e12)

    # ------------------------------------------------------------------ communication
    def routed_seconds(self, nbytes):
        """Time of one routed inter-node message of ``nbytes`` (a number or numpy array):
        the routed-transfer model for a single flow (``routed_message_seconds``), tabulated
        once on a log grid of sizes and interpolated (as ``CostKernel.routed``)."""
        log_sizes, log_times = _routed_table(self.cluster)
        return np.exp(np.interp(np.log(nbytes), log_sizes, log_times))

    def remap_seconds_per_token(self) -> float:
        """Cross-node remap time of one token, all layers, forward + backward: q, k, v there
        and the output back. The remap's all-to-all is not routed, so a token leaves through
        the sending rank's own NIC (static affinity): one GPU's share of the node's NICs."""
        c = self.cluster
        nbytes = 2.0 * self.qkvo_bytes(1) * self.model.num_layers
        return nbytes / (c.nic_byte_per_s * c.nics_per_node / c.gpus_per_node * self.tp)

    def ring_step_bytes(self, seqlen: float, ring: int) -> float:
        """Bytes one rank sends in one ring step, one layer, forward + backward: KV forward,
        KV again and the fp32 dK/dV accumulator backward (trimmed under a sliding window:
        ``CostKernel.relayed``)."""
        b = self.model.bytes_per_element
        kv, dkv = self.kernel.relayed(seqlen, ring)
        if dkv is None:
            return self.kv_bytes(kv) * (2 * b + DKV_BYTES) / b
        return self.kv_bytes(kv) * 2 + self.kv_bytes(dkv) * DKV_BYTES / b

    def ring_step_comm_time(self, seqlen: float, ring: int, tier: Tier, routed: bool) -> float:
        """Forward + backward transfer time of one ring step, all layers."""
        kv, dkv = self.kernel.relayed(seqlen, ring)
        return self.kernel.comm(kv, tier, routed, dkv)

    def ring_bytes(self, seqlen: float, ring: int) -> float:
        """Bytes one rank sends over a whole ring (forward + backward, all layers)."""
        if ring == 1:
            return 0.0
        return self.ring_step_bytes(seqlen, ring) * (ring - 1) * self.model.num_layers

    def task_time(self, seqlen: float, ring: int, tier: Tier, routed: bool = True) -> float:
        """One rank's time for its share of a sequence, counting ring traffic not hidden
        (``CostKernel.task_time``)."""
        return self.kernel.task_time(seqlen, ring, tier, routed)

    def task_times(self, seqlen: int, rings: Sequence[int], tier: Tier,
                   routed: bool = True) -> list[float]:
        """``task_time(seqlen, G, tier, routed)`` for every G of ``rings``."""
        task_time = self.kernel.task_time
        return [task_time(seqlen, g, tier, routed) for g in rings]

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
class CostKernel:
    """The cost model reduced to the numbers the planners evaluate per sequence and span, with
    one scalar implementation of each formula (``math`` and ``twin_arithmetic.interp``). The
    C++ planner twin (``csrc/planner_costs.h``) evaluates the same expressions on the same numbers, so both
    backends compute the same doubles and make the same decisions.

    compute(s, G): ``attn_coef * s * s * window_work(s) / G / F(s / G)`` with F the profile's
    FLOP/s at the chunk length (log interpolation) and attn_coef = a P (1 + bwd ratio) L.
    comm(c, tier, routed, dkv): one ring step's forward KV and backward KV + fp32 dK/dV of a
    chunk of c tokens (dkv: the accumulator's rows when they differ, ``relayed``), all layers:
    over NVLink (INTRA), the GPU's NIC, or routed over every NIC (``routed_message_seconds`` on
    a log grid, interpolated in log-log). relayed(s, G): the rows a hop carries under the
    model's sliding window (the engine's trimming).
    task_time(s, G): compute + G * ring_step_s + (G - 1) * max(0, comm - compute / G -
    ring_step_s) (exposed ring traffic; ring_step_s: the engine's host work per ring step, all
    layers, forward + backward, ``HardwareProfile.ring_step_overhead_us``).
    """

    attn_coef: float
    log_lengths: tuple[float, ...]
    flops_per_s: tuple[float, ...]
    kv_per_token: float  # K and V bytes of one token, one layer
    bwd_bytes_factor: float  # backward bytes per forward byte (KV again + fp32 dK/dV)
    layers: int
    nvlink_byte_per_s: float
    nvlink_latency_s: float
    nic_byte_per_s: float
    nic_latency_s: float
    routable: bool  # more than one NIC rail: inter-node messages can be routed
    routed_log_sizes: tuple[float, ...]
    routed_log_times: tuple[float, ...]
    linear_per_token: float  # linear_time(1)
    pair_bytes: float  # a q/k head and a v head of one token, one layer (model.pair_dim)
    heads: int  # query heads per rank (per GPU of its tensor-parallel group)
    kv_heads: int
    ranks_per_node: int
    nic_share_byte_per_s: float  # one GPU's share of its node's NICs
    ring_step_s: float = 0.0  # host work per ring step, all layers, fwd + bwd
    remap_step_s: float = 0.0  # the remap's host work per micro-batch, all layers, fwd + bwd
    window: int = 0  # the model's sliding window (tokens), where window_share > 0
    window_share: float = 0.0  # fraction of layers with the window (``window_work``)

    @classmethod
    def of(cls, cost: "CostModel") -> "CostKernel":
        m, c, hw = cost.model, cost.cluster, cost.hardware
        log_sizes, log_times = _routed_table(c)
        return cls(
            attn_coef=cost.heads * m.pair_dim * (1.0 + hw.attention_bwd_ratio)
            * m.num_layers,
            log_lengths=hw.log_lengths, flops_per_s=hw.flops_per_s,
            kv_per_token=cost.kv_bytes(1),
            bwd_bytes_factor=(m.bytes_per_element + DKV_BYTES) / m.bytes_per_element,
            layers=m.num_layers, nvlink_byte_per_s=c.nvlink_byte_per_s,
            nvlink_latency_s=c.nvlink_latency_us * 1e-6, nic_byte_per_s=c.nic_byte_per_s,
            nic_latency_s=c.nic_latency_us * 1e-6, routable=len(set(c.gpu_to_nic)) > 1,
            routed_log_sizes=tuple(log_sizes.tolist()), routed_log_times=tuple(log_times.tolist()),
            linear_per_token=cost.linear_time(1),
            pair_bytes=float(m.pair_dim * m.bytes_per_element), heads=cost.heads,
            kv_heads=cost.kv_heads, ranks_per_node=c.gpus_per_node // cost.tp,
            nic_share_byte_per_s=c.nic_byte_per_s * len(set(c.gpu_to_nic)) / c.gpus_per_node,
            ring_step_s=hw.ring_step_overhead_us * 1e-6 * m.num_layers,
            remap_step_s=hw.remap_overhead_us * 1e-6 * m.num_layers,
            window=m.window_size or 0, window_share=m.window_share)

    def flops(self, chunk: float) -> float:
        """Achieved attention FLOP/s at a query chunk of ``chunk`` tokens."""
        return interp(math.log(chunk), self.log_lengths, self.flops_per_s)

    def compute(self, seqlen: float, ring: int) -> float:
        """Forward + backward attention compute of one rank's 1/ring share of a sequence."""
        return self.attn_coef * seqlen * seqlen * \
            window_work(seqlen, self.window, self.window_share) / ring / self.flops(seqlen / ring)

    def routed(self, nbytes: float) -> float:
        """One routed message of ``nbytes`` (the tabulated ``routed_message_seconds``)."""
        return math.exp(interp(math.log(nbytes), self.routed_log_sizes, self.routed_log_times))

    def relayed(self, seqlen: float, ring: int) -> tuple[float, float | None]:
        """(KV rows, dK/dV accumulator rows or None: as many) one ring hop carries for a
        sequence's 1/ring share, mean over layers. The engine trims a windowed layer's hops to
        the rows later positions read (``ZigzagLayout.held_rows``/``dkv_rows``): on average
        ``min(s/G, L)`` KV rows and ``min(s/G, 2 L (G-1)/G)`` accumulator rows, exact once
        ``L <= s / (2G)`` (a chunk), an upper bound below (``tests/test_cost_model.py``)."""
        chunk = seqlen / ring
        if self.window_share <= 0.0:
            return chunk, None
        dense = (1.0 - self.window_share) * chunk
        return (dense + self.window_share * min(chunk, self.window),
                dense + self.window_share * min(chunk, 2.0 * self.window * (ring - 1) / ring))

    def comm(self, chunk: float, tier: Tier, routed: bool, dkv: float | None = None) -> float:
        """Transfer time of one ring step of ``chunk`` KV tokens per rank (``dkv``: the dK/dV
        accumulator's tokens, None: as many), all layers, fwd + bwd."""
        fwd = self.kv_per_token * chunk
        bwd = fwd * self.bwd_bytes_factor if dkv is None else \
            fwd + self.kv_per_token * dkv * (self.bwd_bytes_factor - 1.0)
        if tier == Tier.INTER and routed and self.routable:
            per_layer = self.routed(fwd) + self.routed(bwd)
        elif tier == Tier.INTRA:
            per_layer = (fwd + bwd) / self.nvlink_byte_per_s + 2.0 * self.nvlink_latency_s
        else:
            per_layer = (fwd + bwd) / self.nic_byte_per_s + 2.0 * self.nic_latency_s
        return per_layer * self.layers

    def dkv_tail(self, chunk: float, tier: Tier, routed: bool) -> float:
        """The backward's last exchange, all layers: the fp32 dK/dV accumulator of a chunk of
        ``chunk`` tokens returns to its owner after the last step, with no compute left to
        hide it behind."""
        nbytes = self.kv_per_token * chunk * (self.bwd_bytes_factor - 1.0)  # the accumulator rows
        if tier == Tier.INTER and routed and self.routable:
            per_layer = self.routed(nbytes)
        elif tier == Tier.INTRA:
            per_layer = nbytes / self.nvlink_byte_per_s + self.nvlink_latency_s
        else:
            per_layer = nbytes / self.nic_byte_per_s + self.nic_latency_s
        return per_layer * self.layers

    def ulysses_compute(self, seqlen: float, group: int) -> float:
        """One rank's attention compute of a sequence under Ulysses (DeepSpeed-Ulysses, as
        FlexSP runs it) over ``group`` ranks: the full length over the busiest rank's heads,
        ceil(heads / group) of them (an uneven split where group does not divide them)."""
        share = -(-self.heads // group) / self.heads
        return self.attn_coef * seqlen * seqlen * \
            window_work(seqlen, self.window, self.window_share) * share / self.flops(seqlen)

    def ulysses_comm(self, tokens: float, group: int, tier: Tier) -> float:
        """One rank's all-to-alls, all layers, for ``tokens`` tokens it holds in the linear
        layout (s / G of each sequence of its group), not overlapped with compute: q, k, v in
        and the output back forward, the reverse backward (KV heads replicated up to the
        group size), each rank sending (G-1)/G of them; peers in other nodes (INTER groups
        span whole nodes) through the GPU's share of its node's NICs, the rest over NVLink."""
        if group == 1:
            return 0.0
        per_token = (self.heads + max(self.kv_heads, group)) * self.pair_bytes
        sent = 2.0 * per_token * tokens * (group - 1) / group  # forward + backward, one layer
        local = group if tier != Tier.INTER else self.ranks_per_node
        cross = (group - local) / (group - 1)
        link = max(sent * (1.0 - cross) / self.nvlink_byte_per_s,
                   sent * cross / self.nic_share_byte_per_s)
        latency = self.nic_latency_s if cross > 0 else self.nvlink_latency_s
        return (link + 4.0 * latency) * self.layers

    def task_time(self, seqlen: float, ring: int, tier: Tier, routed: bool = True) -> float:
        """One rank's time for its share: compute plus the ring traffic not hidden (each of
        the G - 1 transfer steps overlaps one step of compute)."""
        compute = self.compute(seqlen, ring)
        if ring == 1:
            return compute
        compute = compute + ring * self.ring_step_s
        kv, dkv = self.relayed(seqlen, ring)
        return compute + (ring - 1) * max(0.0, self.comm(kv, tier, routed, dkv)
                                          - compute / ring)


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
