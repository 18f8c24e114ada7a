"""Megatron's pipeline schedules timed exactly (planner/pipeline.py) and micro-batch balancing
(planner/microbatches.py)."""
import random
from dataclasses import replace

import pytest

from megatron_zeppelin.planner.microbatches import (arrival_microbatches, balance_global_batch,
                                                    balance_microbatches, idle_share, work_cost)
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


def packed(rng: random.Random, count: int, capacity: int) -> list[list[int]]:
    """``count`` micro-batches as the training loop's packing fills them (each to
    ``capacity`` tokens, a document that does not fit starts the next) with long-tailed
    lengths from 1 token (many short documents: tight micro-batches)."""
    batches, current = [], []
    while len(batches) < count:
        n = min(capacity, max(1, int(rng.paretovariate(1.1) * 20)))
        if current and sum(current) + n > capacity:
            batches.append(current)
            current = []
        current.append(n)
    return batches


@pytest.mark.parametrize("seed", range(206, 214))  # 208, 212: a swap overfilled one before
def test_global_batch_balancing_keeps_documents_and_the_packing_capacity(seed):
    rng = random.Random(seed)
    capacity, m, pools = rng.choice([512, 1024, 4096]), rng.choice([2, 4]), rng.choice([1, 2, 3])
    arrival = packed(rng, m * pools, capacity)
    lengths = [n for batch in arrival for n in batch]
    dealt = balance_global_batch(lengths, m, pools, quadratic(), capacity=capacity, pp=2)
    assert len(dealt) == pools and all(len(pool) == m and all(pool) for pool in dealt)
    assert sorted(i for pool in dealt for g in pool for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= capacity for pool in dealt for g in pool)
    assert balance_global_batch(list(lengths), m, pools, quadratic(), capacity=capacity,
                                pp=2) == dealt  # deterministic
    if pools == 1:
        assert dealt[0] == balance_microbatches(lengths, m, quadratic(), capacity=capacity,
                                                pp=2)
    # given the packing's grouping, never a longer estimated step than it (seed 208: the
    # balanced micro-batches alone would be 0.3% longer; the packing is kept)
    starts = [sum(map(len, arrival[:k])) for k in range(len(arrival))]
    mine = [[list(range(starts[k], starts[k] + len(arrival[k])))
             for k in range(p, m * pools, pools)] for p in range(pools)]
    kept = balance_global_batch(lengths, m, pools, quadratic(), capacity=capacity, pp=2,
                                arrival=mine)
    cost = quadratic()

    def step(grouping):
        return idle_share([[cost([lengths[i] for i in g]) for g in pool] for pool in grouping],
                          2)[0]

    assert kept in (dealt, mine) and step(kept) <= min(step(dealt), step(mine))


def test_idle_share_counts_the_bubble_and_the_slowest_pool():
    # 1F1B, 2 stages, 2 micro-batches of 3 s (the whole model: per stage 0.5 s forward, 1 s
    # backward): step (2 + 1) x 1.5 s, each stage busy 3 s; a second pool half as loaded
    # (busy 1.5 s per stage) waits for the first
    assert idle_share([[3.0, 3.0]], 2) == (4.5, pytest.approx(1 / 3))
    step, idle = idle_share([[3.0, 3.0], [1.5, 1.5]], 2)
    assert step == 4.5 and idle == pytest.approx(1 - (6 + 3) / (4.5 * 4))


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
    with pytest.raises(ValueError, match="2 documents cannot fill num_microbatches=3"):
        balance_microbatches([5, 5], 3, quadratic())
    with pytest.raises(ValueError, match="document 1 has length 0"):
        balance_microbatches([5, 0, 4], 2, quadratic())


# --------------------------------------------------------------------------- pricing and CLI

from megatron_zeppelin import cli  # noqa: E402
from megatron_zeppelin.config import ConfigError, PipelineSpec, ZeppelinConfig  # noqa: E402
from megatron_zeppelin.planner import STRATEGIES  # noqa: E402
from megatron_zeppelin.planner.pipeline_cost import (MicrobatchCost, estimate_pipeline,  # noqa
                                                     price, stage_of)
