"""A heartbeat watchdog: a frozen or dead rank is named by every other rank within a bound.

Each rank runs a daemon thread that, every ``interval`` (``min(1 s, timeout / 4)``), writes
its heartbeat record (a counter, its state, host and pid) to the rendezvous store
(torchrun's, at ``MASTER_ADDR:MASTER_PORT``; it lives in the launcher, so a frozen rank does
not take it down) and reads the records of the ranks it watches: every rank of its host and
the next four ranks. A watched rank is reported when

* its record says it failed (an exception it could not handle): at once;
* it is on this host and its process is gone (killed, crashed): at once (``/proc``);
* its counter has not moved for ``timeout`` seconds (``--zeppelin-watchdog-timeout``, default
  20 s): frozen (SIGSTOP, a hung kernel, a dead node). Only time this rank itself was running
  counts, so a job suspended as a whole (Ctrl-Z) is not misreported;
* it left without finishing (an error it reported itself) and this rank is still running
  ``timeout`` seconds later.

The first verdict is published in the store; every rank reads it within one interval, prints
it naming itself (``fatal.fault``) and exits with status 1, before any collective or P2P wait
(``ZEPPELIN_P2P_TIMEOUT_S``, 300 s by default) would time out and blame the wrong peer. So a
frozen rank is named by every survivor within ``timeout + 2 x interval`` seconds.

When the training step raises a communication error (a peer closed its connection),
``explain`` checks at once and waits up to that bound for a verdict, so that the error names
the peer that caused it rather than the one this rank happened to talk to.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Callable, Iterator

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.loop import fatal

WATCHED_NEIGHBOURS = 4
FLAG = "--zeppelin-watchdog-timeout"


def check_timeout(timeout_s: float, name: str = FLAG) -> None:
    """ConfigError naming ``name`` unless the timeout is shorter than a P2P wait's
    (``ZEPPELIN_P2P_TIMEOUT_S``), so that a frozen rank is named before a peer's wait times
    out and blames the wrong rank."""
    from megatron_zeppelin import env

    try:
        p2p = env.p2p_timeout_s()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if timeout_s and timeout_s >= p2p:
        raise ConfigError(f"{name}={timeout_s:g} is invalid: expected fewer seconds than "
                          f"ZEPPELIN_P2P_TIMEOUT_S={p2p:g}, so that a frozen rank is named "
                          "before a peer's wait times out")


def _process_state(pid: int, start: str) -> str:
    """'gone', 'stopped' or 'running' for process ``pid`` of this host started at ``start``
    (``/proc/<pid>/stat`` field 22, so a reused pid reads as gone); 'unknown' without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "unknown"
    if fields[19] != start or fields[0] in ("Z", "X"):
        return "gone"
    return "stopped" if fields[0] in ("T", "t") else "running"


def _own_start() -> str:
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return "?"


