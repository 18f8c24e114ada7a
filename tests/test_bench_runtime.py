"""The runtime benchmarks run on CPU and report what they claim (figures, not speed tests)."""
from __future__ import annotations

import torch

from distributed import run_world


def test_bench_kernels_on_cpu_reports_block_call_vs_raw_kernel(capsys):
    from megatron_zeppelin.bench import kernels

    figures = kernels.run(["--tokens", "16,32", "--iters", "2", "--repeats", "1"])
    whats = [(r["what"], r["tokens"]) for r in figures["rows"]]
    assert whats == [("torch fwd", 16), ("torch bwd", 16), ("torch fwd", 32), ("torch bwd", 32),
                     ("native host fwd", 64), ("native host bwd", 64)]
    assert all(r["ours_us"] > 0 and r["raw_us"] > 0 for r in figures["rows"])
    assert "native host fwd" in capsys.readouterr().out


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
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if torch.cuda.is_available():
        return
    result = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True,
                            env={**__import__("os").environ, "PYTHON": sys.executable})
    assert result.returncode == 2
    assert "gpu_check: no usable CUDA torch; nothing checked" in result.stderr
    assert "torch.cuda.is_available() is False" in (tmp_path / "environment.log").read_text()


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
    assert slow.returncode == 1 and "MISSED" in slow.stdout
    log("train-reference", [(1, 5.6, 9_000)])
    far = check("--min-tokens-per-s", "0")
    assert far.returncode == 1 and "worst difference 0.1000" in far.stdout
    assert "not checked" in far.stdout
    (tmp_path / "train-native.jsonl").unlink()
    assert check().returncode == 1
