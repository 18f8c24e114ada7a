"""How ``pretrain_gpt.py`` ends on an error: one line, printed once, the right exit status.

* A user error (``ConfigError``: a flag, a file, a checkpoint, an environment variable) is the
  same on every rank: rank 0 prints ``pretrain_gpt.py: error: <message>`` and exits with
  status 2. Under torchrun the line is also written to the launcher's error file
  (``TORCHELASTIC_ERROR_FILE``), so torchrun's failure summary shows it as the root cause
  instead of a link to its docs; torchrun then stops the other ranks (SIGTERM) and exits with
  status 1 (it maps any worker failure to 1, whatever the worker's status). The other ranks
  do not exit first: had one of them exited before rank 0 printed, torchrun would have
  stopped rank 0 before it could. They wait up to ``PEER_GRACE_S`` for that; a rank still
  there then (rank 0 did not fail the same way: a file missing on one node only, or no
  launcher to stop it) prints the error with its rank number and exits with status 2.
* A fault (a peer died, froze or failed) is reported by every surviving rank, each naming
  itself and the peer: ``pretrain_gpt.py: error: rank 1: rank 2 ... stopped responding``,
  exit status 1 (``fault``). torchrun stops every rank (SIGTERM) as soon as one dies, often
  before the others noticed; so SIGTERM is taken by a thread (``take_sigterm``, installed
  before anything else starts threads) which first asks the watchdog whether a peer on this
  host is gone, reports it, and otherwise ends the process by SIGTERM as usual.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

from megatron_zeppelin import env
from megatron_zeppelin.config import ConfigError

PROG = "pretrain_gpt.py"
EXIT_USER_ERROR = 2
EXIT_FAULT = 1
PEER_GRACE_S = 15.0


def _record_for_launcher(message: str) -> None:
    """Write ``message`` where torchrun's failure summary reads a worker's error."""
    path = env.launcher_error_file()
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then shows torchrun's generic line; our stderr line stands


def user_error(exc: ConfigError, grace_s: float = PEER_GRACE_S, prefix: str = f"{PROG}: error: ",
               rank: int | None = -1) -> int:
    """Print a user error once (rank 0, or the process when not launched) -> exit status 2;
    another rank waits ``grace_s`` for the launcher to stop it, then prints it itself.
    ``prefix`` starts the line; ``rank``: this process's (default: the launcher's ``RANK``)."""
    rank = env.rank() if rank == -1 else rank
    if rank not in (None, 0):
        time.sleep(grace_s)
    line = prefix + (f"rank {rank}: " if rank not in (None, 0) else "") + str(exc)
    print(line, file=sys.stderr, flush=True)
    _record_for_launcher(line)
    return EXIT_USER_ERROR


def fault(message: str, prog: str = PROG) -> NoReturn:
    """Report a fault seen by this rank and leave at once (any thread; ``os._exit`` because
    the main thread may be blocked in a collective with the failed peer); ``prog`` starts
    the line."""
    rank = env.rank()
    line = f"{prog}: error: " + (f"rank {rank}: " if rank is not None else "") + message
    print(line, file=sys.stderr, flush=True)
    _record_for_launcher(line)
    sys.stdout.flush()
    os._exit(EXIT_FAULT)


_sigterm_verdict: list[tuple[Callable[[], str | None], Callable[[str], None]]] = []


def on_sigterm(verdict: Callable[[], str | None],
               report: Callable[[str], None] = fault) -> None:
    """Ask ``verdict()`` (the watchdog's quick local check) when SIGTERM comes; a peer's
    death it finds goes to ``report`` (``fault``), which must not return."""
    _sigterm_verdict[:] = [(verdict, report)]


def off_sigterm() -> None:
    """Stop asking (the watchdog has stopped)."""
    _sigterm_verdict.clear()


def take_sigterm() -> None:
    """Block SIGTERM in this and every later thread and wait for it on a thread of its own:
    a peer's death found then is reported (``fault``); otherwise the process ends by SIGTERM.
    Call first thing, before any thread exists (they inherit the mask)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        _report_verdict()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # default action: end
        signal.raise_signal(signal.SIGTERM)

    threading.Thread(target=wait, name="zeppelin-sigterm", daemon=True).start()


def take_sigterm_in_python() -> None:
    """``take_sigterm`` for a process whose threads already exist (Megatron-LM through the
    patch): a Python handler, which runs once the main thread returns to Python, reports a
    peer's death; otherwise SIGTERM does what it did before (the previous handler, or the
    default: the process ends). Call from the main thread."""
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: not set from Python

    def handler(signum, frame) -> None:
        _report_verdict()
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def _report_verdict() -> None:
    """On SIGTERM: a peer's death the watchdog finds (``on_sigterm``) ends this rank as a
    fault naming it; nothing otherwise."""
    for verdict, report in list(_sigterm_verdict):
        found = verdict()
        if found:
            report(f"{found} (the launcher then stopped this rank)")


def run(main: Callable[[], int]) -> int:
    """The entry point's wrapper: a ``ConfigError`` from anywhere is one line, status 2."""
    try:
        return main()
    except ConfigError as exc:
        return user_error(exc)
