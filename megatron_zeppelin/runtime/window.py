"""Sliding-window geometry of zigzag ring blocks (pure arithmetic on host offsets).

A query at document position ``i`` sees keys ``i - L .. i`` (Megatron's ``window_size=(L,
0)``). ``window_pair`` trims one (query chunk, key chunk) pair of a ring step to the rows that
see a key and the keys a row sees, and names the END-aligned band (``kernels.base.band``) the
kernel runs it with; ``add_pair`` groups pairs of one band into calls whose query rows are
distinct. ``attention.ZigzagLayout`` builds its windowed blocks and relayed rows from them.
Standard library only.
"""
from __future__ import annotations


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
