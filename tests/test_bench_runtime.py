"""The runtime benchmarks run on CPU and report what they claim (figures, not speed tests)."""
from __future__ import annotations

import torch

from distributed import run_world


def test_bench_kernels_on_cpu_reports_block_call_vs_raw_kernel(capsys):
    from megatron_zeppelin.bench import kernels

    figures = kernels.run(["--tokens", "16,32", "--iters", "2", "--repeats", "1", "--synced",
                           "2"])
    whats = [(r["what"], r["tokens"]) for r in figures["rows"]]
    assert whats == [("torch fwd", 16), ("torch bwd", 16), ("torch fwd", 32), ("torch bwd", 32),
                     ("native host fwd", 64), ("native host bwd", 64)]
    assert all(r[mode]["ours_us"] > 0 and r[mode]["raw_us"] > 0 for r in figures["rows"]
               for mode in ("stream", "synced"))
    assert figures["targets"] == {} and figures["ok"] is None  # CPU: none unless asked
    out = capsys.readouterr().out
    assert "native host fwd" in out and " synced " in out and " stream " in out


def test_bench_targets_pass_or_fail_with_the_exit_status(capsys):
    """A missed target is exit 1 of the command (not a word in a report that exits 0)."""
    from megatron_zeppelin.cli import main

    quick = ["bench", "kernels", "--tokens", "16", "--iters", "1", "--repeats", "1", "--synced",
             "1", "--ratio-from-tokens", "1"]
    assert main(quick + ["--max-ratio", "1e6", "--max-extra-us", "1e9"]) == 0
    assert "target synced ratio <= 1e+06 at >= 1 tokens" in capsys.readouterr().out
    assert main(quick + ["--max-ratio", "1e-6"]) == 1
    assert ": FAIL" in capsys.readouterr().out
    ring = ["bench", "engine", "--parts", "ring", "--ring-size", "2", "--ring-lengths", "9,4",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--iters", "1"]
    assert main(ring + ["--max-ring-ratio", "1e6"]) == 0
    assert main(ring + ["--max-ring-ratio", "1e-6"]) == 1
    assert "fwd + bwd" in capsys.readouterr().out


def test_bench_engine_ring_part_times_every_block_of_every_position():
    """The ring part drives every position's RingGroupRun (the engine's ring path) and the raw
    kernel on the same blocks: block count and per-phase figures."""
    from megatron_zeppelin.bench.engine import parse_args
    from megatron_zeppelin.bench.engine_ring import ring_vs_raw
    from megatron_zeppelin.runtime.zigzag import ZigzagLayout

    args = parse_args(["--parts", "ring", "--ring-size", "3", "--ring-lengths", "30,7,2",
                       "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--iters", "1",
                       "--warmup", "0"])
    figures = ring_vs_raw(args)
    blocks = sum(len(ZigzagLayout([30, 7, 2], 3, p).blocks(s)) for p in range(3)
                 for s in range(3))
    assert figures["blocks"] == blocks and figures["target"] is None
    assert all(figures["seconds"][k] > 0 for k in ("ring fwd", "raw fwd", "ring bwd", "raw bwd"))
    assert set(figures) >= {"fwd_us_per_block", "bwd_us_per_block", "ratio"}


def _local_only(rank: int, world: int) -> dict:
    from megatron_zeppelin.bench.engine import make_bench_plan, parse_args
    from megatron_zeppelin.bench.engine_local import local_only

    args = parse_args(["--lengths", "40,17,5,1", "--heads", "2", "--kv-heads", "1",
                       "--head-dim", "8", "--iters", "1", "--warmup", "0"])
    return local_only(args, make_bench_plan)


def test_local_only_engine_runs_one_fused_call():
    figures = run_world(_local_only, 1)[0]
    assert figures["calls"] == 1 and figures["engine"] > 0 and figures["raw"] > 0


def _injected(rank: int, world: int) -> dict:
    """The compute-only and comm-only variants of the engine benchmark are injected objects:
    the engine runs unchanged; the results are (by design) not attention."""
    import torch.distributed as dist

    from megatron_zeppelin.bench.engine import NoKernel, NullTransport, make_bench_plan, \
        parse_args
    from megatron_zeppelin.runtime.engine import AttentionEngine

    args = parse_args(["--lengths", "90,40,7,3"])
    plan = make_bench_plan(args)
    tokens = plan.attention_tokens()[rank]
    q = torch.randn(tokens, 2, 8, requires_grad=True)
    kv = torch.randn(tokens, 1, 8)
    report = {"rings": sum(len(g.ring) > 1 for g in plan.ring_groups)}
    for name, kwargs in (("compute", dict(transport=NullTransport())),
                         ("comm", dict(backend=NoKernel()))):
        engine = AttentionEngine(plan, rank, dist.group.WORLD, **kwargs)
        out = engine.forward(q, kv, kv)
        out.sum().backward()
        report[name] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(q.grad).all())
        report[f"{name}_zero"] = bool((out == 0).all())
    return report