from megatron_zeppelin.sim.pipeline import run_pipeline_setting, simulate_pipeline  # noqa
from megatron_zeppelin.sim.sweep import (Setting, cap_candidates, resolve_variants,  # noqa
                                         sample_batches, setting_cost)

from conftest import make_cost  # noqa: E402


def test_a_stage_holds_its_share_of_layers_and_gpus():
    cost = make_cost("llama-7b", "h200-8nic", nodes=4)
    stage = stage_of(cost, PipelineSpec(pp=2, vpp=2))
    assert stage.cost.model.num_layers == 16 and stage.cost.cluster.world_size == 16
    assert stage.ranks == 16 and 0 < stage.head_share < 0.5
    assert stage.p2p_byte_per_s == cost.cluster.nic_byte_per_s * 8 / 8  # one NIC per GPU
    inside = stage_of(make_cost("llama-7b", "h200-8nic", nodes=1), PipelineSpec(pp=4))
    assert inside.cost.cluster.world_size == 2 and \
        inside.p2p_byte_per_s == cost.cluster.nvlink_byte_per_s
    with pytest.raises(ConfigError, match="--pp=8 is invalid: expected a divisor of the 4 "):
        stage_of(make_cost("llama-7b", "h200-8nic", nodes=1, gpus_per_node=4), PipelineSpec(pp=8))


def test_price_is_the_schedule_plus_the_head_and_the_exposed_all_reduce():
    stage = stage_of(make_cost("gpt-tiny", "cpu-2x2", nodes=2), PipelineSpec(pp=2))
    costs = [MicrobatchCost(1.0, 2.0, 0.0, 0.0, 0.0)] * 4
    result = price(stage, [[0], [1], [2], [3]], costs)
    assert result.timeline.step_s == pytest.approx((4 + 1) * 3.0)
    assert result.step_s == pytest.approx(result.timeline.step_s + result.grad_s)
    headed = price(stage, [[0], [1], [2], [3]], [MicrobatchCost(1.0, 2.0, 0.5, 1.0, 0.0)] * 4)
    assert headed.timeline.busy_s == (pytest.approx(12.0), pytest.approx(18.0))


def test_the_estimate_plans_every_document_once_per_stage():
    cost = make_cost("llama-7b", "h200-8nic", nodes=2)
    rng = random.Random(3)
    lengths = skewed(rng, 120)
    spec = PipelineSpec(pp=2, microbatches=4)
    result = estimate_pipeline(lengths, STRATEGIES["zeppelin"](), cost, ZeppelinConfig(), spec)
    assert sorted(i for g in result.microbatches for i in g) == list(range(len(lengths)))
    assert result.step_s >= max(result.timeline.busy_s) > 0
    assert len(result.timeline.steps) == 2 * 4 * 2


def test_the_simulated_sweep_runs_every_variant_and_order():
    setting = Setting("llama-7b", "h200-8nic", 2, "arxiv", tokens=256 * 1024, batches=1)
    labels = ["zeppelin", "static-cp", "hybrid-dp-tuned", "flexsp"]
    result = run_pipeline_setting(setting, resolve_variants(labels), ZeppelinConfig(),
                                  PipelineSpec(pp=2, vpp=2, microbatches=4),
                                  ("balanced", "arrival"))
    assert {(r.label, r.order) for r in result.rows} == {
        (v, o) for v in labels for o in ("balanced", "arrival")} and not result.skipped
    assert all(0.0 <= r.bubble < 1.0 and r.step_s > 0 for r in result.rows)
    assert all(bool(r.note) == (r.label == "hybrid-dp-tuned") for r in result.rows)


@pytest.mark.parametrize("workload,pp,tokens,chosen", [
    ("github", 4, 512 * 1024, "default"), ("longtail", 2, 1 << 20, "cap"),
    ("magi", 2, 1 << 20, "cap")])
