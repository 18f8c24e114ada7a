"""The attention engine on spawned gloo worlds, with plans from the real planner.

Worlds of 2, 4 and 8 processes run several cases each (1x2; 2x2; 2x4 and 4x2 plans on 8
ranks): long-tailed batches with length-1 sequences and lengths not divisible by 2G, a batch
with only local work, one sequence spanning every rank, multi-wave Megatron hybrid-CP plans,
static CP, MHA/GQA/MQA, and the inter-node queue as direct ring P2P, as direct global steps
and as routed global steps; some cases cut the LOCAL queue into many calls (small
``local_call_tokens``: single and batched calls, rows gathered out of buffer order). Output and
dq, dk, dv must match every sequence run alone in float64 within 1e-5 (fp32). The 4-rank world
also records the order of posts, ring steps, polls, LOCAL calls and waits (LOCAL work fills
the waits for traffic), counts host syncs inside the per-round loop (none allowed), and ends
with a peer that fails mid-ring while the others wait on the helper thread. Some cases run the
native backend's code path in bf16 through the kernel stand-in (``flash_standin``) and some
the staged transport (host buffers, the path of several ranks sharing one GPU), and some
the ordered transport (NCCL's matching by order per rank pair and communicator, checked).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import sys
import threading
import time
from collections import deque

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import make_cost
from attention_reference import make_batch
from distributed import run_world
from engine_cases import (DTYPES, HEAD_DIM, case, long_tail, plan_of, rank_inputs,
                          router_topology, run_case, zeppelin_plan)
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.planner import make_plan
import megatron_zeppelin
from megatron_zeppelin.runtime import engine as engine_module
from megatron_zeppelin.runtime import transport as transport_module
from megatron_zeppelin.runtime.attention import RingGroupRun
from megatron_zeppelin.runtime.engine import AttentionEngine, fill
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.schedule import LOCAL_CALL_TOKENS, Phase, local_calls
from megatron_zeppelin.sim import rounds

pytestmark = pytest.mark.distributed


# ----------------------------------------------------------------------------- LOCAL queue

def test_local_calls_batch_short_sequences_and_run_by_ascending_work():
    rng = random.Random(5)
    for _ in range(60):
        lengths = [rng.choice([0, 1, 7, 30, 64, 65, 200, 1000]) for _ in range(rng.randint(0, 30))]
        min_tokens = rng.choice([1, 16, 64, 300])
        calls = local_calls(lengths, min_tokens)
        assert sorted(i for call in calls for i in call) == list(range(len(lengths)))
        works = [sum(lengths[i] ** 2 for i in call) for call in calls]
        assert works == sorted(works), (lengths, min_tokens, calls)
        batches = [w for call, w in zip(calls, works) if lengths[call[0]] < min_tokens]
        assert all(len(call) == 1 for call in calls if lengths[call[0]] >= min_tokens)
        assert all(lengths[i] < min_tokens for call in calls if len(call) > 1 for i in call)
        assert sum(w < min_tokens ** 2 for w in batches) <= 1, (lengths, min_tokens, calls)
        assert all(w < 2 * min_tokens ** 2 for w in batches), (lengths, min_tokens, calls)
        # the simulator prices exactly these calls (1 s per sequence, no launch cost)
        seconds = rounds.local_call_seconds([(n * n, 1.0) for n in lengths], 0.0, min_tokens)
        assert seconds == [float(len(call)) for call in calls]
    assert rounds.LOCAL_CALL_TOKENS == LOCAL_CALL_TOKENS  # the simulator's default: the engine's
    assert local_calls([1, 3, 17, 5, 40, 2, 9], 8) == [(0, 5, 1, 3), (6,), (2,), (4,)]


def test_fill_runs_local_calls_only_while_exchanges_are_in_flight():
    for answers, ran in (([True, True, False], 2), ([False], 0), ([True] * 9, 5)):
        queue, done, polls = deque(range(5)), [], iter(answers)
        assert fill(queue, lambda: next(polls), done.append) == ran
        assert done == list(range(ran)) and list(queue) == list(range(ran, 5))


def test_simulator_runs_local_calls_while_the_exchanges_are_in_flight():
    """sim/rounds.py's model of ``fill``: calls start while the round's exchanges fly (the
    last one may overrun them), the rest waits for a later round or the end."""
    spec = rounds.PassSpec(backward=False, compute_scale=1.0, acc_per_kv_byte=1.0, launch_s=0.0)
    work = [[(float(n * n), seconds) for n, seconds in ((5000, 4.0), (3000, 1.0), (4000, 2.0))]]
    queue = rounds._LocalQueue(work, spec, "engine", np.array([False]))
    assert queue.fill(np.array([0.0]), np.array([2.5])).tolist() == [3.0]  # calls 1 s, 2 s
    assert queue.fill(np.array([5.0]), np.array([-np.inf])).tolist() == [5.0]  # no traffic
    assert queue.rest().tolist() == [4.0] and queue.total.tolist() == [7.0]
    quiet = rounds._LocalQueue(work, spec, "engine", np.array([True]))
    assert quiet.count.tolist() == [1] and quiet.rest().tolist() == [7.0]  # one fused call


# ----------------------------------------------------------------------------- worker side

def _engine_worker(rank: int, world: int, cases: list, failure: bool) -> dict:
    """Every case in every mode on this rank, then (optionally) the failing-peer case."""
    route_group = dist.new_group(list(range(world)))  # the global inter-node steps' group
    results = {"cases": [[run_case(rank, c, mode, route_group if mode != "ring" else None)
                          for mode in c["modes"]] for c in cases]}
    results["errors"] = argument_errors(rank, cases[0]["plan"])
    if failure:
        results["timeline"] = timeline(rank, cases[0]["plan"])
        results["syncs"] = host_syncs(rank, cases[0]["plan"], route_group)
        results["failure"] = failing_peer(rank, world)
    return results


WATCH_DELAY_S = 0.2  # timeline: the helper starts waiting this late, exchanges stay in flight


@contextlib.contextmanager
def patched(*wrappers):
    """Replace ``owner.name`` by ``make(original)`` for each ``(owner, name, make)``."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in wrappers]
    for owner, name, make in wrappers:
        setattr(owner, name, make(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def timeline(rank: int, plan) -> dict:
    """The main thread's events of one forward + backward, with every exchange kept in flight
    for at least WATCH_DELAY_S: ``(post|compute, phase, ring name, step)``, ``(poll, None, in
    flight)``, ``(local, phase, lengths, work)`` per LOCAL call, ``(wait, phase, round)``; and
    the lengths of the rank's LOCAL sequences (``local``)."""
    events = []
    batch = make_batch(plan.seqlens, 4, 2, HEAD_DIM, seed=0)
    q, k, v, dout = rank_inputs(plan, rank, batch, torch.float32)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30, local_call_tokens=4)
    names = {id(ring.layout): ring.comm.name for wave in engine.waves for ring in wave.rings}
    with patched(*recorders(events, names)):
        engine.forward(q, k, v).backward(dout)
    engine.close()
    lengths = sorted(n for wave in engine.waves for call in wave.local for n in call.lengths)
    return dict(events=events, local=lengths)


def recorders(events: list, names: dict) -> list:
    """``patched`` arguments that append ``timeline``'s events (``names``: ring layout id ->
    ring name) and start the helper's waits WATCH_DELAY_S late."""

    def exchange(original):
        def wrapped(self, sends, like, step, **kwargs):
            request = original(self, sends, like, step, **kwargs)
            events.append(("post", Phase(kwargs["phase"]).value, self.name, step))
            return request
        return wrapped

    def compute(original):
        def wrapped(self, phase, step):
            events.append(("compute", phase.value, names[id(self.layout)], step))
            return original(self, phase, step)
        return wrapped

    def local(original):
        def wrapped(self, p, call):
            events.append(("local", p.phase.value, call.lengths, call.work))
            return original(self, p, call)
        return wrapped

    def poll(original):
        def wrapped(self):
            in_flight = original(self)
            events.append(("poll", None, in_flight))
            return in_flight
        return wrapped

    def wait(original):
        def wrapped(self, p, r, posted):
            events.append(("wait", p.phase.value, r))
            return original(self, p, r, posted)
        return wrapped

    def delayed(original):
        def wrapped(self):
            if threading.current_thread().name.startswith("zeppelin-p2p-wait"):
                time.sleep(WATCH_DELAY_S)
            return original(self)
        return wrapped

    return [(RingComm, "exchange", exchange), (AttentionEngine, "_local", local),
            (RingGroupRun, "compute", compute), (engine_module.PostedRound, "in_flight", poll),
            (AttentionEngine, "_complete", wait),
            (transport_module._HostPending, "_wait_works", delayed)]


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
PACKAGE = os.path.dirname(megatron_zeppelin.__file__)


def sync_counters(hits: list[str]) -> list:
    """``patched`` arguments that append to ``hits`` every call of a tensor method in SYNCS
    made from the package's code (where, by name, file and line)."""

    def counting(name, original):
        def wrapped(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                hits.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return original(self, *args, **kwargs)
        return wrapped

    return [(torch.Tensor, name, lambda original, name=name: counting(name, original))
            for name in SYNCS]


def host_syncs(rank: int, plan, route_group) -> dict:
    """Forward + backward on prepared engines (rings, LOCAL calls; torch fp32 and the native
    path in bf16; ring and routed inter-node steps) with every tensor method that reads values
    back to the host patched: the calls made from the package's code, per case."""
    from flash_standin import install_in_process

    install_in_process()
    hits: list[str] = []
    report = {}
    for mode, dtype, backend in (("ring", torch.float32, "torch"),
                                 ("routed", torch.bfloat16, "native")):
        batch = make_batch(plan.seqlens, 4, 2, HEAD_DIM, seed=4)
        q, k, v, dout = rank_inputs(plan, rank, batch, dtype)
        engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30, inter_mode=mode,
                                 route_group=route_group, backend=backend, device="cpu",
                                 router_topology=router_topology(plan) if mode == "routed"
                                 else None, local_call_tokens=8)
        with patched(*sync_counters(hits)):
            engine.forward(q, k, v).backward(dout)
        engine.close()
        report[f"{mode}/{backend}"] = list(hits)
        hits.clear()
    return report


def argument_errors(rank, plan) -> list[str]:
    """Messages of the engine's argument checks."""
    messages = []
    for kwargs in (dict(rank=(rank + 1) % plan.topology.world_size), dict(inter_mode="nic"),
                   dict(inter_mode="routed"), dict(timeout_s=0), dict(local_call_tokens=0)):
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


def failing_plan(world: int):
    """One sequence on a ring over every rank and LOCAL sequences on every rank."""
    plan = make_plan("zeppelin", [100 * world + 3, 3, 5, 2, 7, 4, 6, 1, 9],
                     make_cost("gpt-tiny", "h200-8nic", nodes=2, gpus_per_node=world // 2),
                     ZeppelinConfig(capacity_tokens_per_gpu=30 * world + 10))
    shape = sorted((g.tier.name, len(g.ring)) for g in plan.ring_groups)
    assert shape.count(("LOCAL", 1)) == world and len(shape) == world + 1 and \
        max(n for _, n in shape) == world, f"the failing-peer plan changed: {shape}"
    return plan


def failing_peer(rank: int, world: int) -> dict:
    """A ring over every rank plus LOCAL work, kept queued (no fill) so that every wait runs
    on the helper thread; FAILING_RANK raises before posting forward step 1 and stays alive
    (silent); the others must fail with the timeout error, not hang."""
    plan = failing_plan(world)
    batch = make_batch(plan.seqlens, 4, 2, HEAD_DIM, seed=9)
    q, k, v, dout = rank_inputs(plan, rank, batch, torch.float32)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=FAILURE_TIMEOUT_S)
    # LOCAL work waits to the end; the one poll starts the waits on the helper thread
    engine_module.fill = lambda queue, in_flight, run: in_flight() and 0
    if rank == FAILING_RANK:
        original = RingComm.exchange

        def exchange(self, sends, like, step, **kwargs):
            if step == 1 and kwargs.get("phase") is Phase.FORWARD:
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
    ring = next(g.ring for g in plan.ring_groups if len(g.ring) == world)
    helper = any(t.name.startswith("zeppelin-p2p-wait") for t in threading.enumerate())
    return dict(outcome=outcome, seconds=elapsed, ring=str(ring), helper=helper)


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
                         "local_call_tokens=0 is invalid", "the rank's attention tokens"):
            assert expected in messages, f"rank {rank}: no error '{expected}' in {messages}"


