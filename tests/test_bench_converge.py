"""``zeppelin bench converge``: the wrong profile, the per-iteration agreement of two runs'
picks, the windows and the verdict on synthetic logs; bad flags refused in one line. The real
three-run measurement is a benchmark (minutes), not a test."""
from __future__ import annotations

import argparse

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench.converge import (agreement, converged_at, report, windows,
                                              wrong_profile)
from megatron_zeppelin.config import load_hardware


def log(iteration, names, lengths=None, seconds=1.0, estimated=0.5):
    return {"iteration": iteration, "plan_names": list(names), "seconds": seconds,
            "estimated_s": estimated, "seqlens": lengths or [[iteration, 7]] * len(names)}


def test_the_wrong_profile_is_wrong_as_stated():
    true = load_hardware("cpu")
    wrong = wrong_profile(true, 2.0, 3.0)
    assert [t for _, t in wrong.attention_tflops] == [2.0 * t for _, t in true.attention_tflops]
    assert wrong.intra_gbyte_per_s == pytest.approx(3.0 * true.intra_gbyte_per_s)
    assert wrong.inter_gbit_per_s == pytest.approx(true.inter_gbit_per_s / 3.0)
    assert wrong.ring_step_overhead_us == 0.0 and true.ring_step_overhead_us > 0.0
    assert wrong.shared_by == true.shared_by and wrong.gemm_tflops == true.gemm_tflops


def test_agreement_counts_equal_picks_per_iteration_and_needs_the_same_micro_batches():
    a = [log(1, ["hierarchical", "hybrid-dp"]), log(2, ["hybrid-dp", "hybrid-dp"])]
    b = [log(1, ["hierarchical", "static-cp(cp=1)"]), log(2, ["hybrid-dp", "hybrid-dp"])]
    assert agreement(a, b) == [0.5, 1.0]
    other = [log(1, ["hierarchical", "hybrid-dp"], [[9], [9]])]
    with pytest.raises(ValueError, match="iteration 1: the runs planned other micro-batches"):
        agreement(a, other)


def test_windows_and_the_iteration_of_convergence(capsys):
    right = [log(i, ["h", "h"]) for i in range(1, 7)]
    again = [log(i, ["h", "h" if i != 6 else "d"]) for i in range(1, 7)]
    wrong = [log(i, ["x", "x"] if i <= 2 else ["h", "h"], seconds=2.0) for i in range(1, 7)]
    rows = windows({"right": right, "right-again": again, "wrong": wrong}, 2)
    assert [(r["first"], r["last"]) for r in rows] == [(1, 2), (3, 4), (5, 6)]
    assert [r["wrong"] for r in rows] == [0.0, 1.0, pytest.approx(0.875)]
    assert [r["floor"] for r in rows] == [1.0, 1.0, 0.75]
    assert rows[0]["ratio_wrong"] == 4.0 and rows[0]["ratio_right"] == 2.0
    assert converged_at(rows, 0.1) == 3
    assert converged_at(rows[:1], 0.1) is None
    # agreement lost again in a later window restarts the count
    assert converged_at([{"wrong": 1.0, "floor": 1.0, "first": 1},
                         {"wrong": 0.5, "floor": 1.0, "first": 3},
                         {"wrong": 1.0, "floor": 1.0, "first": 5}], 0.1) == 5
    report(rows, argparse.Namespace(tolerance=0.1, json=""))  # no logs kept: --json off
    out = capsys.readouterr().out
    assert "from iteration 3" in out and "met" in out and "cannot show" not in out


def test_bad_flags_are_one_line():
    for flags, name in ((["--interval", "0"], "--interval"), (["--iterations", "5"],
                        "--iterations"), (["--links", "0"], "--links"),
                        (["--tolerance", "1"], "--tolerance")):
        assert cli.main(["bench", "converge", *flags]) == 2, name
