"""bench/sharing.py: the three models' predictions (the estimate's shared_peak is fair sharing,
the simulator's timeline agrees with it, the ideal schedule differs where the work is unequal),
bad --mixes refused in one line, and one tiny real measurement through the command."""
import pytest

from megatron_zeppelin.bench.sharing import predictions


def test_the_estimate_prices_fair_sharing_like_the_simulators_timeline():
    for counts in ((40, 20, 10, 10), (40, 0, 0, 0), (40, 30, 20, 10), (7, 7, 7, 7), (0, 3, 9, 1)):
        pred = predictions(counts, 0.01, 2.0)
        assert pred["estimate"] == pytest.approx(pred["fair"], rel=1e-9), counts
    pred = predictions((40, 10, 10, 10), 0.01, 2.0)  # 4 ranks on 2 cores, one long rank
    assert pred["ideal"] == pytest.approx(0.2)  # the long rank alone on a core all along
    assert pred["fair"] == pytest.approx(0.25)  # it shares a core until the others finish
    equal = predictions((20, 20, 20, 20), 0.01, 2.0)
    assert equal["estimate"] == equal["ideal"] == pytest.approx(0.2)  # as timed, all busy


@pytest.mark.parametrize("mixes", ["1,2,3,4", "2,2,2,2;1,2,3", "2,2,2,2;0,0,0,0", "a",
                                   "2,2,2,2;-1,2,3,4"])
def test_bad_mixes_are_one_line_naming_the_flag(mixes, capsys):
    from megatron_zeppelin.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", "sharing", "--mixes", mixes])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--mixes" in err[-1] and repr(mixes) in err[-1]


def test_a_tiny_measurement_prints_each_model(capsys):
    from megatron_zeppelin.bench.sharing import run

    figures = run(["--mixes", "1,1,1,1;2,1,0,0", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "2,1,0,0" in out and "fair: geometric-mean" in out
    assert [r["counts"] for r in figures["rows"]] == [(1, 1, 1, 1), (2, 1, 0, 0)]
    assert all(r["measured_s"] > 0 for r in figures["rows"])
