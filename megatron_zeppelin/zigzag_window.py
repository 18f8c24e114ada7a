"""Sliding-window geometry of zigzag ring blocks (pure arithmetic on host offsets).

A query at document position ``i`` sees keys ``i - L .. i`` (Megatron's ``window_size=(L,
0)``). ``window_pair`` trims one (query chunk, key chunk) pair of a ring step to the rows that
see a key and the keys a row sees, and names the END-aligned band (``kernels.base.band``) the
kernel runs it with; ``add_pair`` groups pairs of one band into calls whose query rows are
distinct. ``runtime.zigzag.ZigzagLayout`` builds its windowed blocks and relayed rows from
them; ``relay_rows`` counts those rows for one sequence (what the simulator prices). Standard
library only, below the runtime (no torch).
"""
from __future__ import annotations

from functools import lru_cache

from megatron_zeppelin.plan import zigzag_bounds


def chunk_rows(offset: int, chunks) -> tuple[int, int]:
    """Buffer rows where the two chunks of a sequence start."""
    return offset, offset + chunks[0][1] - chunks[0][0]


def window_pair(qa: int, qb: int, ka: int, kb: int, window: int):
    """Query positions ``[qa, qb)`` vs key positions ``[ka, kb)`` under causal + window:
    ``((qa', qb', ka', kb'), band)`` trimmed to the rows that see a key and the keys a row sees
    (band ``(-1, -1)``: every key visible to every row; else the END-aligned ``(L - s, s)``),
    or None when no query sees any key."""
    qa, kb = max(qa, ka), min(kb, qb)      # a query sees keys <= itself
    qb, ka = min(qb, kb + window), max(ka, qa - window)  # and keys >= itself - L
    if qa >= qb or ka >= kb:
        return None
    if ka >= qb - 1 - window and kb - 1 <= qa:
        return (qa, qb, ka, kb), (-1, -1)
    shift = qb - kb
    return (qa, qb, ka, kb), (window - shift, shift)


def add_pair(calls: list, key, pair: tuple[int, int, int, int]) -> None:
    """Add ``pair`` to the first call of band ``key`` whose query rows it does not overlap
    (a call's query rows must be distinct: the merge writes each row once)."""
    for band_key, pairs in calls:
        if band_key == key and all(pair[0] + pair[1] <= s or s + n <= pair[0]
                                   for s, n, _, _ in pairs):
            pairs.append(pair)
            return
    calls.append((key, [pair]))


