"""``zeppelin bench fidelity`` on full training steps (replay of logged micro-batches through the
simulator's step model) and ``zeppelin calibrate-sim``'s profile assembly; no timing asserted."""
import json
from types import SimpleNamespace

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench import calibrate_sim, contention, fidelity_train
from megatron_zeppelin.bench.fidelity_train import StrategyFidelity, format_report
from megatron_zeppelin.bench.train import parse_entry
from megatron_zeppelin.config import load_model
from megatron_zeppelin.sim.profile import load_sim_profile


def test_replay_plans_the_logged_micro_batches_with_the_runs_own_planner():
    from megatron_zeppelin.bench.train import run_flags
    from megatron_zeppelin.megatron.loop import args as train_args, train
    from megatron_zeppelin.sim.step_model import StepOptions, step_time

    logs = [{"seqlens": [[4096, 2000, 100, 3000, 7000], [16000, 384]]},
            {"seqlens": [[64] * 200, [4096] * 4]}]
    entry = parse_entry("static-cp:zeppelin-cp-size=2")
    simulated = fidelity_train.replay(entry, [], 4, logs, "cpu-2x2")
    args = train_args.parse_args(run_flags(entry, 4, []))
    layout = train_args.validate_args(args, 4, 4)
    cost = train.make_cost_model(args, train.model_spec(args), layout)
    planner = train.make_planner(args, cost, layout)
    plans = [planner(lengths) for lengths in logs[0]["seqlens"]]
    assert all(p.strategy.startswith("static-cp(cp=2)") for p in plans)
    options = StepOptions(overlap_grad_reduce=bool(args.overlap_grad_reduce))  # as trained
    expected = step_time(plans, cost, load_sim_profile("cpu-2x2"), options).seconds
    assert simulated[0] == pytest.approx(expected) and len(simulated) == 2
    assert simulated[0] != pytest.approx(simulated[1])


def test_report_marks_a_strategy_outside_the_target_and_round_trips_json():
    good = StrategyFidelity("zeppelin", [1.0, 1.1, 0.9], [1.05, 1.0, 1.0],
                            seqlens=[[[5, 3], [8]], [[8]], [[2, 2, 4]]])
    bad = StrategyFidelity("hydraulis", [1.0, 1.0], [1.3, 1.3])
    refused = StrategyFidelity("flexsp", refused="cannot run here")
    lines, ok = format_report([good, refused], (1.0, 1.0), 10.0, "cpu-2x2")
    assert ok and "not run: cannot run here" in "\n".join(lines)
    lines, ok = format_report([good, bad], (1.0, 1.0), 10.0, "cpu-2x2")
    assert not ok and "OUTSIDE" in lines[3] and "MISSED" in lines[-3]
    # the host factor: geomean(1.0 / 1.0, 1.0 / 1.3); relative errors -12% and +14%; the pair
    # is not ordered as measured (a measured tie, simulated 1.3x apart)
    factor = (1.0 / 1.3) ** 0.5
    assert f"host factor (geomean measured / simulated) {factor:.3f}" in lines[-2]
    assert f"zeppelin {factor - 1:+.1%}" in lines[-2]
    assert f"hydraulis {1.3 * factor - 1:+.1%}" in lines[-2]
    assert lines[-1].endswith("ordered as measured: 0 / 1")
    args = SimpleNamespace(sim_profile="cpu-2x2", iterations=6, warmup=2, rounds=2, extra=[])
    data = json.loads(json.dumps(fidelity_train.to_json([good, bad], (1.0, 2.0), args)))
    back = fidelity_train.rows_from_json(data)
    assert [r.error for r in back] == pytest.approx([good.error, bad.error])
    assert back[0].seqlens == good.seqlens and back[1].seqlens == []  # re-simulable offline


