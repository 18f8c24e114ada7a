"""Where the attention engine's work runs: one host-ordered lane on CPU, streams on CUDA.

CPU: everything runs on the calling thread in program order (``concurrent`` is False): the
engine fills the waits for ring traffic with LOCAL calls itself, polling the exchanges.

CUDA (``concurrent`` True): the ring steps, their merges and their communication joins run on
the *ring* stream (high priority); the LOCAL calls on the *local* stream (low priority), all
queued at the start of the wave; the global inter-node steps' unpacking on the *inter* stream
(high priority, the worker thread's). Ring traffic runs on NCCL's own stream (or through host
buffers, ``transport``), joined to the ring stream by events. The host never waits for the
device: the GPU's block scheduler runs a ring step as soon as its KV block has arrived (the
high priority) and fills every wait with LOCAL work. ``begin`` makes both streams wait for the
work already queued on the caller's stream (the inputs); ``join`` makes the caller's stream
wait for both (the outputs). Tensors allocated on a lane are only used on that lane and on the
caller's stream after ``join``, so the caching allocator needs no ``record_stream``.

Streams once per device. torch hands out streams round-robin from pools of 32 per priority
level (``c10/cuda/CUDAStream.h``), shared by the whole process, NCCL included: an engine per
micro-batch drawing new streams would, one engine in 32, queue its LOCAL work on a stream
some communicator uses. ``lanes_for`` makes a device's lanes once per process and every engine
shares them (engines of one device run one after another). Priorities: NCCL's internal
streams, with ``comm_options`` on the groups the engine communicates on
(``ProcessGroupNCCL.Options.is_high_priority_stream``, torch's documented option), come from
torch's most urgent pool (``getStreamFromPool(isHighPriority=true)``: the greatest priority
torch supports, -3 on H100); the ring and inter streams from the -1 pool, LOCAL from the
default (0) pool. So a transfer never waits behind a LOCAL kernel for a stream slot, and our
streams are never NCCL's (different pools) on devices with at least three priority levels.
"""
from __future__ import annotations

import contextlib

import torch

RING_PRIORITY = -1  # CUDA stream priorities: lower is more urgent; 0 is the default streams'
LOCAL_PRIORITY = 0


class Lanes:
    """The lanes of one device (see the module docstring); ``lanes_for`` shares them."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.concurrent = self.device.type == "cuda"
        self.inter: torch.cuda.Stream | None = None  # the worker thread's stream (CUDA)
        if self.concurrent:
            self._ring = torch.cuda.Stream(self.device, priority=RING_PRIORITY)
            self._local = torch.cuda.Stream(self.device, priority=LOCAL_PRIORITY)
            self.inter = torch.cuda.Stream(self.device, priority=RING_PRIORITY)

    def begin(self) -> None:
        """Both lanes wait for the work queued so far on the caller's stream."""
        if self.concurrent:
            caller = torch.cuda.current_stream(self.device)
            self._ring.wait_stream(caller)
            self._local.wait_stream(caller)

    def join(self) -> None:
        """The caller's stream waits for everything queued on both lanes."""
        if self.concurrent:
            caller = torch.cuda.current_stream(self.device)
            caller.wait_stream(self._ring)
            caller.wait_stream(self._local)

    def ring(self):
        """Context: queue on the ring lane (a no-op on CPU)."""
        return torch.cuda.stream(self._ring) if self.concurrent else contextlib.nullcontext()

    def local(self):
        """Context: queue on the local lane (a no-op on CPU)."""
        return torch.cuda.stream(self._local) if self.concurrent else contextlib.nullcontext()


_LANES: dict[torch.device, Lanes] = {}


def lanes_for(device: torch.device | str) -> Lanes:
    """The lanes of ``device`` (with its index), made once per process."""
    device = torch.device(device)
    if device not in _LANES:
        _LANES[device] = Lanes(device)
    return _LANES[device]


def comm_options():
    """``pg_options`` for a process group the engine communicates on: NCCL's streams at high
    priority (``ProcessGroupNCCL.Options.is_high_priority_stream``); None where torch has no
    NCCL (gloo groups ignore the argument)."""
    if not torch.distributed.is_nccl_available():
        return None
    options = torch.distributed.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options
