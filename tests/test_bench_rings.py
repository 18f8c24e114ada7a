"""bench/rings.py: the table arithmetic (sync = ring round - the same compute with no
exchange - the exchange alone), one tiny real measurement that completes; calibrate-sim's
non-negative fit of its training residuals."""
import pytest

from megatron_zeppelin.bench.rings import LAYOUTS, _peers, measure, sync_rows


def test_ring_peers_follow_the_layouts():
    assert _peers(LAYOUTS["none"], 2) is None
    assert _peers(LAYOUTS["2x2"], 0) == (1, 1) and _peers(LAYOUTS["2x2"], 3) == (2, 2)
    assert _peers(LAYOUTS["1x4"], 0) == (1, 3) and _peers(LAYOUTS["1x4"], 3) == (0, 2)


def test_sync_is_the_round_beyond_the_compute_and_the_link():
    table = {("none", 0): [0.0], ("none", 10): [2.0],
             ("2x2", 0): [0.5], ("2x2", 10): [2.7],
             ("1x4", 0): [1.0], ("1x4", 10): [3.6, 3.4]}
    rows = {(r["layout"], r["units"]): r for r in sync_rows(table, 0.1)}
    assert rows[("2x2", 10)]["sync_s"] == pytest.approx(0.2)
    assert rows[("2x2", 10)]["link_s"] == pytest.approx(0.5)
    assert rows[("1x4", 10)]["sync_s"] == pytest.approx(0.5)
    assert (rows[("1x4", 10)]["sync_min_s"], rows[("1x4", 10)]["sync_max_s"]) == \
        pytest.approx((0.4, 0.6))
    assert rows[("1x4", 0)]["sync_s"] == pytest.approx(0.0)
    assert rows[("1x4", 10)]["ring_size"] == 4 and rows[("2x2", 10)]["compute_alone_s"] == 1.0


def test_a_tiny_measurement_runs_every_layout():
    table = measure((0, 1), rounds=2, repeats=1, nbytes=64)
    assert set(table) == {(name, n) for name in LAYOUTS for n in (0, 1)}
    assert all(len(v) == 1 and v[0] > 0 for v in table.values())


def test_the_training_fit_is_a_nonnegative_least_squares_line():
    from megatron_zeppelin.bench.calibrate_sim import nonnegative_fit

    rows = [(2.0 * a + 0.5 * b, a, b) for a, b in ((1, 0), (0, 1), (2, 3), (4, 1))]
    assert nonnegative_fit(rows) == pytest.approx((2.0, 0.5))
    # a negative unconstrained term is 0, the other fitted alone
    rows = [(2.0 * a - 0.5 * b, a, b) for a, b in ((1, 0), (0, 1), (2, 3), (4, 1))]
    a, b = nonnegative_fit(rows)
    assert b == 0.0 and a > 0
    assert nonnegative_fit([(-1.0, 1.0, 1.0), (-2.0, 2.0, 1.0)]) == (0.0, 0.0)


@pytest.mark.parametrize("argv, flag", [(["--units", "10,20"], "--units"),
                                        (["--units", "0,x"], "--units"),
                                        (["--rounds", "0"], "--rounds"),
                                        (["--bytes", "1"], "--bytes")])
def test_bad_flags_are_refused_naming_the_flag(argv, flag, capsys):
    from megatron_zeppelin.bench.rings import run

    with pytest.raises(SystemExit) as done:
        run(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert flag in err[-1] and "Traceback" not in "".join(err)
