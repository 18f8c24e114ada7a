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
from typing import Sequence

import numpy as np

from megatron_zeppelin.config import ClusterSpec, ModelSpec
from megatron_zeppelin.cost_window import RingWindow, WindowParts, window_kept, window_work
from megatron_zeppelin.hardware_profile import HardwareProfile
from megatron_zeppelin.twin_arithmetic import interp
from megatron_zeppelin.plan import Tier
from megatron_zeppelin.routed_cost import routed_table
from megatron_zeppelin.schedule import HALO_SPLIT
from megatron_zeppelin.zigzag_window import halo_fits

FWD_BWD_LINEAR = 3.0  # backward of a GEMM is two GEMMs of the forward's size
DKV_BYTES = 4  # the engine accumulates dK/dV in fp32 and sends the accumulator


@dataclass(frozen=True)
class CostModel:
    """Per-rank costs of sequences for one model on one cluster and hardware profile."""

    model: ModelSpec
    cluster: ClusterSpec
    hardware: HardwareProfile
    tp: int = 1
    kernel: "CostKernel" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelSpec), ("cluster", ClusterSpec),
                           ("hardware", HardwareProfile)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected a "
                                 f"{kind.__name__} (config.load_{name})")
        if not (isinstance(self.tp, int) and not isinstance(self.tp, bool) and self.tp >= 1):
            raise ValueError(f"tensor_model_parallel_size={self.tp!r} is invalid: expected an "
                             "integer >= 1")
        if self.model.kv_heads % self.tp:
            raise ValueError(f"tensor_model_parallel_size={self.tp} must divide the model's "
                             f"{self.model.kv_heads} key/value heads (num_query_groups), as "
                             "Megatron requires")
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
        log_sizes, log_times = routed_table(self.cluster)
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
    layers, forward + backward, ``HardwareProfile.ring_step_overhead_us``). With a sliding
    window the windowed layers' work is not spread evenly over the steps (the band of each
    chunk with itself at step 0, the rest at the steps that hold the neighbouring chunks), so
    their hops hide behind what each step computes (``window_parts``, ``ring_exposed``).
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
    halo_split: bool = True  # the engine splits a partly fitting windowed group (HALO_SPLIT)

    @classmethod
    def of(cls, cost: "CostModel") -> "CostKernel":
        m, c, hw = cost.model, cost.cluster, cost.hardware
        log_sizes, log_times = routed_table(c)
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
            window=m.window_size or 0, window_share=m.window_share,
            halo_split=HALO_SPLIT["cpu" if hw.kernel == "cpu" else "cuda"])

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
        kv, dkv = self._trimmed(chunk, ring)
        return dense + self.window_share * kv, dense + self.window_share * dkv

    def _trimmed(self, chunk: float, ring: int) -> tuple[float, float]:
        """(KV rows, dK/dV rows) a windowed layer's hop carries of a chunk (``relayed``)."""
        return min(chunk, self.window), min(chunk, 2.0 * self.window * (ring - 1) / ring)

    def _unwindowed(self, seqlen: float, ring: int) -> float:
        """``compute`` of one rank's share as if no layer had the window."""
        return self.attn_coef * seqlen * seqlen / ring / self.flops(seqlen / ring)

    def dense_compute(self, seqlen: float, ring: int) -> float:
        """``compute`` of the layers without the sliding window (the model's dense share)."""
        return self._unwindowed(seqlen, ring) * (1.0 - self.window_share)

    def window_parts(self, seqlen: float, ring: int) -> WindowParts:
        """Where a windowed layer's work of one rank's 1/ring share falls in the ring's steps,
        all windowed layers (``WindowParts``). In the zigzag layout (chunks of ``c = s/2G``) a
        window of ``L`` keeps each chunk's band with itself (``c (L+1) - L (L+1)/2`` pairs, or
        the chunk's ``c (c+1)/2`` once ``L > c``), computed at step 0 with, while ``L <= c``,
        the band between the two middle chunks (``L (L+1)/2``, held together); the rest
        reaches the chunks up to ``D = ceil(L / c)`` away, held by the positions ``1..D`` steps
        before and after this one (``reach``, at most G/2: then every step). A sequence no
        longer than ``L + 1`` attends densely: its windowed layers' work is spread evenly
        (``even``)."""
        chunk, window = seqlen / ring, self.window
        windowed = self._unwindowed(seqlen, ring) * self.window_share
        kv, dkv = self._trimmed(chunk, ring)
        if seqlen <= window + 1.0:
            return WindowParts(windowed, 0.0, 0.0, max(1, ring // 2), kv, dkv)
        halo = halo_fits([seqlen], ring, window)
        kept = min(1.0, window_kept(seqlen, window))
        work, half, band = windowed * kept, seqlen / (2 * ring), window * (window + 1.0) / 2.0
        step0 = 2.0 * ring * (half * (window + 1.0) - band) + band if window <= half else \
            2.0 * ring * half * (half + 1.0) / 2.0
        first = work * min(1.0, step0 / (kept * seqlen * seqlen / 2.0))
        reach = max(1, min(ring // 2, math.ceil(window / half)))
        return WindowParts(0.0, first, work - first, reach, kv, dkv, halo)

    def accumulator_rows(self, share: float, window: RingWindow) -> float:
        """dK/dV rows of the backward's last return (``dkv_tail``), mean over layers: the
        dense layers' whole share, the windowed layers' trimmed accumulator, by halo exchange
        the rows a neighbour read (``window.halo_kv``)."""
        rows = window.halo_kv + window.rest_dkv
        return (1.0 - self.window_share) * share + self.window_share * rows

    def ring_exposed(self, dense: float, window: RingWindow, share: float, tier: Tier,
                     routed: bool) -> float:
        """Ring traffic not hidden, G - 1 hops, all layers, of a ring whose members each hold
        ``share`` tokens and compute ``dense`` seconds in the dense layers (spread evenly over
        the G steps) and ``window`` in the windowed ones. The hop into step t overlaps step
        t-1's compute and host work: a dense layer's hops each hide behind 1/G of its compute;
        a windowed layer's first hop behind step 0's band work, the others behind the work of
        their steps (``window.near``: none beyond the window's reach). The sequences whose
        window fits in their chunks go by halo exchange (``runtime.waves.windowed``; across
        nodes in the global steps, both ways): their KV rows (``window.halo_kv`` each way,
        forward and again backward) once, behind step 0's work (their dK/dV return is
        ``dkv_tail``'s); the others' hops as above, on their rows."""
        g, w, h = window.ring, self.window_share, self.ring_step_s
        exposed = (g - 1) * max(0.0, self.comm(share, tier, routed) * (1.0 - w) - dense / g
                                - (1.0 - w) * h)
        even = window.even / g + w * h
        if window.halo_kv > 0.0:  # KV to both neighbours behind step 0, once
            exposed = exposed + max(0.0, self.comm(window.halo_kv, tier, routed, 0.0) * w
                                    - window.first - even)
        if window.rest <= 0:
            return exposed
        hop = self.comm(window.rest_kv, tier, routed, window.rest_dkv) * w
        exposed = exposed + max(0.0, hop - window.first - even)
        for t in range(1, g - 1):
            exposed = exposed + max(0.0, hop - window.near[min(t, g - t)] - even)
        return exposed

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
        if self.window_share > 0.0:
            return compute + ring * self.ring_step_s + self.ring_exposed(
                self.dense_compute(seqlen, ring),
                RingWindow(ring).add(self.window_parts(seqlen, ring)), seqlen / ring, tier,
                routed)
        compute = compute + ring * self.ring_step_s
        return compute + (ring - 1) * max(0.0, self.comm(seqlen / ring, tier, routed)
                                          - compute / ring)