def halo_fits(lengths, ring: int, window: int | None) -> bool:
    """Whether a windowed ring group of ``ring >= 3`` positions needs only its neighbours'
    KV: every zigzag chunk of every sequence holds at least ``window`` tokens, so a query's
    keys lie in its own chunk or the one before it, which position ``p - 1`` holds for chunk
    ``p`` and position ``p + 1`` for chunk ``2G-1-p`` (chunk ``G`` follows chunk ``G-1`` on
    position ``G-1`` itself). Then the engine exchanges those rows with both neighbours in
    one round (``runtime.halo``) instead of relaying them around the ring: the same on every
    position of the group (a function of the group's lengths, ``ring`` and ``window``)."""
    if window is None or ring < 3:
        return False
    return all(n // (2 * ring) >= window for n in lengths)  # chunk sizes: n // 2G or one more


def halo_sequences(lengths, ring: int, window: int | None, split: bool = True) -> list[bool]:
    """Per sequence of a ring group, whether the engine runs it by halo exchange: its chunks
    hold the window (``halo_fits``); where only some do, those beside a ring run of the rest
    if ``split`` (``schedule.HALO_SPLIT``), else none."""
    fits = [halo_fits([n], ring, window) for n in lengths]
    return fits if split or all(fits) else [False] * len(fits)


def halo_parts(lengths, ring: int, window: int | None, split: bool = True,
               allowed: bool = True) -> list[tuple[bool, tuple[int, ...]]]:
    """The runs of one ring group in order, each (by halo exchange, its sequences' indices
    into ``lengths``): ``halo_sequences``'s halo part first, then the rest round the ring;
    one run when they all go one way (``allowed`` False: none by halo)."""
    fits = halo_sequences(lengths, ring, window, split) if allowed else [False] * len(lengths)
    runs = [(halo, tuple(i for i, f in enumerate(fits) if f == halo)) for halo in (True, False)]
    return [run for run in runs if run[1]] or [(False, ())]


@lru_cache(maxsize=65536)
def halo_rows(length: int, ring: int, window: int) -> tuple[float, float]:
    """(KV rows, dK/dV rows) one position sends per pass for one sequence of ``length``
    tokens in a halo exchange (``halo_fits``), mean over positions: to ``p + 1`` the last
    ``window`` rows of chunk ``p`` (for ``p < G - 1``), to ``p - 1`` the last ``window``
    rows of chunk ``2G-1-p`` (for ``p > 0``); the dK/dV of the same rows come back."""
    bounds = zigzag_bounds(length, ring)
    sent = 0
    for p in range(ring):
        mirror = 2 * ring - 1 - p
        if p < ring - 1:
            sent += min(window, bounds[p + 1] - bounds[p])
        if p > 0:
            sent += min(window, bounds[mirror + 1] - bounds[mirror])
    return sent / ring, sent / ring


@lru_cache(maxsize=65536)
def relay_rows(length: int, ring: int, window: int) -> tuple[float, float]:
    """(KV rows, dK/dV accumulator rows) one hop of a ring of ``ring`` positions carries on
    average for one sequence of ``length`` tokens under the window, as the engine sends them:
    the hop into step ``t`` carries the rows of the source's two zigzag chunks that positions
    at steps ``t..G-1`` read (``ZigzagLayout.held_rows``), the accumulator those of step 1
    (``dkv_rows``); means over sources and hops (KV) or sources (accumulator)."""
    if ring == 1:
        return 0.0, 0.0
    chunks = _position_chunks(zigzag_bounds(length, ring), ring)
    kv = dkv = 0
    for source in range(ring):
        keys, needed = chunks(source), []  # key position ranges read at this step or later
        for later in range(ring - 1, 0, -1):  # the hop into step ``later``: rows read from it on
            for qa, qb in chunks((source + later) % ring):
                for ka, kb in keys:
                    pair = window_pair(qa, qb, ka, kb, window)
                    if pair is not None:
                        needed.append(pair[0][2:])
            kv += _covered(needed)
        dkv += _covered(needed)  # after the loop: the rows of step 1 and later
    return kv / (ring * (ring - 1)), dkv / ring


@lru_cache(maxsize=65536)
def step_pairs(length: int, ring: int, window: int) -> tuple[float, ...]:
    """Per ring step ``t`` of a ring of ``ring`` positions, the (query, key) pairs under the
    window one position computes for one sequence of ``length`` tokens, mean over positions:
    at step t position p attends its two zigzag chunks against those of position ``p - t``
    (the engine's blocks, ``ZigzagLayout``). The steps sum to the sequence's windowed pairs
    over ``ring``."""
    chunks = _position_chunks(zigzag_bounds(length, ring), ring)
    out = []
    for step in range(ring):
        total = 0
        for position in range(ring):
            for qa, qb in chunks(position):
                for ka, kb in chunks((position - step) % ring):
                    total += visible_pairs(qa, qb, ka, kb, window)
        out.append(total / ring)
    return tuple(out)


def visible_pairs(qa: int, qb: int, ka: int, kb: int, window: int) -> int:
    """Pairs (query i in ``[qa, qb)``, key k in ``[ka, kb)``) with ``i - window <= k <= i``."""
    return _clamped_sum(qa, qb, kb - 1 + window, window + 1) - \
        _clamped_sum(qa, qb, ka - 1 + window, window + 1)


def _clamped_sum(lo: int, hi: int, top: int, cap: int) -> int:
    """``sum(min(cap, max(0, top + 1 - i)) for i in range(lo, hi))``: a query's keys below
    ``top - window + 1`` (``visible_pairs``), in O(1)."""
    full_end = min(hi, top + 2 - cap)  # i < full_end: the cap
    total = cap * max(0, full_end - lo)
    a, b = max(lo, top + 2 - cap), min(hi, top + 1)  # i in [a, b): top + 1 - i
    if b > a:
        total += (b - a) * (2 * top + 2 - a - b + 1) // 2
    return total


def _position_chunks(bounds, ring: int):
    """``chunks(position)``: the document ranges of the two zigzag chunks ``position``
    holds, given a sequence's ``zigzag_bounds``."""
    def chunks(position: int) -> list[tuple[int, int]]:
        mirror = 2 * ring - 1 - position
        return [(bounds[position], bounds[position + 1]), (bounds[mirror], bounds[mirror + 1])]

    return chunks


def _covered(ranges: list[tuple[int, int]]) -> int:
    """Positions in the union of half-open ``ranges``."""
    total, end = 0, None
    for a, b in sorted(ranges):
        if end is None or a >= end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total
