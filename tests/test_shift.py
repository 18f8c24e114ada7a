"""runtime/shift.py on gloo: the shift by k within documents across the linear layout's pieces
equals megatron-core's own packed roll (``roll_tensor`` k times, one process, whole documents),
for values, integer labels and masks, and its gradient is the adjoint; pieces shorter than k,
documents shorter than k, documents split over 3 and 4 ranks, a rank without tokens, pad rows."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
# imported once here: the forked ranks share it (megatron-core's import dominates on 2 cores)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_token_prediction import roll_tensor

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.plan import Segment
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.runtime.shift import build_shift_index, shift, shift_moves

from conftest import make_cost
from distributed import run_world

pytestmark = pytest.mark.distributed

S = Segment
SEQLENS = (10, 3, 1, 7, 2, 12)
# doc 0 over 4 ranks (pieces of 4, 1, 1, 4 tokens), doc 1 over 2, doc 5 over 2, doc 2 shorter
# than every k > 1, doc 3 and doc 5 split inside, rank 1 holding pieces of 1 token
LAYOUTS = {
    4: ((S(0, 0, 4), S(1, 0, 1)),
        (S(0, 4, 5), S(1, 1, 3), S(2, 0, 1), S(3, 0, 2)),
        (S(0, 5, 6), S(3, 2, 7), S(4, 0, 2), S(5, 0, 3)),
        (S(0, 6, 10), S(5, 3, 12))),
    # doc 0 over 3 ranks, rank 3 without tokens
    3: ((S(0, 0, 2), S(5, 0, 5), S(1, 0, 3)),
        (S(0, 2, 3), S(5, 5, 6), S(2, 0, 1), S(3, 0, 7)),
        (S(5, 6, 12), S(0, 3, 10), S(4, 0, 2)),
        ()),
    2: ((S(3, 0, 7), S(0, 0, 3), S(5, 0, 1), S(1, 0, 2)),
        (S(0, 3, 10), S(1, 2, 3), S(2, 0, 1), S(4, 0, 2), S(5, 1, 12))),
}
KS = (1, 3, 13)
PAD = 2  # pad rows after the pieces (sequence-parallel padding, a token-less rank's pad token)


def custom_plan(world: int, name: int):
    cost = make_cost("gpt-tiny", nodes=2, gpus_per_node=world // 2)
    plan = make_plan("static-cp", list(SEQLENS), cost)
    return dataclasses.replace(plan, linear=LAYOUTS[name])


def random_plans(world: int):
    rng = random.Random(world)
    cost = make_cost("gpt-tiny", nodes=2, gpus_per_node=world // 2)
    for _ in range(1):
        lengths = [rng.choice([1, 2, 3, 17, 64, 150]) for _ in range(rng.randint(6, 12))]
        config = ZeppelinConfig(capacity_tokens_per_gpu=max(64, 3 * sum(lengths) // world))
        yield make_plan("zeppelin", lengths, cost, config)


def megatron_rolled(values: torch.Tensor, seqlens, k: int) -> torch.Tensor:
    """megatron-core's one-process packed roll, ``k`` times, of ``values`` ``[..., tokens]``
    holding every document whole, in order."""
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for _ in range(k):
        values, _ = roll_tensor(values, shifts=-1, dims=-1, packed_seq_params=params)
    return values


def rows_of(plan, rank: int, full: torch.Tensor, pad: int) -> torch.Tensor:
    """``full`` ``[tokens, ...]`` (whole documents in order) cut to ``rank``'s linear buffer."""
    first = [0, *torch.tensor(plan.seqlens).cumsum(0).tolist()]
    rows = [full[first[seq] + start:first[seq] + end] for seq, start, end in plan.linear[rank]]
    rows.append(full.new_zeros((pad, *full.shape[1:])))
    return torch.cat(rows)


def check_plan(plan, rank: int, k: int) -> None:
    total = sum(plan.seqlens)
    values = torch.arange(1, total + 1, dtype=torch.float64) * 1.5  # distinct, never 0
    expected = megatron_rolled(values, plan.seqlens, k)
    index = build_shift_index(plan, rank, k)
    mine = rows_of(plan, rank, values, PAD)
    assert torch.equal(shift(mine, index), rows_of(plan, rank, expected, PAD)), (rank, k)
    # integer labels and a float mask, [tokens] as MTP shifts them
    labels = torch.arange(total) % 97 + 1
    assert torch.equal(shift(rows_of(plan, rank, labels, PAD), index),
                       rows_of(plan, rank, megatron_rolled(labels, plan.seqlens, k), PAD))
    # [tokens, hidden] with autograd: the gradient is the adjoint (weights rolled back)
    wide = torch.stack([values, -values], dim=1)
    x = rows_of(plan, rank, wide, PAD).requires_grad_(True)
    weights = torch.stack([values * 0.5 + 1, values - 3], dim=1)
    (shift(x, index) * rows_of(plan, rank, weights, PAD)).sum().backward()
    ref = wide.clone().requires_grad_(True)
    (megatron_rolled(ref.t(), plan.seqlens, k).t() * weights).sum().backward()
    assert torch.equal(x.grad, rows_of(plan, rank, ref.grad, PAD)), (rank, k)


def shift_body(rank: int, world: int) -> None:
    plans = [custom_plan(world, name) for name in LAYOUTS if len(LAYOUTS[name]) == world]
    plans += list(random_plans(world))
    for plan in plans:
        for k in KS:
            check_plan(plan, rank, k)


@pytest.mark.parametrize("world", [2, 4])
def test_shift_matches_megatron_packed_roll_and_its_gradient(world):
    run_world(shift_body, world)


def test_shift_exchanges_only_with_the_ranks_holding_the_next_pieces():
    plan = custom_plan(4, 4)
    # k = 1: each piece's last token takes the first token of the next piece of its document
    assert sorted(m for m in shift_moves(plan, 1) if m[0] != m[2]) == [
        (0, 3, 1, 0, 1), (0, 4, 1, 1, 1), (1, 0, 2, 0, 1), (1, 5, 2, 1, 1),
        (2, 0, 3, 0, 1), (2, 10, 3, 4, 1)]
    index = build_shift_index(plan, 1, k=3)  # rank 1's 1-token piece of doc 0 reaches rank 3
    assert index.send_peers == (0,) and index.recv_peers == (2, 3)
    assert index.recv_splits == (2, 1) and index.send_splits == (1,)
    with pytest.raises(ValueError, match="k=0 is invalid"):
        build_shift_index(plan, 0, k=0)
