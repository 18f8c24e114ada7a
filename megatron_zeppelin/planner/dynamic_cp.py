"""Megatron's dynamic CP as a peer strategy: groups from megatron-core's own
``DefaultDynamicCPScheduler`` (``megatron/core/datasets/data_schedule.py``), one wave each.

Megatron renamed hybrid CP to *dynamic CP* after megatron-core 0.19: the scheduler forms, per
micro-batch, CP groups of varying size over all DP x CP ranks from ``--max-seqlen-per-dp-cp-rank``
(packing-aware, ``min_cp_size``). No release up to 0.19.2 ships it (Megatron-LM's dev branch
does), so the strategy is registered only when the installed megatron-core defines it
(``available()``, which reads the source file without importing megatron-core: the planner
stays torch-free). The plan is built like the hybrid-CP baseline's (``plan_from_waves``).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.options import setting
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.baselines import (HybridDP, default_max_seqlen_per_rank,
                                                 plan_from_waves)
from megatron_zeppelin.planner.common import prepare
from megatron_zeppelin.planner.registry import register

NAME = "megatron-dynamic-cp"
MODULE, CLASS = "megatron.core.datasets.data_schedule", "DefaultDynamicCPScheduler"


def available() -> bool:
    """Whether the installed megatron-core defines ``DefaultDynamicCPScheduler``."""
    spec = importlib.util.find_spec("megatron")
    for root in (spec.submodule_search_locations if spec else None) or ():
        path = os.path.join(root, "core", "datasets", "data_schedule.py")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if f"class {CLASS}(" in f.read():
                    return True
    return False


@dataclass(frozen=True)
class MegatronDynamicCP(HybridDP):
    """Megatron-core's dynamic CP over the pool (DP x CP = every rank), one wave per group."""

    name = NAME
    summary = "megatron-core's DefaultDynamicCPScheduler groups, one wave each"
    min_cp_size: int = setting(1, "megatron-dynamic-cp: the scheduler's smallest CP group")

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        return plan_megatron_dynamic_cp(seqlens, cost, config, self.max_seqlen_per_rank,
                                        self.min_cp_size)


def plan_megatron_dynamic_cp(seqlens: Sequence[int], cost: CostModel,
                             config: ZeppelinConfig = ZeppelinConfig(),
                             max_seqlen_per_rank: int | None = None,
                             min_cp_size: int = 1) -> Plan:
    """Megatron-core's dynamic CP over the pool (DP x CP = every rank), one wave per group."""
    try:
        scheduler_class = getattr(importlib.import_module(MODULE), CLASS)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"strategy {NAME!r} needs megatron-core's {MODULE}.{CLASS} (not in "
                          "releases up to 0.19.2)") from exc
    batch = prepare(seqlens, cost.cluster.topology(cost.tp), config)
    per_rank = max_seqlen_per_rank or default_max_seqlen_per_rank(batch)
    scheduler = scheduler_class(max_seqlen_per_dp_cp_rank=per_rank,
                                cp_size=batch.topology.world_size, dp_size=1,
                                microbatch_group_size_per_vp_stage=None,
                                min_cp_size=min_cp_size)
    groups = scheduler.get_groups_and_subsamples(list(enumerate(batch.seqlens)))
    return plan_from_waves(NAME, batch, groups)


if available():  # registered only where the installed megatron-core has the scheduler
    register(MegatronDynamicCP)
