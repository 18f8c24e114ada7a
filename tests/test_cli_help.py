"""Every ``zeppelin`` command and bench target prints its --help (argparse formats help text with
``%``: a literal percent sign in a help string breaks ``--help``); ``zeppelin plan`` refuses bad
input in one line before any work."""
from __future__ import annotations

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench import TARGETS


@pytest.mark.parametrize("argv", [["plan"], ["simulate"], ["calibrate"], ["calibrate-sim"],
                                  *[["bench", target] for target in TARGETS]])
def test_help_prints(argv, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    assert "usage: zeppelin" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--lengths", __file__, "--workload", "arxiv"],
     "with --workload: the file is the batch (all of its documents); drop --workload"),
    (["--lengths", "/"], "--lengths '/' cannot be read"),
    (["--plot", "/"], "argument --plot: '/' is a folder: expected a file path"),
    (["--plot", "/no/such/x.png"], "folder '/no/such' does not exist"),
    (["--plot", "plan.txt"], "expected a file ending in one of ['.png', '.svg', '.pdf']"),
    (["--global-batch-tokens", "abc"], "argument --global-batch-tokens: 'abc' is invalid"),
])
def test_plan_refuses_bad_input_before_planning(argv, message, capsys):
    """Each refusal is one line naming the flag, before any batch is sampled or planned."""
    base = ["plan", "--model", "gpt-tiny", "--cluster", "cpu-2x2"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("strategy", ["hybrid-dp", "megatron-hybrid-cp"])
@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_a_per_rank_limit_too_small_for_the_longest_document_names_the_flag(
        strategy, backend, tmp_path, capsys, monkeypatch):
    """megatron-hybrid-cp handed such a batch to megatron-core's scheduler, which asserted (a
    traceback); both strategies now say which document, the pool and the flag to raise."""
    monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("50\n2\n2\n")
    assert cli.main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-2x2", "--lengths",
                     str(lengths), "--strategy", strategy, "--max-seqlen-per-dp-cp-rank",
                     "10"]) == 2
    err = capsys.readouterr().err
    assert err == ("zeppelin: error: a sequence of 50 tokens does not fit the pool of 4 ranks "
                   "at 10 tokens per rank (--max-seqlen-per-dp-cp-rank): raise it\n"), err


@pytest.mark.parametrize("argv, message", [
    (["--max-seqlen", "10", "--overlong", "error"],
     "more than --max-seqlen allows (10 tokens); raise it, or set --overlong to 'split'"),
    (["--cp-size", "3", "--strategy", "static-cp"],
     "--cp-size=3 is invalid: expected a divisor of the pool's 4 ranks"),
    (["--tp", "3"], "--tp=3 is invalid: expected a positive divisor of gpus_per_node=2"),
])
def test_planner_errors_name_the_flags_of_zeppelin_plan(argv, message, tmp_path, capsys):
    """The planner's messages use setting names (max_seqlen, cp_size...); ``zeppelin`` shows
    them with its own flags (training shows its own)."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("50\n20\n")
    assert cli.main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-2x2", "--lengths",
                     str(lengths), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_binary_lengths_file_is_named(tmp_path, capsys):
    path = tmp_path / "lengths.bin"
    path.write_bytes(b"\xa4\xff\x00")
    assert cli.main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-2x2", "--lengths",
                     str(path)]) == 2
    assert f"--lengths '{path}' is not a text file (UTF-8): byte 0xa4" in capsys.readouterr().err
