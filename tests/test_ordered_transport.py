"""The ``ordered`` transport: NCCL's order matching on gloo (``runtime/ordered.py``).

On 2-3 gloo ranks: messages deliver as with ``direct``; two same-shaped messages received in
the other order pass gloo's tag matching silently (``direct``) and fail loudly with
``ordered``, naming both ranks and the message index; so do a size mismatch and an all-to-all
that one rank runs before a P2P and its peer after; two process groups over the same ranks are
separate ordering domains (as two NCCL communicators are).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from megatron_zeppelin.runtime.transport import P2P, get_transport

pytestmark = pytest.mark.distributed


def _send_recv(name, group, ops):
    return get_transport(name).post(ops, group, "test exchange", 5.0)


def _swapped(rank: int, world: int, name: str) -> str:
    """Rank 0 sends a (tag 1) then b (tag 2); rank 1 posts its receives the other way round."""
    group = dist.group.WORLD
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    if rank == 0:
        ops = [P2P(True, a, 1, 1, "send a"), P2P(True, b, 1, 2, "send b")]
    else:
        got_b, got_a = torch.zeros(4), torch.zeros(4)
        ops = [P2P(False, got_b, 0, 2, "receive b"), P2P(False, got_a, 0, 1, "receive a")]
    try:
        _send_recv(name, group, ops).wait()
    except RuntimeError as exc:
        return str(exc)
    return "ok" if rank == 0 or (got_a[0] == 1 and got_b[0] == 2) else "swapped data"


def test_an_order_that_only_tags_make_agree_fails_loudly():
    assert run_world(_swapped, 2, "direct") == ["ok", "ok"]  # gloo matches by tag
    results = run_world(_swapped, 2, "ordered")  # rank 0's sends may then fail: it exits
    assert "NCCL order mismatch" in results[1], results
    assert ("message 0 from rank 0 to rank 1: rank 0 sent P2P tag 1 (4,) torch.float32 "
            "(message 0), rank 1 expected P2P tag 2 (4,) torch.float32") in results[1], results


def _sizes(rank: int, world: int) -> str:
    """Rank 0 sends 3 rows, rank 1 expects 5."""
    tensor = torch.ones(3, 2) if rank == 0 else torch.zeros(5, 2)
    try:
        _send_recv("ordered", dist.group.WORLD, [P2P(rank == 0, tensor, 1 - rank, 0, "x")]).wait()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def test_a_size_mismatch_names_both_shapes():
    results = run_world(_sizes, 2, env={"ZEPPELIN_P2P_TIMEOUT_S": "3"})
    assert "rank 0 sent P2P tag 0 (3, 2)" in results[1], results
    assert "rank 1 expected P2P tag 0 (5, 2)" in results[1], results


def _collective_order(rank: int, world: int) -> str:
    """Rank 0 runs an all-to-all then a P2P to rank 1; rank 1 the P2P first."""
    group, ordered = dist.group.WORLD, get_transport("ordered")
    x = torch.arange(world * 2, dtype=torch.float32).reshape(world, 2) + 10 * rank
    received = torch.empty_like(x)
    splits = [1] * world

    def a2a():
        ordered.all_to_all(received, x, splits, splits, group, "test all-to-all", 5.0).wait()

    def p2p():
        if rank in (0, 1):
            ordered.post([P2P(rank == 0, torch.ones(2, 2), 1 - rank, 0, "p2p")], group,
                         "test p2p", 5.0).wait()
    try:
        for step in ((a2a, p2p) if rank != 1 else (p2p, a2a)):
            step()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def test_an_all_to_all_is_ordered_with_the_p2p_of_its_group():
    results = run_world(_collective_order, 3, env={"ZEPPELIN_P2P_TIMEOUT_S": "3"})
    assert any("rank 0 sent all-to-all tag 0 (1, 2)" in r and "rank 1 expected P2P tag 0 (2, 2)"
               in r for r in results), results


def _domains(rank: int, world: int) -> list:
    """Two groups over the same ranks: messages of each keep their own order (and the
    all-to-all delivers every row)."""
    first, second = dist.group.WORLD, dist.new_group(list(range(world)))
    peer = 1 - rank
    out = [torch.zeros(3), torch.zeros(3)]
    order = [(first, 0), (second, 1)] if rank == 0 else [(second, 1), (first, 0)]
    pending = [get_transport("ordered").post(
        [P2P(True, torch.full((3,), 10.0 * rank + i), peer, 0, "send"),
         P2P(False, out[i], peer, 0, "receive")], group, f"group {i}", 5.0)
               for group, i in order]
    for p in pending:
        p.wait()
    x = torch.arange(4.0).reshape(2, 2) + 100 * rank
    received = torch.empty(2, 2)
    get_transport("ordered").all_to_all(received, x, [1, 1], [1, 1], second, "a2a", 5.0).wait()
    return [t.tolist() for t in out] + [received.tolist()]


def test_each_group_is_its_own_ordering_domain():
    r0, r1 = run_world(_domains, 2)
    assert r0[:2] == [[10.0] * 3, [11.0] * 3] and r1[:2] == [[0.0] * 3, [1.0] * 3]
    assert r0[2] == [[0.0, 1.0], [100.0, 101.0]] and r1[2] == [[2.0, 3.0], [102.0, 103.0]]


