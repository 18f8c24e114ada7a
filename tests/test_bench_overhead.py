"""``zeppelin bench overhead``'s accounting: CPU clocks per thread and process, per-step
figures, profile lines (the training runs themselves are the benchmark, not a test)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from megatron_zeppelin.bench import overhead


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_splits_by_thread_name_and_counts_the_main_thread():
    before = overhead.thread_cpu()
    worker = threading.Thread(target=_burn, args=(0.05,), name="zeppelin-plan_0")
    worker.start()
    worker.join()
    _burn(0.02)  # the main thread
    # the worker has ended: its CPU is no longer a thread of this process
    after = overhead.thread_cpu()
    assert after["main"] - before["main"] >= 0.02
    assert after["main-runqueue"] >= before["main-runqueue"] >= 0.0
    burnt, leave = threading.Event(), threading.Event()
    live = threading.Thread(target=lambda: (_burn(0.05), burnt.set(), leave.wait(30)),
                            name="zeppelin-inter_3")
    live.start()
    assert burnt.wait(30)
    seen = overhead.thread_cpu()
    leave.set()
    live.join()
    assert seen.get("zeppelin-inter", 0.0) >= 0.05  # pool index stripped


def test_process_cpu_reads_a_child_process_clock():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend = time.process_time() + 0.2\n"
                              "while time.process_time() < end: pass\ntime.sleep(5)"])
    try:
        deadline = time.monotonic() + 20
        while overhead.process_cpu(child.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.2 <= overhead.process_cpu(child.pid) < 5
    finally:
        child.kill()
        child.wait()
    assert overhead.process_cpu(None) == 0.0


def _record(process, planner, planned, main, candidates):
    n = len(process)
    return {"steps": {"process": process, "planner": planner, "wall": [1.0] * n,
                      "planned": planned, "candidates": candidates,
                      "threads": {"main": main, "main-runqueue": [0.1] * n}}}


def test_summary_per_rank_per_step_and_planner_per_micro_batch():
    ranks = [overhead.merge_rounds([_record([0.5, 0.7], [0.01, 0.03], 4, [0.4, 0.6], ["a", "b"]),
                                    _record([0.6], [0.02], 2, [0.5], ["a"])])
             for _ in range(4)]
    f = overhead.summarize(ranks)
    assert f["rank_cpu_s"] == pytest.approx([0.6] * 4)
    assert f["planner_cpu_s"] == pytest.approx([0.02] * 4)
    assert f["planner_cpu_per_microbatch_s"] == pytest.approx(0.06 / 6)
    assert f["total_cpu_s"] == pytest.approx(4 * 0.62)
    assert f["threads_cpu_s"]["main"] == pytest.approx(0.5)
    assert f["threads_cpu_s"]["main-blocked"] == pytest.approx(1.0 - 0.5 - 0.1)
    assert f["candidates"] == {"a": 2, "b": 1}
    lines = overhead.entry_lines("zeppelin", f)
    assert "mean 0.600" in lines[1] and "10.0 ms per micro-batch" in lines[4]


def test_profile_lines_rank_by_own_time_and_over_the_reference():
    rows = [["~:0(<built-in method kernel>)", 10, 2.0, 2.0], ["engine.py:1(run)", 5, 0.5, 3.0],
            ["x.py:2(f)", 4, 0.1, 0.1]]
    lines = overhead.profile_lines("zeppelin", rows, 2, {"engine.py:1(run)": 0.05,
                                                         "~:0(<built-in method kernel>)": 1.0})
    assert "1000.00 own" in lines[1] and "kernel" in lines[1]
    python = lines.index("zeppelin: top Python functions by own time (ms per step)")
    assert "engine.py:1(run)" in lines[python + 1]  # built-ins left out there
    over = lines.index("zeppelin: top own time over the reference's (ms per step)")
    assert "+200.00 own" in lines[over + 1] and "engine.py" in lines[over + 1]


def test_bad_iterations_are_refused_naming_the_flags(capsys):
    from megatron_zeppelin.cli import main

    assert main(["bench", "overhead", "--iterations", "2", "--warmup", "1"]) == 2
    assert "--iterations 2 / --warmup 1" in capsys.readouterr().err


def test_compare_lines_average_rounds_before_and_after():
    before = [{"rank_cpu_s": [1.0, 1.2], "total_cpu_s": 4.4, "planner_cpu_per_microbatch_s": 0.002},
              {"rank_cpu_s": [0.9, 0.9], "total_cpu_s": 3.6, "planner_cpu_per_microbatch_s": 0.002}]
    after = [{"rank_cpu_s": [0.8, 1.0], "total_cpu_s": 3.6, "planner_cpu_per_microbatch_s": 0.001},
             {"rank_cpu_s": [0.7, 0.7], "total_cpu_s": 2.8, "planner_cpu_per_microbatch_s": 0.001}]
    lines = overhead.compare_lines("static", before, after)
    assert lines[1] == ("  CPU s per step per rank: 1.0000 -> 0.8000 (0.800x; per round "
                        "1.1000->0.9000, 0.9000->0.7000)")
    assert "4.0000 -> 3.2000 (0.800x" in lines[2] and "0.0020 -> 0.0010 (0.500x" in lines[3]
    assert overhead.compare_lines("x", [{}], [{}]) == [lines[0].replace("static", "x")]


def test_before_must_be_a_checkout_with_the_benchmark(tmp_path, capsys):
    from megatron_zeppelin.cli import main

    assert main(["bench", "overhead", "--before", str(tmp_path)]) == 2
    assert f"--before {str(tmp_path)!r}: not a checkout" in capsys.readouterr().err
