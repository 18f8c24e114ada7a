"""The remap's host work (``HardwareProfile.remap_overhead_us``) in the step estimate: added
once per micro-batch that moves tokens, the same in both planner backends, and it changes the
portfolio's choice between the remap and the same placement without it."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import make_cost
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.hardware_profile import HardwareProfile
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_step
from megatron_zeppelin.planner import native
from megatron_zeppelin.planner.registry import make_plan
from test_fit import batches


def with_remap_work(cost: CostModel, us: float) -> CostModel:
    return CostModel(cost.model, cost.cluster,
                     dataclasses.replace(cost.hardware, remap_overhead_us=us), cost.tp)


def test_the_remaps_host_work_is_added_once_where_tokens_move():
    base = make_cost("llama-7b", "h200-8nic", nodes=2, gpus_per_node=4)
    costly = with_remap_work(base, 5000.0)
    assert costly.kernel.remap_step_s == pytest.approx(5e-3 * base.model.num_layers)
    remapped = [p for p in (make_plan("zeppelin", b, base, ZeppelinConfig(), portfolio=False)
                            for b in batches(base, 4, seed=3)) if p.linear != p.attention]
    assert remapped, "no batch remapped"
    for plan in remapped:
        extra = estimate_step(plan, costly).remap_s - estimate_step(plan, base).remap_s
        assert extra == pytest.approx(costly.kernel.remap_step_s)
    plain = make_plan("static-cp", batches(base, 1, seed=4)[0], base, ZeppelinConfig())
    assert estimate_step(plain, costly) == estimate_step(plain, base)  # nothing moves
    with pytest.raises(Exception, match="remap_overhead_us"):
        HardwareProfile("x", 1.0, ((128, 1.0),), kernel=base.hardware.kernel,
                        remap_overhead_us=-1.0)


def test_both_backends_agree_and_the_remap_loses_where_its_host_work_is_large(monkeypatch):
    base = make_cost("llama-7b", "h200-8nic", nodes=2, gpus_per_node=4)
    work = batches(base, 4, seed=3)
    picks = {}
    for us in (0.0, 1e6):
        cost = with_remap_work(base, us)
        plans = {}
        for backend in native.BACKENDS:
            monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
            plans[backend] = [(p.tasks, p.linear, p.candidate, p.estimates)
                              for p in (make_plan("zeppelin", b, cost, ZeppelinConfig())
                                        for b in work)]
        assert plans["python"] == plans["cpp"]
        picks[us] = [candidate for _, _, candidate, _ in plans["python"]]
    assert any(c.endswith("+remap") for c in picks[0.0])  # seed 3 remaps twice without it
    assert not any(c.endswith("+remap") for c in picks[1e6])  # 1 s per layer: never worth it