def check_tiers(cases, want=("inter", "intra", "local")) -> None:
    seen = {tier for c in cases for tier, n in c["plan"].tier_counts().items() if n}
    assert set(want) <= seen, f"the cases cover tiers {sorted(seen)}, need {list(want)}"


def test_engine_world_of_2():
    only_local = [1, 3, 17, 5, 40, 2, 9]
    cases = [
        case("zeppelin 1x2 long tail, ordered", zeppelin_plan(1, 2, 0), kv_heads=2,
             local_call_tokens=6, transport="ordered"),
        case("zeppelin 1x2 only local", plan_of("zeppelin", 1, 2, only_local), kv_heads=1),
        case("static-cp 1x2 one sequence", plan_of("static-cp", 1, 2, [101], cp_size=2),
             kv_heads=4, seed=1),
        case("megatron hybrid-cp 1x2 waves",
             plan_of("megatron-hybrid-cp", 1, 2, [400, 150, 90, 33, 17, 8, 5, 1, 1, 60, 23]),
             seed=2, transport="ordered"),
        case("zeppelin 1x2 bf16", zeppelin_plan(1, 2, 1), dtype="bfloat16", seed=3,
             local_call_tokens=3),
        case("zeppelin 1x2 native bf16, staged", zeppelin_plan(1, 2, 0), dtype="bfloat16",
             seed=4, local_call_tokens=6, backend="native", transport="staged"),
        case("zeppelin 1x2 only local, window 4, value head dim 12",
             plan_of("zeppelin", 1, 2, only_local), seed=6, window=4, v_head_dim=12),
        case("zeppelin 1x2 long tail, attention sink", zeppelin_plan(1, 2, 2), seed=7,
             sink=True, local_call_tokens=6),
        case("zeppelin 1x2 attention sink, window 5, bf16", zeppelin_plan(1, 2, 3), seed=8,
             sink=True, window=5, dtype="bfloat16"),
    ]
    assert all(t.tier.name == "LOCAL" for t in cases[1]["plan"].tasks)
    assert cases[3]["plan"].num_waves > 1
    check_tiers(cases, ("intra", "local"))
    check_results(cases, run_world(_engine_worker, 2, cases, False), 2)