class Watchdog:
    """Heartbeats of ``rank`` of ``world`` through ``store`` (keys under ``prefix``); a verdict
    goes to ``on_fault(message)``, which must not return (``fatal.fault``)."""

    def __init__(self, store, prefix: str, rank: int, world: int, timeout_s: float,
                 on_fault: Callable[[str], None], store_note: str = "",
                 clock: Callable[[], float] = time.monotonic, timeout_name: str = FLAG) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: expected seconds > 0")
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.timeout_s, self.on_fault, self.store_note, self.clock = (
            timeout_s, on_fault, store_note, clock)
        self.timeout_name = timeout_name
        self.interval = min(1.0, timeout_s / 4)
        self.record = {"seq": 0, "state": "alive", "host": socket.gethostname(),
                       "pid": os.getpid(), "start": _own_start(), "message": ""}
        self.peers: dict[int, dict] = {}
        self.stale: dict[int, float] = {}
        self.verdict: str | None = None
        self.found = threading.Event()
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.last_poll = clock()
        self.store_failing_s = 0.0
        self.thread = threading.Thread(target=self._loop, name="zeppelin-watchdog", daemon=True)

    # ------------------------------------------------------------------ store records
    def _key(self, rank: int | str) -> str:
        return f"{self.prefix}/{rank}"

    def _publish(self) -> None:
        self.store.set(self._key(self.rank), json.dumps(self.record))

    def announce(self) -> None:
        """Write this rank's first record (every rank, before a barrier, then ``start``)."""
        if self.rank == 0:
            self.store.set(self._key("verdict"), "")
        self._publish()

    def start(self) -> None:
        """Meet the peers and start the heartbeat thread."""
        self.meet()
        self.thread.start()

    def meet(self) -> None:
        """Read every rank's record once (hosts, pids) and choose the ranks to watch."""
        records = self.store.multi_get([self._key(r) for r in range(self.world)])
        everyone = {r: json.loads(v) for r, v in enumerate(records)}
        neighbours = {(self.rank + i) % self.world for i in range(1, WATCHED_NEIGHBOURS + 1)}
        same_host = {r for r, rec in everyone.items() if rec["host"] == self.record["host"]}
        for r in sorted((neighbours | same_host) - {self.rank}):
            self.peers[r] = everyone[r]
            self.stale[r] = 0.0
        self.last_poll = self.clock()

    # ------------------------------------------------------------------ verdicts
    def _judge(self, rank: int, rec: dict, old: dict, credited: float) -> str | None:
        where = f"rank {rank} (pid {rec['pid']} on {rec['host']})"
        if rec["state"] == "failed":
            return f"rank {rank} failed: {rec['message']}"
        if rec["state"] == "done":
            return None
        local = rec["host"] == self.record["host"]
        state = _process_state(rec["pid"], rec["start"]) if local else "unknown"
        if state == "gone" and rec["state"] == "alive":
            return f"{where} died: its process exited or was killed while training"
        self.stale[rank] = self.stale[rank] + credited if rec["seq"] == old["seq"] else 0.0
        if self.stale[rank] <= self.timeout_s:
            return None
        if rec["state"] == "exiting":
            return f"{where} stopped training {self.stale[rank]:.0f} s ago: {rec['message']}"
        note = "; its process is stopped (SIGSTOP or a debugger)" if state == "stopped" else ""
        return (f"{where} stopped responding: no heartbeat for {self.stale[rank]:.1f} s "
                f"({self.timeout_name} {self.timeout_s:g} s){note}")

    def poll(self) -> str | None:
        """One round: publish the heartbeat, read the watched records and the verdict; returns
        the verdict (this rank's or a peer's) or None."""
        with self.lock:
            now = self.clock()
            credited = min(now - self.last_poll, 2 * self.interval)
            self.last_poll = now
            try:
                self.record["seq"] += 1
                self._publish()
                keys = [self._key(r) for r in self.peers] + [self._key("verdict")]
                values = self.store.multi_get(keys)
            except Exception as exc:  # the store is unreachable: count it like a silence
                self.store_failing_s += credited
                if self.store_failing_s <= self.timeout_s:
                    return None
                return (f"the rendezvous store {self.store_note} did not answer for "
                        f"{self.store_failing_s:.0f} s ({type(exc).__name__}: {exc})")
            self.store_failing_s = 0.0
            published = values[-1].decode()
            if published:
                return published
            for (rank, old), raw in zip(list(self.peers.items()), values):
                rec = json.loads(raw)
                verdict = self._judge(rank, rec, old, credited)
                self.peers[rank] = rec
                if verdict:
                    return self._publish_verdict(verdict)
            return None

    def _publish_verdict(self, verdict: str) -> str:
        """The first verdict wins (compare-and-set), so every rank reports the same one."""
        key = self._key("verdict")
        return self.store.compare_set(key, "", verdict).decode() or verdict

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            verdict = self.poll()
            if verdict and not self.stopped.is_set():
                self.verdict = verdict
                self.found.set()
                self.on_fault(verdict)
                self.stopped.set()  # on_fault returned (tests): one report is enough

    def dead_here(self) -> str | None:
        """For a SIGTERM from the launcher: the verdict already published (a peer that
        reported a death and left is not the culprit), else a watched rank of this host whose
        process is gone (published in turn)."""
        if self.stopped.is_set():
            return self.verdict
        try:
            published = self.store.get(self._key("verdict")).decode()
        except Exception:  # the store is gone too: judge from this host alone
            published = ""
        if published:
            return published
        for rank, rec in self.peers.items():
            if (rec["host"] == self.record["host"] and rec["state"] == "alive" and
                    _process_state(rec["pid"], rec["start"]) == "gone"):
                verdict = (f"rank {rank} (pid {rec['pid']} on {rec['host']}) died: its process "
                           "exited or was killed while training")
                try:
                    return self._publish_verdict(verdict)
                except Exception:
                    return verdict
        return None

    # ------------------------------------------------------------------ main thread
    def leave(self, state: str, message: str = "") -> None:
        """Stop heartbeats with a last record: ``done`` (finished), ``failed`` (peers report
        it at once) or ``exiting`` (a user error every rank reports itself)."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        with self.lock:
            self.record.update(state=state, message=message[:500])
            try:
                self._publish()
            except Exception:
                pass  # the store is gone: peers notice the silence
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=2 * self.interval)

    def explain(self, exc: BaseException) -> None:
        """Called with the exception that stops training on this rank: a user error is
        everyone's (state ``exiting``); a communication error waits up to ``timeout + 2 x
        interval`` for the watchdog to name the peer behind it (``on_fault`` then ends the
        process); anything else is this rank's failure, published for the peers."""
        if isinstance(exc, ConfigError):
            self.leave("exiting", str(exc))
            return
        if _is_communication_error(exc):
            verdict = self.poll()
            if verdict:  # kept first: a SIGTERM handler asking dead_here then gets it
                self.verdict = verdict
                self.found.set()
                self.stopped.set()
                self.on_fault(verdict)
            if self.found.wait(self.timeout_s + 2 * self.interval):
                return  # on_fault has ended the process (or a test's on_fault returned)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.leave("failed", f"{type(exc).__name__}: {first}")


