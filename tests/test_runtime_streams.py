"""Issue 21 item 5 on CPU: lanes once per device, NCCL options, one P2P batch per round, and
the per-block merge/index work (device ops counted with ``bench.ring_ops.OpCounter``)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from megatron_zeppelin.bench.ring_ops import count_ops
from megatron_zeppelin.runtime import lanes
from megatron_zeppelin.runtime.zigzag import ZigzagLayout, device_blocks
from megatron_zeppelin.runtime.merge import merge_into_, merge_lse
from megatron_zeppelin.runtime.ring_comm import RingBatch, RingComm


def test_lanes_are_made_once_per_device():
    assert lanes.lanes_for("cpu") is lanes.lanes_for(torch.device("cpu"))
    assert not lanes.lanes_for("cpu").concurrent


def test_comm_options_ask_nccl_for_high_priority_streams():
    options = lanes.comm_options()
    if not dist.is_nccl_available():
        assert options is None
    else:
        assert options.is_high_priority_stream


def _inputs(layout, heads=4, kv_heads=2, dim=8):
    n = layout.tokens()
    return torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)


def test_a_block_of_one_range_merges_in_place_in_five_ops():
    """One sequence: every block's rows are one range (views), so a forward block is the
    merge alone (5 ops; 14-15 before) and a backward block at most 4 (6-8 before)."""
    layout = ZigzagLayout([64], 4, 1)
    blocks = device_blocks(layout, "cpu")
    assert all(not isinstance(r, torch.Tensor) for step in blocks for b in step
               for r in (b.q_rows, b.k_rows))
    for (phase, step), (_, per_block) in count_ops(layout, *_inputs(layout)).items():
        assert per_block <= (5 if phase == "forward" else 4), (phase, step, per_block)


def test_scattered_rows_still_merge_in_at_most_ten_ops():
    layout = ZigzagLayout([16, 9, 30], 4, 1)
    for (phase, step), (_, per_block) in count_ops(layout, *_inputs(layout)).items():
        assert per_block <= (10 if phase == "forward" else 8), (phase, step, per_block)


def test_merge_matches_the_softmax_formula_and_keeps_empty_rows_neutral():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(6, 2, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    la, lb = (torch.randn(2, 6, dtype=torch.float64, generator=gen) for _ in range(2))
    la[0, 1] = lb[0, 1] = la[1, 2] = float("-inf")
    a[1, 0] = b[1, 0] = a[2, 1] = 0.0
    out, lse = merge_lse(a, la, b, lb)
    ref_lse = torch.logaddexp(la, lb)
    ref = ref_lse.masked_fill(torch.isneginf(ref_lse), 0.0)
    expected = a * (la - ref).exp().t()[..., None] + b * (lb - ref).exp().t()[..., None]
    assert torch.allclose(out, expected, rtol=0, atol=1e-14) and not out.isnan().any()
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()) and lse[0, 1] == float("-inf")
    for rows in (slice(1, 4), torch.tensor([4, 0, 2])):  # in place on a view / gathered
        acc_out, acc_lse = a.clone(), la.clone()
        index = torch.arange(6)[rows]
        merge_into_(acc_out, acc_lse, b[index], lb[:, index], rows)
        part_out, part_lse = merge_lse(a[index], la[:, index], b[index], lb[:, index])
        assert torch.allclose(acc_out[index], part_out, rtol=0, atol=1e-14)
        assert torch.equal(acc_lse[:, index].isneginf(), part_lse.isneginf())


def _two_rings_one_batch(rank: int, world: int) -> list:
    """Two rings over the same ranks (opposite directions) post one batch; both deliver."""
    group, posts = dist.group.WORLD, []
    rings = [RingComm(range(world), rank, group, tag=0, name="first"),
             RingComm(list(reversed(range(world))), rank, group, tag=1, name="second")]
    kind = type(rings[0].transport)
    assert kind.name == "ordered"
    original = kind.post

    def counting(self, ops, group, where, timeout_s):
        posts.append(len(ops))
        return original(self, ops, group, where, timeout_s)
    kind.post = counting
    batch = RingBatch(rings[0].transport, group, 10.0)
    requests = [ring.exchange([torch.full((3,), 10.0 * rank + i)], [((3,), torch.float32)], 0,
                              batch=batch) for i, ring in enumerate(rings)]
    batch.post("test round")
    got = [request.wait()[0].tolist() for request in requests]
    assert batch.done()
    return [posts, got]


def test_the_rings_of_a_round_post_one_batch():
    for rank, (posts, got) in enumerate(run_world(_two_rings_one_batch, 3,
                                                  env={"ZEPPELIN_TRANSPORT": "ordered"})):
        assert posts == [4], posts  # one post: 2 rings x (send + receive)
        assert got == [[10.0 * ((rank - 1) % 3)] * 3, [10.0 * ((rank + 1) % 3) + 1] * 3]


def test_a_batch_takes_rings_of_its_own_group_only():
    class Other:
        pass
    ring = RingComm.__new__(RingComm)
    ring.group, ring.name, ring.ring = Other(), "x", (0, 1)
    ring.next, ring.prev, ring.tag = 1, 1, 0
    with pytest.raises(ValueError, match="a batch of another group"):
        ring.exchange([torch.ones(2)], [], 0, batch=RingBatch(None, Other(), 1.0))
