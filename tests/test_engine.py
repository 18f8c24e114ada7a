"""The attention engine on spawned gloo worlds, with plans from the real planner.

Worlds of 2, 4 and 8 processes run several cases each (1x2; 2x2; 2x4 and 4x2 plans on 8
ranks): long-tailed batches with length-1 sequences and lengths not divisible by 2G, a batch
with only local work, one sequence spanning every rank, multi-wave Megatron hybrid-CP plans,
static CP, MHA/GQA/MQA, and the inter-node queue as direct ring P2P, as direct global steps
and as routed global steps. Output and dq, dk, dv must match every sequence run alone in
float64 within 1e-5 (fp32). The 4-rank world ends with a peer that fails mid-ring.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from conftest import make_cost
from attention_reference import gather_rows, make_batch, max_errors, reference_grads
from distributed import run_world
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.router import RouterTopology
from megatron_zeppelin.runtime.attention import RingGroupRun
from megatron_zeppelin.runtime.engine import AttentionEngine
from megatron_zeppelin.runtime.utils import RingComm

pytestmark = pytest.mark.distributed
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


def case(label, plan, heads=4, kv_heads=2, dtype="float32", modes=("ring",), seed=0):
    return dict(label=label, plan=plan, heads=heads, kv_heads=kv_heads, dtype=dtype,
                modes=modes, seed=seed)


def router_topology(plan) -> RouterTopology:
    """Latency-free links, one NIC per GPU: the router splits even small flows over proxies."""
    gpus = plan.topology.gpus_per_node
    return RouterTopology(nodes=plan.topology.nodes, gpus_per_node=gpus, nics_per_node=gpus,
                          gpu_to_nic=tuple(range(gpus)), nvlink_byte_per_s=200e9,
                          nvlink_latency_s=0.0, nic_byte_per_s=25e9, nic_latency_s=0.0)


# ----------------------------------------------------------------------------- worker side

def rank_inputs(plan, rank, batch, dtype):
    """q, k, v (leaves) and dout of the rank's attention buffer."""
    heads, kv_heads = batch["q"][0].shape[1], batch["k"][0].shape[1]
    tensors = []
    for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("dout", heads)):
        per_seq = dict(enumerate(batch[name]))
        x = (gather_rows(plan, rank, per_seq) if plan.attention[rank]
             else torch.zeros(0, h, HEAD_DIM, dtype=torch.float64))
        tensors.append(x.to(dtype))
    for x in tensors[:3]:
        x.requires_grad_()
    return tensors


def run_case(rank, c, mode, route_group):
    """Forward + backward of case ``c`` in ``mode``; max errors against the reference."""
    plan, (dtype, _) = c["plan"], DTYPES[c["dtype"]]
    batch = make_batch(plan.seqlens, c["heads"], c["kv_heads"], HEAD_DIM, c["seed"])
    batch = {n: [t.to(dtype).double() for t in ts] for n, ts in batch.items()}  # as computed
    q, k, v, dout = rank_inputs(plan, rank, batch, dtype)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30, inter_mode=mode,
                             route_group=route_group,
                             router_topology=router_topology(plan) if mode == "routed" else None)
    start = time.perf_counter()
    out = engine.forward(q, k, v)
    out.backward(dout)
    elapsed = time.perf_counter() - start
    engine.close()
    proxied = engine.inter.stats()["proxied_slices"] if engine.inter is not None else 0
    seqs = sorted({s for s, _, _ in plan.attention[rank]})
    ref = reference_grads(batch, seqs, HEAD_DIM ** -0.5)
    got = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    return dict(errors=max_errors(plan, rank, got, ref), seconds=elapsed, proxied=proxied)


def _engine_worker(rank: int, world: int, cases: list, failure: bool) -> dict:
    """Every case in every mode on this rank, then (optionally) the failing-peer case."""
    route_group = dist.new_group(list(range(world)))  # the global inter-node steps' group
    results = {"cases": [[run_case(rank, c, mode, route_group if mode != "ring" else None)
                          for mode in c["modes"]] for c in cases]}
    results["errors"] = argument_errors(rank, cases[0]["plan"])
    if failure:
        results["timeline"] = timeline(rank, cases[0]["plan"])
        results["failure"] = failing_peer(rank, world)
    return results


