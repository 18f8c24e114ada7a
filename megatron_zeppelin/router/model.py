"""The routed step's cost model in integer ticks (the C++ twin: ``csrc/router_model.h``).

Legs. A slice of b bytes with a dispatch leg loads the source GPU's NVLink egress and the
source proxy's NVLink ingress with ``b*cv`` ticks and one message (cv: ticks per NVLink byte);
its NIC leg loads the source proxy's NIC egress and the destination proxy's NIC ingress with
``b*cn`` ticks and one message; a combine leg loads the destination proxy's NVLink egress and
the destination GPU's NVLink ingress like the dispatch leg. The messages of one resource are
served one after the other, each paying the link's latency (lv for NVLink, ln for a NIC).

Pipeline. The runtime (``runtime/routed_p2p.py``) cuts every slice into ``C`` chunks
(``chunk_span``) and runs ``C + 2`` batches: batch t carries the dispatch legs of chunk t, the
NIC legs of chunk t-1 and the combine legs of chunk t-2. A resource that carries W byte-ticks
in m messages over the step carries ``W/C + m*lat`` per chunk (bytes spread evenly over the
chunks, every message cut in C). A batch lasts as long as its busiest resource; in one batch
the dispatch and combine legs of a GPU share its NVLink egress (and ingress). With the
per-chunk maxima d (dispatch), n (NIC), m (combine) over all resources of a phase, and f, the
maximum of n and of a GPU's dispatch plus combine load on one NVLink direction, the step time
is ``routed_cost.pipeline_time`` (the one definition the cost model and the simulator use too)::

    C = 1:   d + n + m                     (three sequential phases)
    C = 2:   d + max(d, n) + max(n, m) + m
    C >= 3:  d + max(d, n) + (C - 2) * f + max(n, m) + m

Everything is computed scaled by C (a per-chunk load times C is ``W + C*m*lat``, an exact
integer) and the step time rounded up once: ``T = ceil(scaled / C)`` ticks.

Chunk counts (``routed_cost.chunk_cap``). A schedule may use ``C`` in
``1..chunk_cap(largest slice)``, where
``chunk_cap(b) = min(max_chunks, max(1, b // min_chunk_bytes))``: a chunk of the largest slice
stays at least ``min_chunk_bytes``. The router keeps the C with the least T (ties: fewer).

``Loads`` keeps per-resource ticks scaled at one chunk count ``cs`` (the router's search runs at
a fixed ``cs``; ``evaluate`` uses 1) plus message counts, so any other C is exact too:
``load(C) = load(cs) + (C - cs) * lat * messages``.
"""
from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.routed_cost import (DEFAULT_MAX_CHUNKS, DEFAULT_MIN_CHUNK_BYTES,
                                          chunk_cap, pipeline_time)

# schedule.check_tick_range keeps every resource load scaled at up to max_chunks chunks below
# 2^53 ticks, so a scaled pipeline sum stays below 2 * MAX_CHUNKS_LIMIT * 2^53 = 2^58 (int64).
MAX_CHUNKS_LIMIT = 16

# A part of one flow's route (a ``RoutePlan``, not to be confused with ``plan.Plan``):
# (egress NIC, ingress NIC, src proxy rank, dst proxy rank, bytes).
Part = tuple[int, int, int, int, int]
RoutePlan = tuple[Part, ...]


