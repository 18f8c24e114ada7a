#!/usr/bin/env python3
"""Summarise gpu_check.sh's one-GPU training runs: tokens/s of the native backend (target
>= 250K) and its losses against the torch reference path (first iterations, within 0.02).

    python3 scripts/gpu_check_training.py RESULTS_DIR

Reads RESULTS_DIR/train-native.log and train-reference.log (the training log's lines
``iteration i/N | loss X | tokens/s Y | ...``); exit status 0 when both targets are met.
"""
import re
import sys
from pathlib import Path

TARGET_TOKENS_PER_S = 250e3
LOSS_TOLERANCE = 0.02
LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([\d.]+) \| tokens/s ([\d,]+)")


def iterations(path: Path) -> list[tuple[int, float, float]]:
    """(iteration, loss, tokens/s) of every logged iteration."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        m = LINE.search(line)
        if m:
            rows.append((int(m[1]), float(m[2]), float(m[3].replace(",", ""))))
    return rows


def main(out: Path) -> int:
    native = iterations(out / "train-native.log")
    reference = iterations(out / "train-reference.log")
    if not native:
        print(f"no iteration lines in {out / 'train-native.log'}")
        return 1
    steady = [t for i, _, t in native if i > 2] or [t for _, _, t in native]
    tps = sum(steady) / len(steady)
    fast = tps >= TARGET_TOKENS_PER_S
    print(f"native: {len(native)} iterations, {tps:,.0f} tokens/s (mean of iterations > 2; "
          f"target >= {TARGET_TOKENS_PER_S:,.0f}: {'met' if fast else 'MISSED'})")
    if not reference:
        print(f"no iteration lines in {out / 'train-reference.log'}")
        return 1
    worst = max(abs(a[1] - b[1]) for a, b in zip(native, reference))
    pairs = ", ".join(f"{a[1]:.4f}/{b[1]:.4f}" for a, b in zip(native, reference))
    print(f"losses native/reference, iterations 1..{len(reference)}: {pairs}; worst "
          f"difference {worst:.4f} (allowed {LOSS_TOLERANCE})")
    ref_tps = sum(t for *_, t in reference) / len(reference)
    print(f"reference path (torch backend): {ref_tps:,.0f} tokens/s; native / reference "
          f"{tps / ref_tps:.1f}x")
    return 0 if fast and worst <= LOSS_TOLERANCE else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
