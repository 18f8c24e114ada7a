"""Bad input to ``zeppelin bench ...``, ``zeppelin calibrate`` and ``zeppelin calibrate-sim`` is
refused before any work: one line on stderr naming the flag (or file) and what is allowed,
exit status 2, nothing on stdout, no traceback. Every case here returns within seconds: the
refusal comes before any process starts or anything is measured."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench import fidelity_train


def refused(argv: list[str], capsys) -> str:
    """The one line ``zeppelin argv`` printed on stderr, after checking that it exited 2
    (returned, or ``SystemExit`` from a target that parses its own flags) and printed
    nothing else."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, (argv, out, err)
    assert err.startswith("zeppelin: error: ")
    return err


# 1. the rendezvous port
@pytest.mark.parametrize("argv, words", [
    (["bench", "train", "--port", "99999"], ["--port", "'99999'", "1..65535"]),
    (["bench", "train", "--port", "0"], ["--port", "'0'", "1..65535"]),
    (["bench", "train", "--port", "65535"], ["--port=65535", "at most 65533"]),
    (["bench", "fidelity", "--port", "-1"], ["--port", "1..65535"]),
    (["bench", "online", "--port", "70000"], ["--port", "1..65535"]),
    (["bench", "converge", "--port", "x"], ["--port", "'x'"]),
    (["bench", "remap", "--port", "65536"], ["--port", "1..65535"]),
    (["bench", "overhead", "--port", "65536"], ["--port", "1..65535"]),
    (["bench", "decisions", "--port", "70000"], ["--port", "0..65535 (0: a free one)"]),
])
def test_ports_out_of_range_are_refused_at_parse_time(argv, words, capsys):
    err = refused(argv, capsys)
    assert all(w in err for w in words), err


# 2. too few iterations for the learning-rate warm-up of the training YAML
@pytest.mark.parametrize("target", ["train", "fidelity", "remap", "overhead"])
def test_iterations_below_the_lr_warmup_name_iterations_and_the_minimum(target, capsys):
    err = refused(["bench", target, "--iterations", "2", "--warmup", "0"], capsys)
    assert "--iterations=2 is invalid: expected an integer >= 3" in err
    assert "--lr-warmup-iters=" not in err and "--lr-decay-iters" not in err


def test_bench_train_iterations_alone_names_iterations(capsys):
    err = refused(["bench", "train", "--iterations", "2"], capsys)
    assert "--iterations=2 is invalid: expected an integer >= 3" in err


def test_flags_the_runs_set_themselves_are_refused_after_the_separator(capsys):
    err = refused(["bench", "train", "--", "--train-iters", "4"], capsys)
    assert "--train-iters" in err and "--iterations" in err


# 3, 5. files to write: the folder must exist, checked before any work
@pytest.mark.parametrize("argv, flag", [
    (["bench", "train", "--strategies", "zeppelin", "--iterations", "3", "--warmup", "0",
      "--rounds", "1", "--json", "MISSING/x.json"], "--json"),
    (["bench", "fidelity", "--json", "MISSING/x.json"], "--json"),
    (["bench", "fidelity", "--calibrate", "MISSING/p.yaml"], "--calibrate"),
    (["bench", "remap", "--json", "MISSING/x.json"], "--json"),
    (["bench", "overhead", "--json", "MISSING/x.json"], "--json"),
    (["bench", "converge", "--json", "MISSING/x.json"], "--json"),
    (["bench", "decisions", "--json", "MISSING/x.json"], "--json"),
    (["bench", "online", "--profile-out", "MISSING/p.yaml"], "--profile-out"),
    (["bench", "kernels", "--json", "MISSING/x.json"], "--json"),
    (["bench", "rings", "--json", "MISSING/x.json"], "--json"),
    (["bench", "sharing", "--json", "MISSING/x.json"], "--json"),
    (["calibrate", "--output", "MISSING/x.yaml"], "--output"),
    (["calibrate", "--output", "/proc/fuzzB/x.yaml"], "--output"),
    (["calibrate", "--cluster-output", "MISSING/c.yaml"], "--cluster-output"),
    (["calibrate-sim", "--output", "MISSING/x.yaml"], "--output"),
    (["bench", "train", "--json", "DIR"], "--json"),
])
def test_output_files_in_a_missing_folder_are_refused_naming_the_flag(argv, flag, tmp_path,
                                                                      capsys):
    argv = [a.replace("MISSING", str(tmp_path / "missing")).replace("DIR", str(tmp_path))
            for a in argv]
    err = refused(argv, capsys)
    assert f"argument {flag}:" in err and ("does not exist" in err or "is a folder" in err)


