"""Megatron's pipeline schedules timed exactly (planner/pipeline.py) and micro-batch balancing
(planner/microbatches.py)."""
import random

import pytest

from megatron_zeppelin.planner.microbatches import (arrival_microbatches, balance_microbatches,
                                                    work_cost)
from megatron_zeppelin.planner.pipeline import pipeline_step, stage_order


def equal(m: int, pp: int, vpp: int, f: float, b: float, p2p: float = 0.0):
    """Every micro-batch f forward and b backward per stage, split over its vpp chunks."""
    n = pp * vpp
    return pipeline_step([[f / vpp] * n] * m, [[b / vpp] * n] * m, pp, vpp, p2p)


def spans(timeline, stage):
    return [("B" if s.backward else "F", s.microbatch, s.chunk, s.start, s.end)
            for s in timeline.steps if s.stage == stage]


def test_1f1b_matches_the_hand_timeline():
    t = equal(2, 2, 1, 1.0, 2.0)
    assert spans(t, 0) == [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("B", 0, 0, 4, 6),
                           ("B", 1, 0, 7, 9)]
    assert spans(t, 1) == [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 4), ("F", 1, 0, 4, 5),
                           ("B", 1, 0, 5, 7)]
    assert t.step_s == 9.0


def test_interleaved_matches_the_hand_timeline():
    t = equal(2, 2, 2, 2.0, 2.0)  # 1 s per chunk each way
    assert spans(t, 0) == [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 2), ("F", 0, 1, 2, 3),
                           ("F", 1, 1, 3, 4), ("B", 0, 1, 5, 6), ("B", 1, 1, 7, 8),
                           ("B", 0, 0, 8, 9), ("B", 1, 0, 9, 10)]
    assert spans(t, 1) == [("F", 0, 0, 1, 2), ("F", 1, 0, 2, 3), ("F", 0, 1, 3, 4),
                           ("B", 0, 1, 4, 5), ("F", 1, 1, 5, 6), ("B", 1, 1, 6, 7),
                           ("B", 0, 0, 7, 8), ("B", 1, 0, 8, 9)]
    assert t.step_s == 10.0


@pytest.mark.parametrize("m,pp", [(1, 1), (1, 4), (3, 4), (8, 4), (16, 8)])
def test_equal_microbatches_give_the_textbook_1f1b_bubble(m, pp):
    t = equal(m, pp, 1, 1.5, 3.0)
    assert t.step_s == pytest.approx((m + pp - 1) * 4.5)
    assert t.bubble == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("m,pp,vpp", [(4, 2, 2), (8, 4, 2), (16, 4, 4), (9, 3, 3), (4, 4, 2)])
def test_equal_microbatches_give_the_textbook_interleaved_bubble(m, pp, vpp):
    t = equal(m, pp, vpp, 1.0, 2.0)
    assert t.step_s == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / vpp)


def test_p2p_adds_one_transfer_per_hop_on_the_critical_path():
    # one micro-batch: forward through 4 stages (3 hops), backward back (3 hops)
    assert equal(1, 4, 1, 1.0, 2.0, p2p=0.5).step_s == pytest.approx(4 * 3.0 + 6 * 0.5)


def test_orders_are_megatrons():
    assert stage_order(0, 4, 6) == [(False, 0, 0), (False, 1, 0), (False, 2, 0),
                                    (False, 3, 0), (True, 0, 0), (False, 4, 0), (True, 1, 0),
                                    (False, 5, 0), (True, 2, 0), (True, 3, 0), (True, 4, 0),
                                    (True, 5, 0)]
    # every step of every stage exactly once, also when warm-up covers everything
    for pp, m, vpp in [(4, 2, 1), (2, 4, 2), (4, 8, 3)]:
        for s in range(pp):
            order = stage_order(s, pp, m, vpp)
            assert sorted(order) == sorted((b, i, c) for b in (False, True) for i in range(m)
                                           for c in range(vpp))