def test_benchmark_variants_are_injected_not_switched():
    for report in run_world(_injected, 2):
        assert report["rings"] >= 1 and report["compute"] and report["comm"]
        assert report["comm_zero"] and not report["compute_zero"]


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_gpu_check_refuses_a_machine_without_cuda(tmp_path):
    """scripts/gpu_check.sh is valid bash and, without CUDA, stops at once with one clear
    line (exit 2) after recording the environment."""
    import subprocess
    import sys

    script = ROOT / "scripts" / "gpu_check.sh"
    for name in ("gpu_check.sh", "gpu_check_steps.sh", "gpu_check_megatron_lm.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)]).returncode == 0
    if torch.cuda.is_available():
        return
    result = subprocess.run(["bash", str(script), "--out", str(tmp_path)], capture_output=True,
                            text=True, env={**__import__("os").environ, "PYTHON": sys.executable,
                                            "GPU_CHECK_CPU": "0"})
    assert result.returncode == 2
    assert "gpu_check: no usable CUDA torch; nothing checked" in result.stderr
    assert "torch.cuda.is_available() is False" in (tmp_path / "environment.log").read_text()


def _gpu_check(*args, python=None, env=None):
    import os
    import subprocess
    import sys

    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHON": python or sys.executable, **(env or {})})


def test_gpu_check_lists_steps_that_fit_the_machine():
    """--list: every step with its estimate, each under the 480 s step limit, and the quick
    set (the default) under 8 minutes in all; a wrong step or flag is one line, exit 2."""
    import re

    listed = _gpu_check("--list")
    assert listed.returncode == 0, listed.stderr
    rows = {m[0]: int(m[1]) for m in re.findall(r"^([a-z-]+) +(\d+) s ", listed.stdout, re.M)}
    assert {"kernel-tests", "bench-kernels", "bench-engine", "train", "mcore-versions"} <= set(rows)
    assert all(0 < s < 480 for s in rows.values())
    quick = int(re.search(r"quick set .*estimate (\d+) s in all", listed.stdout)[1])
    assert quick < 480
    for args, word in ((["--step", "kernel-tests,nope"], "--step 'nope' is not a step"),
                       (["--bogus"], "unknown argument '--bogus'"), (["--step"], "needs a value")):
        bad = _gpu_check(*args)
        assert bad.returncode == 2 and word in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_gpu_check_steps_append_to_one_summary_and_a_miss_exits_1(tmp_path):
    """Two invocations (the CPU dry run; --out, then $OUT) append to one summary: a passing
    step, then a step whose command misses its target (exit 1: here a python that fails
    `bench kernels`): FAIL with its figure line, the next step still runs, exit 1."""
    import sys

    dry = {"GPU_CHECK_CPU": "1"}
    first = _gpu_check("--out", str(tmp_path), "--step", "bench-kernels", env=dry)
    assert first.returncode == 0, first.stdout + first.stderr
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\ncase \"$*\" in *\"bench kernels\"*)\n"
                       "echo '  target synced ratio <= 1.05 at >= 4096 tokens: worst 2: FAIL'\n"
                       f"exit 1;; esac\nexec {sys.executable} \"$@\"\n")
    failing.chmod(0o755)
    second = _gpu_check("--step", "bench-kernels", "--step=megatron-lm", python=str(failing),
                        env={**dry, "OUT": str(tmp_path)})  # $OUT: the device tool's folder
    assert second.returncode == 1, second.stdout + second.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.count("== gpu_check ") == 2 and summary.count("PASS  install") == 2
    assert "PASS  bench-kernels" in summary and "RESULT: PASS (bench-kernels)" in summary
    assert "FAIL  bench-kernels (exit 1" in summary and "worst 2: FAIL" in summary
    assert "SKIP  megatron-lm" in summary and "RESULT: FAIL (bench-kernels,megatron-lm" in summary
    assert (tmp_path / "bench-kernels.log").exists()


