"""The pure-Python router (the reference the C++ twin in ``csrc/router.cpp`` matches bit for bit).

Cost model (integer ticks, see ``schedule``). A slice of b bytes with a dispatch leg loads
the source GPU's NVLink egress and the source proxy's NVLink ingress with ``b*cv + lv``
(cv: ticks per NVLink byte, lv: ticks per NVLink message); its NIC leg loads the source
proxy's NIC egress and the destination proxy's NIC ingress with ``b*cn + ln``; a combine leg
loads the destination proxy's NVLink egress and the destination GPU's NVLink ingress like the
dispatch leg. A resource's time is the sum over its messages (messages of one resource are
served one after the other, an upper bound on their overlap). The runtime
(``runtime/routed_p2p.py``) runs the three phases as three sequential ``batch_isend_irecv``
batches, so the modelled step time is ``max dispatch + max NIC + max combine``, each maximum
over all resources of that phase in the whole pool. (A chunked, pipelined runtime would approach
``max(dispatch, NIC, combine)``; we model the runtime we have.)

Algorithm (deterministic; integers only):

1. Start with every flow direct (its src's NIC to its dst's NIC, no NVLink legs).
2. Sweep the flows, largest first (ties: lower index), at most ``MAX_SWEEPS`` times: take the
   flow out, build candidate plans and keep the one that minimises the flow's own modelled
   completion (max dispatch + max NIC + max combine over the resources it touches, with the
   other flows' loads on them), keeping the current plan unless a candidate is strictly better
   (after the first sweep: better by more than 1/64, which stops flows trading places).
   Candidates, in tie-break order: direct; one rail (the src's NIC, the dst's NIC, the least
   loaded NIC); and the water-filled splits over the 2, 3, ... least loaded rails. A rail k is
   the proxy pair (p, q) on NIC k of the source and destination node (rail alignment: p and q
   have the same local index unless q is the destination itself, also on NIC k); p is the
   source when it sits on NIC k, q the destination when it does. Water-filling pours the
   flow's ``nbytes / align`` units into the rails so that their NIC levels (max of egress and
   ingress time, plus the new message's latency) end equal, in exact integer arithmetic.
3. After each sweep, evaluate the step time of the whole pool; return the best state seen
   (the all-direct start included, so routing never makes the modelled step slower).

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

from megatron_zeppelin.router.schedule import (TICKS_PER_S, Flow, RouterTopology, RouteSchedule,
                                               Slice, build_schedule, compute_nic_load_ratio,
                                               split_flow_fields, validate_flows)

MAX_SWEEPS = 3
HYSTERESIS_SHIFT = 6  # after the first sweep a plan must win by > 1/64 of its score

# A part of a plan: (egress NIC, ingress NIC, src proxy rank, dst proxy rank, bytes).
Part = tuple[int, int, int, int, int]
Plan = tuple[Part, ...]


class _Problem:
    """The immutable inputs, in the backends' flat layout (ranks, bytes, ticks)."""

    def __init__(self, nodes: int, gpus: int, nics: int, gpu_to_nic: Sequence[int],
                 costs: Sequence[int], src: Sequence[int], dst: Sequence[int],
                 nbytes: Sequence[int], align: int) -> None:
        self.nodes, self.g, self.k = nodes, gpus, nics
        self.nic = list(gpu_to_nic)
        self.gpus_of_nic = [[l for l in range(gpus) if self.nic[l] == k] for k in range(nics)]
        self.usable = [k for k in range(nics) if self.gpus_of_nic[k]]
        self.cv, self.lv, self.cn, self.ln = costs
        self.src, self.dst, self.nbytes, self.align = list(src), list(dst), list(nbytes), align
        # Per flow: source / destination node, and their first GPU and first NIC index.
        self.x = [r // gpus for r in self.src]
        self.y = [r // gpus for r in self.dst]
        self.xg, self.yg = [n * gpus for n in self.x], [n * gpus for n in self.y]
        self.xo, self.yo = [n * nics for n in self.x], [n * nics for n in self.y]


class _Loads:
    """Per-resource busy time in ticks, plus bytes per NIC (index node * nics + nic)."""

    def __init__(self, nodes: int, gpus: int, nics: int) -> None:
        self.d_out, self.d_in = [0] * (nodes * gpus), [0] * (nodes * gpus)
        self.c_out, self.c_in = [0] * (nodes * gpus), [0] * (nodes * gpus)
        self.n_out, self.n_in = [0] * (nodes * nics), [0] * (nodes * nics)
        self.b_out, self.b_in = [0] * (nodes * nics), [0] * (nodes * nics)

    def phase_ticks(self) -> tuple[int, int, int]:
        """(max dispatch, max NIC, max combine) resource time."""
        return (max(max(self.d_out), max(self.d_in)), max(max(self.n_out), max(self.n_in)),
                max(max(self.c_out), max(self.c_in)))


def apply_plan(pb: _Problem, loads: _Loads, f: int, plan: Plan, sign: int) -> None:
    """Add (sign=+1) or remove (sign=-1) flow ``f``'s plan to/from the loads."""
    s, d, xo, yo = pb.src[f], pb.dst[f], pb.xo[f], pb.yo[f]
    for e, i, p, q, nb in plan:
        if p != s:
            t = sign * (nb * pb.cv + pb.lv)
            loads.d_out[s] += t
            loads.d_in[p] += t
        t = sign * (nb * pb.cn + pb.ln)
        loads.n_out[xo + e] += t
        loads.n_in[yo + i] += t
        loads.b_out[xo + e] += sign * nb
        loads.b_in[yo + i] += sign * nb
        if q != d:
            t = sign * (nb * pb.cv + pb.lv)
            loads.c_out[q] += t
            loads.c_in[d] += t


def score_plan(pb: _Problem, loads: _Loads, f: int, plan: Plan) -> int:
    """Flow ``f``'s own completion in ticks if ``plan`` were added to ``loads``."""
    s, d, xo, yo = pb.src[f], pb.dst[f], pb.xo[f], pb.yo[f]
    dsum = dmax = csum = cmax = mmax = 0
    for e, i, p, q, nb in plan:
        if p != s:
            t = nb * pb.cv + pb.lv
            dsum += t
            dmax = max(dmax, loads.d_in[p] + t)
        t = nb * pb.cn + pb.ln
        mmax = max(mmax, loads.n_out[xo + e] + t, loads.n_in[yo + i] + t)
        if q != d:
            t = nb * pb.cv + pb.lv
            csum += t
            cmax = max(cmax, loads.c_out[q] + t)
    if dsum:
        dmax = max(dmax, loads.d_out[s] + dsum)
    if csum:
        cmax = max(cmax, loads.c_in[d] + csum)
    return dmax + mmax + cmax


def make_direct_plan(pb: _Problem, f: int) -> Plan:
    """Flow ``f`` in one part from its src's NIC to its dst's NIC (no NVLink legs)."""
    s, d = pb.src[f], pb.dst[f]
    return ((pb.nic[s - pb.xg[f]], pb.nic[d - pb.yg[f]], s, d, pb.nbytes[f]),)


def pick_rail_proxies(pb: _Problem, loads: _Loads, f: int, k: int) -> tuple[int, int]:
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


def list_rails(pb: _Problem, loads: _Loads, f: int) -> list[tuple[int, int, int, int, int]]:
    """Rails of flow ``f`` as (NIC level, NVLink legs, k, p, q), least loaded first."""
    s, d, xo, yo = pb.src[f], pb.dst[f], pb.xo[f], pb.yo[f]
    rails = []
    for k in pb.usable:
        p, q = pick_rail_proxies(pb, loads, f, k)
        level = max(loads.n_out[xo + k], loads.n_in[yo + k])
        rails.append((level, (p != s) + (q != d), k, p, q))
    rails.sort()
    return rails


def water_fill(pb: _Problem, levels: Sequence[int], units: int) -> list[int] | None:
    """Units per rail so that the rails' NIC levels end equal; None unless all get some.

    ``levels`` are ascending NIC levels in ticks; one unit is ``align`` bytes.
    """
    m = len(levels)
    r = pb.cn * pb.align
    total = units * r
    base = [level + pb.ln for level in levels]
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


def make_rail_plan(pb: _Problem, rails: Sequence[tuple], units: Sequence[int]) -> Plan:
    """A plan over ``rails`` with ``units[j]`` units on rail j, parts ordered by NIC."""
    parts = [(k, k, p, q, u * pb.align) for (_, _, k, p, q), u in zip(rails, units)]
    return tuple(sorted(parts))


def list_candidate_plans(pb: _Problem, loads: _Loads, f: int) -> list[Plan]:
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


def replan(pb: _Problem, loads: _Loads, f: int, old: Plan, hysteresis: bool) -> Plan:
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

    def __init__(self, pb: _Problem) -> None:
        self.pb = pb
        self.order = sorted(range(len(pb.src)), key=lambda f: (-pb.nbytes[f], f))
        self.version = [0] * pb.nodes  # bumped when a plan touching the node changes
        self.stamp: list[tuple[int, int] | None] = [None] * len(pb.src)

    def sweep(self, loads: _Loads, plans: list[Plan], hysteresis: bool) -> bool:
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


def search_plans(pb: _Problem, loads: _Loads) -> tuple[list[Plan], int]:
    """Best plans found (see module doc) and the all-direct step time in ticks."""
    n = len(pb.src)
    plans = [make_direct_plan(pb, f) for f in range(n)]
    for f in range(n):
        apply_plan(pb, loads, f, plans[f], +1)
    direct_ticks = sum(loads.phase_ticks())
    best, best_ticks = list(plans), direct_ticks
    sweeper = _Sweeper(pb)
    for it in range(MAX_SWEEPS):
        if not sweeper.sweep(loads, plans, hysteresis=it > 0):
            break
        ticks = sum(loads.phase_ticks())
        if ticks < best_ticks:
            best, best_ticks = list(plans), ticks
    return best, direct_ticks


def route_raw(nodes: int, gpus_per_node: int, nics_per_node: int, gpu_to_nic: Sequence[int],
              costs: Sequence[int], src: Sequence[int], dst: Sequence[int],
              nbytes: Sequence[int], align: int) -> tuple:
    """The router on flat, already validated inputs; the C++ ``route_raw`` has this signature.

    costs: (NVLink ticks/byte, NVLink ticks/message, NIC ticks/byte, NIC ticks/message).
    Returns (flat slices ``[flow, src_proxy, dst_proxy, offset, nbytes]*`` ordered by flow then
    offset, NIC egress bytes, NIC ingress bytes, (dispatch, NIC, combine) ticks, direct ticks).
    """
    pb = _Problem(nodes, gpus_per_node, nics_per_node, gpu_to_nic, costs, src, dst, nbytes,
                  align)
    plans, direct_ticks = search_plans(pb, _Loads(nodes, gpus_per_node, nics_per_node))
    loads = _Loads(nodes, gpus_per_node, nics_per_node)
    flat: list[int] = []
    for f, plan in enumerate(plans):
        apply_plan(pb, loads, f, plan, +1)
        offset = 0
        for _, _, p, q, nb in plan:
            flat += (f, p, q, offset, nb)
            offset += nb
    return flat, loads.b_out, loads.b_in, loads.phase_ticks(), direct_ticks


def make_raw_arguments(topology: RouterTopology, flows: Sequence[Flow], align: int) -> tuple:
    """The positional arguments of ``route_raw`` (both backends) for these flows."""
    src, dst, nbytes = split_flow_fields(flows)
    return (topology.nodes, topology.gpus_per_node, topology.nics_per_node,
            list(topology.gpu_to_nic), list(topology.cost_ticks()), src, dst, nbytes, align)


def route(topology: RouterTopology, flows: Sequence[Flow], align: int = 1) -> RouteSchedule:
    """Route one ring step's inter-node ``flows`` with the Python reference router.

    align: byte granularity of every slice (e.g. the element size); each flow's nbytes must be
    a multiple of it. Raises ValueError naming a bad flow.
    """
    validate_flows(topology, flows, align)
    return build_schedule(topology, flows, align,
                             route_raw(*make_raw_arguments(topology, flows, align)))


@dataclass(frozen=True)
class RouteCost:
    """The model's view of a set of slices: phase times in seconds, bytes per NIC."""

    dispatch_time_s: float
    nic_time_s: float
    combine_time_s: float
    total_time_s: float
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


def evaluate(topology: RouterTopology, flows: Sequence[Flow],
             slices: Sequence[Slice]) -> RouteCost:
    """Model the step time of any slice set (each slice one message per leg); shared by both
    backends' results and the tests."""
    check_slices(topology, flows, slices)
    pb = _Problem(*make_raw_arguments(topology, flows, 1))
    loads = _Loads(topology.nodes, topology.gpus_per_node, topology.nics_per_node)
    for sl in slices:
        part = (topology.nic_of(sl.src_proxy), topology.nic_of(sl.dst_proxy), sl.src_proxy,
                sl.dst_proxy, sl.nbytes)
        apply_plan(pb, loads, sl.flow, (part,), +1)
    phases = loads.phase_ticks()
    return RouteCost(*(t / TICKS_PER_S for t in phases), sum(phases) / TICKS_PER_S,
                     tuple(loads.b_out), tuple(loads.b_in),
                     compute_nic_load_ratio(topology, loads.b_out, loads.b_in))


def direct(topology: RouterTopology, flows: Sequence[Flow], align: int = 1) -> RouteSchedule:
    """The schedule without routing: one slice per flow, src's NIC to dst's NIC."""
    validate_flows(topology, flows, align)
    slices = tuple(Slice(f, flow.src, flow.dst, 0, flow.nbytes) for f, flow in enumerate(flows))
    cost = evaluate(topology, flows, slices)
    table = tuple(field for sl in slices for field in astuple(sl))
    return RouteSchedule(slice_table=table, nic_egress_bytes=cost.nic_egress_bytes,
                         nic_ingress_bytes=cost.nic_ingress_bytes,
                         dispatch_time_s=cost.dispatch_time_s, nic_time_s=cost.nic_time_s,
                         combine_time_s=cost.combine_time_s,
                         estimated_time_s=cost.total_time_s, direct_time_s=cost.total_time_s,
                         nic_load_ratio=cost.nic_load_ratio, align=align)
