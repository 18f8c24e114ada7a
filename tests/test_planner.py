"""Planners: token conservation, balance against the baselines, capacity, bad input."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.estimate import estimate_plan, estimate_step
from megatron_zeppelin.plan import Tier, zigzag_share
from megatron_zeppelin.planner import STRATEGIES, make_plan

from conftest import make_cost

pytestmark = pytest.mark.usefixtures("planner_backend")  # every test on both backends

TOPOLOGIES = [(1, 1), (1, 2), (2, 2), (1, 8), (2, 4), (4, 2), (3, 3), (8, 8)]


def long_tailed(rng: random.Random, n: int, max_len: int = 1 << 17) -> list[int]:
    """Log-normal body with a few very long documents."""
    out = [max(1, min(max_len, int(rng.lognormvariate(6.5, 1.5)))) for _ in range(n)]
    for _ in range(max(1, n // 50)):
        out[rng.randrange(n)] = rng.randint(max_len // 8, max_len)
    return out


@pytest.mark.parametrize("strategy", ["zeppelin", "static-cp", "hybrid-dp"])
def test_token_conservation_over_a_thousand_random_batches(strategy):
    rng = random.Random(1234)
    costs = {t: make_cost(nodes=t[0], gpus_per_node=t[1]) for t in TOPOLOGIES}
    for trial in range(1000):
        topo = TOPOLOGIES[trial % len(TOPOLOGIES)]
        lengths = long_tailed(rng, rng.randint(1, 40), max_len=rng.choice([64, 4096, 1 << 16]))
        plan = make_plan(strategy, lengths, costs[topo])
        plan.validate()
        assert sum(plan.attention_tokens()) == sum(lengths) == sum(plan.linear_tokens())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20000), min_size=1, max_size=24), st.sampled_from(TOPOLOGIES[:6]))
def test_megatron_hybrid_cp_plans_conserve_tokens(lengths, topo):
    plan = make_plan("megatron-hybrid-cp", lengths, make_cost(nodes=topo[0], gpus_per_node=topo[1]))
    plan.validate()
    assert sum(plan.attention_tokens()) == sum(lengths)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 1 << 16), min_size=1, max_size=64), st.sampled_from(TOPOLOGIES),
       st.floats(1.0, 4.0), st.booleans())
def test_zeppelin_plans_are_valid_for_any_derived_capacity(lengths, topo, factor, remap):
    """Down to capacity factor 1.0 (no slack at all) a derived capacity always yields a plan."""
    config = ZeppelinConfig(capacity_factor=factor, remap=remap)
    plan = make_plan("zeppelin", lengths, make_cost(nodes=topo[0], gpus_per_node=topo[1]), config)
    plan.validate()
    assert plan.candidate in dict(plan.estimates) and plan.estimates[0][0] == plan.candidate
    if plan.candidate.endswith("+remap"):  # balanced in every node (across: the remap cost)
        assert remap
        tokens = plan.linear_tokens()
        for node in range(plan.topology.nodes):
            mine = [tokens[r] for r in plan.topology.node_ranks(node)]
            assert max(mine) - min(mine) <= 1, (node, mine)
    else:
        assert plan.linear == plan.attention


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.sampled_from(TOPOLOGIES),
       st.integers(1, 4000))
def test_a_configured_capacity_is_met_or_refused_with_a_capacity_error(lengths, topo, capacity):
    config = ZeppelinConfig(capacity_tokens_per_gpu=capacity, overlong="drop")
    try:
        plan = make_plan("zeppelin", lengths, make_cost(nodes=topo[0], gpus_per_node=topo[1]),
                         config)
    except ValueError as exc:
        assert f"{capacity}" in str(exc) or "dropped" in str(exc)
        return
    plan.validate()
    assert max(plan.attention_tokens()) <= capacity


def test_zeppelin_is_never_slower_than_a_peer_by_the_estimate():
    """By construction: the peers' plans are candidates of zeppelin's portfolio, scored by
    the same estimate, so no peer's plan is estimated faster than zeppelin's."""
    rng = random.Random(7)
    for trial in range(30):
        nodes, gpn = [(2, 4), (4, 8), (2, 8)][trial % 3]
        cost = make_cost(nodes=nodes, gpus_per_node=gpn)
        lengths = long_tailed(rng, rng.randint(20, 200))
        ours = make_plan("zeppelin", lengths, cost)
        assert ours.estimates[0] == (ours.candidate, estimate_step(ours, cost).step_s)
        for base, options in (("hybrid-dp", {}), ("static-cp", {"cp_size": gpn}),
                              ("static-cp", {"cp_size": 2 * gpn}), ("static-cp", {})):
            theirs = make_plan(base, lengths, cost, **options)
            assert estimate_step(ours, cost).step_s <= estimate_step(theirs, cost).step_s, \
                (trial, base, options)


def test_zeppelin_uses_all_three_tiers_on_a_long_tailed_batch():
    cost = make_cost(nodes=4)
    lengths = [262144, 131072] + [32768] * 8 + [2048] * 300 + [300] * 400
    plan = make_plan("zeppelin", lengths, cost)
    plan.validate()
    counts = plan.tier_counts()
    assert counts["inter"] >= 1 and counts["intra"] >= 1 and counts["local"] >= 500
    assert plan.tasks[0].tier == Tier.INTER and plan.tasks[-1].tier == Tier.LOCAL
    att = estimate_plan(plan, cost).attention_s
    assert max(att) / (sum(att) / len(att)) < 1.10


def test_capacity_is_respected_and_sharding_follows_it():
    cost = make_cost(nodes=1, gpus_per_node=4)
    config = ZeppelinConfig(capacity_tokens_per_gpu=1000)
    plan = make_plan("zeppelin", [3000, 500, 200], cost, config)
    plan.validate()
    assert max(plan.attention_tokens()) <= 1000
    ring = len(plan.tasks[0].ring)
    assert ring >= 4 or max(zigzag_share(3000, ring, p) for p in range(ring)) <= 1000


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("lengths,match", [
    ([], "empty batch"),
    ([10, 0, 5], r"sequence 1 has length 0"),
    ([10, -3], r"sequence 1 has length -3"),
    ([10, 2.5], r"sequence 1 has length 2.5"),
])
def test_bad_lengths_name_the_item(strategy, lengths, match):
    with pytest.raises(ValueError, match=match):
        make_plan(strategy, lengths, make_cost(nodes=1, gpus_per_node=2))


def test_overlong_policies_error_split_drop():
    cost = make_cost(nodes=1, gpus_per_node=2)
    lengths = [5000, 100, 200]
    with pytest.raises(ValueError,
                       match=r"sequence 0 has 5000 tokens, more than max_seqlen allows \(2000"):
        make_plan("zeppelin", lengths, cost, ZeppelinConfig(max_seqlen=2000))
    dropped = make_plan("zeppelin", lengths, cost, ZeppelinConfig(max_seqlen=2000, overlong="drop"))
    assert dropped.overlong.dropped_sequences == 1 and dropped.overlong.dropped_tokens == 5000
    assert sum(dropped.seqlens) == 300 and [s.seq for s in dropped.sources] == [1, 2]
    split = make_plan("zeppelin", lengths, cost, ZeppelinConfig(max_seqlen=2000, overlong="split"))
    split.validate()
    assert split.overlong.split_sequences == 1 and split.overlong.split_pieces == 3
    assert sum(split.seqlens) == 5300
    assert [s for s in split.sources if s.seq == 0] == [(0, 0, 1666), (0, 1666, 3333),
                                                        (0, 3333, 5000)]


def test_a_configured_capacity_bounds_documents_by_the_pool():
    cost = make_cost(nodes=1, gpus_per_node=2)
    with pytest.raises(ValueError,
                       match=r"more than the pool limit \(2 ranks x capacity_tokens_per_gpu 1000\) "
                             r"allows \(2000"):
        make_plan("zeppelin", [2500], cost, ZeppelinConfig(capacity_tokens_per_gpu=1000))


def test_every_document_dropped_is_an_error():
    with pytest.raises(ValueError, match="every sequence of the batch was dropped"):
        make_plan("zeppelin", [5000], make_cost(nodes=1, gpus_per_node=2),
                  ZeppelinConfig(max_seqlen=1000, overlong="drop"))


def test_capacity_too_small_for_the_batch():
    with pytest.raises(ValueError, match=r"batch has 4000 tokens but the pool holds at most 2000"):
        make_plan("zeppelin", [1000] * 4, make_cost(nodes=1, gpus_per_node=2),
                  ZeppelinConfig(capacity_tokens_per_gpu=1000))


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown strategy 'ring'.*'zeppelin'"):
        make_plan("ring", [10], make_cost())


def test_static_cp_splits_every_long_document_over_its_group():
    cost = make_cost(nodes=2, gpus_per_node=4)
    plan = make_plan("static-cp", [4096, 4096, 3, 100], cost, cp_size=4)
    plan.validate()
    assert [len(t.ring) for t in plan.tasks] == [4, 4, 1, 4]
    with pytest.raises(ValueError, match="cp_size=3 is invalid"):
        make_plan("static-cp", [10], cost, cp_size=3)


def test_megatron_hybrid_cp_uses_megatrons_scheduler_groups():
    cost = make_cost(nodes=1, gpus_per_node=8)
    lengths = [8000, 4000, 1000, 900, 800, 100, 50, 20]
    plan = make_plan("megatron-hybrid-cp", lengths, cost,
                     ZeppelinConfig(capacity_tokens_per_gpu=2000))
    plan.validate()
    # gpus_needed = 2^ceil(log2(s / 2000)): 8000 tokens need 4 ranks at least
    assert len(plan.tasks[0].ring) >= 4
    assert plan.linear == plan.attention


def test_linear_layout_moves_the_fewest_tokens_across_nodes():
    rng = random.Random(3)
    for trial in range(200):
        nodes, gpn = TOPOLOGIES[trial % len(TOPOLOGIES)]
        plan = make_plan("zeppelin", long_tailed(rng, rng.randint(1, 60), 1 << 15),
                         make_cost(nodes=nodes, gpus_per_node=gpn))
        att, lin = plan.attention_tokens(), plan.linear_tokens()
        minimum = sum(max(0, sum(att[r] for r in plan.topology.node_ranks(n)) -
                          sum(lin[r] for r in plan.topology.node_ranks(n))) for n in range(nodes))
        assert plan.remap_cross_node_tokens() == minimum


@pytest.mark.parametrize("strategy", ["zeppelin", "static-cp", "hybrid-dp"])
def test_a_plan_pickles_to_the_same_plan_of_the_same_types(strategy, planner_backend):
    import gc
    import pickle

    from megatron_zeppelin.plan import AttentionTask, Segment

    plan = make_plan(strategy, [30000, 2000, 700, 90, 5, 12000, 64, 64], make_cost(nodes=2))
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan
    assert {type(t) for t in copy.tasks} == {AttentionTask}
    assert {type(t.tier) for t in copy.tasks} == {Tier}
    assert {type(s) for segs in (copy.sources, *copy.linear) for s in segs} == {Segment}
    # the twin keeps the received tuples out of the receiving process's garbage collector
    segments = [s for segs in (copy.sources, *copy.linear) for s in segs]
    tracked = {gc.is_tracked(x) for x in (*copy.tasks, *segments)}
    assert {gc.is_tracked(t) for t in plan.tasks} == tracked  # as planned
    assert tracked == ({True} if planner_backend == "python" else {False})


def test_the_attention_layout_is_the_reference_layout(planner_backend):
    from megatron_zeppelin import plan as plan_module

    rng = random.Random(7)
    for trial in range(40):
        nodes, gpus = TOPOLOGIES[trial % len(TOPOLOGIES)]
        lengths = long_tailed(rng, rng.randint(1, 60), max_len=rng.choice([64, 1 << 15]))
        plan = make_plan(["zeppelin", "static-cp", "hybrid-dp"][trial % 3], lengths,
                         make_cost(nodes=nodes, gpus_per_node=gpus))
        args = (plan.ring_groups, plan.seqlens, plan.topology.world_size)
        assert plan_module.attention_layout_of(*args) == plan_module._attention_layout(*args)
