"""The overlong policy: what becomes of a document longer than the longest allowed, written
once for the planner (``common.prepare``) and the data pipeline (``megatron/common/data.py``), with
one report type (``plan.OverlongReport``; nothing is split or dropped without being counted).

Policies (``config.OVERLONG_POLICIES``): ``error`` refuses the document, naming it; ``drop``
leaves it out; ``split`` cuts it into ``ceil(length / limit)`` pieces of equal length (within
one token), so that no piece is a sliver.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_zeppelin.config import OVERLONG_POLICIES
from megatron_zeppelin.plan import OverlongReport


def check_policy(policy: str) -> None:
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong policy {policy!r} is invalid: expected one of "
                         f"{list(OVERLONG_POLICIES)}")


def piece_bounds(length: int, limit: int) -> list[tuple[int, int]]:
    """The (start, end) pieces ``split`` cuts a document of ``length`` tokens into."""
    k = -(-length // limit)
    bounds = [i * length // k for i in range(k + 1)]
    return list(zip(bounds, bounds[1:]))


@dataclass
class OverlongTally:
    """Running counts of what the policy did to a stream of documents (``admit`` each), and
    their report. ``documents`` counts every document admitted."""

    documents: int = 0
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    split_sequences: int = 0
    split_pieces: int = 0

    def admit(self, index: int, length: int, limit: int, policy: str, what: str = "sequence",
              why: str = "the limit", setting: str = "the overlong policy"
              ) -> list[tuple[int, int]]:
        """The (start, end) pieces document ``index`` of ``length`` tokens keeps when at most
        ``limit`` are allowed (``why`` names the limit, ``setting`` the policy's flag in the
        error): itself when it fits, else what ``policy`` does, counted here."""
        self.documents += 1
        if length <= limit:
            return [(0, length)]
        if policy == "error":
            raise ValueError(f"{what} {index} has {length} tokens, more than {why} allows "
                             f"({limit} tokens); raise it, or set {setting} to 'split' or "
                             "'drop'")
        if policy == "drop":
            self.dropped_sequences += 1
            self.dropped_tokens += length
            return []
        check_policy(policy)
        pieces = piece_bounds(length, limit)
        self.split_sequences += 1
        self.split_pieces += len(pieces)
        return pieces

    def report(self, policy: str) -> OverlongReport:
        return OverlongReport(policy, self.dropped_sequences, self.dropped_tokens,
                              self.split_sequences, self.split_pieces, self.documents)
