"""Planners: sequence lengths of one global batch -> ``Plan``. Free of torch.

``make_plan(strategy, seqlens, cost, config, **options)`` is the one entry point; strategies
are registered objects (``registry.py``) listed in ``STRATEGIES``: the imports below register
them, one module each.
"""
from __future__ import annotations

from megatron_zeppelin.planner import (baselines, dynamic_cp,  # noqa: F401  (registers)
                                       flexsp, hydraulis, portfolio)
from megatron_zeppelin.planner.registry import (STRATEGIES, Strategy, get_strategy, make_plan,
                                                register)

__all__ = ["STRATEGIES", "Strategy", "get_strategy", "make_plan", "register"]