def test_gpu_check_training_summary(tmp_path):
    """The training targets are read from the runs' JSON logs (--log-json): tokens/s of the
    fast run (iterations > 2) against --min-tokens-per-s, its losses against the reference."""
    import json
    import subprocess
    import sys

    def log(name, rows):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"iteration": i, "loss": loss, "tokens_per_s": tps, "plan_ms": 1.0}) + "\n"
            for i, loss, tps in rows))

    def check(*flags):
        return subprocess.run([sys.executable, script, str(tmp_path), *flags],
                              capture_output=True, text=True)

    log("train-native", [(1, 5.5, 100_000), (2, 5.2, 200_000), (3, 5.0, 300_000),
                         (4, 4.9, 320_000)])
    log("train-reference", [(1, 5.51, 9_000), (2, 5.19, 9_500), (3, 5.01, 9_400)])
    script = str(ROOT / "scripts" / "gpu_check_training.py")
    ok = check()
    assert ok.returncode == 0, ok.stdout
    assert "310,000 tokens/s" in ok.stdout and "worst difference 0.0100" in ok.stdout
    slow = check("--min-tokens-per-s", "400000")
    assert slow.returncode == 1 and "target >= 400,000: FAIL" in slow.stdout
    log("train-reference", [(1, 5.6, 9_000)])
    far = check("--min-tokens-per-s", "0")
    assert far.returncode == 1 and "worst difference 0.1000" in far.stdout
    assert "not checked" in far.stdout
    (tmp_path / "train-native.jsonl").unlink()
    assert check().returncode == 1


def test_bench_ring_simulation_computes_ring_attention():
    """The ring part's wiring (position p receives what p-1 sent) is the real ring: every
    position's forward output equals causal attention of the whole sequences (fp32)."""
    from megatron_zeppelin.bench.engine_ring import _rounds
    from megatron_zeppelin.plan import zigzag_bounds
    from megatron_zeppelin.runtime import kernels
    from megatron_zeppelin.runtime.attention import RingGroupRun
    from megatron_zeppelin.runtime.zigzag import ZigzagLayout
    from megatron_zeppelin.schedule import Phase

    lengths, size, scale = [30, 7, 2], 3, 8 ** -0.5
    gen = torch.Generator().manual_seed(3)
    whole = [torch.randn(sum(lengths), h, 8, generator=gen) for h in (2, 1, 1)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    expected, _ = kernels.block_forward(*whole, cu, cu, True, scale, backend="torch")
    runs, rows = [], []
    for p in range(size):
        mine = []
        for start, n in zip(cu, lengths):
            b = zigzag_bounds(n, size)
            for c in (p, 2 * size - 1 - p):
                mine += range(start + b[c], start + b[c + 1])
        rows.append(torch.tensor(mine, dtype=torch.int64))
        runs.append(RingGroupRun(ZigzagLayout(lengths, size, p), scale, "torch"))
        runs[-1].begin_forward(*(x[rows[-1]] for x in whole))
    _rounds(runs, Phase.FORWARD)
    for run, mine in zip(runs, rows):
        out, _ = run.end_forward()
        torch.testing.assert_close(out, expected[mine], atol=1e-5, rtol=1e-5)


def test_mcore_versions_losses_within_one_bf16_spacing():
    """Check 4's tolerance: iteration 1 identical (same weights, deterministic forward), later
    iterations within one bf16 spacing at the loss (2^(e-7) in [2^e, 2^(e+1)))."""
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_check_losses import bf16_spacing, compare
    finally:
        sys.path.pop(0)
    assert (bf16_spacing(5.5), bf16_spacing(4.0), bf16_spacing(3.99)) == (2 ** -5, 2 ** -5,
                                                                          2 ** -6)
    assert compare([5.5, 5.2, 4.9], [5.5, 5.23, 4.9])[0]
    assert not compare([5.5, 5.2, 4.9], [5.5, 5.24, 4.9])[0]  # 0.04 > 1/32
    assert not compare([3.5, 3.2], [3.5, 3.22])[0]  # 0.02 > 1/64 below 4
    ok, why = compare([5.5, 5.2], [5.5001, 5.2])
    assert not ok and "iteration 1 differs" in why
    assert not compare([5.5], [5.5, 5.2])[0] and not compare([], [])[0]
    script = str(ROOT / "scripts" / "gpu_check_losses.py")
    run = subprocess.run([sys.executable, script, "5.5 5.2", "5.5 5.3"], capture_output=True,
                         text=True)
    assert run.returncode == 1 and "worst difference 0.10000 at iteration 2" in run.stdout
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check_megatron_lm.sh"),
                          "--checks", "5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--checks=5 is invalid" in bad.stderr
