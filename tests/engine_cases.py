"""The attention engine tests' cases (plans from the real planner, long-tailed batches) and the
worker that runs one case on one rank against the float64 reference: q, k, v, dout are the
rank's attention buffer ``[tokens, heads, head_dim]``. Used by test_engine.py, test_ulysses.py
and test_gpu.py (through test_engine's names)."""
from __future__ import annotations

import importlib
import random
import time

import torch
import torch.distributed as dist

from conftest import make_cost
from attention_reference import gather_rows, make_batch, max_errors, reference_grads
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.router import RouterTopology
from megatron_zeppelin.runtime.engine import AttentionEngine
from megatron_zeppelin.schedule import LOCAL_CALL_TOKENS

HEAD_DIM = 8
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 5e-2)}


def long_tail(seed: int, count: int, top: int) -> list[int]:
    """A long-tailed batch: one long sequence, a length-1 one, Pareto-distributed others."""
    rng = random.Random(seed)
    lengths = [1, top]
    while len(lengths) < count:
        lengths.append(max(1, min(top // 2, int(3 * rng.paretovariate(0.8)))))
    rng.shuffle(lengths)
    return lengths


def zeppelin_plan(nodes: int, gpus: int, seed: int):
    """A Zeppelin plan whose small capacity forces sharding (first capacity that fits)."""
    world = nodes * gpus
    lengths = long_tail(seed, 10 if world < 8 else 16, 60 * world + 7)
    cost = make_cost("gpt-tiny", "h200-8nic", nodes=nodes, gpus_per_node=gpus)
    for factor in (1.1, 1.3, 1.6):
        capacity = int(sum(lengths) / world * factor) + 1
        try:
            return make_plan("zeppelin", lengths, cost,
                             ZeppelinConfig(capacity_tokens_per_gpu=capacity))
        except ValueError:
            continue
    raise AssertionError(f"no capacity fits the batch {lengths} on {nodes}x{gpus}")


def plan_of(strategy: str, nodes: int, gpus: int, lengths, **options):
    cost = make_cost("gpt-tiny", "h200-8nic", nodes=nodes, gpus_per_node=gpus)
    return make_plan(strategy, lengths, cost, **options)


def case(label, plan, heads=4, kv_heads=2, dtype="float32", modes=("ring",), seed=0,
         local_call_tokens=LOCAL_CALL_TOKENS, backend=None, transport="direct", window=None,
         v_head_dim=None, split=False, sink=False):
    """backend ``native``, ``te`` or ``flash_attn3`` runs that backend's code path through its
    kernel's CPU stand-in (bf16; ``STAND_INS``); transport ``staged`` stages every exchange
    through host buffers, ``ordered`` matches messages by order per rank pair and group as
    NCCL does (``runtime/ordered.py``: an order that only gloo's tags make agree fails);
    window: sliding window; v_head_dim: a value head dim other than HEAD_DIM (multi-latent
    attention); split: a ring group whose
    sequences only partly fit a halo exchange is split as on CUDA (``schedule.HALO_SPLIT``);
    sink: attention-sink logits per head (learnable: the sink's gradient summed over the
    ranks is checked too)."""
    return dict(label=label, plan=plan, heads=heads, kv_heads=kv_heads, dtype=dtype,
                modes=modes, seed=seed, local_call_tokens=local_call_tokens, backend=backend,
                transport=transport, window=window, v_head_dim=v_head_dim, split=split,
                sink=sink)


def router_topology(plan) -> RouterTopology:
    """Latency-free links, one NIC per GPU: the router splits even small flows over proxies."""
    gpus = plan.topology.gpus_per_node
    return RouterTopology(nodes=plan.topology.nodes, gpus_per_node=gpus, nics_per_node=gpus,
                          gpu_to_nic=tuple(range(gpus)), nvlink_byte_per_s=200e9,
                          nvlink_latency_s=0.0, nic_byte_per_s=25e9, nic_latency_s=0.0)


def rank_inputs(plan, rank, batch, dtype):
    """q, k, v (leaves) and dout of the rank's attention buffer."""
    tensors = []
    for name in ("q", "k", "v", "dout"):
        per_seq = dict(enumerate(batch[name]))
        x = (gather_rows(plan, rank, per_seq) if plan.attention[rank]
             else torch.zeros(0, *batch[name][0].shape[1:], dtype=torch.float64))
        tensors.append(x.to(dtype))
    for x in tensors[:3]:
        x.requires_grad_()
    return tensors


STAND_INS = {"native": "flash_standin", "te": "te_standin", "flash_attn3": "flash3_standin"}


def run_case(rank, c, mode, route_group):
    """Forward + backward of case ``c`` in ``mode``; max errors against the reference."""
    plan, (dtype, _) = c["plan"], DTYPES[c["dtype"]]
    batch = make_batch(plan.seqlens, c["heads"], c["kv_heads"], HEAD_DIM, c["seed"],
                       c["v_head_dim"])
    batch = {n: [t.to(dtype).double() for t in ts] for n, ts in batch.items()}  # as computed
    q, k, v, dout = rank_inputs(plan, rank, batch, dtype)
    if c["backend"] in STAND_INS:  # the backend's code path on its kernel's CPU stand-in
        importlib.import_module(STAND_INS[c["backend"]]).install_in_process()
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30, inter_mode=mode,
                             route_group=route_group,
                             router_topology=router_topology(plan) if mode == "routed" else None,
                             local_call_tokens=c["local_call_tokens"], backend=c["backend"],
                             transport=c["transport"], halo_split=c["split"] or None)
    sink = None
    if c["sink"]:  # the same logits on every rank, some above the scores, some below
        gen = torch.Generator().manual_seed(c["seed"])
        sink = (3 * torch.randn(c["heads"], generator=gen)).to(dtype).requires_grad_()
    start = time.perf_counter()
    out = engine.forward(q, k, v, window=c["window"], sink=sink)
    out.backward(dout)
    elapsed = time.perf_counter() - start
    engine.close()
    runs = [ring.halo for waves, _ in engine._prepared.values()
            for wave in waves[c["window"]] for ring in wave.rings]
    proxied = engine.inter.stats()["proxied_slices"] if engine.inter is not None else 0
    seqs = sorted({s for s, _, _ in plan.attention[rank]})
    ref = reference_grads(batch, seqs, HEAD_DIM ** -0.5, c["window"], sink)
    got = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    errors = max_errors(plan, rank, got, ref)
    if sink is not None:  # every rank's part of the gradient, summed, against every sequence's
        total = sink.grad.double()
        dist.all_reduce(total)
        want = sum(r["sink"] for r in reference_grads(
            batch, range(len(plan.seqlens)), HEAD_DIM ** -0.5, c["window"], sink).values())
        errors["sink"] = ((total - want).abs().max() / want.abs().max().clamp(min=1)).item()
    return dict(errors=errors, seconds=elapsed, proxied=proxied, halo=sum(runs),
                runs=len(runs))
