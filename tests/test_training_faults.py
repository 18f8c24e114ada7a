"""Faults at the process level: ``torchrun --nproc-per-node 4 scripts/pretrain_gpt.py`` with a
rank killed (SIGKILL) or frozen (SIGSTOP), a configuration error, a truncated checkpoint.

Each test kills torchrun and its workers when it ends, so a stopped worker never outlives it.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "pretrain_gpt.py")
FLAGS = ["--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--vocab-size", "256", "--seq-length", "256", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--mock-data", "--zeppelin-overlong", "split",
         "--context-parallel-mode", "zeppelin", "--context-parallel-size", "4",
         "--zeppelin-gpus-per-node", "2", "--zeppelin-cluster", "cpu-2x2"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


class Job:
    """A torchrun of ``pretrain_gpt.py`` on 4 ranks; its output lines, collected as they come."""

    def __init__(self, flags: list[str]) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--monitor-interval", "0.2", SCRIPT, *flags]
        environ = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=environ)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in self.lines):
                return
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.text)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the worker processes (children of torchrun with RANK set)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) != self.proc.pid:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry.name)
        return found

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Kill torchrun and every worker it started (workers run in sessions of their own,
        and a stopped one would outlive torchrun)."""
        if self.proc.poll() is None:  # torchrun (still ours: not reaped) and its workers
            for pid in [*self.workers().values(), self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(30)
        self.reader.join(10)


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_exited(pids: list[int], timeout: float) -> float:
    """Seconds until every process of ``pids`` has exited (fails after ``timeout``)."""
    started = time.monotonic()
    while any(running(pid) for pid in pids):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"processes {[p for p in pids if running(p)]} still run "
                                 f"{timeout} s later")
        time.sleep(0.05)
    return time.monotonic() - started


def strike(flags: list[str], victim: int, sig: int, bound: float) -> tuple[Job, float]:
    """Start a long run, send ``sig`` to rank ``victim`` once training runs, and measure how
    long the other ranks take to exit."""
    job = Job(FLAGS + ["--train-iters", "100000", *flags])
    try:
        job.wait_for(r"^iteration\s+3/", timeout=120)
        workers = job.workers()
        assert sorted(workers) == [0, 1, 2, 3], workers
        os.kill(workers[victim], sig)
        others = [pid for rank, pid in workers.items() if rank != victim]
        return job, wait_exited(others, bound)
    except BaseException:
        job.close()
        raise


def test_a_killed_rank_is_named_by_every_other_rank_within_seconds():
    job, seconds = strike([], victim=2, sig=signal.SIGKILL, bound=10)
    job.finish(60)
    for rank in (0, 1, 3):
        assert re.search(rf"pretrain_gpt.py: error: rank {rank}: rank 2 \(pid \d+ on .*\) died",
                         job.text), job.text
    assert not re.search(r"error: rank \d: rank [013] ", job.text)  # no live rank blamed
    assert job.proc.returncode != 0
    assert seconds < 10


def test_a_frozen_rank_is_named_by_every_other_rank_within_the_watchdog_bound():
    timeout = 4.0  # --zeppelin-watchdog-timeout; heartbeats every 1 s
    job, seconds = strike(["--zeppelin-watchdog-timeout", str(timeout)], victim=2,
                          sig=signal.SIGSTOP, bound=timeout + 2 * 1.0 + 6)
    try:
        for rank in (0, 1, 3):
            job.wait_for(rf"error: rank {rank}: rank 2 \(pid \d+ on .*\) stopped responding: no "
                         r"heartbeat for [\d.]+ s .*its process is stopped", timeout=5)
        assert not re.search(r"error: rank \d: rank [013] ", job.text)  # no live rank blamed
    finally:
        job.close()
    assert seconds < timeout + 2 * 1.0 + 6


def exits(job: Job) -> None:
    """Rank 0 exited with status 2 (a user error) and torchrun stopped the others (SIGTERM),
    which waited for it rather than exit first."""
    listed = re.findall(r"rank      : (\d) \(local_rank: \d\)\n  exitcode  : (-?\d+)", job.text)
    assert dict(listed) == {"0": "2", "1": "-15", "2": "-15", "3": "-15"}, job.text


def test_a_configuration_error_is_one_line_from_rank_0_and_exit_status_2():
    job = Job(FLAGS + ["--train-iters", "2", "--min-lr", "0.5"])
    job.finish(120)
    message = "pretrain_gpt.py: error: --min-lr=0.5 is invalid: expected a rate <= --lr 0.001"
    printed = [line for line in job.lines if line.startswith(message)]
    assert len(printed) == 1, job.text  # rank 0 only
    exits(job)
    root = job.text.split("Root Cause")[1]
    assert "rank      : 0" in root and message in root  # torchrun's summary shows our line
    assert job.text.count("Traceback (most recent call last)") == 1  # torchrun's own, not ours
    assert "raise ChildFailedError(" in job.text
    assert job.proc.returncode == 1  # torchrun's own status for any failed worker


def test_a_truncated_or_corrupted_checkpoint_is_one_line_naming_the_file(tmp_path):
    """A shard cut short is named by its size; one of the right size with flipped bytes by
    torch's reader's own error (its CheckpointException is a BaseException: it escaped as a
    traceback on every rank before)."""
    save = Job(FLAGS + ["--train-iters", "1", "--save", str(tmp_path)])
    assert save.finish(180) == 0, save.text
    shard = max((tmp_path / "iter_0000001").glob("*.distcp"), key=lambda p: p.stat().st_size)
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    flipped = bytearray(whole)
    flipped[1000::997] = bytes(b ^ 0xFF for b in flipped[1000::997])
    for content, said in ((None, rf"is incomplete: {shard.name} has \d+ bytes, \d+ expected"),
                          (bytes(flipped), r"cannot be loaded: \w+Error: ")):
        if content is not None:
            shard.write_bytes(content)
        load = Job(FLAGS + ["--train-iters", "2", "--load", str(tmp_path),
                    "--use-checkpoint-opt_param-scheduler"])
        load.finish(120)
        lines = [line for line in load.lines if line.startswith("pretrain_gpt.py: error:")]
        assert len(lines) == 1, load.text
        assert re.search(rf"--load: checkpoint {tmp_path}/iter_0000001 {said}", lines[0]), lines
        exits(load)


def test_a_rank_that_never_joins_is_one_line_naming_the_rendezvous():
    """A process started by hand with WORLD_SIZE=2 whose peer never comes: a bounded wait
    (ZEPPELIN_P2P_TIMEOUT_S), then one line naming the rank, the rendezvous and the count that
    joined, exit status 1 (a fault), no traceback (torch's DistStoreError before)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ZEPPELIN_P2P_TIMEOUT_S": "3"}
    flags = [f if f != "4" or FLAGS[i - 1] != "--context-parallel-size" else "2"
             for i, f in enumerate(FLAGS)]
    done = subprocess.run([sys.executable, SCRIPT, *flags, "--train-iters", "1",
                           "--zeppelin-watchdog-timeout", "1"], env=environ, text=True,
                          capture_output=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and re.match(
        rf"pretrain_gpt.py: error: rank 0: the 2 ranks did not all meet at the rendezvous "
        rf"127.0.0.1:{port} within ZEPPELIN_P2P_TIMEOUT_S=3 s \(.*1/2 clients joined", lines[0]), \
        done.stderr
