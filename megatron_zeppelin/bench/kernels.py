"""Benchmark of the block call: our kernel call vs the raw kernel, same inputs, side by side.

``zeppelin bench kernels --device cuda`` times, per call size, the native backend's block call
(``backend.forward``/``backward`` on precomputed ``Pieces``, what the engine runs) against
``aten._flash_attention_forward``/``_backward`` called directly with the same tensors, two ways:

* ``stream``: back-to-back calls, one device sync per run (the fastest of ``--repeats`` runs of
  ``--iters`` calls): how a busy GPU sees them; host overhead hides behind queued kernels;
* ``synced``: one device sync after every call (median of ``--synced`` calls): the host work
  of every call is on the critical path, as when the GPU waits for the host (small blocks,
  the first call after a communication wait).

It prints microseconds per call, the ratio and the extra microseconds per call of both.
Targets (issue 9), pass/fail: ratio <= ``--max-ratio`` (1.05) at >= ``--ratio-from-tokens``
(4096) tokens and <= ``--max-extra-us`` (20) extra per call, in both modes. ``run`` returns the
figures with ``ok`` (False on a miss; ``zeppelin bench kernels`` then exits 1).

On CPU (``--device cpu``, the default) the GPU kernel does not exist; what is meaningful there:

* the ``torch`` backend's block call (one document: one pair) against the raw
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward) on the same inputs;
* the native backend's own host overhead: its block call with a kernel that returns
  preallocated results at once (``InstantFlashOps``) against calling that kernel directly,
  i.e. the Python the block call adds to every GPU kernel launch.

On CPU no target is checked unless one is given (``--max-ratio``, ``--max-extra-us``): that is
how CI tests the pass/fail plumbing; CPU figures say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from megatron_zeppelin.bench.flags import check_shape

DEFAULTS = {"cuda": dict(heads=32, kv_heads=8, head_dim=128, tokens="64,1024,4096,16384,65536",
                         max_ratio=1.05, max_extra_us=20.0),
            "cpu": dict(heads=4, kv_heads=2, head_dim=64, tokens="64,256,1024,4096",
                        max_ratio=None, max_extra_us=None)}
MODES = ("stream", "synced")
RATIO_FROM_TOKENS = 4096  # the ratio target applies to calls of at least this many tokens


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from megatron_zeppelin.options import Parser, int_at_least, integer
    from megatron_zeppelin.output_paths import output_file

    parser = Parser(prog="zeppelin bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--tokens", default=None,
                        help="comma-separated tokens per call (one causal document each)")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed stream run")
    parser.add_argument("--repeats", type=int, default=3, help="timed stream runs (fastest)")
    parser.add_argument("--synced", type=int, default=20,
                        help="calls timed one by one, a device sync after each (median)")
    parser.add_argument("--max-ratio", type=float, default=None,
                        help="target: ours/raw per call at >= --ratio-from-tokens (CUDA 1.05)")
    parser.add_argument("--ratio-from-tokens", type=int_at_least(1), default=RATIO_FROM_TOKENS)
    parser.add_argument("--max-extra-us", type=float, default=None,
                        help="target: extra microseconds per call, every size (CUDA 20)")
    parser.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                        help="also write the figures to this file")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("heads", "kv_heads", "head_dim", "iters", "repeats", "synced"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.max_ratio is None and args.ratio_from_tokens != RATIO_FROM_TOKENS:
        parser.error(f"--ratio-from-tokens={args.ratio_from_tokens} applies only with a "
                     "--max-ratio target (none on this device by default): it would be ignored")
    for key in ("max_ratio", "max_extra_us"):
        if getattr(args, key) is not None and getattr(args, key) <= 0:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    try:
        args.tokens = [integer(x) for x in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens={args.tokens!r} is invalid: expected integers")
    if not args.tokens or min(args.tokens) < 1:
        parser.error(f"--tokens={args.tokens!r} is invalid: expected positive integers")
    check_shape(parser, args, ("tokens",))
    return args


def _sync_of(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def per_call_us(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """``stream``: fastest mean microseconds per call of ``fn`` over ``repeats`` runs of
    ``iters`` back-to-back calls (one device sync per run)."""
    sync = _sync_of(args.device)
    fn()
    sync()
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / args.iters)
    return best * 1e6


def synced_call_us(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """``synced``: median microseconds of ``synced`` single calls, each followed by a device
    sync (the host's work per call is on the critical path)."""
    sync = _sync_of(args.device)
    fn()
    sync()
    times = []
    for _ in range(args.synced):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _pair(what: str, tokens: int, ours: Callable[[], object], raw: Callable[[], object],
          args: argparse.Namespace) -> dict:
    """One row: ours vs raw in both modes (``MODES``), microseconds per call."""
    row = dict(what=what, tokens=tokens)
    for mode, timer in zip(MODES, (per_call_us, synced_call_us)):
        a, b = timer(ours, args), timer(raw, args)
        row[mode] = dict(ours_us=a, raw_us=b, ratio=a / b, extra_us=a - b)
    return row


def _inputs(tokens: int, args: argparse.Namespace, dtype: torch.dtype):
    gen = torch.Generator(device=args.device).manual_seed(tokens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, args.head_dim, generator=gen, device=args.device,
                           dtype=dtype)

    return rand(args.heads), rand(args.kv_heads), rand(args.kv_heads), rand(args.heads)


def native_vs_aten(tokens: int, args: argparse.Namespace) -> list[dict]:
    """CUDA: the native backend's block call vs the raw aten flash kernel, fwd and bwd."""
    from megatron_zeppelin.runtime import kernels

    q, k, v, dout = _inputs(tokens, args, torch.bfloat16)
    pieces = kernels.make_pieces([0, tokens], [0, tokens], args.device)
    backend, scale = kernels.get("native"), args.head_dim ** -0.5
    aten = torch.ops.aten
    out, lse = backend.forward(q, k, v, pieces, True, scale)
    raw_out, raw_lse, rng, unused, _ = aten._flash_attention_forward(
        q, k, v, pieces.cu_q_dev, pieces.cu_k_dev, tokens, tokens, 0.0, True, False, scale=scale)
    return [_pair("native fwd", tokens, lambda: backend.forward(q, k, v, pieces, True, scale),
                  lambda: aten._flash_attention_forward(
                      q, k, v, pieces.cu_q_dev, pieces.cu_k_dev, tokens, tokens, 0.0, True,
                      False, scale=scale), args),
            _pair("native bwd", tokens,
                  lambda: backend.backward(dout, q, k, v, out, lse, pieces, True, scale),
                  lambda: aten._flash_attention_backward(
                      dout, q, k, v, raw_out, raw_lse, pieces.cu_q_dev, pieces.cu_k_dev, tokens,
                      tokens, 0.0, True, rng, unused, scale=scale), args)]


def torch_vs_aten_cpu(tokens: int, args: argparse.Namespace) -> list[dict]:
    """CPU: the torch backend's block call (one pair) vs the raw CPU flash kernel."""
    from megatron_zeppelin.runtime import kernels

    q, k, v, dout = _inputs(tokens, args, torch.float32)
    pieces = kernels.make_pieces([0, tokens], [0, tokens])
    backend, scale = kernels.get("torch"), args.head_dim ** -0.5
    b = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, dout)]  # [1, heads, t, d] views
    aten = torch.ops.aten
    out, lse = backend.forward(q, k, v, pieces, True, scale)
    raw_out, raw_lse = aten._scaled_dot_product_flash_attention_for_cpu(b[0], b[1], b[2], 0.0,
                                                                        True, scale=scale)
    return [_pair("torch fwd", tokens, lambda: backend.forward(q, k, v, pieces, True, scale),
                  lambda: aten._scaled_dot_product_flash_attention_for_cpu(
                      b[0], b[1], b[2], 0.0, True, scale=scale), args),
            _pair("torch bwd", tokens,
                  lambda: backend.backward(dout, q, k, v, out, lse, pieces, True, scale),
                  lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
                      b[3], b[0], b[1], b[2], raw_out, raw_lse, 0.0, True, scale=scale), args)]