@pytest.mark.parametrize("strategies", ["static,zeppelin",
                                        "hybrid-dp:max-seqlen-per-dp-cp-rank=512"])
def test_tune_without_a_knob_left_to_tune_is_refused(strategies, capsys):
    """--tune would run nothing and say nothing: refused before any run."""
    err = refused(["bench", "train", "--tune", "--strategies", strategies, "--iterations", "3",
                   "--warmup", "0", "--rounds", "1"], capsys)
    assert f"--tune is invalid with --strategies {strategies}: none of them has a knob" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv, flag", [
    (["bench", "train", "--strategies", "zeppelin", "--iterations", "3", "--warmup", "0",
      "--rounds", "1", "--json", "/proc/x.json"], "--json"),
    (["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2", "--plot",
      "/proc/x.png"], "--plot"),
    (["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
      "--batches", "1", "--plot", "/proc/x.png"], "--plot"),
    (["calibrate", "--output", "/proc/x.yaml"], "--output"),
])
def test_output_files_where_no_file_can_be_made_are_refused_before_any_work(argv, flag,
                                                                            capsys):
    """/proc lets root pass the permission check, yet no file can be made there."""
    err = refused(argv, capsys)
    assert f"argument {flag}:" in err and "'/proc' is not writable" in err, err


def test_calibrate_refuses_existing_outputs_and_one_file_for_both(tmp_path, capsys):
    existing = tmp_path / "sim.yaml"
    existing.write_text("keep me")
    err = refused(["calibrate-sim", "--output", str(existing)], capsys)
    assert f"--output={str(existing)!r} exists: pass --force" in err
    same = str(tmp_path / "both.yaml")
    err = refused(["calibrate", "--output", same, "--cluster-output", same], capsys)
    assert "--cluster-output=" in err and "it is --output" in err
    assert existing.read_text() == "keep me"


# 4. signs and ranges of numeric flags
@pytest.mark.parametrize("argv, flag", [
    (["bench", "train", "--loss-rtol", "-1"], "--loss-rtol"),
    (["bench", "train", "--rounds", "0"], "--rounds"),
    (["bench", "train", "--warmup", "-1"], "--warmup"),
    (["bench", "remap", "--loss-rtol", "nan"], "--loss-rtol"),
    (["bench", "remap", "--seed", "-1"], "--seed"),
    (["bench", "online", "--repeats", "0"], "--repeats"),
    (["bench", "online", "--interval", "0"], "--interval"),
    (["bench", "converge", "--attention", "0"], "--attention"),
    (["bench", "converge", "--links", "-2"], "--links"),
    (["bench", "fidelity", "--engine", "--batches", "0"], "--batches"),
    (["bench", "fidelity", "--engine", "--tokens", "0"], "--tokens"),
    (["bench", "planning", "--steps", "0"], "--steps"),
    (["bench", "planning", "--nodes", "0"], "--nodes"),
    (["bench", "planner", "--budget", "-1"], "--budget"),
    (["bench", "planner", "--sizes", "0x10"], "--sizes"),
    (["bench", "window", "--windows", "-1"], "--windows"),
    (["bench", "window", "--nodes", "0"], "--nodes"),
    (["bench", "kernels", "--ratio-from-tokens", "0"], "--ratio-from-tokens"),
    (["bench", "engine", "--warmup", "-1"], "--warmup"),
    (["bench", "engine", "--capacity-factor", "-1"], "--capacity-factor"),
    (["calibrate", "--min-time", "-1"], "--min-time"),
    (["calibrate", "--threads", "0"], "--threads"),
    (["calibrate", "--concurrency", "0"], "--concurrency"),
    (["calibrate", "--tokens-per-call", "-1"], "--tokens-per-call"),
    (["calibrate", "--heads", "0"], "--heads"),
])
def test_negative_or_zero_counts_are_refused_at_parse_time(argv, flag, capsys):
    err = refused(argv, capsys)
    assert f"argument {flag}:" in err and "is invalid: expected" in err


