"""A phase of one wave on one rank, as the engine's rounds see it (``engine.py``): its inputs
(``Tensors``), what every round reads (``WavePass``), a posted round (``PostedRound``) and the
CPU lanes' LOCAL fill of a round's wait (``fill``).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, NamedTuple

import torch

from megatron_zeppelin.runtime.attention import RingGroupRun
from megatron_zeppelin.runtime.kernels import KernelBackend
from megatron_zeppelin.runtime.lanes import Lanes
from megatron_zeppelin.runtime.ring_comm import RingRequest
from megatron_zeppelin.runtime.waves import LocalCall, Wave
from megatron_zeppelin.schedule import Phase


class Tensors(NamedTuple):
    """A phase's inputs: q ``[tokens, h, d]``, out/dout ``[tokens, h, dv]``, k ``[tokens, g,
    d]``, v ``[tokens, g, dv]``, lse ``[h, tokens]`` (out, lse and dout: backward only)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None
    lse: torch.Tensor | None
    dout: torch.Tensor | None


@dataclasses.dataclass
class WavePass:
    """One phase of one wave on this rank: what every round of it reads."""

    phase: Phase
    index: int
    wave: Wave
    tensors: Tensors
    result: tuple[torch.Tensor, ...]
    scale: float
    kernel: KernelBackend
    lanes: Lanes
    window: tuple[int, int] | None = None  # LOCAL calls' band (base.band), None: causal
    split: bool = False  # a group partly fitting a halo exchange split (``waves.halo_split``)
    runs: list[RingGroupRun] = dataclasses.field(default_factory=list)

    @property
    def window_size(self) -> int | None:
        """The sliding window ``L`` of ``window`` (None: full causal)."""
        return None if self.window is None else self.window[0]


class PostedRound:
    """A posted round: per ring ``(request, recv_like)`` and the global step's future."""

    def __init__(self, requests: list[tuple[RingRequest | None, list]],
                 inter: Future | None) -> None:
        self.requests, self.inter = requests, inter
        self.at = time.perf_counter()  # when the round was posted (the probe's link times)

    def in_flight(self) -> bool:
        """Whether some exchange of the round is still in flight (never blocks)."""
        return any(r is not None and not r.done() for r, _ in self.requests) or (
            self.inter is not None and not self.inter.done())


def fill(queue: deque, in_flight: Callable[[], bool], run: Callable[[LocalCall], None]) -> int:
    """Run calls from the front of ``queue`` while ``in_flight()`` (CPU lanes); the number run.

    ``in_flight`` is asked before every call, so the wait that follows is delayed by at most
    one call after the round's exchanges complete.
    """
    ran = 0
    while queue and in_flight():
        run(queue.popleft())
        ran += 1
    return ran
