"""Token ranges of sequences and the zigzag split: the vocabulary of layouts (stdlib only).

Below ``plan.py`` and ``plan_checks.py``, which both use it (so neither imports the other's
module at import time).
"""
from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """Token range ``[start, end)`` of sequence ``seq``."""

    seq: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def zigzag_bounds(length: int, ring_size: int) -> tuple[int, ...]:
    """The 2G+1 boundaries of the 2G zigzag chunks of a sequence (sizes differ by <= 1)."""
    n = 2 * ring_size
    return tuple(i * length // n for i in range(n + 1))


def zigzag_segments(seq: int, length: int, ring_size: int, position: int) -> tuple[Segment, ...]:
    """The segments ring position ``position`` holds: ``(chunk p, chunk 2G-1-p)``, or the whole."""
    if ring_size == 1:
        return (Segment(seq, 0, length),)
    n = 2 * ring_size
    mirror = n - 1 - position
    return (Segment(seq, position * length // n, (position + 1) * length // n),
            Segment(seq, mirror * length // n, (mirror + 1) * length // n))


def zigzag_share(length: int, ring_size: int, position: int) -> int:
    """Tokens ring position ``position`` holds under the zigzag split (O(1))."""
    if ring_size == 1:
        return length
    n = 2 * ring_size
    mirror = n - 1 - position
    return ((position + 1) * length // n - position * length // n
            + (mirror + 1) * length // n - mirror * length // n)


def zigzag_share_bound(length: int, ring_size: int) -> int:
    """An upper bound on any position's zigzag share: 2 * ceil(length / 2G) (O(1))."""
    if ring_size == 1:
        return length
    return 2 * -(-length // (2 * ring_size))


# Per rank, the token ranges it holds, in buffer order (an attention or a linear layout).
Layout = tuple[tuple[Segment, ...], ...]
