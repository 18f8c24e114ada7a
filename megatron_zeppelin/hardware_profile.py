"""The achieved throughputs of one GPU (or CPU rank) that the cost model prices with
(``configs/hardware/*.yaml``), and the attention kernels a profile may describe.

Loaded strictly by ``config.load_hardware`` / ``config.hardware_for``; written back by
``config_yaml.write_yaml`` (``zeppelin calibrate``, the online fit).
"""
from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real
from dataclasses import dataclass, field
from typing import Mapping, TypeVar

from megatron_zeppelin.options import require, require_at_least, require_positive
from megatron_zeppelin.twin_arithmetic import interp

Cluster = TypeVar("Cluster")  # config.ClusterSpec (which imports this module)

# The attention kernel a hardware profile describes (``HardwareProfile.kernel``); each runtime
# kernel backend names the one it runs (``runtime.kernels``: native/flash_attn -> fa2, te ->
# cudnn, torch on CPU -> cpu).
ATTENTION_KERNELS = {
    "fa2": "FlashAttention-2 code: torch's built-in varlen flash attention (backend native) "
           "and the flash-attn 2.x package (backend flash_attn)",
    "fa3": "FlashAttention-3 (Hopper): flash-attention's hopper/ build (backend flash_attn3)",
    "cudnn": "cuDNN fused attention through Transformer Engine (backend te)",
    "cpu": "torch's CPU kernels (backend torch on CPU)",
}


@dataclass(frozen=True)
class HardwareProfile:
    """Achieved throughputs of one GPU (or CPU rank), with where the numbers come from.

    ``attention_tflops`` maps a per-call query length to achieved causal attention forward
    TFLOP/s; lengths in between interpolate on log(length), outside clamp to the ends.
    ``kernel`` (required, keyword): the attention kernel the figures describe
    (``ATTENTION_KERNELS``); ``hardware_for`` picks the profile of the kernel that will run.
    ``ring_step_overhead_us``: the engine's host work per ring step and layer, forward and
    backward together (0: not modelled); ``remap_overhead_us``: the remapping layer's host work
    per layer, forward and backward together, on top of its bytes (its all-to-alls' setup and
    the wait for the slowest rank; 0: not modelled). ``linear_fixed_us``: a rank's time per
    micro-batch that does not grow with its tokens (kernel launches, the training loop's host
    work), forward and backward: the same in every plan, so plans are scored without it; an
    iteration's estimate adds it per micro-batch (``estimate.iteration_seconds``; 0: not
    modelled). ``intra_*`` / ``inter_*``: measured link figures
    (a profile fitted during training, ``fit.py``) that replace the cluster's nominal NVLink /
    NIC bandwidth and latency in the cost model (``links``); None keeps the cluster's.
    ``shared_by``: how many ranks share one device's compute (1 on GPUs; 4 CPU ranks on 2
    cores: 2). The figures are per rank while all of them compute; a rank whose peers wait
    runs up to ``shared_by`` times faster: the estimate prices a wave's per-rank work under
    fair sharing of the devices (``estimate.shared_peak``).
    """

    name: str
    gemm_tflops: float
    attention_tflops: tuple[tuple[int, float], ...]
    attention_bwd_ratio: float = 2.5
    kernel_overhead_us: float = 8.0
    p2p_gbyte_per_s: float | None = None
    p2p_latency_us: float | None = None
    source: str = ""
    kernel: str = field(kw_only=True)
    ring_step_overhead_us: float = field(default=0.0, kw_only=True)
    remap_overhead_us: float = field(default=0.0, kw_only=True)
    linear_fixed_us: float = field(default=0.0, kw_only=True)
    intra_gbyte_per_s: float | None = field(default=None, kw_only=True)
    intra_latency_us: float | None = field(default=None, kw_only=True)
    inter_gbit_per_s: float | None = field(default=None, kw_only=True)
    inter_latency_us: float | None = field(default=None, kw_only=True)
    shared_by: float = field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        require(self.kernel in ATTENTION_KERNELS, "hardware.kernel", self.kernel,
                f"one of {list(ATTENTION_KERNELS)}")
        require_positive("hardware.gemm_tflops", self.gemm_tflops)
        require_positive("hardware.attention_bwd_ratio", self.attention_bwd_ratio)
        require_at_least("hardware.shared_by", self.shared_by, 1,
                         " (ranks sharing one device's compute)")
        require_at_least("hardware.kernel_overhead_us", self.kernel_overhead_us)
        object.__setattr__(self, "attention_tflops", _attention_table(self.attention_tflops))
        for key in ("p2p_gbyte_per_s", "p2p_latency_us", "intra_latency_us",
                    "inter_latency_us", "ring_step_overhead_us", "remap_overhead_us",
                    "linear_fixed_us"):
            if getattr(self, key) is not None:
                require_at_least(f"hardware.{key}", getattr(self, key))
        for key in ("intra_gbyte_per_s", "inter_gbit_per_s"):
            if getattr(self, key) is not None:
                require_positive(f"hardware.{key}", getattr(self, key))

    def links(self, cluster: Cluster) -> Cluster:
        """``cluster`` (a ``config.ClusterSpec``) with this profile's measured link figures in
        place of its own."""
        keys = {"nvlink_gbyte_per_s": self.intra_gbyte_per_s,
                "nvlink_latency_us": self.intra_latency_us,
                "nic_gbit_per_s": self.inter_gbit_per_s, "nic_latency_us": self.inter_latency_us}
        changes = {k: v for k, v in keys.items() if v is not None and getattr(cluster, k) != v}
        return dataclasses.replace(cluster, **changes) if changes else cluster

    @property
    def log_lengths(self) -> tuple[float, ...]:
        """log of the profile's lengths (the interpolation's abscissae)."""
        return tuple(math.log(length) for length, _ in self.attention_tflops)

    @property
    def flops_per_s(self) -> tuple[float, ...]:
        """The profile's achieved FLOP/s (TFLOP/s x 1e12), in length order."""
        return tuple(tflops * 1e12 for _, tflops in self.attention_tflops)

    def attention_flops_per_s(self, length: float) -> float:
        """Achieved attention FLOP/s for a call whose query chunk has ``length`` tokens."""
        return interp(math.log(length), self.log_lengths, self.flops_per_s)


def _attention_table(raw) -> tuple[tuple[int, float], ...]:
    """``attention_tflops`` as sorted ``(length, TFLOP/s)`` pairs (``length_table``)."""
    return length_table(raw, "hardware.attention_tflops", "TFLOP/s")


def length_table(raw, key: str, values: str) -> tuple[tuple[int, float], ...]:
    """A table by sequence length as sorted ``(length, value)`` pairs: a map ``{length:
    value}`` or a list of pairs; lengths positive integers (each once), values finite and
    positive. ``key`` and ``values`` name the table and its values in errors."""
    allowed = f"a non-empty map {{length: {values}}} of positive integer lengths and finite " \
        f"positive {values}"
    pairs = list(raw.items()) if isinstance(raw, Mapping) else raw
    require(isinstance(pairs, (list, tuple)) and len(pairs) > 0 and
            all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs), key, raw, allowed)
    for length, value in pairs:
        require(isinstance(length, Integral) and not isinstance(length, bool) and length > 0 and
                isinstance(value, Real) and not isinstance(value, bool) and
                math.isfinite(value) and value > 0, key, {length: value}, allowed)
    lengths = [length for length, _ in pairs]
    require(len(set(lengths)) == len(lengths), key, raw, allowed + ", each length once")
    return tuple(sorted((int(length), float(value)) for length, value in pairs))
