"""Engine benchmarks that need no real cluster: the local-only plan, and many ranks on one GPU.

* ``local_only``: the batch planned on one rank (every sequence LOCAL: one fused call) run by
  the engine (forward + backward through autograd) against the raw kernels on the same batch:
  on CUDA ``aten._flash_attention_forward``/``_backward`` (bf16; target <= 1.10x), on CPU the
  ``torch`` backend's block call; fastest runs, the two alternating. A world of one gloo rank
  is made in this process.
* ``one_gpu_ranks``: the batch planned on ``ranks`` ranks (2 nodes), every rank a process on
  the one GPU, gloo with the staged transport (CUDA tensors through pinned host buffers):
  engine forward + backward (median of the slowest rank) against one process running the raw
  kernels on the whole batch (fastest run). The ranks share one GPU, so this shows the
  multi-rank CUDA path working and its cost, not a speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_zeppelin.bench.workers import run_spawned


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one run of ``fn``, device work included."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def slowest_rank_seconds(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of ``fn`` on the slowest rank of the world (all ranks start together)."""
    dist.barrier()
    took = torch.tensor([_seconds(fn, device)], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def alternating(variants: dict[str, Callable[[], None]], iters: int, warmup: int,
                timer: Callable[[Callable[[], None]], float],
                reduce: Callable[[list[float]], float] = min) -> dict[str, float]:
    """``reduce`` (default: the fastest) of ``timer(fn)`` seconds per variant; the variants
    alternate within every iteration, so that load from elsewhere on the machine hits them
    alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(warmup + iters):
        for name, fn in variants.items():
            took = timer(fn)
            if index >= warmup:
                times[name].append(took)
    return {name: reduce(values) for name, values in times.items()}


def fastest(variants: dict[str, Callable[[], None]], iters: int, warmup: int,
            device: torch.device) -> dict[str, float]:
    """Fastest seconds of each variant in this process (``alternating``)."""
    return alternating(variants, iters, warmup, lambda fn: _seconds(fn, device))


def tensors_of(tokens: int, args: argparse.Namespace, device: torch.device, seed: int):
    """Random q, k, v, dout of ``tokens`` rows (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, args.head_dim, generator=gen, device=device,
                           dtype=dtype)

    return rand(args.heads), rand(args.kv_heads), rand(args.kv_heads), rand(args.heads)


def rank_batch(plan, rank: int, args: argparse.Namespace, device: torch.device):
    """The rank's attention buffer (``tensors_of``) and its pieces' lengths in buffer order."""
    lengths = [end - start for _, start, end in plan.attention[rank]]
    return tensors_of(plan.attention_tokens()[rank], args, device, rank), lengths


def raw_step(tensors, lengths: list[int], device: torch.device, forward_only: bool
             ) -> Callable[[], None]:
    """The raw kernels on the whole batch as one causal varlen call (forward + backward)."""
    from megatron_zeppelin.runtime import kernels

    q, k, v, dout = tensors
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    pieces = kernels.make_pieces(cu, cu, device)
    scale = q.shape[-1] ** -0.5
    if device.type != "cuda":
        backend = kernels.get("torch")

        def cpu_step() -> None:
            out, lse = backend.forward(q, k, v, pieces, True, scale)
            if not forward_only:
                backend.backward(dout, q, k, v, out, lse, pieces, True, scale)
        return cpu_step
    aten, longest = torch.ops.aten, max(lengths)

    def cuda_step() -> None:
        out, lse, rng, unused, _ = aten._flash_attention_forward(
            q, k, v, pieces.cu_q_dev, pieces.cu_k_dev, longest, longest, 0.0, True, False,
            scale=scale)
        if not forward_only:
            aten._flash_attention_backward(dout, q, k, v, out, lse, pieces.cu_q_dev,
                                           pieces.cu_k_dev, longest, longest, 0.0, True, rng,
                                           unused, scale=scale)
    return cuda_step


def engine_step(engine, tensors, forward_only: bool,
                window: int | None = None) -> Callable[[], None]:
    """One forward (+ backward) of ``engine`` on ``tensors`` (q, k, v, dout); ``window``: the
    sliding window of the call (None: full causal)."""
    q, k, v, dout = tensors

    def step() -> None:
        leaves = [t.detach().requires_grad_(not forward_only) for t in (q, k, v)]
        out = engine.forward(*leaves, window=window)
        if not forward_only:
            out.backward(dout)
    return step


def local_only(args: argparse.Namespace, make_plan) -> dict:
    """The engine on the batch's one-rank plan vs the raw kernels (see the module docstring)."""
    from megatron_zeppelin.runtime.engine import AttentionEngine

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    plan = make_plan(args, 1, 1)
    created = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if created:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                    world_size=1)
        try:
            tensors, lengths = rank_batch(plan, 0, args, device)
            engine = AttentionEngine(plan, 0, dist.group.WORLD, device=device)
            figures = fastest({"engine": engine_step(engine, tensors, args.forward_only),
                               "raw": raw_step(tensors, lengths, device, args.forward_only)},
                              args.iters, args.warmup, device)
            figures["calls"] = sum(len(w.local) for w in engine.waves)
            engine.close()
        finally:
            if created:
                dist.destroy_process_group()
    figures["ratio"] = figures["engine"] / figures["raw"]
    return figures


def _ranks_worker(rank: int, world: int, store: str, out_path: str, args, plan) -> None:
    """One rank on the shared GPU: engine (staged transport) timings, rank 0 also the raw
    whole batch; the slowest rank's median goes to ``out_path``."""
    from megatron_zeppelin.runtime.engine import AttentionEngine

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    device = torch.device("cuda", 0)
    tensors, _ = rank_batch(plan, rank, args, device)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, transport="staged", device=device)
    step = engine_step(engine, tensors, args.forward_only)
    times = [slowest_rank_seconds(step, device) for _ in range(args.warmup + args.iters)]
    figures = {"engine": statistics.median(times[args.warmup:])}
    if rank == 0:
        whole = tensors_of(sum(plan.seqlens), args, device, world)
        figures["single"] = fastest({"single": raw_step(whole, list(plan.seqlens), device,
                                                        args.forward_only)},
                                    args.iters, args.warmup, device)["single"]
        Path(out_path).write_text(json.dumps(figures))
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


def one_gpu_ranks(args: argparse.Namespace, make_plan) -> dict:
    """``args.ranks`` processes on the one GPU (see the module docstring)."""
    plan = make_plan(args, 2, args.ranks // 2)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "figures.json")
        store = os.path.join(tmp, "store")
        run_spawned(_ranks_worker, args.ranks, (args.ranks, store, out_path, args, plan),
                    timeout_s=1800.0, what="bench engine")
        figures = json.loads(Path(out_path).read_text())
    figures["tiers"] = plan.tier_counts()
    figures["ratio"] = figures["engine"] / figures["single"]
    return figures
