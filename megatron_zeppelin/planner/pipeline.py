"""Megatron's pipeline schedules, timed exactly for micro-batches of unequal cost.

``pipeline_step`` runs an event-driven simulation of the order in which megatron-core 0.16
executes forward and backward steps on each pipeline stage, and returns when the last one
ends. Standard library only (planner layer).

* **1F1B** (``vpp == 1``, ``forward_backward_pipelining_without_interleaving``): stage ``s``
  of ``p`` runs ``min(p - s - 1, M)`` warm-up forwards, then ``F(w + i), B(i)`` pairs, then
  the remaining backwards.
* **Interleaved** (``vpp == V > 1``, ``forward_backward_pipelining_with_interleaving``):
  stage ``s`` holds model chunks ``c = 0..V-1`` (virtual stage ``c p + s``). The k-th forward
  of every stage is entry k of Megatron's schedule table (``get_schedule_table``: groups of
  ``p`` micro-batches, chunk by chunk), the k-th backward the same entry with the chunk
  reversed; warm-up ``2 (p - s - 1) + (V - 1) p`` forwards, capped at ``M V``. Megatron
  requires ``M`` a multiple of ``p`` here (``check_microbatches``).

A step starts when its stage is free and its input has arrived: a forward of virtual stage
``v > 0`` needs the forward of ``v - 1`` of the same micro-batch plus ``p2p_s``; a backward of
``v < last`` needs the backward of ``v + 1`` plus ``p2p_s``; the last virtual stage's backward
follows its own forward. Assumptions: sends do not block the sender (a message arrives
``p2p_s`` after its step ends; Megatron's batched isend/irecv waits for the peer to post the
matching receive, which this ignores), and the optimizer step waits for every stage.

With equal micro-batches (forward ``f``, backward ``b`` per stage) and ``p2p_s = 0`` this
gives the textbook step ``(M + p - 1) (f + b)`` for 1F1B and ``M (f + b) + (p - 1)(f + b) / V``
for the interleaved schedule (``f``, ``b``: a whole stage's times), tested in
``tests/test_pipeline.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence


class Step(NamedTuple):
    """One forward (``backward=False``) or backward of ``microbatch`` through ``chunk`` on
    ``stage``, with its start and end (seconds from the step's start)."""

    stage: int
    chunk: int
    microbatch: int
    backward: bool
    start: float
    end: float


@dataclass(frozen=True)
class PipelineTimeline:
    """Every step of one training step's pipeline schedule; ``step_s`` when the last ends,
    ``busy_s`` per stage the seconds it computes."""

    steps: tuple[Step, ...]
    step_s: float
    busy_s: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """Idle share of the busiest stage's step: 1 - its busy seconds / the step."""
        return 1.0 - max(self.busy_s) / self.step_s if self.step_s > 0 else 0.0


def check_microbatches(microbatches: int, pp: int, vpp: int) -> None:
    """Raise ``ValueError`` unless Megatron runs ``microbatches`` with this ``pp``/``vpp``."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"--microbatches {microbatches!r} is invalid: expected an integer >= 1")
    if vpp > 1 and (pp < 2 or microbatches % pp):
        raise ValueError(f"--microbatches {microbatches} is invalid with --pp {pp} --vpp {vpp}: "
                         "the interleaved schedule needs --pp >= 2 and a multiple of --pp "
                         "micro-batches (megatron-core's schedule table)")


def schedule_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward of a stage, in Megatron's order: groups of
    ``group`` micro-batches, each group through every chunk in turn (the last group takes
    the remainder)."""
    table = []
    for first in range(0, microbatches, group):
        last = microbatches if first + group >= microbatches else first + group
        table.extend((m, c) for c in range(chunks) for m in range(first, last))
    return table


def stage_order(stage: int, pp: int, microbatches: int, vpp: int = 1
                ) -> list[tuple[bool, int, int]]:
    """The steps of ``stage`` as Megatron runs them: (backward, micro-batch, chunk)."""
    if vpp == 1:
        table = [(m, 0) for m in range(microbatches)]
        warmup = pp - stage - 1
    else:
        table = schedule_table(microbatches, vpp, pp)
        warmup = 2 * (pp - stage - 1) + (vpp - 1) * pp
    total = len(table)
    warmup = min(warmup, total)
    order = [(False, m, c) for m, c in table[:warmup]]
    for i in range(total - warmup):
        m, c = table[warmup + i]
        order.append((False, m, c))
        m, c = table[i]
        order.append((True, m, vpp - 1 - c))
    for m, c in table[total - warmup:]:
        order.append((True, m, vpp - 1 - c))
    return order


def pipeline_step(forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]],
                  pp: int, vpp: int = 1, p2p_s: float | Sequence[float] = 0.0
                  ) -> PipelineTimeline:
    """The timeline of one training step (module doc). ``forward[m][v]`` / ``backward[m][v]``:
    seconds of micro-batch ``m`` through virtual stage ``v = chunk * pp + stage`` (``pp * vpp``
    entries each); ``p2p_s``: the transfer between consecutive virtual stages, one for all
    micro-batches or one per micro-batch (its activations, or their gradients)."""
    stages = pp * vpp
    count = len(forward)
    if count < 1 or len(backward) != count:
        raise ValueError(f"forward has {count} micro-batches and backward {len(backward)}: "
                         "expected the same number, at least 1")
    for name, times in (("forward", forward), ("backward", backward)):
        bad = [m for m, row in enumerate(times) if len(row) != stages or min(row) < 0]
        if bad:
            raise ValueError(f"{name}[{bad[0]}] is invalid: expected {stages} times >= 0 "
                             f"(pp={pp} x vpp={vpp} virtual stages)")
    check_microbatches(count, pp, vpp)
    p2p = [float(p2p_s)] * count if isinstance(p2p_s, (int, float)) else list(p2p_s)
    if len(p2p) != count or min(p2p) < 0:
        raise ValueError(f"p2p_s has {len(p2p)} entries: expected {count} times >= 0")
    orders = [stage_order(s, pp, count, vpp) for s in range(pp)]
    return _run(orders, forward, backward, pp, stages, p2p)


