"""``Plan.validate()`` refuses corrupted plans: every check of ``plan_checks.py`` is triggered
by at least one corruption of a valid plan, and names what is wrong."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_zeppelin.plan import AttentionTask, Plan, PlanError, Segment, Tier, Topology

TOPOLOGY = Topology(nodes=2, gpus_per_node=2)


def valid() -> Plan:
    """Three sequences on 2 nodes x 2: 8 tokens across nodes, 4 inside node 0, 2 local."""
    tasks = (AttentionTask(0, (0, 1, 2, 3), Tier.INTER), AttentionTask(1, (0, 1), Tier.INTRA),
             AttentionTask(2, (3,), Tier.LOCAL))
    linear = ((Segment(0, 0, 4),), (Segment(0, 4, 8),), (Segment(1, 0, 4),), (Segment(2, 0, 2),))
    return Plan(strategy="zeppelin", topology=TOPOLOGY, seqlens=(8, 4, 2),
                sources=(Segment(0, 0, 8), Segment(1, 0, 4), Segment(2, 0, 2)), tasks=tasks,
                linear=linear, capacity=8)


def replace(**changes) -> Plan:
    return dataclasses.replace(valid(), **changes)


def with_task(index: int, **changes) -> Plan:
    tasks = list(valid().tasks)
    tasks[index] = tasks[index]._replace(**changes)
    return replace(tasks=tuple(tasks))


def with_linear(rank: int, segments: tuple[Segment, ...]) -> Plan:
    linear = list(valid().linear)
    linear[rank] = segments
    return replace(linear=tuple(linear))


def with_attention(rank: int, segments: tuple[Segment, ...]) -> Plan:
    """A plan whose (derived, cached) attention layout was corrupted after the fact."""
    plan = valid()
    attention = list(plan.attention)
    attention[rank] = segments
    plan.__dict__["attention"] = tuple(attention)
    return plan


def test_the_plan_these_tests_corrupt_is_valid():
    assert valid().validate().tier_counts() == {"local": 1, "intra": 1, "inter": 1}


CORRUPTIONS = {
    "linear layout for too few ranks": (
        lambda: replace(linear=valid().linear[:3]),
        r"linear layout has 3 ranks, topology has 4"),
    "a task missing": (
        lambda: replace(tasks=valid().tasks[:2]),
        r"3 sequences but 2 tasks and 3 sources: expected one each"),
    "a source missing": (
        lambda: replace(sources=valid().sources[:2]),
        r"3 sequences but 3 tasks and 2 sources"),
    "an empty sequence": (
        lambda: replace(seqlens=(8, 4, 0)),
        r"sequence 2 has length 0: expected >= 1"),
    "a source of the wrong length": (
        lambda: replace(sources=(Segment(0, 0, 8), Segment(1, 0, 3), Segment(2, 0, 2))),
        r"sequence 1 of length 4 has source"),
    "a source before the document": (
        lambda: replace(sources=(Segment(0, -1, 7), Segment(1, 0, 4), Segment(2, 0, 2))),
        r"sequence 0 of length 8 has source"),
    "an attention kind the runtime does not run": (
        lambda: replace(attention_kind="ulyses"),
        r"attention_kind='ulyses' is invalid: expected one of \['ring', 'ulysses'\]"),
    "no capacity": (
        lambda: replace(capacity=0),
        r"capacity 0 is invalid: expected >= 1"),
    "tasks out of order": (
        lambda: replace(tasks=(valid().tasks[1], valid().tasks[0], valid().tasks[2])),
        r"task 0 attends sequence 1: tasks must be in sequence order"),
    "an empty ring": (
        lambda: with_task(2, ring=()),
        r"sequence 2 has ring \(\): expected distinct ranks in \[0, 4\)"),
    "a rank twice in a ring": (
        lambda: with_task(1, ring=(0, 0)),
        r"sequence 1 has ring \(0, 0\)"),
    "a rank outside the pool": (
        lambda: with_task(2, ring=(4,)),
        r"sequence 2 has ring \(4,\)"),
    "a tier that does not match the ring": (
        lambda: with_task(1, tier=Tier.INTER),
        r"sequence 1 ring \(0, 1\) is INTRA, task says INTER"),
    "a ring longer than zigzag allows": (
        lambda: with_task(1, ring=(0, 1, 2, 3), tier=Tier.INTER),
        r"sequence 1 of 4 tokens is split over 4 ranks: zigzag needs at least 8 tokens"),
    "a negative wave": (
        lambda: with_task(2, wave=-1),
        r"sequence 2 has wave -1: expected >= 0"),
    "a segment of a sequence that does not exist": (
        lambda: with_linear(3, (Segment(2, 0, 2), Segment(5, 0, 1))),
        r"linear layout of rank 3 names sequence 5, valid: \[0, 3\)"),
    "an empty segment": (
        lambda: with_linear(3, (Segment(2, 0, 2), Segment(2, 2, 2))),
        r"linear layout of rank 3 has empty segment \(2, 2, 2\)"),
    "tokens held twice": (
        lambda: with_linear(1, (Segment(0, 2, 8),)),
        r"linear layout: tokens \[2, 4\) of sequence 0 are duplicated"),
    "a gap": (
        lambda: with_linear(1, (Segment(0, 5, 8),)),
        r"linear layout: tokens \[4, 5\) of sequence 0 are missing"),
    "a missing tail": (
        lambda: with_linear(2, (Segment(1, 0, 3),)),
        r"linear layout: tokens \[3, 4\) of sequence 1 are missing"),
    "attention tokens lost": (
        lambda: with_attention(3, ()),
        r"attention layout: tokens \[\d+, \d+\) of sequence \d are missing"),
    "a rank over the capacity": (
        lambda: replace(capacity=3),
        r"rank 0 holds 4 attention tokens, over the capacity 3"),
    "a rank over the capacity in a later wave": (
        lambda: dataclasses.replace(with_task(2, wave=1), capacity=1),
        r"rank \d holds \d attention tokens in wave [01], over the capacity 1"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_every_corruption_is_refused_by_name(name):
    corrupt, message = CORRUPTIONS[name]
    with pytest.raises(PlanError, match=message):
        corrupt().validate()


def test_every_check_of_plan_checks_is_triggered():
    """Each ``raise PlanError`` in plan_checks.py is reached by one of the corruptions above."""
    import inspect

    from megatron_zeppelin import plan_checks

    source = inspect.getsource(plan_checks)
    raises = source.count("raise PlanError(")
    reached = set()
    for corrupt, _ in CORRUPTIONS.values():
        try:
            corrupt().validate()
        except PlanError as exc:
            reached.add(_raise_line(exc))
    assert len(reached) == raises, (len(reached), raises)


def _raise_line(exc: BaseException) -> int:
    """The line of plan_checks.py that raised ``exc``."""
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("plan_checks.py"):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