def test_unequal_microbatches_cost_more_than_their_average():
    fwd = [[1.0] * 4, [4.0] * 4, [1.0] * 4, [1.0] * 4]
    t = pipeline_step(fwd, [[2 * x for x in row] for row in fwd], 4)
    assert t.step_s > equal(4, 4, 1, 1.75, 3.5).step_s
    assert max(t.busy_s) == pytest.approx(7 * 3.0)


@pytest.mark.parametrize("m,pp,vpp,message", [
    (3, 2, 2, "multiple of --pp"), (0, 2, 1, "forward has 0 micro-batches"), (4, 1, 2, "--pp >= 2")])
def test_schedule_rejects_what_megatron_refuses(m, pp, vpp, message):
    with pytest.raises(ValueError, match=message):
        pipeline_step([[1.0] * (pp * vpp)] * m, [[1.0] * (pp * vpp)] * m, pp, vpp)


# --------------------------------------------------------------------------- balancing

def quadratic(ranks: int = 8):
    return work_cost(lambda n: n * n * 1e-9, lambda t: t * 2e-6, ranks)


def skewed(rng: random.Random, n: int) -> list[int]:
    return [min(32768, max(64, int(rng.paretovariate(1.1) * 300))) for _ in range(n)]


def pipeline_of(groups, lengths, cost, pp, vpp=1):
    c = [cost([lengths[i] for i in g]) for g in groups]
    n = pp * vpp
    return pipeline_step([[x / 3 / n] * n for x in c], [[x * 2 / 3 / n] * n for x in c],
                         pp, vpp).step_s


@pytest.mark.parametrize("seed", range(6))
def test_balancing_keeps_every_document_and_capacity(seed):
    rng = random.Random(seed)
    lengths = skewed(rng, rng.randint(20, 300))
    m = rng.choice([2, 4, 8])
    capacity = max(max(lengths), -(-sum(lengths) // m) * 5 // 4)
    groups = balance_microbatches(lengths, m, quadratic(), capacity=capacity, pp=4)
    assert len(groups) == m and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= capacity for g in groups)
    again = balance_microbatches(list(lengths), m, quadratic(), capacity=capacity, pp=4)
    assert again == groups


@pytest.mark.parametrize("seed", range(5))
def test_balancing_beats_arrival_order_on_skewed_batches(seed):
    rng = random.Random(100 + seed)
    lengths = skewed(rng, 400)
    cost = quadratic()
    for pp, vpp, m in [(4, 1, 8), (4, 2, 8)]:
        balanced = balance_microbatches(lengths, m, cost, pp=pp, vpp=vpp)
        arrival = arrival_microbatches(lengths, m)
        assert pipeline_of(balanced, lengths, cost, pp, vpp) < \
            0.95 * pipeline_of(arrival, lengths, cost, pp, vpp)


def test_a_tight_capacity_still_places_every_document():
    # 24 tokens in 3 micro-batches of 8: the cost-greedy start fails (5+3, 4+3, 5+2, then 2
    # finds no room); the first-fit start by tokens packs them exactly
    lengths = [5, 5, 4, 3, 3, 2, 2]
    groups = balance_microbatches(lengths, 3, quadratic(), capacity=8, pp=2)
    assert sorted(sum(lengths[i] for i in g) for g in groups) == [8, 8, 8]


def test_balancing_refuses_what_it_cannot_place():
    with pytest.raises(ValueError, match="document 1 of 9000 tokens exceeds the micro-batch "
                                         "capacity of 8192 tokens"):
        balance_microbatches([10, 9000, 20], 2, quadratic(), capacity=8192)
    with pytest.raises(ValueError, match="cannot place 3 documents"):
        balance_microbatches([5, 5, 5], 2, quadratic(), capacity=6)
    with pytest.raises(ValueError, match="2 documents cannot fill 3 micro-batches"):
        balance_microbatches([5, 5], 3, quadratic())
    with pytest.raises(ValueError, match="document 1 has length 0"):
        balance_microbatches([5, 0, 4], 2, quadratic())
