"""Micro-batch balancing for pipeline parallelism: a global batch's documents grouped into the
``M`` micro-batches of one training step, and ordered, to shorten the pipeline schedule
(``pipeline.py``). Standard library only (planner layer).

Policy (``balance_microbatches``):

1. **A feasible start.** Documents, heaviest first (their cost alone, then length, then index),
   each go to the micro-batch with the least summed cost that has room for it (empty ones
   first, so none stays empty). If a capacity leaves a document nowhere, the start is
   first-fit by tokens (longest first), then arrival order cut into ``M`` runs of about equal
   tokens, then arrival order with each run filled to the capacity (as
   ``megatron/loop/corpus.py``'s ``MicroBatchSampler`` packs: documents a packing loader placed in
   ``M`` micro-batches are always placed); if none places every document, ``ValueError``
   names the longest document, its length, the capacity and ``M``.
2. **Local search on the real cost.** The costliest micro-batch gives one document to, or swaps
   one with, another micro-batch (cheapest first) when that lowers the larger of the two
   costs; repeated until no such move exists or ``max_evaluations`` calls of ``cost`` are
   spent. Only moves that keep every micro-batch non-empty and within the capacity.
3. **Order.** Candidate orders of the micro-batches (as built; cheapest first; costliest
   first; cheapest at both ends) are timed with Megatron's schedule (``pipeline_step``, the
   cost split evenly over the ``pp x vpp`` virtual stages, backward ``backward_ratio`` x
   forward) and the fastest kept, the first listed on a tie.

Over data-parallel pools (``balance_global_batch``, what training uses:
``megatron/loop/microbatch_order.py``): steps 1-2 form ``pools x M`` micro-batches, which are
dealt to the pools (costliest first, to the least-loaded pool with room), step 3 orders each
pool's; given the data loader's grouping (``arrival``), that grouping is kept unless the
balanced one's estimated step (``idle_share``: the slowest pool's schedule) is shorter.

Guarantees: every document is in exactly one micro-batch (indices into ``lengths``), every
micro-batch is non-empty and holds at most ``capacity`` tokens; the result depends only on
the arguments (no randomness, ties broken by index), so every rank and stage computing it
from the same lengths gets the same micro-batches, provided ``cost`` is a deterministic
function of the lengths it is given (``work_cost`` is).
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

from megatron_zeppelin.planner.pipeline import PipelineTimeline, check_microbatches, pipeline_step

Cost = Callable[[Sequence[int]], float]
SEARCH_WIDTH = 32  # distinct document lengths of a micro-batch tried per move


def balance_microbatches(lengths: Sequence[int], num_microbatches: int, cost: Cost, *,
                         capacity: int | None = None, pp: int = 1, vpp: int = 1,
                         backward_ratio: float = 2.0, p2p_s: float = 0.0,
                         max_evaluations: int = 2000) -> list[list[int]]:
    """``lengths`` grouped into ``num_microbatches`` micro-batches of document indices, in the
    order to run them (module doc: policy and guarantees)."""
    return balance_global_batch(lengths, num_microbatches, 1, cost, capacity=capacity, pp=pp,
                                vpp=vpp, backward_ratio=backward_ratio, p2p_s=p2p_s,
                                max_evaluations=max_evaluations)[0]


def balance_global_batch(lengths: Sequence[int], num_microbatches: int, pools: int, cost: Cost,
                         *, capacity: int | None = None, pp: int = 1, vpp: int = 1,
                         backward_ratio: float = 2.0, p2p_s: float = 0.0,
                         max_evaluations: int = 2000,
                         arrival: Sequence[Sequence[Sequence[int]]] | None = None
                         ) -> list[list[list[int]]]:
    """A global batch for ``pools`` data-parallel replicas: ``lengths`` grouped into
    ``pools x num_microbatches`` micro-batches (steps 1 and 2 of the policy), dealt to the
    pools (costliest micro-batch first, each to the pool with the least summed cost that has
    fewer than ``num_microbatches``; ties: lowest index), each pool's in its step-3 order.
    Returns per pool its micro-batches (document indices) in run order; ``pools == 1`` is
    ``balance_microbatches``. Same guarantees (module doc). ``arrival``: the grouping the
    data loader gave (same shape); kept when the balanced one's step (``idle_share``) is not
    shorter (minimising the costliest micro-batch does not always shorten the schedule)."""
    if not isinstance(pools, int) or isinstance(pools, bool) or pools < 1:
        raise ValueError(f"pools={pools!r} is invalid: expected an integer >= 1")
    _check(lengths, num_microbatches, capacity)
    _check(lengths, num_microbatches * pools, None)  # one document per micro-batch of all pools
    check_microbatches(num_microbatches, pp, vpp)
    groups = _start(lengths, num_microbatches * pools, cost, capacity)
    costs = _local_search(groups, lengths, cost, capacity, max_evaluations)
    dealt = [_order([groups[g] for g in mine], [costs[g] for g in mine], pp, vpp,
                    backward_ratio, p2p_s)
             for mine in _deal(costs, num_microbatches, pools)]
    if arrival is None:
        return dealt

    def step(grouping) -> float:
        rows = [[cost([lengths[i] for i in g]) for g in pool] for pool in grouping]
        return idle_share(rows, pp, vpp, backward_ratio, p2p_s)[0]

    kept = [[list(g) for g in pool] for pool in arrival]
    return kept if step(kept) <= step(dealt) else dealt


def _deal(costs: list[float], per_pool: int, pools: int) -> list[list[int]]:
    """Micro-batch indices per pool (``per_pool`` each, ascending): costliest first to the
    least-loaded pool with room (ties: lowest pool)."""
    dealt: list[list[int]] = [[] for _ in range(pools)]
    load = [0.0] * pools
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        pool = min((p for p in range(pools) if len(dealt[p]) < per_pool),
                   key=lambda p: (load[p], p))
        dealt[pool].append(g)
        load[pool] += costs[g]
    return [sorted(mine) for mine in dealt]


def idle_share(costs: Sequence[Sequence[float]], pp: int, vpp: int = 1,
               backward_ratio: float = 2.0, p2p_s: float = 0.0) -> tuple[float, float]:
    """(step seconds, idle share) of a global batch whose pool ``p`` runs micro-batches of
    ``costs[p]`` (forward + backward of the whole model, in run order) on ``pp`` stages: the
    slowest pool's pipeline step, and the share of every stage of every pool idle in it
    (pipeline bubble and waiting for the slowest data-parallel replica)."""
    timelines = [_timeline(list(row), pp, vpp, backward_ratio, p2p_s) for row in costs]
    step = max(t.step_s for t in timelines)
    busy = sum(sum(t.busy_s) for t in timelines)
    return step, 1.0 - busy / (step * pp * len(costs)) if step > 0 else 0.0


def _timeline(costs: list[float], pp: int, vpp: int, backward_ratio: float, p2p_s: float
              ) -> PipelineTimeline:
    """Megatron's schedule over micro-batches of ``costs`` (each split evenly over the
    ``pp x vpp`` virtual stages, backward ``backward_ratio`` x forward)."""
    stages = pp * vpp
    fwd_share = 1.0 / (1.0 + backward_ratio) / stages
    fwd = [[c * fwd_share] * stages for c in costs]
    bwd = [[c * fwd_share * backward_ratio] * stages for c in costs]
    return pipeline_step(fwd, bwd, pp, vpp, p2p_s)


def arrival_microbatches(lengths: Sequence[int], num_microbatches: int,
                         capacity: int | None = None) -> list[list[int]]:
    """The unbalanced reference: documents in arrival order cut into ``num_microbatches``
    contiguous runs of about equal tokens (a packing data loader's micro-batches)."""
    _check(lengths, num_microbatches, capacity)
    groups = _arrival(lengths, num_microbatches, capacity)
    if groups is None:
        raise ValueError(f"{len(lengths)} documents in arrival order do not fit "
                         f"{num_microbatches} micro-batches of {capacity} tokens")
    return groups


def work_cost(attention_s: Callable[[int], float], linear_s: Callable[[int], float],
              ranks: int) -> Cost:
    """A micro-batch's balanced-compute time on ``ranks`` ranks: (sum of each document's
    attention seconds + the linear seconds of all its tokens) / ranks; the time a plan that
    balances perfectly with no exposed communication reaches (the simulator's lower bound)."""
    def cost(group: Sequence[int]) -> float:
        return (sum(attention_s(n) for n in group) + linear_s(sum(group))) / ranks

    return cost


def _check(lengths: Sequence[int], count: int, capacity: int | None) -> None:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"num_microbatches={count!r} is invalid: expected an integer >= 1")
    if len(lengths) < count:
        raise ValueError(f"{len(lengths)} documents cannot fill num_microbatches={count}: "
                         "expected at least one document per micro-batch")
    bad = next((i for i, n in enumerate(lengths)
                if not isinstance(n, int) or isinstance(n, bool) or n < 1), None)
    if bad is not None:
        raise ValueError(f"document {bad} has length {lengths[bad]!r}: expected an integer >= 1")
    if capacity is None:
        return
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity={capacity!r} is invalid: expected tokens >= 1")
    over = next((i for i, n in enumerate(lengths) if n > capacity), None)
    if over is not None:
        raise ValueError(f"document {over} of {lengths[over]} tokens exceeds the micro-batch "
                         f"capacity of {capacity} tokens")