def test_a_tuned_peer_under_pp_runs_at_its_best_cap(workload, pp, tokens, chosen):
    """The cap is swept over one stage's ranks and scored by the pipeline's step; the row is
    the step at the cap its note names (or at the default, per micro-batch, when that is
    faster), no slower than the untuned strategy nor any cap swept."""
    setting = Setting("llama-7b", "a800-4nic", 4, workload, tokens=tokens, batches=2)
    spec = PipelineSpec(pp=pp, microbatches=2 * pp)
    tuned, plain = resolve_variants(["hybrid-dp-tuned", "hybrid-dp"])
    result = run_pipeline_setting(setting, [tuned, plain], ZeppelinConfig(), spec)
    row, untuned = result.get(tuned.label, "balanced"), result.get(plain.label, "balanced")
    assert row.step_s <= untuned.step_s * (1 + 1e-12)
    swept = [float(x.split(": ")[1].split()[0]) for x in
             row.note.split("swept ")[1].rstrip(")").split(", ") if "no fit" not in x]
    assert row.step_s <= min(swept) * (1 + 5e-3)  # the note rounds to 3 digits
    assert row.note.split()[0] == chosen
    if chosen == "default":
        assert row.step_s == untuned.step_s
        return
    assert row.step_s < untuned.step_s
    cost = setting_cost(setting)
    batches = sample_batches(setting, cost)
    cap = int(row.note.split()[1])
    assert cap in cap_candidates(batches, stage_of(cost, spec).ranks)
    at = replace(tuned, strategy=replace(tuned.strategy, max_seqlen_per_rank=cap))
    steps = [simulate_pipeline(b, at, cost, ZeppelinConfig(), spec).step_s for b in batches]
    assert row.step_s == pytest.approx(sum(steps) / len(steps), rel=1e-12)


PLAN = ["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
        "--strategy", "zeppelin", "--global-batch-tokens", "256K"]


@pytest.mark.parametrize("argv,message", [
    (["--pp", "3"], "--pp=3 is invalid: expected a divisor of num_layers=32 (llama-7b)"),
    (["--pp", "2", "--vpp", "3"], "--vpp=3 is invalid: expected pp x vpp dividing num_layers"),
    (["--pp", "0"], "--pp=0 is invalid: expected a positive integer"),
    (["--vpp", "2"], "--vpp=2 is invalid: expected 1 when --pp is 1"),
    (["--pp", "2", "--vpp", "2", "--microbatches", "5"], "--microbatches=5 is invalid: "
     "expected a multiple of --pp=2"),
    (["--microbatches", "4"], "--microbatches and --microbatch-order apply only with --pp"),
    (["--pp", "32"], "--pp=32 is invalid: expected a divisor of the 16 ranks"),
    (["--pp", "2", "--microbatch-order", "random"], "invalid choice: 'random'"),
    (["--pp", "2", "--microbatches", "4096"], "cannot fill --microbatches=4096"),
])
def test_plan_cli_rejects_bad_pipeline_flags(argv, message, capsys):
    assert cli.main(PLAN + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_simulate_cli_rejects_bad_pipeline_flags(capsys):
    base = ["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
            "--no-progress", "--strategies", "zeppelin", "--baseline", "zeppelin"]
    assert cli.main(base + ["--pp", "3"]) == 2
    assert "--pp=3 is invalid" in capsys.readouterr().err
    assert cli.main(base + ["--pp", "2", "--json"]) == 2
    assert "--json are not available with --pp" in capsys.readouterr().err


def test_plan_cli_prints_the_pipeline_estimate(capsys):
    assert cli.main(PLAN + ["--pp", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "PP=2 VPP=1" in out and "4 micro-batches (balanced)" in out and "zeppelin" in out


@pytest.mark.parametrize("seed", range(4))
def test_what_a_packing_loader_placed_is_always_placed(seed):
    """Documents packed greedily in arrival order into M micro-batches of ``capacity`` tokens
    (megatron/loop/corpus.py's MicroBatchSampler) are placed again, within the capacity."""
    rng = random.Random(seed)
    capacity, m = 4096, 8
    lengths, held, runs = [], 0, 1
    while True:
        n = min(capacity, max(1, int(rng.paretovariate(1.2) * 200)))
        if held + n > capacity:
            if runs == m:
                break
            runs, held = runs + 1, 0
        lengths.append(n)
        held += n
    groups = balance_microbatches(lengths, m, quadratic(), capacity=capacity, pp=4)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g and sum(lengths[i] for i in g) <= capacity for g in groups)
