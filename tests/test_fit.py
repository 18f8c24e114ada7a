"""The online-fitted hardware profile (fit.py): recovery of known coefficients from synthetic
measurements with outliers and a stalled rank, decisions from a wrong start, the profile
file, and the new estimate term (host work per ring step) in both planner backends."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from conftest import make_cost
from megatron_zeppelin import fit
from megatron_zeppelin.config import ZeppelinConfig, load_hardware
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_step
from megatron_zeppelin.plan import Plan, Tier
from megatron_zeppelin.planner import native
from megatron_zeppelin.planner.registry import make_plan
from megatron_zeppelin.sim.workloads import sample_batch

CONFIG = ZeppelinConfig(routing=False)  # inter-node links measured direct (module doc of fit)


def true_profile(cost: CostModel):
    """A 'real' profile unlike the shipped one: attention at 0.55x, GEMMs at 0.8x, links at
    the cluster's nominal figures with other latencies, host work per ring step 40 us."""
    hw, c = cost.hardware, cost.cluster
    return dataclasses.replace(
        hw, attention_tflops=tuple((n, t * 0.55) for n, t in hw.attention_tflops),
        gemm_tflops=hw.gemm_tflops * 0.8, attention_bwd_ratio=2.2,
        intra_gbyte_per_s=c.nvlink_gbyte_per_s * 0.7, intra_latency_us=6.0,
        inter_gbit_per_s=c.nic_gbit_per_s * 0.6, inter_latency_us=15.0,
        ring_step_overhead_us=40.0)


def wrong_profile(true):
    """2x wrong on attention, 3x on links, no host work per ring step."""
    return dataclasses.replace(
        true, attention_tflops=tuple((n, t * 2.0) for n, t in true.attention_tflops),
        intra_gbyte_per_s=true.intra_gbyte_per_s * 3.0,
        inter_gbit_per_s=true.inter_gbit_per_s / 3.0, ring_step_overhead_us=0.0)


def measure(plan: Plan, truth: CostModel, rng: random.Random, outliers: float = 0.1,
            stalled: int | None = None) -> list[fit.Measurements]:
    """What each rank's probe would record running ``plan`` on hardware ``truth``: per task
    one forward and one backward call, per ring task its exchanges and host work; 2% noise,
    ``outliers`` of the samples 3-8x slow, rank ``stalled`` 5x slow in everything."""
    hw, k = truth.hardware, truth.kernel
    per = [fit.Measurements() for _ in range(plan.topology.world_size)]

    def noisy(seconds: float, rank: int) -> float:
        seconds *= math.exp(rng.gauss(0.0, 0.02))
        if rng.random() < outliers:
            seconds *= rng.uniform(3.0, 8.0)
        return seconds * (5.0 if rank == stalled else 1.0)

    links = {Tier.INTRA: ("intra", k.nvlink_byte_per_s, k.nvlink_latency_s),
             Tier.INTER: ("inter", k.nic_byte_per_s, k.nic_latency_s)}
    for task in plan.tasks:
        g = len(task.ring)
        chunk = plan.seqlens[task.seq] / g
        flops = 2.0 * truth.heads * truth.model.head_dim * chunk * chunk
        fwd = flops / hw.attention_flops_per_s(chunk)
        for r in task.ring:
            m = per[r]
            tier = task.tier.name.lower()
            m.attention.append(("forward", chunk, flops, noisy(fwd, r), tier))
            m.attention.append(("backward", chunk, flops,
                                noisy(fwd * hw.attention_bwd_ratio, r), tier))
            if g == 1:
                continue
            name, rate, latency = links[task.tier]
            for nbytes in (k.kv_per_token * chunk, k.kv_per_token * chunk * k.bwd_bytes_factor):
                m.link.append((name, nbytes, noisy(nbytes / rate + latency, r)))
            m.ring_host.append(noisy(hw.ring_step_overhead_us * 1e-6 / 2, r))
    for r, tokens in enumerate(plan.linear_tokens()):
        per[r].linear.append((tokens, noisy(truth.linear_time(tokens), r)))
    return per


def ping(truth: CostModel, rng: random.Random) -> list[tuple[str, float, float]]:
    """A rank's active link samples at a refit (``runtime.probe.ping_links``), 2% noise."""
    k = truth.kernel
    return [(name, float(n), (n / rate + latency) * math.exp(rng.gauss(0.0, 0.02)))
            for name, rate, latency in (("intra", k.nvlink_byte_per_s, k.nvlink_latency_s),
                                        ("inter", k.nic_byte_per_s, k.nic_latency_s))
            for n in (1 << 14, 1 << 18, 1 << 21) for _ in range(3)]