def _start(lengths: Sequence[int], count: int, cost: Cost, capacity: int | None
           ) -> list[list[int]]:
    """Step 1 of the policy: cost-greedy, else first-fit by tokens, else arrival order."""
    alone: dict[int, float] = {}
    for n in lengths:
        if n not in alone:
            alone[n] = cost([n])
    weight = [alone[n] for n in lengths]
    by_cost = sorted(range(len(lengths)), key=lambda i: (-weight[i], -lengths[i], i))
    groups = _greedy(by_cost, lengths, weight, count, capacity)
    if groups is None:
        by_tokens = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        groups = _greedy(by_tokens, lengths, [0.0] * len(lengths), count, capacity)
    if groups is None:
        groups = _arrival(lengths, count, capacity)
    if groups is None:
        groups = _arrival(lengths, count, capacity, shares=False)
    if groups is None:
        i = max(range(len(lengths)), key=lambda j: (lengths[j], -j))
        raise ValueError(f"cannot place {len(lengths)} documents ({sum(lengths)} tokens, "
                         f"longest: document {i} of {lengths[i]} tokens) in {count} "
                         f"micro-batches of at most {capacity} tokens")
    return groups


def _greedy(order: list[int], lengths: Sequence[int], weight: list[float], count: int,
            capacity: int | None) -> list[list[int]] | None:
    """Each document (in ``order``) to the empty, else least-loaded, micro-batch with room
    (ties: lowest index); None when one finds no room."""
    groups: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    heap = [(False, 0.0, g) for g in range(count)]  # (non-empty, load, index), all current
    for i in order:
        skipped = []
        while heap and capacity is not None and tokens[heap[0][2]] + lengths[i] > capacity:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        _, load, g = heapq.heappop(heap)
        groups[g].append(i)
        tokens[g] += lengths[i]
        heapq.heappush(heap, (True, load + weight[i], g))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return groups if all(groups) else None


