"""Ulysses (FlexSP) all-to-all attention in the engine, on gloo worlds of 2 and 4 ranks.

Plans are built by hand (groups of 1, 2, 3 and 4 ranks at once, overlapping groups, a group
listed in reverse rank order, a length-1 document, ranks without any token) and by the FlexSP
planner. Output and dq, dk, dv must match every sequence run alone in float64 within 1e-5
(fp32): MHA, GQA with KV heads straddling the head split, MQA with KV heads replicated, head
counts the group size does not divide; the native backend's path in bf16 through the flash
stand-in; the staged transport; no host sync inside a call; a silent peer makes the others fail
within their timeout, naming the all-to-all.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from conftest import make_cost
from distributed import run_world
from megatron_zeppelin.plan import (AttentionTask, Plan, PlanError, Segment, Topology,
                                    attention_layout_of)
from megatron_zeppelin.plan import ring_groups_of
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.runtime.engine import AttentionEngine
from megatron_zeppelin.runtime.ulysses import head_range, kv_heads_for
from attention_reference import make_batch
from test_engine import DTYPES, HEAD_DIM, case, patched, rank_inputs, run_case, sync_counters

pytestmark = pytest.mark.distributed


def ulysses_plan(nodes: int, gpus: int, seqlens, rings, kind: str = "ulysses") -> Plan:
    """A plan attending sequence i over ``rings[i]`` (no remap: linear = attention layout)."""
    topology = Topology(nodes, gpus)
    tasks = tuple(AttentionTask(i, tuple(r), topology.tier_of(tuple(r)))
                  for i, r in enumerate(rings))
    layout = attention_layout_of(ring_groups_of(tasks, topology), seqlens, topology.world_size)
    return Plan("flexsp", topology, tuple(seqlens), tuple(Segment(i, 0, n) for i, n in
                                                          enumerate(seqlens)),
                tasks, layout, capacity=sum(seqlens), attention_kind=kind)


# ----------------------------------------------------------------------------- host side

def test_heads_split_unevenly_and_kv_heads_follow_their_query_heads():
    for heads in range(1, 13):
        for size in range(1, heads + 1):
            ranges = [head_range(heads, size, p) for p in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == heads
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
            for kv in (k for k in range(1, heads + 1) if heads % k == 0):
                for a, b in ranges:
                    kept = kv_heads_for(heads, kv, a, b)
                    width = (b - a) // len(kept)
                    assert (b - a) % len(kept) == 0
                    assert [kept[t // width] for t in range(b - a)] == \
                        [(a + t) // (heads // kv) for t in range(b - a)]
    for heads, kv, size in ((8, 2, 4), (8, 8, 4), (8, 1, 8), (32, 8, 4), (32, 8, 16)):
        # the docstring's traffic: a group moves max(g, kv_heads) KV heads when g divides heads
        moved = sum(len(kv_heads_for(heads, kv, *head_range(heads, size, p)))
                    for p in range(size))
        assert moved == max(size, kv), (heads, kv, size, moved)
    assert kv_heads_for(8, 2, 0, 4) == (0,)  # an even split keeps the grouping: no copy
    assert kv_heads_for(8, 1, 3, 6) == (0,)  # MQA: one head, replicated on every rank
    assert kv_heads_for(6, 2, 2, 4) == (0, 1)  # straddles two KV groups
    assert kv_heads_for(8, 2, 3, 6) == (0, 1, 1)  # uneven: one KV head per query head


def test_plan_checks_accept_ulysses_plans_and_reject_malformed_ones():
    good = ulysses_plan(1, 4, [50, 1, 9, 23], [(0, 1, 2, 3), (2,), (3, 1), (0, 1, 2)])
    assert good.validate() is good
    flexsp = make_plan("flexsp", [3000, 900, 40, 7], make_cost("gpt-tiny", nodes=1,
                                                               gpus_per_node=4))
    assert flexsp.attention_kind == "ulysses" and flexsp.validate() is flexsp
    bad = {
        "attention_kind='ulyses'": ulysses_plan(1, 2, [8], [(0, 1)], kind="ulyses"),
        "zigzag needs at least 4 tokens": ulysses_plan(1, 2, [3], [(0, 1)]),
        "expected distinct ranks": ulysses_plan(1, 2, [8], [(1, 1)]),
    }
    for expected, plan in bad.items():
        with pytest.raises(PlanError, match=expected):
            plan.validate()


def test_an_unknown_attention_kind_is_refused_by_name():
    plan = ulysses_plan(1, 2, [8], [(0, 1)], kind="magic")
    with pytest.raises(ValueError) as refused:
        AttentionEngine(plan, 0, None)
    assert "attention_kind='magic'" in str(refused.value)
    assert "['ring', 'ulysses']" in str(refused.value)


# ----------------------------------------------------------------------------- worlds

def _worker(rank: int, world: int, cases: list, checks: bool) -> dict:
    results = {"cases": [run_case(rank, c, "ring", None) for c in cases]}
    if checks:
        results["syncs"] = _host_syncs(rank, cases[0]["plan"])
        results["too_many"] = _too_many_ranks(rank, cases[0]["plan"])
        results["failure"] = _failing_peer(rank, cases[0]["plan"])  # last: breaks the group
    return results


def _host_syncs(rank: int, plan) -> list[str]:
    """Tensor methods that read values back to the host, called from the package during a
    prepared forward + backward (native path in bf16 through the stand-in): none allowed."""
    from flash_standin import install_in_process

    install_in_process()
    hits: list[str] = []

    q, k, v, dout = rank_inputs(plan, rank, make_batch(plan.seqlens, 4, 2, HEAD_DIM, 3),
                                torch.bfloat16)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30, backend="native",
                             device="cpu")
    # the cases before ran these head counts: the indices were built ahead, with the engine
    ahead = set(engine.ulysses._indices) == {(torch.device("cpu"), h, g)
                                              for h, g in ((4, 4), (4, 2), (3, 1), (5, 5), (3, 3))}
    with patched(*sync_counters(hits)):
        engine.forward(q, k, v).backward(dout)
    return hits + ([] if ahead else [f"not built ahead: {list(engine.ulysses._indices)}"])


def _too_many_ranks(rank: int, plan) -> str:
    """A group larger than the query heads is refused by name (before any collective)."""
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30)
    x = torch.zeros(engine.tokens, 1, HEAD_DIM)
    try:
        engine.forward(x, x, x)
    except ValueError as exc:
        return str(exc)
    return "accepted"


FAILURE_TIMEOUT_S = 1.0


def _failing_peer(rank: int, plan) -> dict:
    """Rank 0 never joins the forward's first all-to-all (alive and silent); rank 1 must fail
    within its timeout with an error naming the all-to-all and the missing rank, not hang."""
    q, k, v, _ = rank_inputs(plan, rank, make_batch(plan.seqlens, 4, 2, HEAD_DIM, 9),
                             torch.float32)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=FAILURE_TIMEOUT_S)
    if rank == 0:
        time.sleep(4 * FAILURE_TIMEOUT_S)
        return {}
    start = time.perf_counter()
    try:
        engine.forward(q, k, v)
        outcome = "finished"
    except RuntimeError as exc:
        outcome = str(exc)
    return dict(outcome=outcome, seconds=time.perf_counter() - start)


def _check(cases, results) -> None:
    for rank, result in enumerate(results):
        for c, got in zip(cases, result["cases"]):
            tol = DTYPES[c["dtype"]][1]
            assert max(got["errors"].values()) <= tol, \
                f"{c['label']}, rank {rank}: errors {got['errors']} exceed {tol}"


def test_ulysses_world_of_2():
    mixed = ulysses_plan(1, 2, [37, 1, 20, 5, 4], [(0, 1), (0,), (1, 0), (1,), (0, 1)])
    empty_rank = ulysses_plan(1, 2, [30, 1], [(0,), (0,)])  # rank 1 holds nothing, no traffic
    all_in_one = ulysses_plan(1, 2, [2, 1, 15], [(1,), (0,), (0, 1)])
    cases = [case("MHA", mixed, heads=4, kv_heads=4),
             case("GQA", mixed, heads=4, kv_heads=2, seed=1),
             case("MQA, 3 heads split 2+1", mixed, heads=3, kv_heads=1, seed=2),
             case("empty rank", empty_rank, heads=2, kv_heads=1),
             case("length-1 documents", all_in_one, heads=5, kv_heads=5, seed=3),
             case("native bf16", mixed, heads=4, kv_heads=2, dtype="bfloat16",
                  backend="native", seed=4),
             case("staged", mixed, heads=3, kv_heads=3, transport="staged", seed=5)]
    results = run_world(_worker, 2, cases, True)
    _check(cases, results)
    for rank, result in enumerate(results):
        assert result["syncs"] == [], f"rank {rank}: host syncs {result['syncs']}"
        assert "a Ulysses group of 2 ranks (0, 1)" in result["too_many"]
        assert "this rank has 1 query heads" in result["too_many"]
    failure = results[1]["failure"]
    assert "Ulysses all-to-all (q/k/v) on rank 1 failed" in failure["outcome"], failure
    assert "expected from ranks [0, 1]" in failure["outcome"], failure
    assert failure["seconds"] < 10 * FAILURE_TIMEOUT_S, failure


def test_ulysses_world_of_4_with_groups_of_every_size():
    # groups of 4, 3, 2 (intra and inter node, overlapping) and 1 at once; rank 3 in three
    groups = ulysses_plan(2, 2, [50, 23, 9, 1, 12, 31, 6],
                          [(0, 1, 2, 3), (0, 1), (2, 3), (2,), (1, 3), (0, 1, 2), (3, 0)])
    empty = ulysses_plan(2, 2, [40, 3, 8], [(2, 0, 1), (0,), (1, 2)])  # rank 3 has no token
    flexsp = make_plan("flexsp", [300, 120, 64, 40, 9, 7, 2, 1],
                       make_cost("gpt-tiny", "h200-8nic", nodes=2, gpus_per_node=2))
    assert flexsp.attention_kind == "ulysses" and any(len(g.ring) > 1
                                                      for g in flexsp.ring_groups)
    cases = [case("GQA", groups, heads=4, kv_heads=2),
             case("KV straddling the split", groups, heads=6, kv_heads=2, seed=1),
             case("MQA", groups, heads=4, kv_heads=1, seed=2),
             case("uneven MHA", groups, heads=5, kv_heads=5, seed=3),
             case("empty rank", empty, heads=4, kv_heads=2, seed=4),
             case("flexsp planner", flexsp, heads=4, kv_heads=2, seed=5),
             case("native bf16", groups, heads=8, kv_heads=2, dtype="bfloat16",
                  backend="native", seed=6)]
    results = run_world(_worker, 4, cases, False)
    _check(cases, results)