def batches(cost: CostModel, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    world = cost.cluster.topology(cost.tp).world_size
    return [sample_batch("longtail" if i % 2 else "github", 8 * 1024 * world, rng)
            for i in range(count)]


@pytest.fixture(scope="module")
def setup():
    base = make_cost("llama-7b", "h200-8nic", nodes=2, gpus_per_node=4)
    truth = CostModel(base.model, base.cluster, true_profile(base), base.tp)
    return base, truth


def test_the_fit_recovers_known_coefficients_despite_outliers_and_a_stalled_rank(setup):
    base, truth = setup
    rng = random.Random(0)
    wrong = wrong_profile(truth.hardware)
    start = CostModel(base.model, base.cluster, wrong, base.tp)
    ranks = [fit.Measurements() for _ in range(8)]
    for lengths in batches(base, 6, seed=1):
        for options in ({}, {"cp_size": 8}):  # static CP over both nodes: INTER rings
            plan = make_plan("static-cp" if options else "zeppelin", lengths, start, CONFIG,
                             **options)
            for mine, new in zip(ranks, measure(plan, truth, rng, stalled=3)):
                mine.add(new)
    for mine in ranks:  # calls shorter than the table: their fixed cost is left out
        mine.attention.extend([("forward", 20.0, 1e6, 1e-3, "local")] * 50)
    got = fit.refit(ranks, wrong, start)
    want = truth.hardware
    for (n, a), (_, b) in zip(got.attention_tflops, want.attention_tflops):
        assert a == pytest.approx(b, rel=0.03), n
    for key in ("gemm_tflops", "attention_bwd_ratio", "intra_gbyte_per_s", "inter_gbit_per_s",
                "ring_step_overhead_us"):
        assert getattr(got, key) == pytest.approx(getattr(want, key), rel=0.03), key
    assert got.intra_latency_us == pytest.approx(want.intra_latency_us, rel=0.1, abs=0.5)
    assert got.inter_latency_us == pytest.approx(want.inter_latency_us, rel=0.1, abs=1.0)
    # the stalled rank alone, or nothing measured: the fit says so instead of guessing
    assert fit.refit([fit.Measurements()], wrong, start) == dataclasses.replace(
        wrong, source=got.source)


def test_work_seconds_on_shared_cores_are_seconds_while_every_rank_computes(setup):
    """On CPU the probe records a rank's own CPU seconds; with ``shared_by`` ranks per core the
    profile's figures are ``shared_by`` times those (every rank computing): rates halve,
    seconds per token double, the backward / forward ratio (a ratio) stays."""
    base, truth = setup
    rng = random.Random(7)
    one = fit.Measurements()
    for lengths in batches(base, 4, seed=2):
        for ranks in measure(make_plan("zeppelin", lengths, truth, CONFIG), truth, rng, 0.0):
            one.add(ranks)
    alone = fit.summarize(one, truth.hardware)
    shared = fit.summarize(one, dataclasses.replace(truth.hardware, shared_by=2.0))
    tables = len(truth.hardware.attention_tflops)
    assert sum(math.isfinite(a) for a in alone[:tables]) >= 3  # lengths measured
    for a, b in zip(alone[:tables], shared[:tables]):
        assert math.isnan(a) and math.isnan(b) or b == pytest.approx(a / 2.0)
    assert shared[tables] == pytest.approx(alone[tables])  # backward / forward
    assert shared[tables + 1] == pytest.approx(2.0 * alone[tables + 1])  # linear per token


def test_lengths_no_call_measured_are_pinged_and_fitted_with_the_calls(setup):
    """A plan that never attends at some length leaves it to the prior (a wrong start rating
    long calls slow keeps avoiding them): those lengths, up to the longest possible call, are
    what the refit pings, and the pings fit that length's rate."""
    _, truth = setup
    hw = truth.hardware
    lengths = [n for n, _ in hw.attention_tflops]
    short, long_ = lengths[0], lengths[-1]
    rate = hw.attention_flops_per_s(short)
    m = fit.Measurements()
    m.attention.extend([("forward", float(short), 1e9, 1e9 / rate, "local")] * fit.MIN_SAMPLES)
    m.attention.extend([("backward", float(long_), 1e9, 1.0, "local")] * 5)  # not a forward
    assert fit.unmeasured_lengths(m, hw, long_) == lengths[1:]
    assert fit.unmeasured_lengths(m, hw, lengths[1]) == lengths[1:2]  # none longer than that
    slow = hw.attention_flops_per_s(long_) / 3.0  # the truth at the longest length
    m.attention_ping.extend([("forward", float(long_), 1e9, 1e9 / slow, "local")] * 3)
    assert long_ not in fit.unmeasured_lengths(m, hw, long_)
    fitted = fit.summarize(m, hw)[:len(lengths)]
    assert fitted[-1] == pytest.approx(slow) and fitted[0] == pytest.approx(rate)


def test_a_run_started_2x_wrong_on_attention_and_3x_on_links_reaches_the_true_decisions(setup):
    """20 iterations of 2 micro-batches planned with the current profile, measured on the true
    hardware, refitted every 5 iterations; then the portfolio picks what the true profile
    picks on held-out batches (and did not before). A link believed too slow for any plan
    is measured by the active samples taken at each refit (``ping``)."""
    base, truth = setup
    rng = random.Random(2)
    profile = wrong_profile(truth.hardware)
    ranks = [fit.Measurements() for _ in range(8)]
    for iteration, lengths in enumerate(batches(base, 40, seed=3)):
        cost = CostModel(base.model, base.cluster, profile, base.tp)
        for mine, new in zip(ranks, measure(make_plan("zeppelin", lengths, cost, CONFIG),
                                            truth, rng)):
            mine.add(new)
        if iteration % 10 == 9:  # every 5 iterations of 2 micro-batches
            for mine in ranks:
                mine.link.extend(ping(truth, rng))
            profile = fit.refit(ranks, profile, cost)
    fitted = CostModel(base.model, base.cluster, profile, base.tp)
    wrong = CostModel(base.model, base.cluster, wrong_profile(truth.hardware), base.tp)

    def picks(cost):  # the portfolio's chosen candidate per batch
        return [make_plan("zeppelin", b, cost, CONFIG).candidate for b in batches(base, 8, 4)]

    assert picks(fitted) == picks(truth)
    for key in ("intra_gbyte_per_s", "inter_gbit_per_s"):  # both links, though no plan used
        assert getattr(profile, key) == pytest.approx(getattr(truth.hardware, key), rel=0.03)
    assert picks(wrong) != picks(truth)  # the test can fail: the wrong start decides otherwise


def test_the_profile_file_round_trips_and_the_planner_reads_it(setup, tmp_path):
    _, truth = setup
    path = tmp_path / "fitted.yaml"
    fit.save_profile(truth.hardware, str(path), "test")
    assert load_hardware(str(path)) == truth.hardware
    from megatron_zeppelin.cli import main
    assert main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "1",
                 "--hardware", str(path), "--global-batch-tokens", "256K"]) == 0