class InstantFlashOps:
    """A kernel with the aten flash contract that returns preallocated results at once: the
    block call's host overhead, measured without a GPU (benchmark only)."""

    def __init__(self, out, lse, grads) -> None:
        self.result = (out, lse, torch.zeros(2, dtype=torch.uint64),
                       torch.zeros((), dtype=torch.uint64), torch.empty(0))
        self.grads = grads

    def refuses(self, q):
        return None

    def forward(self, *args, **kwargs):
        return self.result

    def backward(self, *args, **kwargs):
        return self.grads


def native_host_overhead(args: argparse.Namespace) -> list[dict]:
    """CPU: the native block call around an instant kernel vs calling that kernel directly."""
    from megatron_zeppelin.runtime import kernels
    from megatron_zeppelin.runtime.kernels.native import NativeFlash

    tokens = 64
    q, k, v, dout = _inputs(tokens, args, torch.bfloat16)
    pieces = kernels.make_pieces([0, tokens], [0, tokens])
    lse = torch.zeros(args.heads, tokens)
    backend, scale = NativeFlash(), args.head_dim ** -0.5
    backend.ops = ops = InstantFlashOps(q, lse, (q, k, v))
    call = (q, k, v, pieces.cu_q_dev, pieces.cu_k_dev, tokens, tokens, 0.0, True, False)
    return [_pair("native host fwd", tokens,
                  lambda: backend.forward(q, k, v, pieces, True, scale),
                  lambda: ops.forward(*call, scale=scale), args),
            _pair("native host bwd", tokens,
                  lambda: backend.backward(dout, q, k, v, q, lse, pieces, True, scale),
                  lambda: ops.backward(dout, *call[:3], q, lse, *call[3:7], True, None, None,
                                       scale=scale), args)]


