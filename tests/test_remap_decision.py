"""The remap's price in the estimate (``estimate.remap_fixed_seconds``) and ``bench remap``'s
designed corpora (micro-batches exactly of the pattern, replayed through the planner)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import (Move, estimate_step, remap_a2a_seconds,
                                        remap_fixed_seconds)
from megatron_zeppelin.planner import make_plan, native
from megatron_zeppelin.sim.workloads import sample_batch

from conftest import make_cost


def with_host_work(cost: CostModel, us: float) -> CostModel:
    """``cost`` with the remap's host work per layer (forward + backward) set to ``us``."""
    hardware = dataclasses.replace(cost.hardware, remap_overhead_us=us)
    return CostModel(cost.model, cost.cluster, hardware, cost.tp)


def test_the_remap_pays_its_second_latency_and_host_work_only_when_it_moves_tokens():
    cost = with_host_work(make_cost(nodes=2, gpus_per_node=4), 300.0)
    topo = cost.cluster.topology(1)
    kernel = cost.kernel
    assert remap_fixed_seconds([], topo, cost) == 0.0
    inside = [Move(0, 1, 100)]
    assert remap_fixed_seconds(inside, topo, cost) == pytest.approx(
        2 * kernel.layers * kernel.nvlink_latency_s + kernel.remap_step_s)
    across = [Move(0, 1, 100), Move(0, 5, 10)]  # ranks 0 and 5 are on different nodes
    assert remap_fixed_seconds(across, topo, cost) == pytest.approx(
        2 * kernel.layers * max(kernel.nic_latency_s, kernel.nvlink_latency_s)
        + kernel.remap_step_s)
    assert kernel.remap_step_s == pytest.approx(300e-6 * kernel.layers)
    assert remap_fixed_seconds([Move(2, 2, 100), Move(0, 1, 0)], topo, cost) == 0.0


def test_a_remapped_plan_is_charged_the_fixed_price_in_its_estimate():
    base = make_cost(nodes=2, gpus_per_node=4)
    lengths = sample_batch("github", 1 << 19, random.Random(3))
    plan = make_plan("zeppelin", lengths, base, ZeppelinConfig(remap=True), portfolio=False)
    moves = [Move(t.src, t.dst, t.end - t.start) for t in plan.transfers if t.src != t.dst]
    assert moves, "the batch must make the remap move tokens"
    for us in (0.0, 500.0):
        cost = with_host_work(base, us)
        est = estimate_step(plan, cost)
        assert est.remap_s == pytest.approx(
            remap_a2a_seconds(moves, plan.topology, cost) * 2 * cost.kernel.layers
            + remap_fixed_seconds(moves, plan.topology, cost))
    costly, free = (estimate_step(plan, with_host_work(base, us)).remap_s for us in (500., 0.))
    assert costly - free == pytest.approx(500e-6 * base.kernel.layers)


@pytest.mark.parametrize("seed", range(2))
def test_backends_price_the_remap_alike_with_host_work(seed, monkeypatch):
    rng = random.Random(seed)
    cost = with_host_work(make_cost(nodes=2, gpus_per_node=4), rng.choice([50.0, 800.0]))
    lengths = sample_batch(rng.choice(["github", "prolong64k"]), 1 << 19, rng)
    outcomes = []
    for backend in native.BACKENDS:
        monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
        plan = make_plan("zeppelin", lengths, cost, ZeppelinConfig(remap=True))
        outcomes.append((plan.tasks, plan.linear, plan.candidate, plan.estimates))
    assert outcomes[0] == outcomes[1]
    assert "hierarchical+remap" in dict(outcomes[0][3])


def test_the_remaps_host_work_turns_a_remap_of_few_tokens_down():
    """The remap candidate beats the same placement without it by less than the remap's host
    work where the attention layout is already nearly token-balanced (one long document, many
    short ones: ``bench remap``'s one-long setting); priced, the placement without it wins."""
    from megatron_zeppelin.config import load_setup

    setup = load_setup("gpt-tiny", "cpu-2x2")
    model = dataclasses.replace(setup.model, hidden_size=256, ffn_hidden_size=1024)
    rng = random.Random(5)
    lengths = [4096]
    while sum(lengths) < 16384:
        lengths.append(min(rng.randint(16, 128), 16384 - sum(lengths)))
    margins = []
    for us in (0.0, 4000.0):
        hardware = dataclasses.replace(setup.hardware, ring_step_overhead_us=0.0,
                                       remap_overhead_us=us, shared_by=1.0)  # a device each
        cost = CostModel(model, setup.cluster, hardware, 1)
        plan = make_plan("zeppelin", lengths, cost, ZeppelinConfig(max_seqlen=4096))
        estimates = dict(plan.estimates)
        margins.append(estimates["hierarchical"] - estimates["hierarchical+remap"])
        if us == 0.0:
            assert 0.0 < margins[0] < 0.01 * estimates["hierarchical"]
    assert margins[1] < 0.0  # priced, the placement without the remap is the cheaper one


def test_designed_corpus_packs_into_the_pattern_and_replays(tmp_path):
    from megatron_zeppelin.bench import remap

    setting = remap.Setting("one-long-wide-2x2", *remap.SETTINGS["one-long-wide-2x2"])
    remap.prepare([setting], tmp_path, 6, 1234)
    flags = ["--yaml-cfg", str(remap.YAML), "--seed", "1234", *setting.flags]
    batches = remap.micro_batches(flags, 6)
    rng = random.Random("bench-remap-one-long")
    assert batches == [remap.one_long(rng) for _ in range(6)]
    assert all(sum(b) == remap.MICRO and max(b) == remap.SEQ for b in batches)
    other_seed = remap.micro_batches(["--yaml-cfg", str(remap.YAML), "--seed", "7",
                                      *setting.flags], 6)
    assert other_seed != batches  # the order is designed for the seed it was written for
    replayed = remap.replay(flags, batches)
    assert sum(replayed["picks"].values()) == 6
    assert all(x >= 1.0 for x in replayed["token_imbalance"])
    assert len(replayed["remap_plans"]) == 6
