"""The one switch point between the planner's backends: the pure-Python reference and its C++
twin (``megatron_zeppelin._planner_cpp``, built from ``csrc/planner*.cpp`` by
``pip install -e .``), which return the same plans bit for bit and release the GIL while they
compute. ``ZEPPELIN_PLANNER_BACKEND`` (read by ``env.planner_backend()``): ``auto`` (default:
the twin when built), ``cpp`` (require it) or ``python``.

The twin returns plan.py's own objects (``AttentionTask`` lists, ``Segment`` layouts), built
in C++ as ``tuple.__new__`` builds them.
"""
from __future__ import annotations

from types import ModuleType
from typing import Sequence

from megatron_zeppelin import env
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.estimate import grad_allreduce_seconds
from megatron_zeppelin.plan import AttentionTask
from megatron_zeppelin.twins import load_twin, twin_backend

BACKENDS = ("cpp", "python")


def load_cpp() -> ModuleType | None:
    """The compiled twin, or None when it was not built."""
    return load_twin("planner")


def backend_name(backend: str | None = None) -> str:
    """``"cpp"`` or ``"python"``: the backend planners use now; ``backend`` overrides the
    environment. Raises ImportError when ``cpp`` is required but not built."""
    choice = backend or env.planner_backend()
    if choice not in ("auto", *BACKENDS):
        raise ValueError(f"planner backend={choice!r} is invalid: expected one of "
                         f"{['auto', *BACKENDS]}")
    return twin_backend(choice, load_cpp, "planner", "ZEPPELIN_PLANNER_BACKEND")


def problem_args(seqlens: Sequence[int], capacity: int, cost: CostModel,
                 config: ZeppelinConfig) -> tuple:
    """Everything the twin reads, in ``csrc/planner_bindings.cpp``'s order."""
    k, topo, cluster = cost.kernel, cost.cluster.topology(cost.tp), cost.cluster
    kernel = (k.attn_coef, list(k.log_lengths), list(k.flops_per_s), k.kv_per_token,
              k.bwd_bytes_factor, k.layers, k.nvlink_byte_per_s, k.nvlink_latency_s,
              k.nic_byte_per_s, k.nic_latency_s, k.routable, list(k.routed_log_sizes),
              list(k.routed_log_times), k.linear_per_token, k.ring_step_s, k.remap_step_s,
              float(k.window), k.window_share, k.halo_split)
    return (list(seqlens), capacity, topo.nodes, topo.gpus_per_node, kernel, config.routing,
            config.remap, config.balance_slack, cost.linear_time(1),
            cost.remap_seconds_per_token(), cost.qkvo_bytes(1), cost.tp, cluster.nics_per_node,
            list(cluster.gpu_to_nic), grad_allreduce_seconds(cost),
            cost.hardware.attention_bwd_ratio, FWD_BWD_LINEAR, cost.hardware.shared_by)


def cpp_module(backend: str | None) -> ModuleType | None:
    """The twin when ``backend`` resolves to ``cpp``, else None (use the Python reference)."""
    return load_cpp() if backend_name(backend) == "cpp" else None


def twin_tasks(function: str, seqlens: Sequence[int], capacity: int, cost: CostModel,
               config: ZeppelinConfig, *args) -> list[AttentionTask] | None:
    """``_planner_cpp.<function>(problem, *args)`` as AttentionTasks when the backend is
    ``cpp``; None with the Python backend (the caller runs its reference)."""
    cpp = cpp_module(None)
    if cpp is None:
        return None
    return getattr(cpp, function)(problem_args(seqlens, capacity, cost, config), *args)