def _arrival(lengths: Sequence[int], count: int, capacity: int | None, shares: bool = True
             ) -> list[list[int]] | None:
    """Arrival order cut into ``count`` runs near equal token shares, or (``shares=False``)
    each run filled to ``capacity`` as a packing loader fills it (None: capacity broken or a
    run left empty)."""
    total, groups, run, seen, held = sum(lengths), [[] for _ in range(count)], 0, 0, 0
    for i, n in enumerate(lengths):
        must = shares and len(lengths) - i <= count - 1 - run  # the later runs need the rest
        full = capacity is not None and held + n > capacity
        share = shares and seen >= total * (run + 1) / count
        if groups[run] and run + 1 < count and (must or full or share):
            run, held = run + 1, 0
        groups[run].append(i)
        seen, held = seen + n, held + n
    if not all(groups) or (capacity is not None and
                           any(sum(lengths[j] for j in g) > capacity for g in groups)):
        return None
    return groups


def _local_search(groups: list[list[int]], lengths: Sequence[int], cost: Cost,
                  capacity: int | None, budget: int) -> list[float]:
    """Step 2 of the policy, in place; returns each micro-batch's cost."""
    def of(members: list[int]) -> float:
        return cost([lengths[i] for i in members])

    costs = [of(g) for g in groups]
    budget -= len(groups)
    while budget > 0:
        heavy = max(range(len(groups)), key=lambda g: (costs[g], -g))
        others = sorted((g for g in range(len(groups)) if g != heavy), key=lambda g: (costs[g], g))
        for light in others:
            best = None
            for a, b in _moves(groups[heavy], groups[light], lengths, capacity):
                if budget <= 0:
                    break
                new_heavy = [i for i in groups[heavy] if i != a] + ([b] if b is not None else [])
                new_light = [i for i in groups[light] if i != b] + [a]
                pair = (of(new_heavy), of(new_light))
                budget -= 2
                if max(pair) < costs[heavy] * (1.0 - 1e-9) and (best is None or
                                                                max(pair) < max(best[2])):
                    best = (new_heavy, new_light, pair)
            if best is not None:
                groups[heavy], groups[light] = sorted(best[0]), sorted(best[1])
                costs[heavy], costs[light] = best[2]
                break
        else:
            break
    return costs


