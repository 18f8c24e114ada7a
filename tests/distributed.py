"""Run a test body on several gloo processes on this machine (ranks grouped into nodes).

``run_world(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` ranks joined in one
gloo group and returns every rank's return value (any picklable object). A rank that raises
fails the call with that rank's traceback; a world still running after ``timeout_s`` is
killed, so a deadlock fails the test instead of hanging CI. Ranks leave with ``os._exit``,
skipping process-group teardown (a rank whose peer failed may still have receives pending).

Start methods: ``fork`` (default) shares the parent's imports, which matters on a 2-core
machine where 8 interpreters importing torch dominate a test; ``spawn`` for bodies that
initialise megatron-core's parallel state or when the parent may hold a live gloo group (forked
ranks then hang in their first ``new_group``).
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, out_dir: str, env: dict, fn, args) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)  # several ranks share this machine's few cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {"ok": fn(rank, world, *args)}
    except BaseException:  # reported to the parent, which fails the test with it
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)


def run_world(fn, world: int, *args, env: dict | None = None, start_method: str = "fork",
              timeout_s: float = 180.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; their return values, rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank, args=(world, os.path.join(tmp, "store"), tmp, dict(env or {}), fn, args),
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
        results = []
        for rank in range(world):
            path = Path(tmp, f"rank{rank}.pkl")
            assert path.exists(), f"rank {rank} wrote no result"
            data = pickle.loads(path.read_bytes())
            assert "error" not in data, f"rank {rank} failed:\n{data['error']}"
            results.append(data["ok"])
        return results