def timeline(rank: int, plan) -> list:
    """The order of P2P posts, waits and kernel calls of one forward + backward:
    ``(event, queue, phase, step)`` with queue the ring's name or ``LOCAL``."""
    events = []
    batch = make_batch(plan.seqlens, 4, 2, HEAD_DIM, seed=0)
    q, k, v, dout = rank_inputs(plan, rank, batch, torch.float32)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30)
    names = {id(ring.layout): ring.comm.name for wave in engine.waves for ring in wave.rings}
    saved = (RingComm.exchange, RingGroupRun.forward_compute, RingGroupRun.backward_compute,
             AttentionEngine._local)

    def exchange(self, sends, like, step, **kwargs):
        request = saved[0](self, sends, like, step, **kwargs)
        events.append(("post", self.name, kwargs["phase"], step))
        wait = request.wait

        def logged_wait():
            events.append(("wait", self.name, kwargs["phase"], step))
            return wait()
        request.wait = logged_wait
        return request

    def compute(phase, original):
        def wrapped(self, step):
            events.append(("compute", names[id(self.layout)], phase, step))
            return original(self, step)
        return wrapped

    def local(self, phase, part, *args):
        events.append(("compute", "LOCAL", phase, None))
        return saved[3](self, phase, part, *args)

    RingComm.exchange, AttentionEngine._local = exchange, local
    RingGroupRun.forward_compute = compute("forward", saved[1])
    RingGroupRun.backward_compute = compute("backward", saved[2])
    try:
        engine.forward(q, k, v).backward(dout)
    finally:
        (RingComm.exchange, RingGroupRun.forward_compute, RingGroupRun.backward_compute,
         AttentionEngine._local) = saved
    return events


