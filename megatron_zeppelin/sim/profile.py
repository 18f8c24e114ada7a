"""The simulator's own profile (``configs/sim/<name>.yaml``): what one training step costs on a
cluster, measured by ``zeppelin calibrate-sim`` (``bench/calibrate_sim.py``) or derived from
stated measurements (the GPU files cite ``GPU-FACTS.md``). It is not the planner's hardware
profile (``configs/hardware/``): the simulator judges the planner's estimate, so it reads its
own measurements and its own formulas (``step_model.py``), never ``estimate.py``'s.

Fields (times per rank; ``*_us`` microseconds; per-token lines measured at ``measured_hidden``
and ``measured_vocab`` and scaled linearly in hidden size / vocabulary for other models):

* attention: forward TFLOP/s by query length (``attention_tflops``, causal forward FLOPs
  ``2 heads head_dim s^2``), the backward / forward time ratio by length
  (``attention_bwd_ratio``), host + launch per kernel call (``attention_call_us``);
* GEMMs: ``gemm_tflops`` and host + launch per GEMM call (``gemm_call_us``);
* non-GEMM kernels of a layer (norms, SwiGLU, rotary, residual adds), forward + backward:
  ``nongemm_layer_us`` + ``nongemm_ns_per_token`` per token;
* the head (embedding, final norm, loss; its logits GEMM is a GEMM), forward + backward:
  ``head_us`` + ``head_ns_per_token``;
* optimizer step (Adam + gradient clipping): ``optimizer_us`` + ``optimizer_ns_per_param``;
* host work of the attention engine per ring step (per ring, per round): ``ring_step_us``;
* host work of the training loop (schedule, modules' Python, data, hooks) per step and per
  micro-batch: ``step_host_us``, ``micro_batch_host_us``; and per token of a rank's
  micro-batch (``token_host_ns``: Megatron's modules and autograd around the kernels, what
  full-length training steps take beyond every other term);
* links: P2P inside a node (``intra_*``) and across nodes (``inter_*``), an all-reduce over the
  pool (``allreduce_*``: latency per ring step, bus bandwidth);
* ``nvlink_contention``: the factor an intra-node ring hop's time grows by when the routing
  layer's dispatch / combine legs use the same NVLink direction in that round (2: fair share).

* ``compute_scale``: every compute term (attention, GEMMs, non-GEMM kernels, head, optimizer)
  is multiplied by it: the compute figures are one thread's CPU time; 1 on a GPU. With
  ``shared_cores`` > 0 it is only what all ranks computing at once cost beyond a fair share of
  the cores (memory bandwidth, the OS); the sharing itself is ``shared_cores``'s.
* ``shared_cores``: the cores every rank of the pool shares (the emulated CPU cluster: one
  machine). A rank computing while ``k`` ranks compute advances at ``min(1, shared_cores / k)``
  (``sharing.py``; ``step_model`` applies it per micro-batch and to the optimizer step). 0: one
  device per rank, no sharing (GPU profiles).

``unmeasured`` names the fields no measurement backs (they are 0 and say so in every report).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.config_yaml import (from_dict, read_yaml, resolve_config_path,
                                           write_yaml)
from megatron_zeppelin.hardware_profile import length_table
from megatron_zeppelin.options import require, require_at_least, require_positive

TABLES = ("attention_tflops", "attention_bwd_ratio")


@dataclass(frozen=True)
class SimProfile:
    name: str
    source: str
    attention_tflops: tuple[tuple[int, float], ...]
    attention_bwd_ratio: tuple[tuple[int, float], ...]
    attention_call_us: float
    gemm_tflops: float
    gemm_call_us: float
    nongemm_layer_us: float
    nongemm_ns_per_token: float
    head_us: float
    head_ns_per_token: float
    optimizer_us: float
    optimizer_ns_per_param: float
    ring_step_us: float
    intra_gbyte_per_s: float
    intra_latency_us: float
    inter_gbyte_per_s: float
    inter_latency_us: float
    allreduce_gbyte_per_s: float
    allreduce_latency_us: float
    nvlink_contention: float = 1.0
    compute_scale: float = 1.0
    shared_cores: float = 0.0
    step_host_us: float = 0.0
    micro_batch_host_us: float = 0.0
    token_host_ns: float = 0.0
    measured_hidden: int = 0
    measured_vocab: int = 0
    unmeasured: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in TABLES:
            object.__setattr__(self, key, length_table(getattr(self, key), f"SimProfile.{key}",
                                                       "values"))
        for key in ("measured_hidden", "measured_vocab"):
            require(getattr(self, key) >= 0, f"SimProfile.{key}", getattr(self, key),
                    "an integer >= 0 (0: not measured)")
        require(all(isinstance(u, str) for u in self.unmeasured), "SimProfile.unmeasured",
                list(self.unmeasured), "a list of the names of what was not measured")
        for key in ("gemm_tflops", "intra_gbyte_per_s", "inter_gbyte_per_s",
                    "allreduce_gbyte_per_s"):
            require_positive(f"SimProfile.{key}", getattr(self, key))
        for key in ("attention_call_us", "gemm_call_us", "nongemm_layer_us",
                    "nongemm_ns_per_token", "head_us", "head_ns_per_token", "optimizer_us",
                    "optimizer_ns_per_param", "ring_step_us", "step_host_us",
                    "micro_batch_host_us", "token_host_ns", "intra_latency_us",
                    "inter_latency_us", "allreduce_latency_us"):
            require_at_least(f"SimProfile.{key}", getattr(self, key))
        require_at_least("SimProfile.shared_cores", self.shared_cores, 0,
                         " (0: one device per rank)")
        for key in ("nvlink_contention", "compute_scale"):
            require_at_least(f"SimProfile.{key}", getattr(self, key), 1)

    # ------------------------------------------------------------------ lookups
    def fair_share(self, ranks: int) -> float:
        """How much slower each of ``ranks`` ranks computes when all compute at once on
        ``shared_cores`` cores (1 with no sharing)."""
        return max(1.0, ranks / self.shared_cores) if self.shared_cores > 0 else 1.0

    def attention_tflops_at(self, chunk) -> np.ndarray:
        """Forward TFLOP/s at query length ``chunk`` (log interpolation, clamped)."""
        return _interp(self.attention_tflops, chunk)

    def best_tflops_up_to(self, length) -> np.ndarray:
        """The best forward TFLOP/s any query length up to ``length`` reaches (a ring's
        chunk of a sequence may run faster than the whole)."""
        length = np.asarray(length, dtype=np.float64)
        return _running(np.maximum, self.attention_tflops_at(length), self.attention_tflops,
                        length)

    def least_ratio_up_to(self, length) -> np.ndarray:
        """The lowest backward / forward ratio at any query length up to ``length``."""
        length = np.asarray(length, dtype=np.float64)
        return _running(np.minimum, self.backward_ratio(length), self.attention_bwd_ratio,
                        length)

    def attention_forward_s(self, flops: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        """Seconds of ``flops`` forward attention FLOPs run at query length ``chunk`` (log
        interpolation of the measured table, clamped at its ends), no call overhead."""
        return flops / (self.attention_tflops_at(chunk) * 1e12)

    def backward_ratio(self, chunk: np.ndarray) -> np.ndarray:
        """Backward / forward time of attention at query length ``chunk``."""
        return _interp(self.attention_bwd_ratio, chunk)

    def to_yaml(self, path: str | os.PathLike, comment: str) -> None:
        """Write the profile (``load_sim_profile`` reads it back)."""
        write_yaml(_Plain(self), path, comment)


class _Plain:
    """``write_yaml``'s view of a profile: the bwd-ratio table as a {length: value} mapping
    (``write_yaml`` maps ``attention_tflops`` itself)."""

    def __init__(self, profile: SimProfile) -> None:
        self.__dict__ = {k: ({int(n): float(v) for n, v in val}
                             if k == "attention_bwd_ratio" else val)
                         for k, val in profile.__dict__.items()}


def _interp(table: tuple[tuple[int, float], ...], x) -> np.ndarray:
    lengths = np.log([n for n, _ in table])
    values = [v for _, v in table]
    return np.interp(np.log(np.maximum(np.asarray(x, dtype=np.float64), 1.0)), lengths, values)


def _running(pick, start: np.ndarray, table: tuple[tuple[int, float], ...],
             length: np.ndarray) -> np.ndarray:
    """``start`` folded with ``pick`` (np.maximum / np.minimum) over the table's values at
    lengths up to ``length``, elementwise."""
    for n, value in table:
        start = np.where(length >= n, pick(start, value), start)
    return start


def load_sim_profile(name_or_path: str | os.PathLike) -> SimProfile:
    """``configs/sim/<name>.yaml`` or a path; ConfigError naming the file and key. Read once
    per file version (cached on path and modification time: sweeps simulate thousands of
    plans)."""
    path = resolve_config_path(name_or_path, "sim")
    return _load(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=32)
def _load(path: str, _mtime: int) -> SimProfile:
    return from_dict(SimProfile, read_yaml(Path(path)), where=str(path))


def from_planner_profile(cost) -> SimProfile:
    """A profile derived from the planner's hardware profile and cluster (``cost``), for a
    cluster with no ``configs/sim/`` file: NOT independent of the estimate's inputs (the same
    attention and GEMM figures), and host work, non-GEMM kernels and the optimizer unmeasured
    (0). Its ``source`` and ``unmeasured`` say so in every report."""
    hw, c = cost.hardware, cost.cluster
    nics = len(set(c.gpu_to_nic))
    bus = min(c.nvlink_gbyte_per_s, c.nic_gbit_per_s / 8.0 * nics / c.gpus_per_node)
    return SimProfile(
        name=c.name, source=f"derived from the planner's hardware profile {hw.name!r} and "
        f"cluster {c.name!r} (not an independent measurement)",
        attention_tflops=hw.attention_tflops,
        attention_bwd_ratio=((1, hw.attention_bwd_ratio),),
        attention_call_us=hw.kernel_overhead_us, gemm_tflops=hw.gemm_tflops, gemm_call_us=0.0,
        nongemm_layer_us=0.0, nongemm_ns_per_token=0.0, head_us=0.0, head_ns_per_token=0.0,
        optimizer_us=0.0, optimizer_ns_per_param=0.0, ring_step_us=0.0,
        intra_gbyte_per_s=c.nvlink_gbyte_per_s, intra_latency_us=c.nvlink_latency_us,
        inter_gbyte_per_s=c.nic_gbit_per_s / 8.0, inter_latency_us=c.nic_latency_us,
        allreduce_gbyte_per_s=bus, allreduce_latency_us=c.nic_latency_us,
        unmeasured=("gemm_call_us", "nongemm", "head", "optimizer", "ring_step_us",
                    "nvlink_contention", "attention_bwd_ratio by length"))


def profile_of(cost) -> SimProfile:
    """The simulator's profile of ``cost``'s cluster: ``configs/sim/<cluster>.yaml`` when one
    is shipped, else ``from_planner_profile`` (marked as derived)."""
    try:
        return load_sim_profile(cost.cluster.name)
    except ConfigError as exc:
        if "unknown sim config" not in str(exc):
            raise
    return from_planner_profile(cost)