def run(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); print and return the figures
    (``ok``: every target met, None when none was checked)."""
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for tokens in args.tokens:
        rows += (native_vs_aten if args.device == "cuda" else torch_vs_aten_cpu)(tokens, args)
    if args.device == "cpu":
        rows += native_host_overhead(args)
    figures = {"device": args.device, "heads": args.heads, "kv_heads": args.kv_heads,
               "head_dim": args.head_dim, "rows": rows}
    figures["targets"] = targets(rows, args)
    checks = list(figures["targets"].values())
    figures["ok"] = all(c["ok"] for c in checks) if checks else None
    _print(figures, args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


def targets(rows: list[dict], args: argparse.Namespace) -> dict:
    """Each target asked for, per mode: the worst value, its limit and whether it is met. The
    rows they apply to: the block-call rows (not the CPU-only host-overhead rows)."""
    calls = [r for r in rows if not r["what"].startswith("native host")]
    big = [r for r in calls if r["tokens"] >= args.ratio_from_tokens]
    found = {}
    for mode in MODES:
        if args.max_ratio is not None and big:
            worst = max(r[mode]["ratio"] for r in big)
            found[f"{mode} ratio"] = dict(worst=worst, limit=args.max_ratio,
                                          ok=worst <= args.max_ratio)
        if args.max_extra_us is not None:
            worst = max(r[mode]["extra_us"] for r in calls)
            found[f"{mode} extra us"] = dict(worst=worst, limit=args.max_extra_us,
                                             ok=worst <= args.max_extra_us)
    return found


def _print(figures: dict, args: argparse.Namespace) -> None:
    dtype = "bf16" if args.device == "cuda" else "fp32 (native host rows: bf16)"
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"block call vs raw kernel on {where}, {dtype}, heads {args.heads}/{args.kv_heads} kv, "
          f"head_dim {args.head_dim}, causal, one document per call; stream: fastest of "
          f"{args.repeats} x {args.iters} back-to-back calls; synced: median of {args.synced} "
          "calls with a device sync after each")
    print(f"  {'call':<16} {'tokens':>7} {'mode':>7} {'ours us':>10} {'raw us':>10} {'ratio':>7} "
          f"{'extra us':>9}")
    for r in figures["rows"]:
        for mode in MODES:
            m = r[mode]
            print(f"  {r['what']:<16} {r['tokens']:>7} {mode:>7} {m['ours_us']:>10.1f} "
                  f"{m['raw_us']:>10.1f} {m['ratio']:>7.3f} {m['extra_us']:>9.1f}")
    for name, t in figures["targets"].items():
        where = (f" at >= {args.ratio_from_tokens} tokens" if name.endswith("ratio")
                 else " per call")
        print(f"  target {name} <= {t['limit']:g}{where}: worst {t['worst']:.3f}: "
              f"{'PASS' if t['ok'] else 'FAIL'}")
    if args.max_ratio is not None and max(args.tokens) < args.ratio_from_tokens:
        print(f"  target ratio: not checked (no call of >= {args.ratio_from_tokens} tokens)")
    if not figures["targets"]:
        print("  targets: none checked (on CPU only when --max-ratio/--max-extra-us is given)")


def register(targets) -> None:
    """``zeppelin bench kernels``: this module's own parser handles every flag (``run``)."""
    from megatron_zeppelin.bench import register_passthrough

    register_passthrough(targets, "kernels", "our block call vs the raw kernel (ratio, us per "
                         "call, stream and synced); exit 1 on a missed target", run)
