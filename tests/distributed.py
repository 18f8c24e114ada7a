"""Run a test body on several gloo processes on this machine (ranks grouped into nodes).

``run_world(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` ranks joined in one
gloo group and returns every rank's return value (any picklable object). A rank that raises
fails the call with that rank's traceback; a world still running after ``timeout_s`` is
killed, so a deadlock fails the test instead of hanging CI. Ranks leave with ``os._exit``,
skipping process-group teardown (a rank whose peer failed may still have receives pending).

Start methods: ``fork`` (default) shares the parent's imports, which matters on a 2-core
machine where 8 interpreters importing torch dominate a test; ``spawn`` for bodies that
initialise megatron-core's parallel state or when the parent may hold a live gloo group (forked
ranks then hang in their first ``new_group``). Without CUDA, ``spawn`` runs the ranks from a
fork server started once per test session that has imported torch, megatron-core and our
training loop (``PRELOAD``) and nothing else (no process group, no parallel state): each rank
starts as a fresh process would, without paying ~8 s of CPU for those imports (4 ranks: ~16 s
of a 2-core machine per world). The rank gets the parent's environment and working directory
of the moment, as a spawned one does. With CUDA, ranks are spawned (a fork server that
imported megatron-core may have initialised CUDA, which forked children cannot use).
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


PRELOAD = ["torch", "megatron.core", "megatron_zeppelin.megatron.loop.train",
           "megatron_zeppelin.megatron.loop.checkpoint"]


def _start_method(wanted: str) -> str:
    """``wanted``, or ``forkserver`` (preloaded, once per session) for ``spawn`` on CPU."""
    if wanted != "spawn" or torch.cuda.is_available():
        return wanted
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # before it starts: once
    return "forkserver"


def _rank(rank: int, world: int, store: str, out_dir: str, env: dict, fn, args) -> None:
    os.environ.clear()  # the parent's environment now, not the fork server's at its start
    os.environ.update(env)
    # a native crash (SIGSEGV, SIGABRT) leaves every thread's Python stack for the parent
    faulthandler.enable(open(Path(out_dir, f"rank{rank}.fault"), "w"), all_threads=True)
    torch.set_num_threads(1)  # several ranks share this machine's few cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {"ok": fn(rank, world, *args)}
    except BaseException:  # reported to the parent, which fails the test with it
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)


def _fault_stacks(out_dir: str, world: int) -> str:
    """The Python stacks ``faulthandler`` wrote for ranks that died of a fatal signal."""
    stacks = []
    for rank in range(world):
        path = Path(out_dir, f"rank{rank}.fault")
        text = path.read_text() if path.exists() else ""
        if text.strip():
            stacks.append(f"\n--- rank {rank} (faulthandler) ---\n{text}")
    return "".join(stacks)


def run_world(fn, world: int, *args, env: dict | None = None, start_method: str = "fork",
              timeout_s: float = 180.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; their return values, rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank, args=(world, os.path.join(tmp, "store"), tmp,
                         {**os.environ, **(env or {})}, fn, args),
            nprocs=world, join=False, start_method=_start_method(start_method))
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a world of {world} ranks ran past {timeout_s:.0f} s "
                                       "(deadlock?)")
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"{exc}{_fault_stacks(tmp, world)}") from exc
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