def test_calibrate_refuses_flags_it_would_ignore(tmp_path, capsys):
    out = str(tmp_path / "x.yaml")
    err = refused(["calibrate", "--model", "gpt-tiny", "--heads", "2", "--output", out], capsys)
    assert "--heads=2 is invalid with --model gpt-tiny" in err
    err = refused(["calibrate", "--kv-heads", "3", "--output", out], capsys)
    assert "--kv-heads=3 is invalid: expected a divisor of --heads 4" in err


# 6. calibrate --lengths
@pytest.mark.parametrize("lengths", ["1,a", ",", "8", "16,,32", ""])
def test_calibrate_lengths_name_the_flag_and_what_is_expected(lengths, capsys):
    err = refused(["calibrate", "--lengths", lengths], capsys)
    assert f"argument --lengths: {lengths!r} is invalid: expected comma-separated document " \
           "lengths >= 16" in err


# 7. calibrate-sim
def test_calibrate_sim_max_length_names_the_flag_and_minimum(capsys):
    err = refused(["calibrate-sim", "--max-length", "0"], capsys)
    assert "argument --max-length: 0 is invalid: expected an integer >= 16" in err


def test_calibrate_sim_refuses_a_cluster_it_cannot_emulate(tmp_path, capsys):
    out = str(tmp_path / "x.yaml")
    err = refused(["calibrate-sim", "--cluster", "h200-8nic", "--output", out], capsys)
    assert "--cluster='h200-8nic' is invalid: expected an emulated cluster of 4 ranks" in err
    err = refused(["calibrate-sim", "--model", "no-such-model", "--output", out], capsys)
    assert "--model='no-such-model' is invalid" in err


# 8. bench window
def test_bench_window_tokens_name_the_flag(capsys):
    err = refused(["bench", "window", "--tokens", "0"], capsys)
    assert "argument --tokens: '0' is invalid" in err


def test_bench_window_cp_is_checked_before_any_row(capsys):
    err = refused(["bench", "window", "--model", "gpt-tiny", "--cluster", "cpu-2x2", "--cp",
                   "3"], capsys)
    assert "--cp=3 is invalid: expected a divisor of the 4 GPUs" in err and "[1, 2, 4]" in err


# 9, 10. bench planner and bench router
def test_bench_planner_repeats_and_sizes_before_the_header(capsys):
    base = ["bench", "planner", "--model", "gpt-tiny", "--cluster", "cpu-2x2"]
    err = refused(base + ["--repeats", "-1"], capsys)
    assert "argument --repeats: -1 is invalid: expected an integer >= 1" in err
    err = refused(base + ["--sizes", "3x10"], capsys)
    assert "--sizes 3x10 is invalid: expected GPUs a multiple of the 2 GPUs per node" in err


@pytest.mark.parametrize("argv, words", [
    (["--repeats", "0"], "argument --repeats: 0 is invalid: expected an integer >= 1"),
    (["--nodes", "0"], "argument --nodes: 0 is invalid: expected an integer >= 2"),
    (["--nodes", "16", "1"], "argument --nodes: 1 is invalid"),
    (["--seed", "-3"], "argument --seed: -3 is invalid"),
    (["--nodes", "2000000"], "--nodes=2000000 is invalid: expected at most"),
])
def test_bench_router_bad_flag_is_one_line(argv, words, capsys):
    assert words in refused(["bench", "router", *argv], capsys)


# 11. bench fidelity --resimulate FILE
def saved_run(tmp_path, edit) -> str:
    """A ``bench fidelity --json`` file, changed by ``edit(data)``."""
    row = fidelity_train.StrategyFidelity("zeppelin", [1.0], [1.1], ["zeppelin"], "",
                                          [[[64, 32]]])
    args = SimpleNamespace(sim_profile="cpu-2x2", iterations=4, warmup=2, rounds=1, extra=[])
    data = json.loads(json.dumps(fidelity_train.to_json([row], (1.0, 1.0), args)))
    edit(data)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(bogus=1), "unknown key 'bogus'"),
    (lambda d: d["strategies"]["zeppelin"].update(typo_s=[1.0]),
     "strategy 'zeppelin': unknown key 'typo_s'"),
    (lambda d: d.update(strategies={}), "no strategies"),
    (lambda d: d.pop("flags"), "no key 'flags'"),
    (lambda d: d["strategies"]["zeppelin"].pop("measured_s"), "KeyError"),
])
def test_resimulate_refuses_a_file_it_would_misread(edit, words, tmp_path, capsys):
    path = saved_run(tmp_path, edit)
    err = refused(["bench", "fidelity", "--resimulate", path], capsys)
    assert f"--resimulate={path} is invalid" in err and words in err


