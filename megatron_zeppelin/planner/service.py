"""Planning off the training process: a planner process fed the next micro-batches' lengths.

``PlannerService(plan_fn)`` starts ``python -m megatron_zeppelin.planner.service`` (a fresh
interpreter that imports the planner only: no torch, no fork of the training process and its
threads), sends it ``plan_fn`` (a picklable ``lengths -> Plan``, e.g. ``PlanFunction``), and
then plans every submitted batch there, in order::

    service = PlannerService(PlanFunction("zeppelin", cost, config))
    ticket = service.submit(lengths)      # returns at once; the process plans meanwhile
    plan = service.result(ticket)         # bounded wait
    service.close()

The training process only writes the lengths and reads the pickled plans back (on a reader
thread; ``Plan.__reduce__`` keeps that cheap): planning never holds its GIL, and its garbage
collector is left as it is. The planner process runs at a lower CPU priority (``NICE``), so
that on a machine short of cores it does not take one from the training threads. Nothing waits
unboundedly: ``result`` gives up after ``ZEPPELIN_PLANNER_TIMEOUT_S`` (``env.planner_timeout_s``,
default 300 s) and notices at once when the process dies. Every failure raises
``PlannerServiceError`` naming the micro-batch, what failed (the planner's own exception type
and message, or the process's exit code and the end of its stderr) and the process id.
"""
from __future__ import annotations

import gc
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_zeppelin import env
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan

_HEADER = struct.Struct("<Q")  # every message: its byte length, then a pickle
_POLL_S = 0.05  # how often a waiting ``result`` checks that the process is alive
# The planner process's CPU priority (``os.nice``): planning one micro-batch ahead is background
# work, so where cores are short it yields them to the training process's threads.
NICE = 10


class PlannerServiceError(RuntimeError):
    """The planner process failed or timed out; the message names the micro-batch and why."""


@dataclass(frozen=True)
class PlanFunction:
    """A picklable ``lengths -> Plan``: ``strategy`` (a registered name with ``options``, see
    ``planner.registry``) on ``cost`` and ``config``; ``validate`` runs ``Plan.validate``."""

    strategy: str
    cost: CostModel
    config: ZeppelinConfig = ZeppelinConfig()
    options: dict = field(default_factory=dict)
    validate: bool = False

    def __call__(self, lengths: Sequence[int]) -> Plan:
        from megatron_zeppelin.planner.registry import make_plan

        plan = make_plan(self.strategy, lengths, self.cost, self.config, **self.options)
        return plan.validate() if self.validate else plan


