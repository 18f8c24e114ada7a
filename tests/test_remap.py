"""Remapping layer on gloo: exact data movement, exact gradients, cross-node bytes as planned."""
import random
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.runtime.remap import (build_remap_index, to_attention_layout,
                                             to_linear_layout)

from conftest import make_cost
from distributed import run_world

pytestmark = pytest.mark.distributed


def token_values(plan, layout, width: int = 3) -> torch.Tensor:
    """A distinct row per (sequence, position): [tokens, width] float64, in ``layout`` order."""
    rows = [torch.tensor([s.seq * 100003.0 + t + k * 0.25 for k in range(width)],
                         dtype=torch.float64)
            for s in layout for t in range(s.start, s.end)]
    return torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.float64)


def make_plans(nodes: int, gpn: int):
    """Remapping plans (the hierarchical placement with the remap, not the portfolio's pick,
    which is often a plan without it)."""
    rng = random.Random(nodes * 10 + gpn)
    cost = make_cost("gpt-tiny", nodes=nodes, gpus_per_node=gpn)
    for trial in range(3):
        lengths = [rng.choice([1, 3, 17, 64, 150, 600]) for _ in range(rng.randint(3, 25))]
        config = ZeppelinConfig(capacity_tokens_per_gpu=max(64, 3 * sum(lengths) // (nodes * gpn)))
        yield make_plan("zeppelin", lengths, cost, config, portfolio=False)
    # one long document: big node imbalance
    yield make_plan("zeppelin", [900, 5, 5, 5], cost, portfolio=False)
    # linear-heavy (a 30B model's linear time per token): the remap crosses nodes on 2 x 2
    heavy = make_cost("llama-30b", nodes=nodes, gpus_per_node=gpn)
    yield make_plan("zeppelin", [4000, 300, 300, 300, 5, 5], heavy, portfolio=False)


@pytest.mark.parametrize("nodes,gpn", [(2, 2), (2, 4)])
def test_the_plans_move_rows_inside_and_across_nodes(nodes, gpn):
    moved = [[t for t in p.transfers if t.src != t.dst] for p in make_plans(nodes, gpn)]
    assert any(t.src // gpn == t.dst // gpn for ts in moved for t in ts)
    if gpn == 2:
        assert any(t.src // gpn != t.dst // gpn for ts in moved for t in ts)


def check_plans(rank: int, world: int, nodes: int, gpn: int, transport: str,
                exchange: str = "all-to-all") -> None:
    for plan in make_plans(nodes, gpn):
        idx = build_remap_index(plan, rank, transport=transport, exchange=exchange)
        assert idx.transport.name == transport
        lin = token_values(plan, plan.linear[rank]).requires_grad_(True)
        att = to_attention_layout(lin, idx)
        assert torch.equal(att, token_values(plan, plan.attention[rank]))
        back = to_linear_layout(att, idx)
        assert torch.equal(back, lin)
        # d/dlin sum(att * w) = w mapped back to the linear layout, row for row
        weights = token_values(plan, plan.attention[rank]) * 0.5 + 1.0
        (att * weights).sum().backward()
        assert torch.equal(lin.grad, token_values(plan, plan.linear[rank]) * 0.5 + 1.0)
        crossing = torch.tensor([idx.cross_node_rows(plan)])
        dist.all_reduce(crossing)
        assert crossing.item() == plan.remap_cross_node_tokens()


@pytest.mark.parametrize("nodes,gpn,transport,exchange", [
    (2, 2, "direct", "all-to-all"), (2, 4, "direct", "all-to-all"),
    (2, 2, "staged", "all-to-all"), (2, 4, "ordered", "all-to-all"),
    (2, 2, "direct", "pairs"), (2, 4, "ordered", "pairs")])
def test_remap_moves_rows_exactly_and_inverts_gradients(nodes, gpn, transport, exchange):
    run_world(check_plans, nodes * gpn, nodes, gpn, transport, exchange)


def test_an_unknown_exchange_is_refused_naming_it():
    plan = next(make_plans(2, 2))
    with pytest.raises(ValueError, match="exchange='ring'.*all-to-all"):
        build_remap_index(plan, 0, exchange="ring")


def lose_one_rank(rank: int, world: int, how: str) -> None:
    plan = next(make_plans(1, 2))
    idx = build_remap_index(plan, rank)
    if rank == 1:
        if how == "stall":
            time.sleep(6)  # alive but never joins: rank 0 must time out after 2 s
        return  # "exit": leaves at once, closing its connections
    lin = token_values(plan, plan.linear[rank])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"remap all-to-all on rank 0 failed: a peer of the "
                                           r"pool stopped or stalled \(timeout 2 s"):
        to_attention_layout(lin, idx)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("how", ["stall", "exit"])
def test_a_lost_peer_fails_loudly_not_a_hang(how):
    run_world(lose_one_rank, 2, how, env={"ZEPPELIN_P2P_TIMEOUT_S": "2"})


def test_rows_must_match_the_plan():
    plan = next(make_plans(1, 2))
    idx = build_remap_index(plan, 0)
    with pytest.raises(ValueError, match=r"rank 0: a linear-layout tensor must have \d+ rows"):
        to_attention_layout(torch.zeros(idx.linear_rows + 1, 2), idx)
    with pytest.raises(ValueError, match=r"rank 5 is invalid: the plan has ranks \[0, 2\)"):
        build_remap_index(plan, 5)