def argument_errors(rank, plan) -> list[str]:
    """Messages of the engine's argument checks."""
    messages = []
    for kwargs in (dict(rank=(rank + 1) % plan.topology.world_size), dict(inter_mode="nic"),
                   dict(inter_mode="routed"), dict(timeout_s=0)):
        try:
            AttentionEngine(plan, kwargs.pop("rank", rank), dist.group.WORLD, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    engine = AttentionEngine(plan, rank, dist.group.WORLD)
    try:
        engine.forward(*(torch.zeros(engine.tokens + 1, 4, HEAD_DIM) for _ in range(3)))
    except ValueError as exc:
        messages.append(str(exc))
    return messages


FAILING_RANK, FAILURE_TIMEOUT_S = 0, 1.0


def failing_peer(rank: int, world: int) -> dict:
    """One sequence over every rank; FAILING_RANK raises before posting forward step 1 and
    stays alive (silent); the others must fail with the timeout error, not hang."""
    plan = plan_of("static-cp", 2, world // 2, [8 * world + 3], cp_size=world)
    batch = make_batch(plan.seqlens, 4, 2, HEAD_DIM, seed=9)
    q, k, v, dout = rank_inputs(plan, rank, batch, torch.float32)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=FAILURE_TIMEOUT_S)
    if rank == FAILING_RANK:
        original = RingComm.exchange

        def exchange(self, sends, like, step, **kwargs):
            if step == 1 and kwargs.get("phase") == "forward":
                raise RuntimeError("injected failure before sending step 1")
            return original(self, sends, like, step, **kwargs)

        RingComm.exchange = exchange
    start = time.perf_counter()
    try:
        engine.forward(q, k, v).backward(dout)
        outcome = "finished"
    except RuntimeError as exc:
        outcome = str(exc)
    elapsed = time.perf_counter() - start
    if rank == FAILING_RANK:
        time.sleep(4 * FAILURE_TIMEOUT_S)  # stay silent while the others time out
    return dict(outcome=outcome, seconds=elapsed, ring=str(plan.ring_groups[0].ring))


# ----------------------------------------------------------------------------- parent side

def check_results(cases, results, world) -> None:
    for rank, result in enumerate(results):
        for c, per_mode in zip(cases, result["cases"]):
            tol = DTYPES[c["dtype"]][1]
            for mode, got in zip(c["modes"], per_mode):
                worst = max(got["errors"].values())
                assert worst <= tol, (f"{c['label']} ({mode}), rank {rank}/{world}: errors "
                                      f"{got['errors']} exceed {tol}")
        messages = " | ".join(result["errors"])
        for expected in ("is not this process's rank", "inter_mode='nic' is invalid",
                         "inter_mode='routed' needs route_group", "timeout_s=0 is invalid",
                         "the rank's attention tokens"):
            assert expected in messages, f"rank {rank}: no error '{expected}' in {messages}"


def check_tiers(cases, want=("inter", "intra", "local")) -> None:
    seen = {tier for c in cases for tier, n in c["plan"].tier_counts().items() if n}
    assert set(want) <= seen, f"the cases cover tiers {sorted(seen)}, need {list(want)}"


def test_engine_world_of_2():
    only_local = [1, 3, 17, 5, 40, 2, 9]
    cases = [
        case("zeppelin 1x2 long tail", zeppelin_plan(1, 2, 0), kv_heads=2),
        case("zeppelin 1x2 only local", plan_of("zeppelin", 1, 2, only_local), kv_heads=1),
        case("static-cp 1x2 one sequence", plan_of("static-cp", 1, 2, [101], cp_size=2),
             kv_heads=4, seed=1),
        case("megatron hybrid-cp 1x2 waves",
             plan_of("megatron-hybrid-cp", 1, 2, [400, 150, 90, 33, 17, 8, 5, 1, 1, 60, 23]),
             seed=2),
        case("zeppelin 1x2 bf16", zeppelin_plan(1, 2, 1), dtype="bfloat16", seed=3),
    ]
    assert all(t.tier.name == "LOCAL" for t in cases[1]["plan"].tasks)
    assert cases[3]["plan"].num_waves > 1
    check_tiers(cases, ("intra", "local"))
    check_results(cases, run_world(_engine_worker, 2, cases, False), 2)


def test_engine_world_of_4_and_failing_peer():
    cases = [
        case("zeppelin 2x2 seed 0", zeppelin_plan(2, 2, 0), modes=("ring", "direct", "routed")),
        case("zeppelin 2x2 seed 3 MQA", zeppelin_plan(2, 2, 3), kv_heads=1,
             modes=("ring", "routed"), seed=1),
        case("static-cp 2x2 one sequence over all", plan_of("static-cp", 2, 2, [203],
                                                            cp_size=4),
             modes=("ring", "routed"), seed=2),
        case("megatron hybrid-cp 2x2", plan_of("megatron-hybrid-cp", 2, 2, long_tail(1, 12, 32)),
             kv_heads=4, seed=3),
    ]
    check_tiers(cases)
    assert cases[3]["plan"].num_waves > 1
    results = run_world(_engine_worker, 4, cases, True)
    check_results(cases, results, 4)
    for rank, result in enumerate(results):
        check_overlap(rank, [tuple(e) for e in result["timeline"]])
        failure = result["failure"]
        if rank == FAILING_RANK:
            assert "injected failure" in failure["outcome"]
            continue
        assert "did not complete within 1 s" in failure["outcome"], failure
        assert failure["ring"] in failure["outcome"] and "step" in failure["outcome"]
        assert failure["seconds"] < 10 * FAILURE_TIMEOUT_S, failure


def check_overlap(rank: int, events: list) -> None:
    """Every exchange is waited only after compute ran while it was in flight; the INTER
    ring's traffic flies while the INTRA ring and the LOCAL queue compute (in that order)."""
    posts = [i for i, e in enumerate(events) if e[0] == "post"]
    assert posts, f"rank {rank} posted no P2P"
    for i in posts:
        _, name, phase, step = events[i]
        j = events.index(("wait", name, phase, step), i)
        window = [e for e in events[i:j] if e[0] == "compute"]
        assert window, f"rank {rank}: {name} {phase} step {step} waited with nothing computed"
        if "INTER" in name and phase == "forward" and step == 0:
            queues = [e[1].split()[0] for e in window]
            have = {e[1].split()[0] for e in events if e[0] == "compute"}
            want = [tier for tier in ("INTER", "INTRA", "LOCAL") if tier in have]
            assert sorted(set(queues), key=queues.index) == want, (rank, queues)


def test_engine_world_of_8():
    cases = [
        case("zeppelin 2x4 seed 0", zeppelin_plan(2, 4, 0), modes=("ring", "routed")),
        case("zeppelin 4x2 seed 2", zeppelin_plan(4, 2, 2), kv_heads=1,
             modes=("ring", "direct", "routed"), seed=1),
        case("static-cp 4x2", plan_of("static-cp", 4, 2, long_tail(4, 12, 90)), seed=2),
        case("megatron hybrid-cp 2x4", plan_of("megatron-hybrid-cp", 2, 4, long_tail(2, 16, 300)),
             seed=3),
        case("static-cp 4x2 one sequence over all", plan_of("static-cp", 4, 2, [133],
                                                            cp_size=8),
             kv_heads=4, modes=("routed",), seed=4),
    ]
    check_tiers(cases)
    results = run_world(_engine_worker, 8, cases, False, timeout_s=150)
    check_results(cases, results, 8)
    proxied = sum(r["cases"][0][1]["proxied"] for r in results)
    assert proxied > 0, "the routed 2x4 case never relayed a slice through a proxy"