def test_engine_world_of_4_and_failing_peer():
    cases = [
        case("zeppelin 2x2 seed 0", zeppelin_plan(2, 2, 0), modes=("ring", "direct", "routed")),
        case("zeppelin 2x2 seed 3 MQA, ordered", zeppelin_plan(2, 2, 3), kv_heads=1,
             modes=("ring", "routed"), seed=1, local_call_tokens=5, transport="ordered"),
        case("static-cp 2x2 one sequence over all", plan_of("static-cp", 2, 2, [203],
                                                            cp_size=4),
             modes=("ring", "routed"), seed=2, transport="ordered"),
        case("megatron hybrid-cp 2x2", plan_of("megatron-hybrid-cp", 2, 2, long_tail(1, 12, 32)),
             kv_heads=4, seed=3),
        case("zeppelin 2x2 native bf16, staged", zeppelin_plan(2, 2, 0), dtype="bfloat16",
             modes=("ring", "routed"), seed=5, backend="native", transport="staged"),
        case("zeppelin 2x2 window 9, value head dim 4", zeppelin_plan(2, 2, 0),
             modes=("ring", "routed"), seed=6, window=9, v_head_dim=4, local_call_tokens=5),
        case("zeppelin 2x2 native bf16, window 30, value head dim 16", zeppelin_plan(2, 2, 3),
             dtype="bfloat16", modes=("ring",), seed=7, backend="native", window=30,
             v_head_dim=16),
        case("zeppelin 2x2 te bf16 (TE 2.15), window 9, value head dim 16",
             zeppelin_plan(2, 2, 0), dtype="bfloat16", modes=("ring",), seed=7, backend="te",
             window=9, v_head_dim=16),
        case("zeppelin 2x2 flash_attn3 bf16, value head dim 16", zeppelin_plan(2, 2, 0),
             dtype="bfloat16", modes=("ring", "routed"), seed=5, backend="flash_attn3",
             v_head_dim=16),
        case("zeppelin 2x2 attention sink, value head dim 12", zeppelin_plan(2, 2, 0),
             modes=("ring", "routed"), seed=9, v_head_dim=12, sink=True),
        case("static-cp 1x4 window 5, halo exchange, ordered",
             plan_of("static-cp", 1, 4, [203, 90, 41], cp_size=4), modes=("ring",), seed=8,
             window=5, v_head_dim=12, transport="ordered"),
        case("static-cp 2x2 window 3: halo with ring P2P, and across nodes both ways in the "
             "global steps", plan_of("static-cp", 2, 2, [160, 64], cp_size=4),
             modes=("ring", "routed"), seed=9, window=3),
        case("static-cp 1x4 window 6: the long sequences by halo, the short ones round the "
             "ring, one group split as on CUDA", plan_of("static-cp", 1, 4, [9, 120, 30, 77, 5],
                                                         cp_size=4),
             modes=("ring",), seed=10, window=6, kv_heads=1, transport="ordered", split=True),
        case("static-cp 1x4 window 6, on CPU: the group round the ring",
             plan_of("static-cp", 1, 4, [9, 120, 30, 77, 5], cp_size=4), seed=10, window=6),
        case("static-cp 2x2 window 6, split as on CUDA: the halo run and the ring run both "
             "in the global steps, ordered", plan_of("static-cp", 2, 2, [9, 120, 30, 77, 5],
                                                     cp_size=4),
             modes=("direct", "routed"), seed=11, window=6, transport="ordered", split=True),
    ]
    check_tiers(cases)
    assert cases[3]["plan"].num_waves > 1 and cases[0]["plan"].num_waves == 1  # timeline: one
    results = run_world(_engine_worker, 4, cases, True)
    check_results(cases, results, 4)
    for result in results:  # the halo ran where it fits, across nodes too
        assert [got["halo"] for got in result["cases"][-5]] == [1]
        assert [got["halo"] for got in result["cases"][-4]] == [1, 1]
    # ranks 0-1 also run the 5-token sequence's ring of two (static CP gives it 2 ranks)
    assert [[(got["halo"], got["runs"]) for got in r["cases"][-3]] for r in results] == \
        [[(1, 3)], [(1, 3)], [(1, 2)], [(1, 2)]]
    assert [[(got["halo"], got["runs"]) for got in r["cases"][-2]] for r in results] == \
        [[(0, 2)], [(0, 2)], [(0, 1)], [(0, 1)]]
    assert [[(got["halo"], got["runs"]) for got in r["cases"][-1]] for r in results] == \
        [[(1, 3)] * 2, [(1, 3)] * 2, [(1, 2)] * 2, [(1, 2)] * 2]
    for rank, result in enumerate(results):
        check_timeline(rank, result["timeline"])
        assert result["syncs"].keys() == {"ring/torch", "routed/native"}
        for what, hits in result["syncs"].items():
            assert not hits, f"rank {rank} {what}: host syncs in the per-round loop: {hits}"
        failure = result["failure"]
        if rank == FAILING_RANK:
            assert "injected failure" in failure["outcome"]
            continue
        assert "did not complete within 1 s" in failure["outcome"], failure
        assert failure["helper"], f"rank {rank} waited inline: the helper's failure is untested"
        assert failure["ring"] in failure["outcome"] and "step" in failure["outcome"]
        assert failure["seconds"] < 10 * FAILURE_TIMEOUT_S, failure


