"""Benchmark of the block call: our kernel call vs the raw kernel, same inputs, side by side.

``zeppelin bench kernels --device cuda`` times, per call size, the native backend's block call
(``backend.forward``/``backward`` on precomputed ``Pieces``, what the engine runs) against
``aten._flash_attention_forward``/``_backward`` called directly with the same tensors, and
prints microseconds per call, the ratio and the extra microseconds per call. Targets (issue 9):
ratio <= 1.05 at >= 4K tokens and <= 20 us extra per call.

On CPU (``--device cpu``, the default) the GPU kernel does not exist; what is meaningful there:

* the ``torch`` backend's block call (one document: one pair) against the raw
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward) on the same inputs;
* the native backend's own host overhead: its block call with a kernel that returns
  preallocated results at once (``InstantFlashOps``) against calling that kernel directly,
  i.e. the Python the block call adds to every GPU kernel launch.

Times are the fastest of ``--repeats`` runs of ``--iters`` back-to-back calls (one device sync
per run), so per-call figures include launch costs but not syncs.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

DEFAULTS = {"cuda": dict(heads=32, kv_heads=8, head_dim=128, tokens="64,1024,4096,16384,65536"),
            "cpu": dict(heads=4, kv_heads=2, head_dim=64, tokens="64,256,1024,4096")}
TARGET_RATIO, TARGET_EXTRA_US, TARGET_TOKENS = 1.05, 20.0, 4096


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zeppelin bench kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--tokens", default=None,
                        help="comma-separated tokens per call (one causal document each)")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (fastest kept)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("heads", "kv_heads", "head_dim", "iters", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads={args.kv_heads} must divide --heads={args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    try:
        args.tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--tokens={args.tokens!r} is invalid: expected integers")
    if not args.tokens or min(args.tokens) < 1:
        parser.error(f"--tokens={args.tokens!r} is invalid: expected positive integers")
    return args


def per_call_us(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Fastest mean microseconds per call of ``fn`` over ``repeats`` runs of ``iters`` calls."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
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


def _inputs(tokens: int, args: argparse.Namespace, dtype: torch.dtype):
    gen = torch.Generator(device=args.device).manual_seed(tokens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, args.head_dim, generator=gen, device=args.device,
                           dtype=dtype)

    return rand(args.heads), rand(args.kv_heads), rand(args.kv_heads), rand(args.heads)


def _row(what: str, tokens: int, ours: float, raw: float) -> dict:
    return dict(what=what, tokens=tokens, ours_us=ours, raw_us=raw, ratio=ours / raw,
                extra_us=ours - raw)


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
    fwd = (per_call_us(lambda: backend.forward(q, k, v, pieces, True, scale), args),
           per_call_us(lambda: aten._flash_attention_forward(
               q, k, v, pieces.cu_q_dev, pieces.cu_k_dev, tokens, tokens, 0.0, True, False,
               scale=scale), args))
    bwd = (per_call_us(lambda: backend.backward(dout, q, k, v, out, lse, pieces, True, scale),
                       args),
           per_call_us(lambda: aten._flash_attention_backward(
               dout, q, k, v, raw_out, raw_lse, pieces.cu_q_dev, pieces.cu_k_dev, tokens, tokens,
               0.0, True, rng, unused, scale=scale), args))
    return [_row("native fwd", tokens, *fwd), _row("native bwd", tokens, *bwd)]


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
    fwd = (per_call_us(lambda: backend.forward(q, k, v, pieces, True, scale), args),
           per_call_us(lambda: aten._scaled_dot_product_flash_attention_for_cpu(
               b[0], b[1], b[2], 0.0, True, scale=scale), args))
    bwd = (per_call_us(lambda: backend.backward(dout, q, k, v, out, lse, pieces, True, scale),
                       args),
           per_call_us(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
               b[3], b[0], b[1], b[2], raw_out, raw_lse, 0.0, True, scale=scale), args))
    return [_row("torch fwd", tokens, *fwd), _row("torch bwd", tokens, *bwd)]


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
    fwd = (per_call_us(lambda: backend.forward(q, k, v, pieces, True, scale), args),
           per_call_us(lambda: ops.forward(*call, scale=scale), args))
    bwd = (per_call_us(lambda: backend.backward(dout, q, k, v, q, lse, pieces, True, scale),
                       args),
           per_call_us(lambda: ops.backward(dout, *call[:3], q, lse, *call[3:7], True, None,
                                            None, scale=scale), args))
    return [_row("native host fwd", tokens, *fwd), _row("native host bwd", tokens, *bwd)]


def run(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); print and return the figures."""
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for tokens in args.tokens:
        rows += (native_vs_aten if args.device == "cuda" else torch_vs_aten_cpu)(tokens, args)
    if args.device == "cpu":
        rows += native_host_overhead(args)
    figures = {"device": args.device, "heads": args.heads, "kv_heads": args.kv_heads,
               "head_dim": args.head_dim, "rows": rows, "targets": targets(rows, args.device)}
    _print(figures, args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


def targets(rows: list[dict], device: str) -> dict:
    """The issue's targets on the rows they apply to (the native kernel on CUDA)."""
    if device != "cuda":
        return {}
    big = [r for r in rows if r["tokens"] >= TARGET_TOKENS]
    return {"max_ratio_at_4k_plus": max((r["ratio"] for r in big), default=None),
            "max_extra_us": max(r["extra_us"] for r in rows),
            "ratio_ok": all(r["ratio"] <= TARGET_RATIO for r in big),
            "extra_ok": all(r["extra_us"] <= TARGET_EXTRA_US for r in rows)}


def _print(figures: dict, args: argparse.Namespace) -> None:
    dtype = "bf16" if args.device == "cuda" else "fp32 (native host rows: bf16)"
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"block call vs raw kernel on {where}, {dtype}, heads {args.heads}/{args.kv_heads} kv, "
          f"head_dim {args.head_dim}, causal, one document per call, fastest of "
          f"{args.repeats} x {args.iters} calls")
    print(f"  {'call':<16} {'tokens':>7} {'ours us':>10} {'raw us':>10} {'ratio':>7} "
          f"{'extra us':>9}")
    for r in figures["rows"]:
        print(f"  {r['what']:<16} {r['tokens']:>7} {r['ours_us']:>10.1f} {r['raw_us']:>10.1f} "
              f"{r['ratio']:>7.3f} {r['extra_us']:>9.1f}")
    t = figures["targets"]
    if t:
        print(f"  target: ratio <= {TARGET_RATIO} at >= {TARGET_TOKENS} tokens (worst "
              f"{t['max_ratio_at_4k_plus']:.3f}: {'met' if t['ratio_ok'] else 'MISSED'}); "
              f"<= {TARGET_EXTRA_US:g} us extra per call (worst {t['max_extra_us']:.1f}: "
              f"{'met' if t['extra_ok'] else 'MISSED'})")


def register(targets) -> None:
    """``zeppelin bench kernels``: this module's own parser handles every flag (``run``)."""
    from megatron_zeppelin.bench import register_passthrough

    register_passthrough(targets, "kernels", "our block call vs the raw kernel (ratio, us per "
                         "call)", run)
