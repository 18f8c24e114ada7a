"""The engine's ring path against the raw kernels of the same blocks, every ring position on one
device (``zeppelin bench engine``, part ``ring``).

One ring group (``--ring-lengths``, fused as the engine fuses a group) on a ring of
``--ring-size`` positions: every position's ``RingGroupRun`` (what the engine runs per ring
group and round: index gathers, the kernel per block, the LSE merge, the dq/dK/dV
accumulation) in this one process, the KV and dKV each position sends handed to the next one
as they are (no transport: its cost is the ``ranks`` parts'). Forward (all rounds) and backward
(all rounds) are timed apart, each the fastest of ``--iters`` runs (``engine_local.fastest``).

Against it: the raw kernel on every block of every round and position, its inputs gathered
beforehand (CUDA: ``aten._flash_attention_forward``/``_backward``, bf16; CPU: the ``torch``
backend's block call, fp32): the ring's kernels with nothing around them. Reported: the ratio
and the overhead per block in microseconds, ``(ring - raw) / blocks``, per phase.

Target (pass/fail): (ring forward + backward) / (raw forward + backward) <= ``--max-ring-ratio``
(CUDA default 1.5: at the default sizes a block's kernels take ~2 ms forward + backward at
GPU-FACTS' 300+ TFLOP/s, and the gathers, the float32 merge and the accumulations move about
2 GB per block, ~0.6 ms at H100's ~3 TB/s). On CPU no target unless one is given.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from megatron_zeppelin.runtime.attention import RingGroupRun, take
from megatron_zeppelin.runtime.zigzag import ZigzagLayout, device_blocks
from megatron_zeppelin.schedule import Phase

DEFAULT_LENGTHS = {"cuda": "16384,4096,4096,4096,4096", "cpu": "1024,256,128,33,5"}


def _rounds(runs: list[RingGroupRun], phase: Phase) -> None:
    """Every round of ``phase`` at every position; position p receives what p-1 sent."""
    for step in range(runs[0].steps(phase)):
        sent = [run.sends(phase, step) for run in runs]
        for run in runs:
            run.compute(phase, step)
        for position, run in enumerate(runs):
            run.receive(phase, step, sent[position - 1])


def _ring_passes(runs, tensors) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, backward) of the ring group at every position; the backward uses the
    forward's out and lse, computed once here."""
    def forward() -> list:
        for run, (q, k, v, _) in zip(runs, tensors):
            run.begin_forward(q, k, v)
        _rounds(runs, Phase.FORWARD)
        return [run.end_forward() for run in runs]

    finals = forward()

    def backward() -> None:
        for run, (q, k, v, dout), (out, lse) in zip(runs, tensors, finals):
            run.begin_backward(dout, q, k, v, out, lse)
        _rounds(runs, Phase.BACKWARD)
        for run in runs:
            run.end_backward()
    return forward, backward


def _raw_kernels(device: torch.device):
    """(forward, backward) raw kernel calls on one block: ``fwd(q, k, v, pieces, causal, scale)
    -> (out, lse, extra)``, ``bwd(dout, q, k, v, out, lse, extra, pieces, causal, scale)``."""
    if device.type != "cuda":
        from megatron_zeppelin.runtime import kernels

        backend = kernels.get("torch")
        return (lambda q, k, v, p, c, s: (*backend.forward(q, k, v, p, c, s), None),
                lambda do, q, k, v, o, lse, extra, p, c, s:
                backend.backward(do, q, k, v, o, lse, p, c, s))
    aten = torch.ops.aten

    def fwd(q, k, v, p, causal, scale):
        out, lse, rng, unused, _ = aten._flash_attention_forward(
            q, k, v, p.cu_q_dev, p.cu_k_dev, p.max_q, p.max_k, 0.0, causal, False, scale=scale)
        return out, lse, (rng, unused)

    def bwd(dout, q, k, v, out, lse, extra, p, causal, scale):
        return aten._flash_attention_backward(dout, q, k, v, out, lse, p.cu_q_dev, p.cu_k_dev,
                                              p.max_q, p.max_k, 0.0, causal, *extra,
                                              scale=scale)
    return fwd, bwd