def test_resimulate_refuses_the_measuring_flags(tmp_path, capsys):
    path = saved_run(tmp_path, lambda d: None)
    err = refused(["bench", "fidelity", "--resimulate", path, "--rounds", "1"], capsys)
    assert "--rounds=1 is invalid with --resimulate" in err
    err = refused(["bench", "fidelity", "--resimulate", path, "--", "--seed", "3"], capsys)
    assert "--seed 3" in err and "--resimulate" in err


def test_fidelity_refuses_the_other_modes_flags(capsys):
    assert "--batches=3 is invalid without --engine" in refused(
        ["bench", "fidelity", "--batches", "3"], capsys)
    assert "--iterations=3 is invalid with --engine" in refused(
        ["bench", "fidelity", "--engine", "--iterations", "3"], capsys)


def test_a_flag_given_at_its_default_value_still_counts_as_given(tmp_path, capsys):
    # a flag equal to its default used to pass for "not given", and was then ignored
    assert "--iterations=6 is invalid with --engine" in refused(
        ["bench", "fidelity", "--engine", "--iterations", "6"], capsys)
    assert "--batches=2 is invalid without --engine" in refused(
        ["bench", "fidelity", "--batches", "2"], capsys)
    err = refused(["bench", "fidelity", "--calibrate", str(tmp_path / "p.yaml"),
                   "--sim-profile", "cpu-2x2"], capsys)
    assert "--calibrate=" in err and "--sim-profile=cpu-2x2" in err
    path = saved_run(tmp_path, lambda d: None)
    assert "--rounds=2 is invalid with --resimulate" in refused(
        ["bench", "fidelity", "--resimulate", path, "--rounds", "2"], capsys)


# the other targets: strategies, settings, plans
@pytest.mark.parametrize("argv, words", [
    (["bench", "train", "--strategies", ","], "--strategies=',' is invalid"),
    (["bench", "train", "--strategies", "zeppelin,zeppelin"], "'zeppelin' is given twice"),
    (["bench", "fidelity", "--strategies", "nosuch"], "unknown strategy 'nosuch'"),
    (["bench", "overhead", "--strategies", "bogus"], "unknown strategy 'bogus'"),
    (["bench", "remap", "--settings", ","], "--settings=',' is invalid"),
    (["bench", "engine", "--strategy", "nope"], "--strategy='nope' is invalid"),
    (["bench", "engine", "--lengths", "1,a"], "--lengths='1,a' is invalid"),
    (["bench", "kernels", "--heads", "0"], "--heads=0"),
    (["bench", "planning", "--workload", "nope"], "argument --workload: invalid choice"),
    (["bench", "planner", "--sizes", "64x512", "64x512"], "--sizes lists 64x512 more than once"),
    (["bench", "window", "--windows", "512", "512"], "--windows lists 512 more than once"),
    (["bench", "halo", "--windows", "64", "64"], "--windows lists 64 more than once"),
])
def test_other_targets_refuse_bad_values_naming_the_flag(argv, words, capsys):
    assert words in refused(argv, capsys)


def test_decisions_refuses_writing_over_the_file_it_rejudges(tmp_path, capsys):
    path = tmp_path / "measured.json"
    path.write_text("{}")
    err = refused(["bench", "decisions", "--rejudge", str(path), "--json", str(path)], capsys)
    assert "it is the --rejudge file" in err and path.read_text() == "{}"


def test_a_warmup_given_after_the_separator_is_named_as_given(capsys):
    err = refused(["bench", "train", "--iterations", "3", "--", "--lr-warmup-iters", "3"], capsys)
    assert "--lr-warmup-iters=3 is invalid: expected < --iterations 3" in err


@pytest.mark.parametrize("entry,said", [
    ("zeppelin:zeppelin-strategy=hybrid-dp", "option zeppelin-strategy is invalid: the "
                                             "benchmark sets --zeppelin-strategy on every run"),
    ("zeppelin:train-iters=100", "the benchmark sets --train-iters on every run"),
    ("static:max-seqlen-per-dp-cp-rank=2048", "--strategies 'static:max-seqlen-per-dp-cp-rank"
                                              "=2048': --max-seqlen-per-dp-cp-rank"),
    ("zeppelin:context-parallel-size=3", "--strategies 'zeppelin:context-parallel-size=3': "),
])
def test_an_entry_the_runs_would_refuse_is_refused_before_any_rank_starts(entry, said, capsys):
    """Options of --strategies entries: one the benchmark sets itself (it ran hybrid-dp under
    zeppelin's label), or one the run's own checks refuse (4 ranks started first)."""
    err = refused(["bench", "train", "--strategies", entry], capsys)
    assert said in err, err


