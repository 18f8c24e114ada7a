#!/usr/bin/env python3
"""Summarise gpu_check.sh's one-GPU training runs: tokens/s of the fast backend (target
--min-tokens-per-s, default 250K; 0 checks nothing) and its losses against the torch reference
path (the reference's iterations, within 0.02).

    python3 scripts/gpu_check_training.py RESULTS_DIR [--min-tokens-per-s N]

Reads RESULTS_DIR/train-native.jsonl and train-reference.jsonl (``--log-json``: one object per
iteration with ``iteration``, ``loss``, ``tokens_per_s``); exit status 0 when both targets are met.
"""
import argparse
import json
import sys
from pathlib import Path

LOSS_TOLERANCE = 0.02


def iterations(path: Path) -> list[tuple[int, float, float]]:
    """(iteration, loss, tokens/s) of every logged iteration; [] when the run left no log."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append((int(row["iteration"]), float(row["loss"]), float(row["tokens_per_s"])))
    return rows


def main(out: Path, target: float) -> int:
    native = iterations(out / "train-native.jsonl")
    reference = iterations(out / "train-reference.jsonl")
    if not native:
        print(f"no iterations logged in {out / 'train-native.jsonl'} (see train.log, section "
              "'== train-native')")
        return 1
    steady = [t for i, _, t in native if i > 2] or [t for _, _, t in native]
    tps = sum(steady) / len(steady)
    fast = tps >= target
    verdict = "not checked" if target <= 0 else ("PASS" if fast else "FAIL")
    print(f"fast backend: {len(native)} iterations, {tps:,.0f} tokens/s (mean of iterations "
          f"> 2; target >= {target:,.0f}: {verdict})")
    if not reference:
        print(f"no iterations logged in {out / 'train-reference.jsonl'} (see train.log, "
              "section '== train-reference')")
        return 1
    worst = max(abs(a[1] - b[1]) for a, b in zip(native, reference))
    pairs = ", ".join(f"{a[1]:.4f}/{b[1]:.4f}" for a, b in zip(native, reference))
    print(f"losses fast/reference, iterations 1..{len(reference)}: {pairs}; worst "
          f"difference {worst:.4f} (allowed {LOSS_TOLERANCE}: "
          f"{'PASS' if worst <= LOSS_TOLERANCE else 'FAIL'})")
    ref_tps = sum(t for *_, t in reference) / len(reference)
    print(f"reference path (torch backend): {ref_tps:,.0f} tokens/s; fast / reference "
          f"{tps / ref_tps:.1f}x")
    return 0 if fast and worst <= LOSS_TOLERANCE else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--min-tokens-per-s", type=float, default=250e3)
    args = parser.parse_args()
    sys.exit(main(args.results, args.min_tokens_per_s))