def _raw_passes(layouts, blocks, tensors, scale, device):
    """(forward, backward, block count): the raw kernel on every block of every round and
    position, inputs gathered (contiguous) beforehand."""
    fwd, bwd = _raw_kernels(device)
    calls = []
    for layout, steps, (q, _, _, dout) in zip(layouts, blocks, tensors):
        for step, step_blocks in enumerate(steps):
            _, k, v, _ = tensors[layout.source(step)]
            for b in step_blocks:
                args = [take(x, b.q_rows).contiguous() for x in (q, dout)] + \
                       [take(x, b.k_rows).contiguous() for x in (k, v)]
                calls.append((*args, b))
    done = [(fwd(q, k, v, b.pieces, b.causal, scale), (dout, q, k, v, b))
            for q, dout, k, v, b in calls]

    def forward() -> None:
        for q, _, k, v, b in calls:
            fwd(q, k, v, b.pieces, b.causal, scale)

    def backward() -> None:
        for (out, lse, extra), (dout, q, k, v, b) in done:
            bwd(dout, q, k, v, out, lse, extra, b.pieces, b.causal, scale)
    return forward, backward, len(calls)


def ring_vs_raw(args: argparse.Namespace) -> dict:
    """The figures of the module docstring (seconds, microseconds, ratio, target)."""
    from megatron_zeppelin.bench.engine_local import fastest, tensors_of

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    lengths = list(args.ring_lengths)  # parsed and checked by engine.parse_args
    scale, size = args.head_dim ** -0.5, args.ring_size
    backend = "native" if device.type == "cuda" else "torch"
    layouts = [ZigzagLayout(lengths, size, p) for p in range(size)]
    blocks = [device_blocks(layout, device) for layout in layouts]
    runs = [RingGroupRun(layout, scale, backend, b) for layout, b in zip(layouts, blocks)]
    tensors = [tensors_of(layout.tokens(), args, device, p) for p, layout in enumerate(layouts)]
    ring_fwd, ring_bwd = _ring_passes(runs, tensors)
    raw_fwd, raw_bwd, count = _raw_passes(layouts, blocks, tensors, scale, device)
    t = fastest({"ring fwd": ring_fwd, "raw fwd": raw_fwd, "ring bwd": ring_bwd,
                 "raw bwd": raw_bwd}, args.iters, args.warmup, device)
    figures = {"lengths": lengths, "ring_size": size, "blocks": count, "seconds": t}
    for phase in ("fwd", "bwd"):
        figures[f"{phase}_ratio"] = t[f"ring {phase}"] / t[f"raw {phase}"]
        figures[f"{phase}_us_per_block"] = (t[f"ring {phase}"] - t[f"raw {phase}"]) / count * 1e6
    figures["ratio"] = (t["ring fwd"] + t["ring bwd"]) / (t["raw fwd"] + t["raw bwd"])
    limit = args.max_ring_ratio
    figures["target"] = None if limit is None else dict(limit=limit,
                                                        ok=figures["ratio"] <= limit)
    return figures


def describe(figures: dict) -> list[str]:
    """The printed lines of ``ring_vs_raw``'s figures."""
    t, f = figures["seconds"], figures
    lines = [f"  ring path, {f['ring_size']} positions on this device, one group "
             f"{f['lengths']}: {f['blocks']} blocks per phase (transport excluded)"]
    for phase in ("fwd", "bwd"):
        lines.append(f"    {phase}: ring {t[f'ring {phase}'] * 1e3:9.2f} ms vs raw kernels of the "
                     f"same blocks {t[f'raw {phase}'] * 1e3:9.2f} ms: {f[f'{phase}_ratio']:.3f}x, "
                     f"{f[f'{phase}_us_per_block']:.1f} us overhead per block")
    target = f["target"]
    verdict = ("not checked (no --max-ring-ratio)" if target is None else
               f"target <= {target['limit']:g}x: {'PASS' if target['ok'] else 'FAIL'}")
    lines.append(f"    fwd + bwd: {f['ratio']:.3f}x ({verdict})")
    return lines
