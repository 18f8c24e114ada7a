"""The simulator's processor-sharing timeline (sim/sharing.py) against hand-computed cases."""

import pytest

from megatron_zeppelin.sim.sharing import shared_finish


def test_two_ranks_one_core_share_then_run_alone():
    # 0..2: both at rate 1/2 -> job 0 (1 s) done at 2; job 1 has 1 s left alone -> 3
    assert shared_finish([0.0, 0.0], [1.0, 2.0], cores=1) == pytest.approx([2.0, 3.0], abs=1e-12)


def test_late_release_slows_the_running_job():
    # job 0 alone 0..0.5 (0.5 left), both at 1/2 until 1.5; job 1 then 0.5 left alone -> 2.0
    assert shared_finish([0.0, 0.5], [1.0, 1.0], cores=1) == pytest.approx([1.5, 2.0], abs=1e-12)


def test_four_ranks_two_cores_and_idle_gap():
    # 4 jobs of 1 s on 2 cores: rate 1/2 -> all end at 2; a job released after them runs alone
    assert shared_finish([0, 0, 0, 0, 5.0], [1, 1, 1, 1, 1], cores=2) == \
        pytest.approx([2, 2, 2, 2, 6.0], abs=1e-12)


def test_one_core_per_rank_is_release_plus_work_exactly():
    release, work = [0.1, 0.3, 0.7], [0.25, 1.5, 0.125]
    assert shared_finish(release, work, cores=3) == [r + w for r, w in zip(release, work)]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="cores"):
        shared_finish([0.0], [1.0], cores=0)
    with pytest.raises(ValueError, match="work"):
        shared_finish([0.0], [-1.0], cores=1)


# ---------------------------------------------------------------- wired into the step model
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

from conftest import make_cost  # noqa: E402
from megatron_zeppelin.planner import make_plan  # noqa: E402
from megatron_zeppelin.sim.profile import load_sim_profile  # noqa: E402
from megatron_zeppelin.sim.simulator import lower_bound  # noqa: E402
from megatron_zeppelin.sim.step_model import linear_parts, shared_ends, step_time  # noqa: E402

GOLDEN_LENGTHS = [30000, 9000, 4000, 2500] + [500] * 40
# step_time on the GPU profiles before shared cores were modelled (commit a7af33e)
GOLDEN = {("h200-8nic", "zeppelin"): 1.0880525839120816,
          ("h200-8nic", "static-cp"): 1.6072490585927905,
          ("h800-8nic", "zeppelin"): 1.1090062384977768,
          ("h800-8nic", "static-cp"): 1.6491563677641805,
          ("h200-8nic", "lower_bound"): 0.3849789459504105}


@pytest.mark.parametrize("cluster,strategy", sorted(GOLDEN))
def test_gpu_profiles_are_bit_identical_to_before(cluster, strategy):
    cost, profile = make_cost(cluster=cluster, nodes=2), load_sim_profile(cluster)
    assert profile.shared_cores == 0 and profile.fair_share(16) == 1.0
    if strategy == "lower_bound":
        got = lower_bound(GOLDEN_LENGTHS, cost, 16, profile)
    else:
        plan = make_plan(strategy, GOLDEN_LENGTHS, cost,
                         **({"cp_size": 4} if strategy == "static-cp" else {}))
        got = step_time([plan], cost, profile).seconds
    assert got == GOLDEN[(cluster, strategy)]
    # as many cores as ranks: no sharing either
    if strategy != "lower_bound":
        assert step_time([plan], cost, replace(profile, shared_cores=16)).seconds == got


def test_shared_ends_two_ranks_one_core_by_hand():
    profile = replace(load_sim_profile("h200-8nic"), shared_cores=1.0)
    # compute 2 s and 1 s: both at 1/2 until 2 (rank 1 done), rank 0 alone 2..3; then each
    # rank's other time (1 s) follows
    assert shared_ends(np.asarray([3.0, 2.0]), np.asarray([2.0, 1.0]), profile).tolist() == \
        pytest.approx([4.0, 3.0], abs=1e-12)
    # 2 ranks on 2 cores: unchanged (the very array)
    two = replace(profile, shared_cores=2.0)
    ends = np.asarray([3.0, 2.0])
    assert shared_ends(ends, np.asarray([2.0, 1.0]), two) is ends


def test_idle_ranks_give_their_cores_to_the_busy_one():
    """On 2 cores, a static CP 1 batch with one long sequence (one rank busy, three nearly
    idle) costs less than a lockstep CP 4 ring over the same work, relative to no sharing."""
    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    base = replace(load_sim_profile("cpu-2x2"), shared_cores=0.0)
    shared = replace(base, shared_cores=2.0)
    lengths = [4096, 64, 64, 64]
    local = make_plan("static-cp", lengths, cost, cp_size=1)
    ring = make_plan("static-cp", lengths, cost, cp_size=4)
    slow_local = step_time([local], cost, shared).seconds / step_time([local], cost, base).seconds
    slow_ring = step_time([ring], cost, shared).seconds / step_time([ring], cost, base).seconds
    assert 1.0 < slow_local < slow_ring < 2.0
    # the busiest rank's compute at least doubles its share when all 4 compute equally
    tokens = np.full(4, 1000.0)
    lin, compute = linear_parts(tokens, cost, base)
    assert np.all(shared_ends(lin, compute, shared) - lin == pytest.approx(compute, rel=1e-9))


def test_optimizer_and_lower_bound_pay_the_fair_share():
    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    base = replace(load_sim_profile("cpu-2x2"), shared_cores=0.0)
    plan = make_plan("static-cp", [512] * 4, cost, cp_size=1)
    host = base.step_host_us * 1e-6 + base.micro_batch_host_us * 1e-6
    opt = step_time([plan], cost, base).optimizer_s - host
    shared_opt = step_time([plan], cost, replace(base, shared_cores=1.0)).optimizer_s - host
    assert shared_opt == pytest.approx(4 * opt, rel=1e-12)
    fixed = lower_bound([], cost, 4, base)
    lin, compute = linear_parts(np.asarray([2048.0, 0.0]), cost, base)
    host = (lin[0] - compute[0] - lin[1] + compute[1]) / 4  # per-token work off the cores
    assert host > 0
    assert lower_bound([512] * 4, cost, 4, replace(base, shared_cores=2.0)) - fixed - host == \
        pytest.approx(2 * (lower_bound([512] * 4, cost, 4, base) - fixed - host), rel=1e-9)


def test_a_negative_core_count_is_refused_naming_the_key():
    with pytest.raises(Exception, match="shared_cores"):
        replace(load_sim_profile("cpu-2x2"), shared_cores=-1.0)


def test_sweep_names_the_portfolios_pick_by_plan_name():
    """The simulator's tables count zeppelin's picks by ``Plan.name`` (a ``+remap`` candidate
    that remaps nothing is named without the suffix), not by the candidate key."""
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.sim.sweep import plan_and_simulate, resolve_variants

    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    variant, = resolve_variants(["zeppelin"])
    for lengths in ([3000, 200, 200, 200], [1000] * 4, GOLDEN_LENGTHS[:8]):
        run = plan_and_simulate(variant, lengths, cost, ZeppelinConfig())
        plan = variant.strategy.plan(lengths, cost, ZeppelinConfig(routing=variant.routing,
                                                                   remap=variant.remap))
        assert plan.candidate and run.candidate == plan.name