@pytest.mark.parametrize("argv,said", [
    (["bench", "decisions", "--", "--context-parallel-mode", "static"],
     "--context-parallel-mode after -- is invalid: the benchmark sets"),
    (["bench", "decisions", "--", "--train-iters", "3"], "no training steps"),
    (["bench", "online", "--", "--zeppelin-fit-interval", "3"],
     "--zeppelin-fit-interval after -- is invalid"),
    (["bench", "converge", "--", "--zeppelin-fit-interval", "2"],
     "--zeppelin-fit-interval after -- is invalid"),
])
def test_flags_the_fit_and_decision_benchmarks_set_are_refused(argv, said, capsys):
    """They were silently overridden by the benchmark's own values."""
    assert said in refused(argv, capsys)


@pytest.mark.parametrize("argv,said", [
    (["bench", "kernels", "--head-dim", "1000000000000"], "--head-dim=1000000000000 is "
                                                          "invalid: expected at most 1024"),
    (["bench", "kernels", "--tokens", "1000000000000"], "expected at most 16777216"),
    (["bench", "engine", "--parts", "ring", "--ring-lengths", "1000000000000"],
     "--ring-lengths=[1000000000000] is invalid: expected at most 16777216"),
])
def test_shapes_beyond_any_benchmark_are_refused_before_the_allocator(argv, said, capsys):
    assert said in refused(argv, capsys)


def test_the_ring_ops_module_checks_its_flags(capsys):
    from megatron_zeppelin.bench import ring_ops

    for flags, said in ((["--kv-heads", "0"], "argument --kv-heads: 0 is invalid"),
                        (["--tokens", "5"], "argument --tokens: 5 is invalid: expected an "
                                            "integer >= 8"),
                        (["--kv-heads", "3"], "--kv-heads=3 is invalid: expected a divisor")):
        with pytest.raises(SystemExit) as info:
            ring_ops.main(flags)
        assert info.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("flags,said", [
    (["--parts", "local", "--ranks", "6"], "--ranks applies only to --parts gpu-ranks"),
    (["--parts", "local", "--ring-size", "8"], "--ring-size applies only to --parts ring"),
    (["--parts", "ring", "--lengths", "5"], "--lengths applies only to --parts cpu-ranks, "
                                            "local, gpu-ranks"),
    (["--parts", "local,local"], "--parts=local,local lists a part twice"),
])
def test_bench_engine_refuses_flags_of_parts_that_do_not_run(flags, said, capsys):
    assert said in refused(["bench", "engine", *flags], capsys)


def test_decisions_rejudge_names_the_file_when_it_is_a_folder_or_holds_bad_lengths(tmp_path,
                                                                                  capsys):
    err = refused(["bench", "decisions", "--rejudge", str(tmp_path)], capsys)
    assert f"--rejudge {tmp_path}: cannot be read (Is a directory)" in err
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"micro_batches": [
        {"index": 3, "lengths": [512, -1], "names": ["a"], "measured_s": [0.1]}]}))
    err = refused(["bench", "decisions", "--rejudge", str(path)], capsys)
    assert f"--rejudge {path}: micro-batch 3's lengths [512, -1] are invalid" in err


def test_bench_engine_takes_each_devices_multi_rank_part(monkeypatch, capsys):
    """CUDA's default parts (and ``--parts gpu-ranks``, gpu_check's bench-ranks step) parse
    where CUDA is present; the other device's part is refused, naming the valid ones."""
    import torch

    from megatron_zeppelin.bench.engine import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_args(["--device", "cuda"]).parts == ["local", "ring", "gpu-ranks"]
    assert parse_args(["--device", "cuda", "--parts", "gpu-ranks"]).parts == ["gpu-ranks"]
    assert parse_args(["--parts", "cpu-ranks"]).parts == ["cpu-ranks"]
    for device, other in (("cuda", "cpu-ranks"), ("cpu", "gpu-ranks")):
        err = refused(["bench", "engine", "--device", device, "--parts", other], capsys)
        assert f"--parts='{other}' is invalid on {device}: expected some of" in err