def test_a_bad_profile_field_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nkernel: fa2\ngemm_tflops: 100\nattention_tflops: {1024: 100}\n"
                    "inter_gbit_per_s: -3\n")
    from megatron_zeppelin.cli import main
    assert main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--hardware",
                 str(path), "--global-batch-tokens", "256K"]) == 2
    err = capsys.readouterr().err.strip()
    assert "inter_gbit_per_s" in err and "-3" in err and len(err.splitlines()) == 1


def test_host_work_per_ring_step_is_in_the_estimate_of_both_backends(setup, monkeypatch):
    base, truth = setup
    plans = {}
    for backend in native.BACKENDS:
        monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
        plans[backend] = [(p.tasks, p.linear, p.candidate, p.estimates) for p in
                          (make_plan(s, b, truth, ZeppelinConfig(routing=r))
                           for b in batches(base, 3, seed=5) for r in (False, True)
                           for s in ("zeppelin", "static-cp", "hybrid-dp"))]
    assert plans["python"] == plans["cpp"]
    none = CostModel(base.model, base.cluster,
                     dataclasses.replace(truth.hardware, ring_step_overhead_us=0.0), base.tp)
    plan = make_plan("static-cp", batches(base, 1, seed=6)[0], none, ZeppelinConfig())
    extra = estimate_step(plan, truth).attention_s - estimate_step(plan, none).attention_s
    steps = max(len(t.ring) for t in plan.tasks)  # a rank's rings: G steps each, at least one
    assert steps > 1 and extra >= steps * truth.kernel.ring_step_s * 0.999


