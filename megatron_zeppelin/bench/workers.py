"""Worker processes of the CPU benchmarks: N processes on this host, a gloo world on a free
port, their results collected with a bounded wait; a worker that fails is named by its rank.

* ``run_forked(target, world, args, timeout_s=..., what=...)``: ``world`` forked processes
  (the parent's imports are shared: cheap on a machine of few cores); each runs
  ``target(rank, *args)`` and its return value (picklable) comes back, in rank order. With
  ``gloo_timeout_s`` the workers are joined in one gloo group first (``gloo_world``), left
  after ``target`` returns. Used by ``calibrate`` (compute, P2P), ``calibrate-sim``
  (all-reduce) and ``fidelity`` (engine timing).
* ``run_spawned(target, world, args, timeout_s=..., what=...)``: ``world`` spawned
  interpreters (fresh process state: megatron-core's globals) running ``target(rank, *args)``;
  results travel through files the target writes. Used by ``bench train`` (and ``fidelity``,
  ``online``, ``remap`` through its runner) and ``bench decisions``.
  ``training_rank_env`` sets what ``torchrun`` would set in such a rank.

Either returns once every worker is done, or raises ``RuntimeError`` naming ``what`` and the
rank: the first that failed (its exception's last line, the traceback is on stderr) or exited
before reporting (its exit status), or those still running after ``timeout_s``; the other
workers are then terminated, not waited for.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_module
import socket
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Sequence

FORK = multiprocessing.get_context("fork")
JOIN_S = 30.0  # how long finished workers may take to exit before they are terminated
GRACE_S = 2.0  # after a failure: how long other failures are gathered to find the first


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of forked/spawned gloo ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_world(rank: int, world: int, port: int, timeout_s: float):
    """This process as gloo rank ``rank`` of ``world`` (rendezvous on 127.0.0.1:``port``, one
    intra-op thread: the ranks share the machine's cores), for the ``with`` block. The group
    is left only when the block ends normally: a failing worker keeps it until it exits, so
    that its report reaches the parent before its peers see their connections reset."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    yield dist
    dist.destroy_process_group()


def run_forked(target: Callable[..., Any], world: int, args: Sequence = (), *,
               timeout_s: float, what: str, gloo_timeout_s: float | None = None) -> list:
    """``target(rank, *args)`` on ``world`` forked processes; their return values, rank order
    (module doc). ``gloo_timeout_s``: inside one gloo world on a free port, with that timeout
    on its collectives."""
    port = free_port() if gloo_timeout_s is not None else None
    queue = FORK.Queue()
    procs = [FORK.Process(target=_report, args=(target, rank, world, tuple(args), port,
                                                gloo_timeout_s, queue))
             for rank in range(world)]
    for p in procs:
        p.start()
    return collect(queue, procs, timeout_s, what)


def _report(target, rank: int, world: int, args: tuple, port: int | None,
            gloo_timeout_s: float | None, queue) -> None:
    """Body of a forked worker: (rank, True, result) or (rank, False, error) to ``queue``."""
    try:
        if port is None:
            result = target(rank, *args)
        else:
            with gloo_world(rank, world, port, gloo_timeout_s):
                result = target(rank, *args)
    except BaseException as exc:  # named to the parent; the traceback goes to stderr
        queue.put((rank, False, _one_line(exc)))
        raise
    queue.put((rank, True, result))


def collect(queue, procs: list, timeout_s: float, what: str) -> list:
    """One ``(rank, ok, value)`` report per process of ``procs`` (rank = index) from
    ``queue``; the values in rank order. Raises naming the rank as soon as one reports a
    failure or exits without reporting, or after ``timeout_s`` seconds."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    done = False
    try:
        while len(results) < len(procs):
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                _check_alive(procs, results, deadline, timeout_s, what)
                continue
            if not ok:
                raise RuntimeError(f"{what}: {_failures(queue, procs, results, rank, value)}")
            results[rank] = value
        done = True
    finally:
        _finish(procs, done)
    return [results[rank] for rank in range(len(procs))]


def _check_alive(procs: list, results: dict, deadline: float, timeout_s: float,
                 what: str) -> None:
    dead = _dead(procs, results)
    if dead:
        rank, status = dead[0]
        raise RuntimeError(f"{what}: rank {rank} exited with status {status} before "
                           "reporting")
    if time.monotonic() > deadline:
        missing = [r for r in range(len(procs)) if r not in results]
        raise RuntimeError(f"{what}: no result from rank(s) {missing} within "
                           f"{timeout_s:.0f} s")


def _failures(queue, procs: list, results: dict, rank: int, error: str) -> str:
    """The failure of ``rank`` and what else fails within ``GRACE_S``: ranks that exited
    without a report first (a peer's lost connection follows from them), then the others'
    failures in the order they came."""
    failed = [(rank, error)]
    results[rank] = None  # reported
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            other, ok, value = queue.get(timeout=0.1)
        except queue_module.Empty:
            continue
        if not ok:
            failed.append((other, value))
        results[other] = value
    dead = [f"rank {r} exited with status {status} before reporting"
            for r, status in _dead(procs, results)]
    return "; then ".join(dead + [f"rank {r} failed: {e}" for r, e in failed])


def _dead(procs: list, results: dict) -> list[tuple[int, int]]:
    """(rank, exit status) of the processes that exited without a result."""
    return [(r, p.exitcode) for r, p in enumerate(procs)
            if r not in results and p.exitcode is not None]


def _finish(procs: list, done: bool) -> None:
    """Join the processes (briefly when they all reported), then terminate what is left."""
    deadline = time.monotonic() + (JOIN_S if done else 0.0)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=JOIN_S)


def run_spawned(target: Callable[..., Any], world: int, args: Sequence = (), *,
                timeout_s: float, what: str) -> None:
    """``target(rank, *args)`` on ``world`` spawned processes (module doc); returns when all
    have exited cleanly."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    context = mp.start_processes(target, args=tuple(args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                raise RuntimeError(f"{what}: rank(s) {alive} still running after "
                                   f"{timeout_s:.0f} s")
    except ProcessRaisedException as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        raise RuntimeError(f"{what}: rank {exc.error_index} failed: {last}") from None
    except ProcessExitedException as exc:
        raise RuntimeError(f"{what}: rank {exc.error_index} exited with status "
                           f"{exc.exit_code}") from None
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=JOIN_S)


def training_rank_env(rank: int, world: int, port: int) -> None:
    """What ``torchrun`` sets in a rank of a ``world`` on this host (rendezvous on ``port``),
    one intra-op thread (the ranks share the machine's cores), warnings and the training
    loop's own printing silenced (the benchmark's table says it). Call first in a spawned
    rank, before torch is imported."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    sys.stdout = open(os.devnull, "w")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
