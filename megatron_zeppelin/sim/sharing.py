"""Processor sharing: compute jobs of several ranks on fewer cores (the simulator's own model).

On a CPU cluster where ``k`` ranks share ``cores`` cores, a rank that computes while ``k`` of
the ranks on those cores compute advances at rate ``min(1, cores / k)``; a rank that waits (a ring
peer, a remap, the gradient all-reduce) takes no core, so the busy ones speed up. One device per
rank (GPU profiles) is ``cores >= ranks``: every job runs at rate 1 and finishes at
``release + work`` exactly.

``step_model.shared_ends`` prices each wave's compute with it when the profile sets
``shared_cores``.
"""

from __future__ import annotations

from typing import Sequence


def shared_finish(release: Sequence[float], work: Sequence[float], cores: float) -> list[float]:
    """Finish time of each job under processor sharing on ``cores`` cores.

    ``release[j]``: when job ``j`` becomes ready (seconds); ``work[j]``: its seconds on a whole
    core. Between events every ready, unfinished job advances at ``min(1, cores / k)``, ``k`` the
    number of such jobs. Exact (event by event), O(jobs^2)."""
    if len(release) != len(work):
        raise ValueError(f"release has {len(release)} jobs, work {len(work)}")
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    if any(w < 0 for w in work):
        raise ValueError(f"work must be >= 0, got {list(work)}")
    left = [float(w) for w in work]
    finish = [float("nan")] * len(left)
    pending = sorted(range(len(left)), key=lambda j: release[j])
    active: list[int] = []
    now = min((float(r) for r in release), default=0.0)
    while pending or active:
        while pending and release[pending[0]] <= now:
            active.append(pending.pop(0))
        if not active:
            now = float(release[pending[0]])
            continue
        rate = min(1.0, cores / len(active))
        first = min(active, key=lambda j: left[j])
        done_in = left[first] / rate
        step = min(done_in, float(release[pending[0]]) - now) if pending else done_in
        now += step
        for j in list(active):
            left[j] = 0.0 if (j == first and step == done_in) else left[j] - step * rate
            if left[j] <= 1e-12 * float(work[j]):
                finish[j] = now
                active.remove(j)
    return finish