def _send(stream, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream) -> Any:
    """The next message, or raises EOFError when the other side closed the pipe."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("pipe closed")
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("pipe closed mid-message")
    return pickle.loads(data)


class PlannerService:
    """A planner process (module doc). Thread-safe ``submit``; ``result`` for each ticket."""

    def __init__(self, plan_fn: Callable[[Sequence[int]], Plan],
                 timeout_s: float | None = None, nice: int = NICE) -> None:
        self.timeout_s = env.planner_timeout_s() if timeout_s is None else timeout_s
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "megatron_zeppelin.planner.service",
                                       str(int(nice))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, env=os.environ.copy())
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._results: dict[int, tuple] = {}
        self._sizes: dict[int, int] = {}
        self._next = 0
        self._broken: str | None = None
        try:
            _send(self._proc.stdin, plan_fn)
        except (BrokenPipeError, pickle.PicklingError, TypeError, AttributeError) as exc:
            self._proc.kill()
            self._release(timeout_s=10.0)
            self._proc.stdout.close()
            self._stderr.close()
            raise PlannerServiceError(f"cannot start the planner process with {plan_fn!r}: "
                                      f"{type(exc).__name__}: {exc} (the planner must be "
                                      "picklable, e.g. planner.service.PlanFunction)") from None
        self._reader = threading.Thread(target=self._read, name="zeppelin-planner-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def submit(self, lengths: Sequence[int]) -> int:
        """Queue one batch's lengths for planning; returns its ticket (0, 1, 2, ...)."""
        with self._lock:
            if self._broken:
                raise PlannerServiceError(self._broken)
            ticket = self._next
            self._next += 1
            self._sizes[ticket] = len(lengths)
            try:
                _send(self._proc.stdin, (ticket, list(lengths)))
            except (BrokenPipeError, OSError, ValueError):
                raise PlannerServiceError(f"micro-batch {ticket}: {self._failure()}") from None
        return ticket

    def replace(self, plan_fn: Callable[[Sequence[int]], Plan]) -> int:
        """Plan every batch submitted from now on with ``plan_fn`` (e.g. a ``PlanFunction`` on
        a refitted profile); returns the first ticket it plans."""
        with self._lock:
            if self._broken:
                raise PlannerServiceError(self._broken)
            try:
                _send(self._proc.stdin, ("replace", plan_fn))
            except (BrokenPipeError, OSError, ValueError):
                raise PlannerServiceError(f"replacing the plan function before micro-batch "
                                          f"{self._next}: {self._failure()}") from None
            return self._next

    def result(self, ticket: int) -> Plan:
        """The plan of ``ticket``; raises PlannerServiceError if the planner failed on it, the
        process died, or no plan came within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._done:
            while ticket not in self._results:
                if self._broken:
                    raise PlannerServiceError(f"micro-batch {ticket}: {self._broken}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PlannerServiceError(
                        f"the planner process (pid {self.pid}) produced no plan for micro-batch "
                        f"{ticket} ({self._sizes.get(ticket, '?')} documents) within "
                        f"{self.timeout_s:g} s (ZEPPELIN_PLANNER_TIMEOUT_S)")
                self._done.wait(min(left, _POLL_S))
            status, *payload = self._results.pop(ticket)
        if status == "ok":
            return payload[0]
        kind, message, trace = payload
        raise PlannerServiceError(f"planning micro-batch {ticket} ({self._sizes.get(ticket)} "
                                  f"documents) failed in the planner process (pid {self.pid}): "
                                  f"{kind}: {message}\n{trace}")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the process (bounded: killed after ``timeout_s``) and release its pipes."""
        with self._lock:
            self._release(timeout_s)
        self._reader.join(timeout=timeout_s)
        self._proc.stdout.close()
        self._stderr.close()

    def _release(self, timeout_s: float) -> None:
        """End of input for the process, then wait for it to exit (killed after ``timeout_s``).
        Its stdout and stderr file stay open for the reader thread (``_failure``)."""
        try:
            self._proc.stdin.close()
        except OSError:  # the process is gone and the last write never reached it
            pass
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=timeout_s)

    def __enter__(self) -> "PlannerService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        """Reader thread: plans (and errors) back from the process, until it ends."""
        while True:
            try:
                ticket, *rest = _receive(self._proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError, ValueError):
                with self._done:
                    self._broken = self._failure()
                    self._done.notify_all()
                return
            with self._done:
                self._results[ticket] = tuple(rest)
                self._done.notify_all()

    def _failure(self) -> str:
        """Why the process is gone: its exit code and the end of its stderr."""
        try:
            code = self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip()[-2000:]
        return (f"the planner process (pid {self.pid}) ended with exit code {code} before it "
                "was planned" + (f"; its stderr ends with:\n{tail}" if tail else ""))


def serve(stdin, stdout) -> None:
    """The planner process: read the plan function, then plan every batch until EOF. Plans
    hold no reference cycles, so this process (it only plans) runs without the cyclic GC."""
    gc.disable()
    plan_fn = _receive(stdin)
    while True:
        try:
            ticket, lengths = _receive(stdin)
        except EOFError:
            return
        if ticket == "replace":  # PlannerService.replace: the batches after it use this one
            plan_fn = lengths
            continue
        try:
            reply = (ticket, "ok", plan_fn(lengths))
        except Exception as exc:  # reported to the training process, which raises it
            reply = (ticket, "error", type(exc).__name__, str(exc),
                     "".join(traceback.format_exc(limit=-3)))
        _send(stdout, reply)


def main() -> None:
    """Entry of ``python -m megatron_zeppelin.planner.service NICE``: the protocol keeps the
    real stdout; anything else printing to file descriptor 1 (a solver's log) goes to stderr."""
    os.nice(int(sys.argv[1]) if len(sys.argv) > 1 else NICE)
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, protocol)


if __name__ == "__main__":
    main()