def _is_communication_error(exc: BaseException) -> bool:
    """Errors a peer's failure causes here: torch.distributed's, gloo/NCCL runtime errors and
    our runtime's P2P timeouts (all RuntimeError), connection errors."""
    import torch.distributed as dist

    return isinstance(exc, (dist.DistError, ConnectionError, TimeoutError)) or \
        type(exc) is RuntimeError


def start_watchdog(timeout_s: float, on_fault: Callable[[str], None] = fatal.fault,
                   timeout_name: str = FLAG) -> tuple[Watchdog | None, str]:
    """The run's watchdog (collective: every rank calls it after the process group exists),
    on a client of the rendezvous store at MASTER_ADDR:MASTER_PORT, reporting through
    ``on_fault`` (``fatal.fault``; also on SIGTERM); returns it (None when off) and a banner
    line; ``timeout_name``: how messages name the timeout's setting."""
    import datetime
    import uuid

    import torch.distributed as dist

    from megatron_zeppelin import env

    address = env.master_address()
    if not timeout_s:
        return None, f"off ({timeout_name} 0)"
    if address is None:
        return None, "off (no MASTER_ADDR/MASTER_PORT rendezvous store to beat through)"
    store = dist.TCPStore(address[0], address[1], is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one key space per run, restarts included
    where = "in the torchrun launcher" if env.store_in_launcher() else "hosted by rank 0"
    note = f"{address[0]}:{address[1]}, {where}"
    dog = Watchdog(store, f"zeppelin/watchdog/{token[0]}", dist.get_rank(),
                   dist.get_world_size(), timeout_s, on_fault, note,
                   timeout_name=timeout_name)
    dog.announce()
    dist.barrier()
    dog.start()
    fatal.on_sigterm(dog.dead_here, on_fault)
    return dog, (f"a rank silent for {timeout_s:g} s is named by every other rank within "
                 f"{timeout_s + 2 * dog.interval:g} s (heartbeats every {dog.interval:g} s "
                 f"through the rendezvous store {note})")


@contextlib.contextmanager
def watched(dog: Watchdog | None) -> Iterator[None]:
    """The block a run's watchdog (``start_watchdog``; None: off) watches: an exception
    leaving it is handed to ``dog.explain`` first (a communication error waits for the verdict
    naming the peer behind it, and a peer's fault ends the process there; another is this
    rank's failure, published) and re-raised; a normal end leaves the watch ("done")."""
    try:
        yield
    except BaseException as exc:
        if dog is not None:
            dog.explain(exc)
        raise
    if dog is not None:
        dog.leave("done")
