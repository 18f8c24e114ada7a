#!/usr/bin/env python3
"""Compare two runs' bf16 losses (scripts/gpu_check_megatron_lm.sh, check 4): iteration 1 must
be identical, every later iteration within one bf16 spacing of the loss (the derivation is in
that script's header).

    python3 scripts/gpu_check_losses.py "LOSSES A" "LOSSES B"

LOSSES: space-separated floats, one per iteration. Prints one line (the worst difference and
its allowance); exit status 0 when the runs agree, 1 otherwise (or when either is empty or
their lengths differ).
"""
import math
import sys


def bf16_spacing(x: float) -> float:
    """Distance between adjacent bf16 numbers at ``|x|`` (8 significant bits: 2^(e-7) in
    [2^e, 2^(e+1)))."""
    return 2.0 ** (math.frexp(abs(x))[1] - 1 - 7) if x else 2.0 ** -133


def compare(a: list[float], b: list[float]) -> tuple[bool, str]:
    """(agree, one line saying why) for two runs' per-iteration losses."""
    if not a or len(a) != len(b):
        return False, f"iterations differ: {len(a)} vs {len(b)} logged losses"
    if a[0] != b[0]:
        return False, (f"iteration 1 differs ({a[0]!r} vs {b[0]!r}): same weights and a "
                       "deterministic forward must give identical losses")
    worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i]) / bf16_spacing(max(a[i], b[i])))
    diff, allowed = abs(a[worst] - b[worst]), bf16_spacing(max(a[worst], b[worst]))
    line = (f"iteration 1 identical; worst difference {diff:.5f} at iteration {worst + 1} "
            f"(allowed: one bf16 spacing at that loss, {allowed:.5f})")
    return diff <= allowed, line


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[3].strip())
        return 2
    try:
        a, b = ([float(x) for x in s.split()] for s in argv)
    except ValueError as exc:
        print(f"gpu_check_losses: a loss is not a number: {exc}")
        return 2
    ok, line = compare(a, b)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
