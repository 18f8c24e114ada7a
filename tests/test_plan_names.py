"""Plans are named by what they do (``Plan.name``, the one place the name is decided): the
attention-balanced candidate ``hierarchical+remap`` reads so only where its remap moves tokens;
where its placement is already token-balanced it runs no remap and logs read ``hierarchical``.
``Plan.candidate`` (the portfolio's key into ``estimates``) and the pick are unchanged."""
from __future__ import annotations

import random

import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.loop.train_log import chosen_candidates, count_names, names_line
from megatron_zeppelin.plan import AttentionTask, Tier
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.planner.common import assemble, prepare
from megatron_zeppelin.planner.portfolio import REMAPPED, remapped
from megatron_zeppelin.sim.workloads import sample_batch

from conftest import make_cost


def _local_plan(lengths: list[int]):
    """Document i whole on rank i of a 2 x 2 pool, with the remap's linear layout, as the
    portfolio returns a ``hierarchical+remap`` winner."""
    cost = make_cost("gpt-tiny", "cpu-2x2", nodes=2)
    batch = prepare(lengths, cost.cluster.topology(), ZeppelinConfig())
    tasks = [AttentionTask(i, (i,), Tier.LOCAL) for i in range(len(lengths))]
    chosen = remapped(batch, cost, tasks, REMAPPED)
    return assemble("zeppelin", batch, chosen.tasks, chosen.linear, candidate=REMAPPED,
                    estimates=((REMAPPED, 1.0), ("hierarchical", 1.5)))


def test_a_remap_candidate_that_moves_nothing_is_named_without_the_suffix():
    balanced = _local_plan([1000, 1000, 1000, 1000])  # every rank already holds its share
    assert not balanced.remaps and balanced.remap_matrix() == [[0] * 4] * 4
    assert balanced.candidate == REMAPPED and balanced.estimated_gain(REMAPPED) == 1.0
    assert balanced.name == "hierarchical"
    skewed = _local_plan([3000, 200, 200, 200])  # rank 0 gives tokens to the others
    assert skewed.remaps and sum(map(sum, skewed.remap_matrix())) > 0
    assert skewed.name == skewed.candidate == REMAPPED


def test_the_log_and_the_run_summary_use_the_plan_name():
    balanced, skewed = _local_plan([1000] * 4), _local_plan([3000, 200, 200, 200])
    assert chosen_candidates([balanced, skewed, balanced]) == \
        "hierarchical x2, hierarchical+remap"
    run: dict[str, int] = {}
    for plans in ([balanced], [skewed, balanced]):  # two iterations
        count_names(plans, run)
    assert names_line(run) == "hierarchical x2, hierarchical+remap"
    peer = make_plan("static-cp", [500, 700], make_cost("gpt-tiny", "cpu-2x2"), cp_size=2)
    assert chosen_candidates([peer]) == peer.strategy == "static-cp(cp=2)"  # its own name


@pytest.mark.usefixtures("planner_backend")
def test_portfolio_plans_read_remap_exactly_when_they_remap():
    cost = make_cost(nodes=2)
    for seed, workload in enumerate(("github", "uniform-short", "prolong64k")):
        plan = make_plan("zeppelin", sample_batch(workload, 1 << 20, random.Random(seed)), cost)
        assert plan.name.endswith("+remap") == plan.remaps
        assert plan.name == plan.candidate or (plan.candidate == REMAPPED
                                               and plan.name == "hierarchical")