def _moves(heavy: list[int], light: list[int], lengths: Sequence[int], capacity: int | None):
    """(document of ``heavy`` to give, document of ``light`` to take back or None): one per
    distinct length pair among the ``SEARCH_WIDTH`` longest distinct lengths of each, within
    ``capacity`` and leaving ``heavy`` non-empty."""
    def widest(members: list[int]) -> list[int]:
        first: dict[int, int] = {}
        for i in sorted(members, key=lambda j: (-lengths[j], j)):
            first.setdefault(lengths[i], i)
        return list(first.values())[:SEARCH_WIDTH]

    held_l = sum(lengths[i] for i in light)
    give, take = widest(heavy), widest(light)
    for a in give:
        if len(heavy) > 1 and (capacity is None or held_l + lengths[a] <= capacity):
            yield a, None
    for a in give:
        for b in take:
            if lengths[b] >= lengths[a]:
                continue
            if capacity is None or held_l - lengths[b] + lengths[a] <= capacity:
                yield a, b  # light grows (heavy shrinks: b is shorter than a)


def _order(groups: list[list[int]], costs: list[float], pp: int, vpp: int,
           backward_ratio: float, p2p_s: float) -> list[list[int]]:
    """Step 3 of the policy: the candidate order with the shortest pipeline step."""
    built = list(range(len(groups)))
    rising = sorted(built, key=lambda g: (costs[g], g))
    ends = rising[0::2] + rising[1::2][::-1]  # cheapest at both ends, costliest in the middle
    candidates = [built, rising, rising[::-1], ends]
    if pp == 1:
        return [groups[g] for g in built]
    times = [_timeline([costs[g] for g in order], pp, vpp, backward_ratio, p2p_s).step_s
             for order in candidates]
    best = min(range(len(candidates)), key=lambda k: (times[k], k))
    return [groups[g] for g in candidates[best]]