def chunk_span(nbytes: int, align: int, chunks: int, c: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of chunk ``c`` of a slice of ``nbytes`` bytes (a multiple of
    ``align``): the slice's ``nbytes // align`` units split as evenly as possible, in order.
    Empty (lo == hi) when the slice has fewer units than chunks."""
    units = nbytes // align
    return units * c // chunks * align, units * (c + 1) // chunks * align


class Problem:
    """The immutable inputs, in the backends' flat layout (ranks, bytes, ticks).

    cs: the chunk count the search scores plans at; max_chunks / min_chunk_bytes: the chunk
    rule (module doc).
    """

    def __init__(self, nodes: int, gpus: int, nics: int, gpu_to_nic: Sequence[int],
                 costs: Sequence[int], src: Sequence[int], dst: Sequence[int],
                 nbytes: Sequence[int], align: int, max_chunks: int,
                 min_chunk_bytes: int) -> None:
        self.nodes, self.g, self.k = nodes, gpus, nics
        self.nic = list(gpu_to_nic)
        self.gpus_of_nic = [[l for l in range(gpus) if self.nic[l] == k] for k in range(nics)]
        self.usable = [k for k in range(nics) if self.gpus_of_nic[k]]
        self.cv, self.lv, self.cn, self.ln = costs
        self.src, self.dst, self.nbytes, self.align = list(src), list(dst), list(nbytes), align
        self.max_chunks, self.min_chunk_bytes = max_chunks, min_chunk_bytes
        # the search's chunk count: the cap of the largest flow spread over every usable NIC
        self.cs = chunk_cap(max(self.nbytes, default=0) // len(self.usable), max_chunks,
                            min_chunk_bytes)
        # Per flow: source / destination node, and their first GPU and first NIC index.
        self.x = [r // gpus for r in self.src]
        self.y = [r // gpus for r in self.dst]
        self.xg, self.yg = [n * gpus for n in self.x], [n * gpus for n in self.y]
        self.xo, self.yo = [n * nics for n in self.x], [n * nics for n in self.y]


class Loads:
    """Per-resource ticks scaled at ``cs`` chunks, message counts, and bytes per NIC.

    d_*: dispatch legs on a GPU's NVLink, c_*: combine legs, n_*: NIC legs; GPU arrays are
    indexed by rank, NIC arrays by ``node * nics + nic``; *_m: message counts.
    """

    def __init__(self, nodes: int, gpus: int, nics: int, cs: int) -> None:
        self.cs = cs
        self.d_out, self.d_in = [0] * (nodes * gpus), [0] * (nodes * gpus)
        self.c_out, self.c_in = [0] * (nodes * gpus), [0] * (nodes * gpus)
        self.n_out, self.n_in = [0] * (nodes * nics), [0] * (nodes * nics)
        self.d_m_out, self.d_m_in = [0] * (nodes * gpus), [0] * (nodes * gpus)
        self.c_m_out, self.c_m_in = [0] * (nodes * gpus), [0] * (nodes * gpus)
        self.n_m_out, self.n_m_in = [0] * (nodes * nics), [0] * (nodes * nics)
        self.b_out, self.b_in = [0] * (nodes * nics), [0] * (nodes * nics)


def apply_plan(pb: Problem, loads: Loads, f: int, plan: RoutePlan, sign: int) -> None:
    """Add (sign=+1) or remove (sign=-1) flow ``f``'s plan to/from the loads."""
    s, d, xo, yo = pb.src[f], pb.dst[f], pb.xo[f], pb.yo[f]
    lv, ln = loads.cs * pb.lv, loads.cs * pb.ln
    for e, i, p, q, nb in plan:
        if p != s:
            _add_leg(loads.d_out, loads.d_in, loads.d_m_out, loads.d_m_in, s, p,
                     sign * (nb * pb.cv + lv), sign)
        _add_leg(loads.n_out, loads.n_in, loads.n_m_out, loads.n_m_in, xo + e, yo + i,
                 sign * (nb * pb.cn + ln), sign)
        loads.b_out[xo + e] += sign * nb
        loads.b_in[yo + i] += sign * nb
        if q != d:
            _add_leg(loads.c_out, loads.c_in, loads.c_m_out, loads.c_m_in, q, d,
                     sign * (nb * pb.cv + lv), sign)


def _add_leg(t_out: list[int], t_in: list[int], m_out: list[int], m_in: list[int],
             a: int, b: int, ticks: int, sign: int) -> None:
    """One leg a -> b: ``ticks`` busy time on a's egress and b's ingress, one message each."""
    t_out[a] += ticks
    t_in[b] += ticks
    m_out[a] += sign
    m_in[b] += sign


def score_plan(pb: Problem, loads: Loads, f: int, plan: RoutePlan) -> int:
    """Flow ``f``'s own completion if ``plan`` were added to ``loads``: the pipeline formula at
    ``loads.cs`` chunks over the resources the plan touches, in ticks times ``cs``."""
    s, d, xo, yo = pb.src[f], pb.dst[f], pb.xo[f], pb.yo[f]
    lv, ln = loads.cs * pb.lv, loads.cs * pb.ln
    dsum = dmax = csum = cmax = nmax = share = 0
    for e, i, p, q, nb in plan:
        if p != s:
            t = nb * pb.cv + lv
            dsum += t
            x = loads.d_in[p] + t
            dmax = max(dmax, x)
            share = max(share, x + loads.c_in[p])
        t = nb * pb.cn + ln
        nmax = max(nmax, loads.n_out[xo + e] + t, loads.n_in[yo + i] + t)
        if q != d:
            t = nb * pb.cv + lv
            csum += t
            x = loads.c_out[q] + t
            cmax = max(cmax, x)
            share = max(share, x + loads.d_out[q])
    if dsum:
        x = loads.d_out[s] + dsum
        dmax = max(dmax, x)
        share = max(share, x + loads.c_out[s])
    if csum:
        x = loads.c_in[d] + csum
        cmax = max(cmax, x)
        share = max(share, x + loads.d_in[d])
    return pipeline_time(dmax, nmax, cmax, max(nmax, share), loads.cs)


def pool_phase_scaled(pb: Problem, loads: Loads, chunks: int) -> tuple[int, int, int, int]:
    """Per-chunk (d, n, m, f) maxima over the whole pool at ``chunks``, scaled by ``chunks``."""
    dv, dn = (chunks - loads.cs) * pb.lv, (chunks - loads.cs) * pb.ln
    d_out = [t + dv * m for t, m in zip(loads.d_out, loads.d_m_out)]
    d_in = [t + dv * m for t, m in zip(loads.d_in, loads.d_m_in)]
    c_out = [t + dv * m for t, m in zip(loads.c_out, loads.c_m_out)]
    c_in = [t + dv * m for t, m in zip(loads.c_in, loads.c_m_in)]
    n = max(max(t + dn * m for t, m in zip(loads.n_out, loads.n_m_out)),
            max(t + dn * m for t, m in zip(loads.n_in, loads.n_m_in)))
    d, m = max(max(d_out), max(d_in)), max(max(c_out), max(c_in))
    f = n
    if chunks >= 3:
        f = max(n, max(map(int.__add__, d_out, c_out)), max(map(int.__add__, d_in, c_in)))
    return d, n, m, f


def phase_ticks(pb: Problem, loads: Loads) -> tuple[int, int, int]:
    """(max dispatch, max NIC, max combine) resource time of the whole step, in ticks."""
    return pool_phase_scaled(pb, loads, 1)[:3]


def step_ticks(pb: Problem, loads: Loads, chunks: int) -> int:
    """The pool's modelled step time at ``chunks`` chunks, in ticks (rounded up)."""
    scaled = pipeline_time(*pool_phase_scaled(pb, loads, chunks), chunks)
    return -(-scaled // chunks)


def best_chunks(pb: Problem, loads: Loads, largest_slice: int) -> tuple[int, int]:
    """(chunks, step ticks): the allowed chunk count with the least step time (ties: fewer)."""
    best = (1, step_ticks(pb, loads, 1))
    for chunks in range(2, chunk_cap(largest_slice, pb.max_chunks, pb.min_chunk_bytes) + 1):
        ticks = step_ticks(pb, loads, chunks)
        if ticks < best[1]:
            best = (chunks, ticks)
    return best
