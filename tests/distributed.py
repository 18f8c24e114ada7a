"""Run a test body on several gloo processes on this machine (ranks grouped into nodes)."""
from __future__ import annotations

import datetime
import os
import socket

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


def run_world(fn, world: int, *args, env: dict | None = None) -> None:
    """Fork ``world`` processes running ``fn(rank, world, *args)``; any failure fails the test.

    Forked (not spawned) so the ranks share the parent's imports: starting 8 interpreters
    that each import torch would dominate the test time on a 2-core machine.
    """
    mp.start_processes(_entry, args=(world, free_port(), dict(env or {}), fn, args),
                       nprocs=world, join=True, start_method="fork")
