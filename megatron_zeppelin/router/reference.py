"""The pure-Python router (the reference the C++ twin in ``csrc/router.cpp`` matches bit for bit).

Cost model: ``model`` (integer ticks). The runtime pipelines a routed step in ``C`` chunks
(dispatch of chunk t, NIC transfer of chunk t-1 and combine of chunk t-2 in one batch), so the
modelled step time is the pipeline formula over the per-chunk phase maxima, for the chunk count
``C <= model.chunk_cap(largest slice)`` that minimises it; ``C = 1`` is the three sequential
phases ``max dispatch + max NIC + max combine``.

Algorithm (deterministic; integers only):

1. Start with every flow direct (its src's NIC to its dst's NIC, no NVLink legs).
2. Sweep the flows, largest first (ties: lower index), at most ``MAX_SWEEPS`` times: take the
   flow out, build candidate plans and keep the one that minimises the flow's own modelled
   completion (the pipeline formula at the search's chunk count ``cs`` over the resources it
   touches, with the other flows' loads on them), keeping the current plan unless a candidate
   is strictly better (after the first sweep: better by more than 1/64, which stops flows
   trading places). ``cs`` is the chunk cap of the largest flow spread over every usable NIC.
   Candidates, in tie-break order: direct; one rail (the src's NIC, the dst's NIC, the least
   loaded NIC); and the water-filled splits over the 2, 3, ... least loaded rails. A rail k is
   the proxy pair (p, q) on NIC k of the source and destination node (rail alignment: p and q
   have the same local index unless q is the destination itself, also on NIC k); p is the
   source when it sits on NIC k, q the destination when it does. Water-filling pours the
   flow's ``nbytes / align`` units into the rails so that their NIC levels (max of egress and
   ingress load at ``cs`` chunks, plus the new message's latency) end equal, in exact integer
   arithmetic.
3. After each sweep, evaluate the step time of the whole pool at its best chunk count; return
   the best state seen (the all-direct start at one chunk included, so routing never makes the
   modelled step slower than sending direct).

Why each flow minimises its own completion rather than the pool's step time: the step time is
a sum of maxima, flat under most single-flow moves (two flows sharing a NIC: moving either alone
leaves the maximum where it is and adds NVLink phases), so a search on it stalls at the direct
start; the flows' own completions do decrease one move at a time, and step 3 keeps the pool's
best. Small flows stay direct because every extra rail adds NVLink and NIC message latencies
that outweigh the bandwidth gained; a flow whose NIC is shared with others spreads out.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Sequence

from megatron_zeppelin.router.model import (DEFAULT_MAX_CHUNKS, DEFAULT_MIN_CHUNK_BYTES, Loads,
                                            RoutePlan, Problem, apply_plan, best_chunks,
                                            phase_ticks, score_plan, step_ticks)
from megatron_zeppelin.router.schedule import (TICKS_PER_S, Flow, RouterTopology, RouteSchedule,
                                               Slice, build_schedule, compute_nic_load_ratio,
                                               split_flow_fields, validate_chunking,
                                               validate_flows)

MAX_SWEEPS = 3
HYSTERESIS_SHIFT = 6  # after the first sweep a plan must win by > 1/64 of its score


def make_direct_plan(pb: Problem, f: int) -> RoutePlan:
    """Flow ``f`` in one part from its src's NIC to its dst's NIC (no NVLink legs)."""
    s, d = pb.src[f], pb.dst[f]
    return ((pb.nic[s - pb.xg[f]], pb.nic[d - pb.yg[f]], s, d, pb.nbytes[f]),)


def pick_rail_proxies(pb: Problem, loads: Loads, f: int, k: int) -> tuple[int, int]:
    """(src proxy, dst proxy) of flow ``f`` on rail (NIC) ``k``."""
    xg, yg = pb.xg[f], pb.yg[f]
    ls, ld = pb.src[f] - xg, pb.dst[f] - yg
    if pb.nic[ls] == k:
        local = ls
    elif pb.nic[ld] == k:
        local = ld
    else:
        local = min(pb.gpus_of_nic[k],
                    key=lambda l: (loads.d_in[xg + l] + loads.c_out[yg + l], l))
    p = xg + local
    q = pb.dst[f] if pb.nic[ld] == k else yg + local
    return p, q


def list_rails(pb: Problem, loads: Loads, f: int) -> list[tuple[int, int, int, int, int]]:
    """Rails of flow ``f`` as (NIC level, NVLink legs, k, p, q), least loaded first."""
    s, d, xo, yo = pb.src[f], pb.dst[f], pb.xo[f], pb.yo[f]
    rails = []
    for k in pb.usable:
        p, q = pick_rail_proxies(pb, loads, f, k)
        level = max(loads.n_out[xo + k], loads.n_in[yo + k])
        rails.append((level, (p != s) + (q != d), k, p, q))
    rails.sort()
    return rails


def water_fill(pb: Problem, levels: Sequence[int], units: int) -> list[int] | None:
    """Units per rail so that the rails' NIC levels end equal; None unless all get some.

    ``levels`` are ascending NIC levels in ticks scaled at ``cs`` chunks (``model``); one unit
    is ``align`` bytes.
    """
    m = len(levels)
    r = pb.cn * pb.align
    total = units * r
    base = [level + pb.cs * pb.ln for level in levels]
    used, acc = 1, base[0]
    while used < m and base[used] * used < total + acc:
        acc += base[used]
        used += 1
    if used < m:
        return None
    x = [(total + acc - m * b) // (m * r) for b in base]
    for _ in range(units - sum(x)):
        j = min(range(m), key=lambda j: (base[j] + (x[j] + 1) * r, j))
        x[j] += 1
    return x if min(x) > 0 else None


def make_rail_plan(pb: Problem, rails: Sequence[tuple], units: Sequence[int]) -> RoutePlan:
    """A plan over ``rails`` with ``units[j]`` units on rail j, parts ordered by NIC."""
    parts = [(k, k, p, q, u * pb.align) for (_, _, k, p, q), u in zip(rails, units)]
    return tuple(sorted(parts))


def list_candidate_plans(pb: Problem, loads: Loads, f: int) -> list[RoutePlan]:
    """Direct, single-rail and water-filled multi-rail plans of flow ``f``, in tie-break order."""
    rails = list_rails(pb, loads, f)
    by_nic = {rail[2]: rail for rail in rails}
    s, d, nbytes = pb.src[f], pb.dst[f], pb.nbytes[f]
    nic_s, nic_d = pb.nic[s - pb.xg[f]], pb.nic[d - pb.yg[f]]
    plans = [make_direct_plan(pb, f)]
    singles: list[int] = []
    for k in (nic_s, nic_d, rails[0][2]):
        if k not in singles and not nic_s == nic_d == k:  # (rail nic_s == nic_d is direct)
            singles.append(k)
            _, _, _, p, q = by_nic[k]
            plans.append(((k, k, p, q, nbytes),))
    units = nbytes // pb.align
    for m in range(2, len(rails) + 1):
        split = water_fill(pb, [rail[0] for rail in rails[:m]], units)
        if split is None:
            break
        plans.append(make_rail_plan(pb, rails[:m], split))
    return plans


def replan(pb: Problem, loads: Loads, f: int, old: RoutePlan, hysteresis: bool) -> RoutePlan:
    """The best plan of flow ``f`` (``old`` unless a candidate scores strictly lower) against
    loads without it. hysteresis: a new plan must beat ``old`` by more than 1/64 of its score
    (damps flows trading places back and forth in later sweeps)."""
    best, best_score = old, score_plan(pb, loads, f, old)
    if hysteresis:
        best_score -= best_score >> HYSTERESIS_SHIFT
    for plan in list_candidate_plans(pb, loads, f):
        score = score_plan(pb, loads, f, plan)
        if score < best_score:
            best, best_score = plan, score
    return best


class _Sweeper:
    """Re-plans flows in a fixed order, skipping a flow when nothing changed on its two nodes
    since its last re-plan (the re-plan would keep its plan: exact, only faster)."""

    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.order = sorted(range(len(pb.src)), key=lambda f: (-pb.nbytes[f], f))
        self.version = [0] * pb.nodes  # bumped when a plan touching the node changes
        self.stamp: list[tuple[int, int] | None] = [None] * len(pb.src)

    def sweep(self, loads: Loads, plans: list[RoutePlan], hysteresis: bool) -> bool:
        """Re-plan every flow once; True when some plan changed."""
        pb, version, changed = self.pb, self.version, False
        for f in self.order:
            x, y = pb.x[f], pb.y[f]
            if self.stamp[f] == (version[x], version[y]):
                continue
            old = plans[f]
            apply_plan(pb, loads, f, old, -1)
            plans[f] = replan(pb, loads, f, old, hysteresis)
            apply_plan(pb, loads, f, plans[f], +1)
            if plans[f] is not old:
                changed = True
                version[x] += 1
                version[y] += 1
            self.stamp[f] = (version[x], version[y])
        return changed


def largest_part(plans: Sequence[RoutePlan]) -> int:
    """Bytes of the largest slice of ``plans`` (0 without any)."""
    return max((part[4] for plan in plans for part in plan), default=0)


def search_plans(pb: Problem, loads: Loads) -> tuple[list[RoutePlan], int]:
    """Best plans found (see module doc) and the all-direct step time (one chunk) in ticks."""
    n = len(pb.src)
    plans = [make_direct_plan(pb, f) for f in range(n)]
    for f in range(n):
        apply_plan(pb, loads, f, plans[f], +1)
    direct_ticks = step_ticks(pb, loads, 1)
    best, best_ticks = list(plans), direct_ticks
    sweeper = _Sweeper(pb)
    for it in range(MAX_SWEEPS):
        if not sweeper.sweep(loads, plans, hysteresis=it > 0):
            break
        _, ticks = best_chunks(pb, loads, largest_part(plans))
        if ticks < best_ticks:
            best, best_ticks = list(plans), ticks
    return best, direct_ticks


def route_raw(nodes: int, gpus_per_node: int, nics_per_node: int, gpu_to_nic: Sequence[int],
              costs: Sequence[int], src: Sequence[int], dst: Sequence[int],
              nbytes: Sequence[int], align: int, max_chunks: int, min_chunk_bytes: int) -> tuple:
    """The router on flat, already validated inputs; the C++ ``route_raw`` has this signature.

    costs: (NVLink ticks/byte, NVLink ticks/message, NIC ticks/byte, NIC ticks/message);
    max_chunks / min_chunk_bytes: the chunk rule (``model``). Returns (flat slices
    ``[flow, src_proxy, dst_proxy, offset, nbytes]*`` ordered by flow then offset, NIC egress
    bytes, NIC ingress bytes, (dispatch, NIC, combine) ticks of the whole step, direct ticks,
    chunks, pipelined step ticks at those chunks).
    """
    pb = Problem(nodes, gpus_per_node, nics_per_node, gpu_to_nic, costs, src, dst, nbytes,
                 align, max_chunks, min_chunk_bytes)
    plans, direct_ticks = search_plans(pb, Loads(nodes, gpus_per_node, nics_per_node, pb.cs))
    loads = Loads(nodes, gpus_per_node, nics_per_node, 1)
    flat: list[int] = []
    for f, plan in enumerate(plans):
        apply_plan(pb, loads, f, plan, +1)
        offset = 0
        for _, _, p, q, nb in plan:
            flat += (f, p, q, offset, nb)
            offset += nb
    chunks, ticks = best_chunks(pb, loads, largest_part(plans))
    return (flat, loads.b_out, loads.b_in, phase_ticks(pb, loads), direct_ticks, chunks,
            ticks)


def make_raw_arguments(topology: RouterTopology, flows: Sequence[Flow], align: int,
                       max_chunks: int = DEFAULT_MAX_CHUNKS,
                       min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> tuple:
    """The positional arguments of ``route_raw`` (both backends) for these flows."""
    src, dst, nbytes = split_flow_fields(flows)
    return (topology.nodes, topology.gpus_per_node, topology.nics_per_node,
            list(topology.gpu_to_nic), list(topology.cost_ticks()), src, dst, nbytes, align,
            max_chunks, min_chunk_bytes)


def route(topology: RouterTopology, flows: Sequence[Flow], align: int = 1, *,
          max_chunks: int = DEFAULT_MAX_CHUNKS,
          min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> RouteSchedule:
    """Route one ring step's inter-node ``flows`` with the Python reference router.

    align: byte granularity of every slice (e.g. the element size); each flow's nbytes must be
    a multiple of it. max_chunks / min_chunk_bytes: the pipeline's chunk rule (``model``).
    Raises ValueError naming a bad flow or chunk setting.
    """
    validate_chunking(max_chunks, min_chunk_bytes)
    validate_flows(topology, flows, align, max_chunks)
    args = make_raw_arguments(topology, flows, align, max_chunks, min_chunk_bytes)
    return build_schedule(topology, flows, align, route_raw(*args))


@dataclass(frozen=True)
class RouteCost:
    """The model's view of a set of slices: phase times of the whole step and the pipelined
    step time at ``chunks`` chunks (``total_time_s``) in seconds, bytes per NIC."""

    dispatch_time_s: float
    nic_time_s: float
    combine_time_s: float
    total_time_s: float
    chunks: int
    nic_egress_bytes: tuple[int, ...]
    nic_ingress_bytes: tuple[int, ...]
    nic_load_ratio: float


def check_slices(topology: RouterTopology, flows: Sequence[Flow], slices: Sequence[Slice]) -> None:
    """Raise ValueError unless the slices tile every flow and sit on the right nodes."""
    covered = [0] * len(flows)
    for index, sl in enumerate(slices):
        if not 0 <= sl.flow < len(flows):
            raise ValueError(f"slice {index} {sl}: flow index out of range [0, {len(flows)})")
        flow = flows[sl.flow]
        if sl.offset != covered[sl.flow] or sl.nbytes <= 0:
            raise ValueError(f"slice {index} {sl}: expected a positive slice at offset "
                             f"{covered[sl.flow]} of flow {sl.flow} (slices in offset order)")
        covered[sl.flow] += sl.nbytes
        for proxy, end in ((sl.src_proxy, flow.src), (sl.dst_proxy, flow.dst)):
            if not (0 <= proxy < topology.world_size
                    and topology.node_of(proxy) == topology.node_of(end)):
                raise ValueError(f"slice {index} {sl}: proxy {proxy} is not on node "
                                 f"{topology.node_of(end)} of rank {end}")
    for f, flow in enumerate(flows):
        if covered[f] != flow.nbytes:
            raise ValueError(f"flow {f} {flow}: slices cover {covered[f]} of {flow.nbytes} bytes")


def evaluate(topology: RouterTopology, flows: Sequence[Flow], slices: Sequence[Slice],
             chunks: int | None = None, *, max_chunks: int = DEFAULT_MAX_CHUNKS,
             min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> RouteCost:
    """Model the step time of any slice set (each slice one message per leg and chunk); shared
    by both backends' results and the tests. chunks: the pipeline's chunk count (any in
    ``[1, model.MAX_CHUNKS_LIMIT]``); None: the best one the chunk rule allows, as the router
    picks it."""
    check_slices(topology, flows, slices)
    validate_chunking(max_chunks, min_chunk_bytes, chunks)
    pb = Problem(*make_raw_arguments(topology, flows, 1, max_chunks, min_chunk_bytes))
    loads = Loads(topology.nodes, topology.gpus_per_node, topology.nics_per_node, 1)
    for sl in slices:
        part = (topology.nic_of(sl.src_proxy), topology.nic_of(sl.dst_proxy), sl.src_proxy,
                sl.dst_proxy, sl.nbytes)
        apply_plan(pb, loads, sl.flow, (part,), +1)
    if chunks is None:
        chunks, ticks = best_chunks(pb, loads, max((sl.nbytes for sl in slices), default=0))
    else:
        ticks = step_ticks(pb, loads, chunks)
    phases = phase_ticks(pb, loads)
    return RouteCost(*(t / TICKS_PER_S for t in phases), ticks / TICKS_PER_S, chunks,
                     tuple(loads.b_out), tuple(loads.b_in),
                     compute_nic_load_ratio(topology, loads.b_out, loads.b_in))


def direct(topology: RouterTopology, flows: Sequence[Flow], align: int = 1) -> RouteSchedule:
    """The schedule without routing: one slice per flow, src's NIC to dst's NIC, one chunk."""
    validate_flows(topology, flows, align)
    slices = tuple(Slice(f, flow.src, flow.dst, 0, flow.nbytes) for f, flow in enumerate(flows))
    cost = evaluate(topology, flows, slices, chunks=1)
    table = tuple(field for sl in slices for field in astuple(sl))
    return RouteSchedule(slice_table=table, nic_egress_bytes=cost.nic_egress_bytes,
                         nic_ingress_bytes=cost.nic_ingress_bytes,
                         dispatch_time_s=cost.dispatch_time_s, nic_time_s=cost.nic_time_s,
                         combine_time_s=cost.combine_time_s, chunks=1,
                         estimated_time_s=cost.total_time_s,
                         sequential_time_s=cost.total_time_s, direct_time_s=cost.total_time_s,
                         nic_load_ratio=cost.nic_load_ratio, align=align)
