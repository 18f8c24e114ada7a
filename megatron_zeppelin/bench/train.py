"""``zeppelin bench train``: per-step time of zeppelin vs static mode for the tiny GPT on CPU.

Both modes run ``scripts/pretrain_gpt.py``'s training loop (``train.main``) on 4 gloo ranks (2
emulated nodes x 2) with the same seed, so they see the same documents in the same
micro-batches; the median step time of each mode (first iterations dropped as warm-up) and
their ratio are printed, side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "configs" / "train" / "gpt-tiny-cpu.yaml"


def _rank(rank: int, world: int, port: int, argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)  # as torchrun does: 4 ranks share this machine's cores
    from megatron_zeppelin.megatron.train import main

    main(argv)


def run_mode(mode: str, iterations: int, extra: list[str], port: int) -> list[dict]:
    """Train ``iterations`` steps in ``mode`` on 4 spawned ranks; rank 0's per-step logs."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        argv = ["--yaml-cfg", str(YAML), "--context-parallel-mode", mode, "--train-iters",
                str(iterations), "--log-json", log, "--log-interval", str(iterations + 1),
                *extra]
        mp.start_processes(_rank, args=(4, port, argv), nprocs=4, start_method="spawn")
        return [json.loads(line) for line in Path(log).read_text().splitlines()]


def bench_train(args: argparse.Namespace) -> int:
    print(f"tiny GPT ({YAML.name}), 4 gloo ranks as 2 nodes x 2, {args.iterations} steps per "
          f"mode, first {args.warmup} dropped; same documents in both modes")
    results = {}
    for i, mode in enumerate(("static", "zeppelin")):
        logs = run_mode(mode, args.iterations, args.extra, args.port + i)
        steps = [r["seconds"] for r in logs[args.warmup:]]
        results[mode] = statistics.median(steps)
        print(f"{mode:>9}: median step {results[mode]:.3f} s, tokens/s "
              f"{statistics.median(r['tokens_per_s'] for r in logs[args.warmup:]):,.0f}, "
              f"final loss {logs[-1]['loss']:.4f}")
    print(f"zeppelin speedup over static (median step time ratio): "
          f"{results['static'] / results['zeppelin']:.2f}x")
    return 0


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("train", help="tiny GPT step time: zeppelin vs static (CPU, 4 ranks)")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    p.set_defaults(func=bench_train)
