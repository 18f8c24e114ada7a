"""Run a test body on several gloo processes on this machine (ranks grouped into nodes)."""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, env: dict, fn, args) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)  # several ranks share this machine's few cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args, env: dict | None = None, start_method: str = "fork",
              timeout_s: float = 180.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; any failure fails the test, and a
    world still running after ``timeout_s`` is killed (a deadlock must not hang CI).

    Forked by default, so the ranks share the parent's imports (8 interpreters importing torch
    would dominate the test time on a 2-core machine). Use ``start_method="spawn"`` for bodies
    that initialise megatron-core's parallel state: a gloo group left alive in the parent by an
    earlier test makes forked ranks hang in their first ``new_group``.
    """
    context = mp.start_processes(_entry, args=(world, free_port(), dict(env or {}), fn, args),
                                 nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a world of {world} ranks ran past {timeout_s:.0f} s "
                                   "(deadlock?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