def phases(events: list) -> dict[str, list]:
    """The timeline cut into forward and backward (polls carry no phase)."""
    cut = next(i for i, e in enumerate(events) if e[1] == "backward")
    return {"forward": events[:cut], "backward": events[cut:]}


def check_timeline(rank: int, timeline: dict) -> None:
    """Per phase and round: posts, ring steps (INTER before INTRA), then LOCAL calls each
    right after a poll that found the round's exchanges in flight, and the wait right after
    a poll that found them done (or once the LOCAL queue is empty); the LOCAL calls left run
    after the last wait. Every LOCAL sequence runs once per phase, calls by ascending work;
    with exchanges kept in flight, LOCAL work fills the first round that has traffic."""
    code = {"post": "P", "compute": "C", "local": "L", "wait": "W"}
    for phase, events in phases([tuple(e) for e in timeline["events"]]).items():
        kinds = "".join("T" if e == ("poll", None, True) else "F" if e[0] == "poll"
                        else code[e[0]] for e in events)
        *rounds_, tail = kinds.split("W")
        for r, text in enumerate(rounds_):
            assert re.fullmatch(r"P*C*(TL)*F?", text), (rank, phase, r, kinds)
            assert "P" not in text or "C" in text, (rank, phase, r, kinds)  # traffic overlaps
        assert re.fullmatch(r"L*", tail), (rank, phase, kinds)
        calls = [e for e in events if e[0] == "local"]
        assert sorted(n for e in calls for n in e[2]) == timeline["local"], (rank, phase)
        assert [e[3] for e in calls] == sorted(e[3] for e in calls), (rank, phase, calls)
        tiers = [e[2].split()[0] for e in events if e[0] == "compute"]
        for text, start in zip(rounds_, itertools.accumulate([0] + [len(t) + 1
                                                                   for t in rounds_])):
            steps = [e[2].split()[0] for e in events[start:start + len(text)]
                     if e[0] == "compute"]
            assert steps == sorted(steps), (rank, phase, steps)  # INTER before INTRA
        if timeline["local"] and tiers and "P" in rounds_[0]:
            assert "TL" in rounds_[0], f"rank {rank} {phase}: no LOCAL call filled round 0"


def test_engine_world_of_8():
    cases = [
        case("zeppelin 2x4 seed 0", zeppelin_plan(2, 4, 0), modes=("ring", "routed")),
        case("zeppelin 4x2 seed 2, ordered", zeppelin_plan(4, 2, 2), kv_heads=1,
             modes=("ring", "direct", "routed"), seed=1, local_call_tokens=4,
             transport="ordered"),
        case("static-cp 4x2", plan_of("static-cp", 4, 2, long_tail(4, 12, 90)), seed=2),
        case("megatron hybrid-cp 2x4, ordered",
             plan_of("megatron-hybrid-cp", 2, 4, long_tail(2, 16, 300)), seed=3,
             transport="ordered"),
        case("static-cp 4x2 one sequence over all", plan_of("static-cp", 4, 2, [133],
                                                            cp_size=8),
             kv_heads=4, modes=("routed",), seed=4),
    ]
    check_tiers(cases)
    results = run_world(_engine_worker, 8, cases, False, timeout_s=150)
    check_results(cases, results, 8)
    proxied = sum(r["cases"][0][1]["proxied"] for r in results)
    assert proxied > 0, "the routed 2x4 case never relayed a slice through a proxy"
