"""The helper scripts refuse bad input before any work: one line on stderr naming the flag (or
argument), exit status 2, no traceback, no usage block; nothing written (found by fuzzing:
tracebacks after minutes of sweeps or 24 MB of corpora, ``check_sizes.py --bogus`` exit 0)."""
from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
QUICK_S = 10.0  # a refusal takes ~0.5 s (one case ~4 s: the training flags); work takes minutes


def refuse(tmp_path: Path, script: str, argv: list[str], flag: str) -> str:
    """Run ``scripts/SCRIPT.py`` with ``argv`` (FILE: an existing file, DIR: an empty folder
    of its own) and check the one-line refusal naming ``flag``; the line."""
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "file.txt").write_text("a file\n")
    argv = [a.replace("FILE", str(tmp_path / "file.txt")).replace("DIR", str(work))
            for a in argv]
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    elapsed = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"{script}.py: error: ") and "usage:" not in done.stderr
    assert flag in lines[0], lines[0]
    assert elapsed < QUICK_S, f"{elapsed:.1f} s: refused only after starting work"
    assert list(work.iterdir()) == [], "wrote before refusing"
    return lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["--pp", "0"], "--pp"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--micro-batches", "64", "5", "--pools", "2"], "--micro-batches=5"),
    (["--repeats", "0"], "--repeats"),
    (["--pools", "0"], "--pools"),
    (["--cp", "-1"], "--cp"),
    (["--seq-length", "0"], "--seq-length"),  # drew zero-token documents forever
    (["--model", "nosuch"], "--model='nosuch'"),
    (["--cluster", "nosuch"], "--cluster='nosuch'"),
    (["--workload", "nosuch"], "--workload"),
    (["--bogus"], "--bogus"),
])
def test_bench_microbatch_order_refuses(tmp_path, argv, flag):
    refuse(tmp_path, "bench_microbatch_order", argv, flag)


@pytest.mark.parametrize("argv, flag", [
    (["--output", "FILE", "--corpus", "longtail"], "--output"),
    (["--output", "FILE/sub"], "--output"),
    (["--output", "DIR", "--tokens", "0"], "--tokens"),
    (["--output", "DIR", "--tokens", "2G"], "--tokens"),
    (["--output", "DIR", "--scale", "0"], "--scale"),
    (["--output", "DIR", "--seed", "-1"], "--seed"),
    (["--output", "DIR", "--corpus", "nosuch"], "--corpus"),
    (["--output", "DIR", "--corpus", "arxiv", "arxiv"], "--corpus"),
    (["--output", "DIR", "--corpus", "longtail", "--tokens", "1M"], "--tokens"),  # unused
    (["--output", "DIR", "--bogus"], "--bogus"),
    ([], "--output"),
])
def test_make_corpora_refuses(tmp_path, argv, flag):
    refuse(tmp_path, "make_corpora", argv, flag)


@pytest.mark.parametrize("argv, flag", [
    (["--iterations", "0"], "--iterations"),
    (["--rounds", "0"], "--rounds"),
    (["--warmup", "-1"], "--warmup"),
    (["--warmup", "5", "--iterations", "3"], "--warmup=5"),
    (["--warmup", "3", "--iterations", "3"], "--warmup=3"),
    (["--smoke", "--rounds", "2"], "--rounds"),
    (["--corpus", "arxiv", "arxiv"], "--corpus"),
    (["--corpus", "nosuch"], "--corpus"),
    (["--output", "FILE/bc.md"], "--output"),
    (["--output", "DIR"], "--output"),
    (["--corpora", "FILE"], "--corpora"),
    (["--bogus"], "--bogus"),
    (["--iterations", "2", "--warmup", "0"], "--iterations=2"),  # the training flags refuse it
])
def test_bench_corpora_refuses_before_writing_corpora(tmp_path, argv, flag):
    defaults = ["--corpora", "DIR/corpora", "--output", "DIR/bench/corpora.md"]
    refuse(tmp_path, "bench_corpora", defaults + argv, flag)


@pytest.mark.parametrize("argv, flag", [
    (["--fidelity-json", "DIR/nosuch.json", "--quick"], "--fidelity-json"),
    (["--fidelity-json", "BAD_JSON"], "--fidelity-json"),
    (["--fidelity-json", "NOT_JSON"], "--fidelity-json"),
    (["--measured", "DIR/nosuch.md"], "--measured"),
    (["--measured", "BINARY"], "--measured"),
    (["--output", "FILE/rep.md"], "--output"),
    (["--output", "DIR"], "--output"),
    (["--jobs", "0"], "--jobs"),
    (["--batches", "0"], "--batches"),
    (["--results", "DIR"], "--results"),
    (["--results", "NOT_PICKLE"], "--results"),
    (["--results", "FILE/results.pkl"], "--results"),
    (["--results", "OLD_RESULTS"], "--results"),
    (["--results", "SAVED", "--batches", "3"], "--batches=3 is invalid with --results"),
    (["--results", "SAVED", "--quick"], "--quick=True is invalid with --results"),
    (["--results", "SAVED", "--jobs", "2"], "--jobs=2 is invalid with --results"),
    (["--bogus"], "--bogus"),
])
def test_make_benchmarks_report_refuses_before_any_sweep(tmp_path, argv, flag):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    files = {"BAD_JSON": '{"a": 1}', "NOT_JSON": "{", "BINARY": b"\xa4\xff",
             "NOT_PICKLE": pickle.dumps([1]), "OLD_RESULTS": pickle.dumps((1, 2, 3, 4)),
             "SAVED": pickle.dumps({"quick": False, "batches": 2, "sweeps": (1, 2, 3, 4)})}
    for name, content in files.items():
        path = inputs / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        argv = [str(path) if a == name else a for a in argv]
    refuse(tmp_path, "make_benchmarks_report", ["--output", "DIR/rep/rep.md", *argv], flag)


@pytest.mark.parametrize("argv, flag", [(["--bogus"], "--bogus"), (["all"], "'all'"),
                                        (["--all", "--x"], "--x")])
def test_check_sizes_refuses_unknown_arguments(tmp_path, argv, flag):
    refuse(tmp_path, "check_sizes", argv, flag)


def test_check_sizes_help_prints_its_usage():
    done = subprocess.run([sys.executable, str(SCRIPTS / "check_sizes.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("Usage: python scripts/check_sizes.py [--all]")


@pytest.mark.parametrize("version", ["latest", "0.19", "0.19.2; rm -rf x"])
def test_test_newer_core_refuses_a_version_that_is_not_a_release(tmp_path, version):
    done = subprocess.run(["bash", str(SCRIPTS / "test_newer_core.sh"), version],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    assert lines == [f"test_newer_core.sh: error: VERSION '{version}' is not a release number "
                     "such as 0.19.2"], done.stderr
