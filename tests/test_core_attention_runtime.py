"""The zeppelin core attention's runtime is built once per plan, ahead of the step when the
data iterator prepares it (on its planning thread), with every index already on the device."""
from __future__ import annotations

import threading

import pytest

from conftest import make_cost
from distributed import run_world

pytestmark = pytest.mark.distributed


def _prepared_ahead(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_zeppelin.megatron.core_attention import ZeppelinAttentionState
    from megatron_zeppelin.planner import make_plan

    cost = make_cost("gpt-tiny", "h200-8nic", nodes=1, gpus_per_node=2)
    state = ZeppelinAttentionState(dist.group.WORLD, device="cpu")
    planner = state.preparing(lambda lengths: make_plan("zeppelin", lengths, cost))
    plans = []
    thread = threading.Thread(target=lambda: plans.append(planner([300, 40, 7, 2, 1])))
    thread.start()
    thread.join()
    plan = plans[0]
    ahead = state._ahead[id(plan)]
    runtime = state.runtime(plan, None, torch.device("cpu"))
    report = {"same": runtime.engine is ahead.engine, "prepared": list(ahead.engine._prepared),
              "remapped": runtime.remap is not None}
    other = make_plan("zeppelin", [50, 9], cost)  # not prepared: built at the first layer
    report["fresh"] = state.runtime(other, None, torch.device("cpu")).engine is not ahead.engine
    try:  # FlexSP's Ulysses attention: the simulator's only, refused by name
        state.prepare(make_plan("flexsp", [300, 40, 7, 2], cost))
    except ValueError as exc:
        report["refused"] = str(exc)
    state.close()
    return report


def test_runtime_is_prepared_ahead_on_the_planning_thread():
    for report in run_world(_prepared_ahead, 2):
        assert report["same"] and report["fresh"]
        assert [str(d) for d in report["prepared"]] == ["cpu"]
        assert "strategy 'flexsp' is 'ulysses' attention" in report.get("refused", "")