def _run(orders, forward, backward, pp: int, stages: int, p2p: list[float]) -> PipelineTimeline:
    """Event-driven execution of every stage's ``orders`` (list scheduling in fixed order)."""
    done: dict[tuple[bool, int, int], float] = {}  # (backward, micro-batch, virtual stage)
    clock, nxt, busy = [0.0] * pp, [0] * pp, [0.0] * pp
    steps: list[Step] = []
    remaining = sum(map(len, orders))
    while remaining:
        progressed = False
        for s in range(pp):
            while nxt[s] < len(orders[s]):
                back, m, c = orders[s][nxt[s]]
                v = c * pp + s
                ready = _ready(done, back, m, v, stages, p2p[m])
                if ready is None:
                    break
                start = max(clock[s], ready)
                took = (backward if back else forward)[m][v]
                clock[s] = start + took
                busy[s] += took
                done[(back, m, v)] = clock[s]
                steps.append(Step(s, c, m, back, start, clock[s]))
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for Megatron's orders; says so if it ever does
            raise RuntimeError(f"pipeline schedule deadlocked at steps {nxt}")
    return PipelineTimeline(tuple(steps), max(clock), tuple(busy))


def _ready(done, back: bool, m: int, v: int, stages: int, p2p_s: float) -> float | None:
    """When the input of a step has arrived (None: its producer has not run yet)."""
    if not back:
        if v == 0:
            return 0.0
        end = done.get((False, m, v - 1))
        return None if end is None else end + p2p_s
    if v == stages - 1:
        return done.get((False, m, v))
    end = done.get((True, m, v + 1))
    return None if end is None else end + p2p_s
