"""Helpers for the attention-engine tests: spawned gloo worlds and a float64 reference.

``spawn_world(world, target, *args)`` runs ``target(rank, world, *args)`` in ``world`` spawned
processes joined in one gloo group (file:// rendezvous, so no port is guessed), each with one
intra-op thread, and returns every rank's (JSON-able) return value. A world that has not
finished within ``timeout_s`` is killed and the test fails, so a deadlock cannot hang CI.

The reference: every sequence alone, causal attention in float64 with autograd.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_zeppelin.plan import Plan


def _child(rank: int, world: int, store: str, out_dir: str, target: Callable, args: tuple):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        result = {"ok": target(rank, world, *args)}
    except BaseException:  # reported to the parent, which fails the test with the traceback
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip destroy_process_group: a rank that timed out may have closed pairs


def spawn_world(world: int, target: Callable, *args, timeout_s: float = 90.0) -> list:
    """Run ``target(rank, world, *args)`` on ``world`` gloo ranks; their return values."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_child, args=(world, os.path.join(tmp, "store"), tmp, target,
                                                   args),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world} ranks did not finish within "
                                       f"{timeout_s:g} s (deadlock?)")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world):
            path = Path(tmp, f"rank{rank}.json")
            assert path.exists(), f"rank {rank} wrote no result"
            data = json.loads(path.read_text())
            assert "error" not in data, f"rank {rank} failed:\n{data['error']}"
            results.append(data["ok"])
        return results


# ----------------------------------------------------------------------------- reference

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of one sequence: q ``[s, h, d]``, k/v ``[s, g, d]`` -> ``[s, h, d]``."""
    s, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_batch(seqlens: Sequence[int], heads: int, kv_heads: int, head_dim: int,
               seed: int) -> dict[str, list[torch.Tensor]]:
    """Per sequence float64 q, k, v, dout (the same on every rank for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": heads, "k": kv_heads, "v": kv_heads, "dout": heads}
    return {name: [torch.randn(n, h, head_dim, generator=gen, dtype=torch.float64)
                   for n in seqlens] for name, h in shapes.items()}


def reference_grads(batch: dict[str, list[torch.Tensor]], seqs: Sequence[int],
                    scale: float) -> dict[int, dict[str, torch.Tensor]]:
    """out, dq, dk, dv of sequences ``seqs`` (float64), each alone."""
    result = {}
    for s in seqs:
        q, k, v = (batch[n][s].clone().requires_grad_() for n in ("q", "k", "v"))
        out = reference_attention(q, k, v, scale)
        out.backward(batch["dout"][s])
        result[s] = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    return result


def gather_rows(plan: Plan, rank: int, per_seq: dict) -> torch.Tensor:
    """The rank's attention buffer ``[tokens, ...]`` built from per-sequence tensors."""
    return torch.cat([per_seq[seq][start:end] for seq, start, end in plan.attention[rank]])


def max_errors(plan: Plan, rank: int, got: dict[str, torch.Tensor],
               ref: dict[int, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Largest |got - reference| of out, dq, dk, dv on this rank's rows."""
    if not plan.attention[rank]:
        return {name: 0.0 if tensor.numel() == 0 else float("inf") for name, tensor in got.items()}
    errors = {}
    for name, tensor in got.items():
        want = gather_rows(plan, rank, {s: r[name] for s, r in ref.items()})
        errors[name] = (tensor.double() - want).abs().max().item()
    return errors
