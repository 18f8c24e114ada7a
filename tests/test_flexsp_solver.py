"""FlexSP's MILP solved by bisection on the makespan (``planner/flexsp.py``): the optimum of the
model against brute force on a small pool, a deterministic work limit, the status it reports."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_zeppelin.config import ConfigError, ZeppelinConfig
from megatron_zeppelin.plan import zigzag_share_bound
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.planner.common import prepare
from megatron_zeppelin.planner.flexsp import REL_GAP, FlexSP, _Problem, solver_stats
from megatron_zeppelin.sim.workloads import sample_batch
from tests.conftest import make_cost


def small_problem(seed: int) -> _Problem:
    """Four ranks in one node (sizes 1-4), three buckets of two or three sequences."""
    cost = make_cost(nodes=1, gpus_per_node=4)
    rng = random.Random(seed)
    seqlens = [rng.choice((600, 2000, 9000, 30000, 60000)) + rng.randrange(100)
               for _ in range(7)]
    batch = prepare(seqlens, cost.cluster.topology(cost.tp), ZeppelinConfig())
    return _Problem(batch, cost, 3)


def brute_force(problem: _Problem) -> float:
    """The model's least makespan over every tiling of the pool and every split of every
    bucket over the sizes (capacity included)."""
    sizes, world = problem.sizes, problem.batch.topology.world_size
    tilings = [m for m in itertools.product(*[range(world // d + 1) for d in sizes])
               if sum(d * k for d, k in zip(sizes, m)) == world]
    splits = [[s for s in itertools.product(range(len(members) + 1), repeat=len(sizes))
               if sum(s) == len(members) and all(not k or t < math.inf for k, t in zip(s, row))]
              for members, row in zip(problem.buckets, problem.times)]
    longest = [max(problem.batch.seqlens[i] for i in m) for m in problem.buckets]
    best = math.inf
    for m in tilings:
        for per_size in itertools.product(*splits):
            if any(sum(per_size[b][j] for b in range(len(per_size))) and not m[j]
                   or sum(per_size[b][j] * zigzag_share_bound(longest[b], d)
                          for b in range(len(per_size))) > m[j] * problem.batch.capacity
                   for j, d in enumerate(sizes)):
                continue
            best = min(best, problem.makespan(list(m), [list(s) for s in per_size]))
    return best


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_bisection_reaches_the_models_optimum_within_its_gap(seed):
    problem = small_problem(seed)
    groups, per_size, status = problem.solve(node_limit=5000)
    optimum = brute_force(problem)
    found = problem.makespan(groups, per_size)
    assert optimum <= found <= optimum * (1 + REL_GAP) + 1e-12, (found, optimum, status)
    solves, at_limit, gap = solver_stats(status)
    assert solves >= 2 and at_limit == 0 and 0 <= gap <= REL_GAP
    assert sum(d * k for d, k in zip(problem.sizes, groups)) == 4
    assert [sum(row) for row in per_size] == [len(b) for b in problem.buckets]


def test_the_plan_is_deterministic_and_a_tiny_node_limit_is_reported():
    cost = make_cost(nodes=2)
    lengths = sample_batch("arxiv", 1 << 20, random.Random(5))
    first = make_plan("flexsp", lengths, cost)
    again = make_plan("flexsp", lengths, cost)
    assert first.tasks == again.tasks and solver_stats(first.candidate)[:2] == \
        solver_stats(again.candidate)[:2]
    capped = FlexSP(node_limit=1).plan(lengths, cost, ZeppelinConfig())
    capped.validate()
    solves, at_limit, gap = solver_stats(capped.candidate)
    assert solves >= 1 and gap >= 0 and (at_limit > 0 or gap <= REL_GAP)


def test_the_node_limit_is_validated():
    with pytest.raises(ConfigError, match=r"flexsp.node_limit=0 is invalid: expected an "
                                          r"integer >= 1"):
        FlexSP(node_limit=0)
    assert solver_stats("replicas 4x2") is None


def test_the_node_limit_flag_is_refused_below_one_with_one_line(capsys):
    from megatron_zeppelin import cli

    assert cli.main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
                     "--global-batch-tokens", "64K", "--json", "--strategy", "flexsp",
                     "--node-limit", "0"]) == 2
    err = capsys.readouterr().err
    assert "zeppelin: error: --node-limit=0 is invalid: expected an integer >= 1" in err
    assert "Traceback" not in err
