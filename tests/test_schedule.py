"""The engine's schedule, stated once (schedule.py): the runtime runs it, the simulator prices
it; the module is torch-free."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megatron_zeppelin import schedule
from megatron_zeppelin.schedule import Phase


def test_schedule_and_simulator_import_no_torch():
    code = ("import sys; import megatron_zeppelin.schedule, megatron_zeppelin.sim.rounds; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_rounds_of_a_ring_follow_from_what_it_sends(size):
    """Exchange rounds are exactly the rounds in which something is sent; scalars and numpy
    arrays give the same answers (the simulator vectorises over rings)."""
    for phase in Phase:
        rounds = schedule.phase_steps(size, phase)
        sends = [bool(schedule.sends_kv(size, r)) or (
            phase is Phase.BACKWARD and bool(schedule.sends_dkv(size, r))) for r in range(rounds)]
        assert sum(sends) == schedule.exchange_rounds(size, phase)
        assert not schedule.sends_kv(size, rounds) and not schedule.sends_dkv(size, rounds + 1)
        sizes = np.array([size, size])
        assert schedule.exchange_rounds(sizes, phase).tolist() == [sum(sends)] * 2
    assert schedule.global_steps(0, Phase.FORWARD) == 0
    assert schedule.global_steps(size, Phase.BACKWARD) == schedule.exchange_rounds(size,
                                                                                   Phase.BACKWARD)


def test_engine_ring_runs_the_schedule():
    import torch

    from megatron_zeppelin.runtime.attention import RingGroupRun
    from megatron_zeppelin.runtime.zigzag import ZigzagLayout

    for size in (1, 2, 4):
        run = RingGroupRun(ZigzagLayout([9, 4], size, 0), 0.5)
        run.begin_backward(*(torch.zeros(run.layout.tokens(), 2, 8) for _ in range(5)),
                           torch.zeros(2, run.layout.tokens()))
        assert run.steps(Phase.FORWARD) == schedule.compute_steps(size)
        assert run.steps(Phase.BACKWARD) == schedule.phase_steps(size, Phase.BACKWARD)
        for r in range(run.steps(Phase.BACKWARD)):
            like = run.recv_like(Phase.BACKWARD, r)
            assert len(like) == bool(schedule.sends_kv(size, r)) + bool(
                schedule.sends_dkv(size, r))
