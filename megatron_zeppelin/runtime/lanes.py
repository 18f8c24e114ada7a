"""Where the attention engine's work runs: one host-ordered lane on CPU, two streams on CUDA.

CPU: everything runs on the calling thread in program order (``concurrent`` is False): the
engine fills the waits for ring traffic with LOCAL calls itself, polling the exchanges.

CUDA (``concurrent`` True): the ring steps, their merges and their communication joins run on
the *ring* stream (high priority); the LOCAL calls on the *local* stream (low priority), all
queued at the start of the wave. Ring traffic runs on NCCL's own stream (or through host
buffers, ``transport``), joined to the ring stream by events. The host never waits for the
device: the GPU's block scheduler runs a ring step as soon as its KV block has arrived (the
high priority) and fills every wait with LOCAL work. ``begin`` makes both streams wait for the
work already queued on the caller's stream (the inputs); ``join`` makes the caller's stream
wait for both (the outputs). Tensors allocated on a lane are only used on that lane and on the
caller's stream after ``join``, so the caching allocator needs no ``record_stream``.
"""
from __future__ import annotations

import contextlib

import torch

RING_PRIORITY = -1  # CUDA stream priorities: lower is more urgent; 0 is the default streams'
LOCAL_PRIORITY = 0


class Lanes:
    """The lanes of one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.concurrent = self.device.type == "cuda"
        if self.concurrent:
            self._ring = torch.cuda.Stream(self.device, priority=RING_PRIORITY)
            self._local = torch.cuda.Stream(self.device, priority=LOCAL_PRIORITY)

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
