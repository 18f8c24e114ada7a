"""Planners: sequence lengths of one global batch -> ``Plan``. Free of torch.distributed.

``make_plan(strategy, seqlens, cost, config)`` is the one entry point; ``STRATEGIES`` lists the
valid names.
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.baselines import (plan_hybrid_dp, plan_megatron_hybrid_cp,
                                                 plan_static_cp)
from megatron_zeppelin.planner import dynamic_cp
from megatron_zeppelin.planner.zeppelin import plan_zeppelin

STRATEGIES: dict[str, Callable[..., Plan]] = {
    "zeppelin": plan_zeppelin,
    "static-cp": plan_static_cp,
    "hybrid-dp": plan_hybrid_dp,
    "megatron-hybrid-cp": plan_megatron_hybrid_cp,
}
if dynamic_cp.available():  # Megatron's dynamic CP, where the installed megatron-core has it
    STRATEGIES[dynamic_cp.NAME] = dynamic_cp.plan_megatron_dynamic_cp


def make_plan(strategy: str, seqlens: Sequence[int], cost: CostModel,
              config: ZeppelinConfig = ZeppelinConfig(), **options) -> Plan:
    """Plan one global batch with ``strategy`` (a key of ``STRATEGIES``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {list(STRATEGIES)}")
    return STRATEGIES[strategy](seqlens, cost, config, **options)


__all__ = ["STRATEGIES", "make_plan", "plan_zeppelin", "plan_static_cp", "plan_hybrid_dp",
           "plan_megatron_hybrid_cp"]
