"""FlexSP's plans train end to end: the tiny GPT on 4 gloo ranks (2 nodes x 2), every micro-batch
planned by ``PlanFunction("flexsp", ...)`` (Ulysses groups of several sizes, run by the engine's
all-to-all attention), trains with the losses and gradient norms of static CP on the same
documents and seed.

The run chooses FlexSP's planner with ``--zeppelin-strategy flexsp`` and validates every plan.
"""
from __future__ import annotations


import pytest

from distributed import run_world
from test_training_resume import FLAGS, run

pytestmark = pytest.mark.distributed

# a small capacity: the longer documents must be split over Ulysses groups of several ranks;
# every plan is validated (each group within the capacity)
ZEPPELIN_4 = ["--context-parallel-mode", "zeppelin", "--context-parallel-size", "4",
              "--zeppelin-gpus-per-node", "2", "--zeppelin-capacity-tokens-per-gpu", "300",
              "--zeppelin-strategy", "flexsp", "--zeppelin-validate-plan"]
STATIC_4 = ["--context-parallel-mode", "static", "--context-parallel-size", "4",
            "--zeppelin-gpus-per-node", "2"]


def flexsp_body(rank: int, world: int) -> dict:
    from megatron_zeppelin.runtime import engine

    static = run(world, FLAGS + STATIC_4)
    kinds = []
    original_init = engine.AttentionEngine.__init__

    def recording(self, plan, *args, **kwargs):
        original_init(self, plan, *args, **kwargs)
        kinds.append((plan.strategy, plan.attention_kind,
                      max(len(g.ring) for g in plan.ring_groups)))

    engine.AttentionEngine.__init__ = recording
    flexsp = run(world, FLAGS + ZEPPELIN_4)
    return dict(static=[(log.iteration, log.loss, log.grad_norm) for log in static],
                flexsp=[(log.iteration, log.loss, log.grad_norm) for log in flexsp],
                tiers=[(log.local, log.intra, log.inter) for log in flexsp], kinds=kinds)


def test_flexsp_plans_train_like_static_cp():
    result = run_world(flexsp_body, 4, start_method="spawn", timeout_s=600)[0]
    assert result["kinds"] and all(k[:2] == ("flexsp", "ulysses") for k in result["kinds"])
    assert max(k[2] for k in result["kinds"]) > 1, result["kinds"]  # groups of several ranks
    assert sum(intra + inter for _, intra, inter in result["tiers"]) > 0, result["tiers"]
    static, flexsp = result["static"], result["flexsp"]
    assert [i for i, _, _ in flexsp] == [i for i, _, _ in static] == [1, 2, 3, 4]
    for (i, loss, norm), (_, want_loss, want_norm) in zip(flexsp, static):
        assert loss == pytest.approx(want_loss, rel=1e-5), (i, loss, want_loss)
        assert norm == pytest.approx(want_norm, rel=1e-5), (i, norm, want_norm)
