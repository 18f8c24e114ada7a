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

    from megatron_zeppelin.megatron.common.core_attention import ZeppelinAttentionState
    from megatron_zeppelin.planner import make_plan

    cost = make_cost("gpt-tiny", "h200-8nic", nodes=1, gpus_per_node=2)
    state = ZeppelinAttentionState(dist.group.WORLD, device="cpu")
    planner = state.preparing(lambda lengths: make_plan("zeppelin", lengths, cost))
    plans = []
    thread = threading.Thread(target=lambda: [plans.append(planner(lengths)) for lengths in
                                              ([300, 40, 7, 2, 1], [120, 64, 9])])
    thread.start()
    thread.join()
    plan, following = plans  # the next micro-batch's runtime was prepared before this one ran
    ahead, next_ahead = state._ahead[id(plan)], state._ahead[id(following)]
    runtime = state.runtime(plan, torch.device("cpu"))
    report = {"same": runtime.engine is ahead.engine,
              "scaled": _same_as_an_engine_built_with(runtime.engine, 0.125),
              "prepared": list(ahead.engine._prepared),
              "remapped": runtime.remap is not None}
    report["next kept"] = state.runtime(following, torch.device("cpu")).engine is \
        next_ahead.engine
    other = make_plan("zeppelin", [50, 9], cost)  # not prepared: built at the first layer
    report["fresh"] = state.runtime(other, torch.device("cpu")).engine is not ahead.engine
    flexsp = make_plan("flexsp", [300, 40, 7, 2], cost)  # FlexSP's Ulysses attention
    state.prepare(flexsp)
    report["ulysses"] = state._ahead[id(flexsp)].engine.ulysses is not None
    state.close()
    return report


def _same_as_an_engine_built_with(engine, scale: float) -> bool:
    """The call's scale (forward and backward) gives what an engine built with it gives."""
    import torch

    from megatron_zeppelin.runtime.engine import AttentionEngine

    built = AttentionEngine(engine.plan, engine.rank, engine.group, scale=scale)
    g = torch.Generator().manual_seed(engine.rank)
    inputs = [torch.randn(engine.tokens, h, 8, generator=g, dtype=torch.float64)
              for h in (4, 2, 2)]
    results = []
    for run in (lambda *t: engine.forward(*t, scale), built.forward):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = run(*leaves)
        out.sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    built.close()
    return all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(*results))


def test_runtime_is_prepared_ahead_on_the_planning_thread():
    for report in run_world(_prepared_ahead, 2):
        assert report["same"] and report["fresh"] and report["scaled"] and report["next kept"]
        assert [str(d) for d in report["prepared"]] == ["cpu"]
        assert report["ulysses"]