@pytest.mark.parametrize("argv, message", [
    (["--iterations", "0"], "--iterations=0 is invalid"),
    (["--iterations", "3", "--warmup", "3"], "--warmup=3 is invalid"),
    (["--sim-profile", "nowhere"], "unknown sim config 'nowhere'"),
    (["--calibrate", "x.yaml", "--resimulate", "f.json"],
     "--calibrate=x.yaml is invalid with --resimulate"),
    (["--calibrate", "x.yaml", "--sim-profile", "cpu-2x2-old"],
     "--calibrate=x.yaml is invalid with --sim-profile=cpu-2x2-old"),
])
def test_bench_fidelity_rejects_bad_flags_in_one_line(argv, message, capsys):
    assert cli.main(["bench", "fidelity", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_calibrated_figures_make_a_profile_that_loads_back(tmp_path):
    model = load_model("gpt-tiny")
    lengths = (16, 256, 4096)
    kernels = {"fwd": [1e-4, 1e-3, 0.2], "bwd": [2e-4, 2.5e-3, 0.5], "call": 5e-5,
               "gemm_tflops": 0.08, "gemm_call": 4e-6, "nongemm": (1e-4, 2e-7),
               "head": (5e-5, 1e-7), "optimizer": (2e-4, 3e-9), "compute_scale": 2.3,
               "shared_cores": 2.0}
    p2p = SimpleNamespace(gbyte_per_s=4.0, latency_us=50.0)
    profile = calibrate_sim.build_sim_profile("cpu-x", model, lengths, kernels, p2p,
                                              (60.0, 1.5), "test figures")
    assert dict(profile.attention_bwd_ratio)[4096] == pytest.approx(2.5)
    assert profile.nongemm_ns_per_token == pytest.approx(200.0)
    assert profile.compute_scale == 2.3 and profile.shared_cores == 2.0
    profile.to_yaml(tmp_path / "p.yaml", "test")
    assert load_sim_profile(tmp_path / "p.yaml") == profile


def test_the_non_gemm_kernels_run_forward_and_backward():
    model = load_model("gpt-tiny")
    calibrate_sim.nongemm_layer(calibrate_sim.layer_inputs(model, 32))
    calibrate_sim.head_kernels(calibrate_sim.head_inputs(model, 32))


def test_compute_sharing_is_measured_against_the_time_alone():
    """Two processes at once, against a time alone far below theirs (the scale is their median
    over it) and far above it (never below 1)."""
    model = load_model("gpt-tiny")
    scale, shared = contention.measure_compute_scale(model, 2, alone_s=1e-6, runs=2)
    assert len(shared) == 2 and all(t > 0 for t in shared)
    assert scale == pytest.approx(sorted(shared)[0] / 2e-6 + sorted(shared)[1] / 2e-6, rel=1e-9)
    assert contention.measure_compute_scale(model, 2, alone_s=1e3, runs=1)[0] == 1.0


def test_with_shared_cores_the_scale_is_beyond_the_fair_share():
    """2 processes on 1 core (as the simulator shares it): the scale is their median over the
    time alone, halved; one process alone is timed too."""
    model = load_model("gpt-tiny")
    scale, shared = contention.measure_compute_scale(model, 2, alone_s=1e-6, runs=2, cores=1.0)
    assert scale == pytest.approx((shared[0] + shared[1]) / 2 / 1e-6 / 2, rel=1e-9)
    assert contention.measure_one_rank(model, runs=2) > 0


def test_a_saved_run_is_resimulated_offline_under_another_profile(tmp_path, capsys):
    """--resimulate re-plans the saved micro-batches and prices them with the profile named
    (here with shared cores): no training; a file without the lengths is refused in one line."""
    from dataclasses import replace

    lengths = [[[4096, 2000, 100], [3000, 700]], [[64] * 50, [4096] * 2]]
    row = StrategyFidelity("static-cp:zeppelin-cp-size=2", [1.0, 1.2], [9.0, 9.0],
                           seqlens=lengths)
    args = SimpleNamespace(sim_profile="cpu-2x2", iterations=4, warmup=2, rounds=1, extra=[])
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(fidelity_train.to_json([row], (1.0, 1.0), args)))
    shared = replace(load_sim_profile("cpu-2x2"), shared_cores=1.0)
    shared.to_yaml(tmp_path / "shared.yaml", "test")
    alone = replace(shared, shared_cores=0.0)
    rows, _ = fidelity_train.resimulate(str(saved), str(tmp_path / "shared.yaml"))
    expected = fidelity_train.replay(parse_entry(row.label), [], 4,
                                     [{"seqlens": s} for s in lengths], shared)
    assert rows[0].simulated_s == pytest.approx(expected) and rows[0].measured_s == [1.0, 1.2]
    assert rows[0].simulated_s != pytest.approx(fidelity_train.replay(
        parse_entry(row.label), [], 4, [{"seqlens": s} for s in lengths], alone))
    cli.main(["bench", "fidelity", "--resimulate", str(saved)])
    assert "static-cp:zeppelin-cp-size=2" in capsys.readouterr().out
    old = tmp_path / "old.json"
    data = json.loads(saved.read_text())
    del data["strategies"][row.label]["seqlens"]
    old.write_text(json.dumps(data))
    assert cli.main(["bench", "fidelity", "--resimulate", str(old)]) == 2
    err = capsys.readouterr().err
    assert "has no micro-batch lengths" in err and err.count("\n") == 1
