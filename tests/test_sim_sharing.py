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