def test_the_remap_host_work_is_fitted_where_plans_remapped_and_kept_elsewhere(setup):
    """Remap all-to-alls of 10-40 ms beyond their bytes (every 10th 300 ms, and a
    stalled rank) -> 4 x 25 ms per layer; with no remap measured the prior's term stays."""
    base, truth = setup
    prior = dataclasses.replace(truth.hardware, remap_overhead_us=100000.0)
    rng = random.Random(3)
    per_byte = 1e-9 / prior.intra_gbyte_per_s
    ranks = [fit.Measurements() for _ in range(4)]
    for rank, m in enumerate(ranks):
        for i in range(41):
            nbytes = rng.uniform(1e4, 1e7)
            host = 0.010 + 0.030 * i / 40 if i % 10 else 0.3  # every 10th: an outlier
            m.remap.append((nbytes, prior.intra_latency_us * 1e-6 + nbytes * per_byte
                            + host * (5.0 if rank == 2 else 1.0)))
    got = fit.refit(ranks, prior, truth)
    # the median (27.25 ms: 5 outliers of 41 shift it up a little); a mean would be 2x
    assert got.remap_overhead_us == pytest.approx(4 * 27_250, rel=1e-6)
    assert fit.refit([fit.Measurements()] * 4, prior, truth).remap_overhead_us == 100000.0


def test_a_ring_steps_cost_is_the_median_micro_batchs_mean_round_waits_included():
    prior = load_hardware("cpu")
    m = fit.Measurements()
    m.ring_host.extend([0.001] * 40)  # the per-round median: the tail left out
    # per micro-batch: most rounds quick, a few preempted (the tail is the cost); one stalled
    m.ring_rounds.extend([(0.001 * 9 + 0.041, 10), (0.001 * 9 + 0.041, 10),
                          (0.001 * 9 + 0.041, 10), (5.0, 10)])
    index = fit.summary_size(prior) - 3  # host per ring step, before the remap's and fixed
    assert fit.summarize(m, prior)[index] == pytest.approx(0.005)
    m.ring_rounds[:] = m.ring_rounds[:2]  # too few micro-batches: the per-round median
    assert fit.summarize(m, prior)[index] == pytest.approx(0.001)


def test_where_rounds_hold_the_waits_links_come_from_the_active_pings_only():
    prior = load_hardware("cpu")
    m = fit.Measurements()
    m.ping.extend(("intra", float(n), 1e-4 + n / 2e9) for n in (1 << 14, 1 << 18, 1 << 21))
    m.link.extend(("intra", float(n), 5e-3 + n / 1e8) for n in (1 << 12, 1 << 16, 1 << 20))
    n = len(prior.attention_tflops)
    latency = fit.summarize(m, prior)[n + 3]  # waited exchanges and pings together
    m.ring_rounds.extend([(0.01, 2)] * 3)  # the waits are priced per ring step: pings only
    assert fit.summarize(m, prior)[n + 2:n + 4] == pytest.approx([1 / 2e9, 1e-4])
    assert latency > 1e-3


@pytest.mark.parametrize("fixed", [0.0, 0.02])
def test_the_linear_rate_leaves_the_fixed_cost_per_micro_batch_out(fixed):
    """seconds = fixed + rate x tokens (+-3% noise), pad-only micro-batches at 0 tokens: the
    fitted rate is the slope, not seconds / tokens (which spreads the fixed cost over the
    tokens), and the fixed cost the intercept; a rank whose micro-batches all hold about the
    same tokens keeps the ratio (fixed cost included, so 0 fixed); the profile gets both."""
    from megatron_zeppelin.fit import _linear_line

    rate = 1e-4
    tokens = [0, 0, 40, 60, 100, 128, 128, 200, 256, 90, 30, 0]
    samples = [(n, (fixed + rate * n) * (1 + 0.03 * ((i * 7) % 5 - 2) / 2))
               for i, n in enumerate(tokens)]
    slope, intercept = _linear_line(samples, 1.0)
    assert slope == pytest.approx(rate, rel=0.05) and intercept == pytest.approx(fixed, abs=1e-3)
    assert _linear_line(samples, 2.0)[0] == pytest.approx(2 * rate, rel=0.05)
    same = [(n, fixed + rate * n) for n in (128, 127, 128, 120, 128)]
    assert _linear_line(same, 1.0) == (pytest.approx(fixed / 128 + rate, rel=0.01), 0.0)
    assert all(math.isnan(x) for x in _linear_line([(0, 0.02)] * 5, 1.0))  # no token to rate
    prior = load_hardware("cpu")
    measured = fit.Measurements(linear=samples)
    coefficients = fit.summarize(measured, dataclasses.replace(prior, shared_by=1.0))
    assert len(coefficients) == fit.summary_size(prior)
    profile = fit.to_profile(coefficients, prior, make_cost("llama-7b", "cpu-2x2", nodes=2))
    assert profile.linear_fixed_us == pytest.approx(1e6 * max(0.0, intercept))
