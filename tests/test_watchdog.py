"""The heartbeat watchdog on an in-memory store with a fake clock: a silent rank is named
after the timeout by every rank, a failed one at once, a finished one never, a job suspended
as a whole is not misreported; dead processes on this host are named at once."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

from megatron_zeppelin.megatron.loop.watchdog import Watchdog

TIMEOUT = 4.0  # heartbeats every 1 s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def world(size: int = 3, store=None):
    store = store or dist.HashStore()
    clock, reports = Clock(), {r: [] for r in range(size)}
    dogs = [Watchdog(store, "test", r, size, TIMEOUT, reports[r].append, "in memory", clock)
            for r in range(size)]
    for dog in dogs:
        dog.announce()
    for dog in dogs:
        dog.meet()
    return dogs, clock, reports


def beat(dogs, clock, seconds: float, ranks) -> list:
    """Advance ``seconds`` in heartbeat steps; ``ranks`` poll; returns their verdicts."""
    verdicts = []
    for _ in range(int(seconds / dogs[0].interval)):
        clock.now += dogs[0].interval
        verdicts += [(r, v) for r in ranks if (v := dogs[r].poll())]
    return verdicts


def test_a_silent_rank_is_named_after_the_timeout_by_every_rank():
    dogs, clock, _ = world()
    assert beat(dogs, clock, 10, ranks=(0, 1, 2)) == []
    assert beat(dogs, clock, TIMEOUT, ranks=(0, 1)) == []  # rank 2 froze
    verdicts = beat(dogs, clock, 2, ranks=(0, 1))  # named within timeout + 2 heartbeats
    assert {r for r, _ in verdicts} == {0, 1}
    assert len({v for _, v in verdicts}) == 1  # the first verdict is everyone's
    assert "rank 2 (pid" in verdicts[0][1] and "stopped responding: no heartbeat for" in \
        verdicts[0][1] and "--zeppelin-watchdog-timeout 4 s" in verdicts[0][1]


def test_a_job_suspended_as_a_whole_is_not_misreported():
    dogs, clock, _ = world()
    beat(dogs, clock, 3, ranks=(0, 1, 2))
    clock.now += 600  # Ctrl-Z, then fg: nobody polled
    assert beat(dogs, clock, 3, ranks=(0, 1, 2)) == []


def test_a_failed_rank_is_named_at_once_and_a_finished_one_never():
    dogs, clock, _ = world()
    dogs[1].leave("done")
    dogs[2].leave("failed", "ValueError: bad batch")
    verdicts = beat(dogs, clock, 1, ranks=(0,))
    assert verdicts == [(0, "rank 2 failed: ValueError: bad batch")]
    dogs, clock, _ = world()
    dogs[2].leave("done")
    assert beat(dogs, clock, 3 * TIMEOUT, ranks=(0, 1)) == []


def test_a_rank_that_left_with_a_user_error_is_named_only_if_others_still_run_later():
    dogs, clock, _ = world()
    dogs[2].leave("exiting", "--load: checkpoint x is incomplete")
    assert beat(dogs, clock, TIMEOUT - 1, ranks=(0, 1)) == []
    verdicts = beat(dogs, clock, 2, ranks=(0,))
    assert "stopped training" in verdicts[0][1] and "is incomplete" in verdicts[0][1]


def test_a_dead_process_on_this_host_is_named_at_once():
    dogs, clock, _ = world()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dogs[0].peers[2]["pid"] = gone.pid  # rank 2's process has exited
    dogs[0].stale[2] = 0.0
    record = dict(dogs[2].record, pid=gone.pid)
    dogs[2].store.set(dogs[2]._key(2), __import__("json").dumps(record))
    verdicts = beat(dogs, clock, 1, ranks=(0,))
    assert verdicts and f"rank 2 (pid {gone.pid} on" in verdicts[0][1] and "died" in \
        verdicts[0][1]


class BrokenStore:
    """A store that stops answering after ``good`` multi_get calls."""

    def __init__(self, good: int) -> None:
        self.inner, self.good = dist.HashStore(), good

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def multi_get(self, keys):
        self.good -= 1
        if self.good < 0:
            raise TimeoutError("store timed out")
        return self.inner.multi_get(keys)


def test_an_unreachable_store_is_reported_after_the_timeout():
    store = BrokenStore(good=3)
    dogs, clock, _ = world(store=store)
    verdicts = beat(dogs, clock, TIMEOUT + 2, ranks=(0,))
    assert verdicts and "the rendezvous store in memory did not answer" in verdicts[0][1]


def test_explain_names_the_peer_behind_a_communication_error():
    dogs, clock, reports = world()
    dogs[2].leave("failed", "RuntimeError: CUDA error")
    dogs[0].explain(RuntimeError("Connection closed by peer [127.0.0.1]:5000"))
    assert reports[0] == ["rank 2 failed: RuntimeError: CUDA error"]


def test_explain_publishes_a_local_error_without_waiting():
    dogs, clock, _ = world()
    dogs[1].explain(ValueError("a shape bug"))
    verdicts = beat(dogs, clock, 1, ranks=(0,))
    assert verdicts == [(0, "rank 1 failed: ValueError: a shape bug")]


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        Watchdog(dist.HashStore(), "x", 0, 1, 0, print)
