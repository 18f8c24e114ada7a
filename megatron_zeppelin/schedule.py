"""The attention engine's schedule, stated once: what the engine runs and the simulator prices.

The runtime (``runtime/engine.py``, ``runtime/attention.py``, ``runtime/inter.py``) executes
these facts and the simulator (``sim/rounds.py``) models them; neither restates them. Pure
Python (no torch), so the plan layer and the simulator can import it.

A wave of a plan runs in *rounds* ``r = 0, 1, ...`` per phase (forward, backward). A ring of
``G`` ranks (zigzag, ``runtime/attention.py``):

* computes ``compute_steps(G)`` = ``G`` steps (one per KV block it sees), step ``r`` in round r;
* sends its KV block to the next position in rounds ``r < G - 1`` (``sends_kv``), and in the
  backward also the dK/dV accumulator, one step behind the KV, in rounds ``1 <= r <= G``
  (``sends_dkv``: the last one returns the accumulator to its owner);
* so it exchanges in ``exchange_rounds(G)`` rounds and runs ``phase_steps(G)`` rounds.

A windowed ring whose window fits in every zigzag chunk and that has 3 positions or more
exchanges with its two neighbours only (``runtime/halo.py``): it runs the rounds of a ring of
two (``halo_steps``), sending to both neighbours (across nodes in the global steps below).

INTER rings whose hops cross nodes travel as *global* steps (``inter_mode`` direct/routed): a
wave with such rings runs ``wave_global_steps`` global steps (the exchange rounds of its
longest INTER ring, a halo group counting as a ring of ``HALO_ROUNDS_SIZE``), every rank of the
pool taking part.

LOCAL sequences run as calls of ``local_calls`` (``plan.local_call_groups``: shortest first,
short ones batched into calls of at least the work of one ``LOCAL_CALL_TOKENS``-token sequence).
Where they run: on CPU (host-driven, ``LOCAL_POLICY['cpu']``) a call starts only while a round's
exchanges are in flight and the rest run after the last round (the simulator's ``engine``
policy); on CUDA (``LOCAL_POLICY['cuda']``) every LOCAL call is queued at the start of the wave
on a low-priority stream, so the GPU fills every wait of the ring streams with LOCAL work (the
simulator's ``fill`` policy).
"""
from __future__ import annotations

import enum
from typing import Iterable, Sequence

from megatron_zeppelin.plan import local_call_groups

LOCAL_CALL_TOKENS = 2048  # the engine's default LOCAL call size (work of one such sequence)
LOCAL_POLICY = {"cpu": "engine", "cuda": "fill"}  # the simulator policy the engine follows


class Phase(enum.Enum):
    """A pass of the engine: ``FORWARD`` (KV travels) or ``BACKWARD`` (KV, then dK/dV back)."""

    FORWARD = "forward"
    BACKWARD = "backward"


def compute_steps(size: int) -> int:
    """Ring steps with compute of a ring of ``size`` ranks (one per KV block it sees)."""
    return size


def phase_steps(size: int, phase: Phase) -> int:
    """Rounds a ring of ``size`` ranks takes part in: forward ``G``; backward ``G + 1`` (the
    last one only returns the dK/dV accumulator to its owner), 1 for a ring of one."""
    if phase is Phase.FORWARD or size < 2:
        return size
    return size + 1


HALO_ROUNDS_SIZE = 2  # a halo group runs the rounds of a ring of this size (``halo_steps``)
# a group where only some sequences' chunks hold the window: its halo part beside a ring run of
# the rest (CUDA: the rows saved outweigh the extra calls, as the simulator prices them), or
# the whole group round the ring (CPU, host-driven: the extra calls cost more, measured by
# ``zeppelin bench halo``: 0.89-1.02x on 4-8 gloo ranks, where whole halo groups gain 1.08-1.40x)
HALO_SPLIT = {"cpu": False, "cuda": True}


def halo_steps(phase: Phase) -> int:
    """Rounds of a windowed ring group run by halo exchange (``runtime/halo.py``, where
    ``zigzag_window.halo_fits``), whatever the ring's size: those of a ring of
    ``HALO_ROUNDS_SIZE``. Forward 2 (its KV rows out to both neighbours in round 0, their
    blocks computed in round 1); backward 3 (the KV rows out in round 0, the neighbours' rows'
    dK/dV home in round 2, ``sends_dkv(..., halo=True)``)."""
    return phase_steps(HALO_ROUNDS_SIZE, Phase(phase))


def sends_kv(size, r):
    """Whether a member of a ring of ``size`` sends its KV block in round ``r`` (both phases);
    elementwise for numpy arrays."""
    return r < size - 1


def sends_dkv(size, r, halo=False):
    """Whether a member of a ring of ``size`` sends the dK/dV accumulator in backward round
    ``r``; elementwise for numpy arrays (never for a ring of one). A halo group (``halo``,
    ``size`` then ``HALO_ROUNDS_SIZE``) sends its neighbours' rows' dK/dV in round 2 only."""
    return (1 + halo <= r) & (r <= size) & (size > 1)


def exchange_rounds(size, phase: Phase):
    """Rounds in which a ring of ``size`` ranks has an exchange in flight (forward ``G - 1``,
    backward ``G + 1``, none for a ring of one); elementwise for numpy arrays."""
    return (size + (-1 if phase is Phase.FORWARD else 1)) * (size > 1)


def global_steps(longest: int, phase: Phase) -> int:
    """Global inter-node steps of a wave whose longest INTER ring has ``longest`` ranks (0: no
    such ring): the exchange rounds of that ring."""
    return exchange_rounds(longest, phase) if longest > 0 else 0


def wave_global_steps(rings: Iterable[tuple[int, bool]], phase: Phase) -> int:
    """Global inter-node steps of a wave whose INTER ring runs are ``rings`` = (ring size,
    run by halo exchange) each: those of the longest, a halo run counting as a ring of
    ``HALO_ROUNDS_SIZE`` (its hops across nodes travel in global steps too)."""
    return global_steps(max((HALO_ROUNDS_SIZE if halo else size for size, halo in rings),
                            default=0), phase)


def local_calls(lengths: Sequence[int], min_tokens: int = LOCAL_CALL_TOKENS
                ) -> list[tuple[int, ...]]:
    """The LOCAL sequences (indices into ``lengths``) of each call, in run order."""
    return local_call_groups([n * n for n in lengths], min_tokens)
