"""``api.watchdog``: zeppelin's heartbeat watchdog around a custom training loop. Under
torchrun (3 gloo ranks), a rank that raises or is killed inside the block is named by every
other rank, which leaves a collective it would otherwise wait in with status 1."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

LOOP = r'''
import os, signal, sys, time
import torch, torch.distributed as dist
from megatron_zeppelin import api

dist.init_process_group("gloo")
how = sys.argv[1]
with api.watchdog(4.0) as line:
    if dist.get_rank() == 0:
        print("watchdog:", line, flush=True)
    dist.barrier()
    if dist.get_rank() == 1 and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if dist.get_rank() == 1 and how == "raise":
        raise ValueError("bad batch 7")
    for _ in range(3 if how == "none" else 6000):  # the others wait here on rank 1
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)
sys.stdout.write(f"done {dist.get_rank()}\n")  # one write: ranks share the pipe
sys.stdout.flush()
dist.destroy_process_group()
'''


def launch(tmp_path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "my_loop.py"
    script.write_text(LOOP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--monitor-interval", "0.2", str(script), how]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("how,said", [
    ("raise", r"rank 1 failed: ValueError: bad batch 7"),
    ("kill", r"rank 1 \(pid \d+ on .*\) died: its process exited or was killed"),
])
def test_a_failed_rank_is_named_by_every_other_rank(tmp_path, how, said):
    run = launch(tmp_path, how)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    for rank in (0, 2):
        assert re.search(rf"my_loop.py: error: rank {rank}: {said}", out), out
    assert "done" not in run.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_a_loop_that_ends_normally_leaves_no_trace(tmp_path):
    run = launch(tmp_path, "none")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"watchdog: a rank silent for 4 s is named by every other rank within 6 s",
                     run.stdout)
    assert sorted(re.findall(r"done \d", run.stdout)) == ["done 0", "done 1", "done 2"]
    assert "error" not in run.stderr


@pytest.mark.parametrize("timeout,match", [
    (-1, r"timeout_s=-1 is invalid: expected 0 \(off\) or seconds >= 1"),
    (0.5, r"timeout_s=0.5 is invalid"),
    ("20", r"timeout_s='20' is invalid"),
    (True, r"timeout_s=True is invalid"),
    (float("nan"), r"timeout_s=nan is invalid"),
    (400.0, r"timeout_s=400 is invalid: expected fewer seconds than ZEPPELIN_P2P_TIMEOUT_S=300"),
    (20.0, r"watchdog\(\) is invalid here: no process group"),
])
def test_the_watchdog_refuses_a_bad_timeout_or_no_process_group(timeout, match):
    from megatron_zeppelin import api

    with pytest.raises(ValueError, match=match):
        with api.watchdog(timeout):
            pass
