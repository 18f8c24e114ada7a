"""Megatron-FSDP (megatron-core's ``FullyShardedDataParallel``) and torch FSDP2 (its
``TorchFullyShardedDataParallel``) on CPU with gloo: the CUDA streams, events and device mesh
they assume, bridged while ``cpu.py``'s bridge is on.

``enable_megatron_fsdp_on_cpu()`` is called by the training loop before it wraps a model with
``--use-megatron-fsdp --device cpu``; ``cpu.disable_cpu_mode()`` undoes it with the rest.
What megatron-core 0.16.1's Megatron-FSDP does on CUDA and what stands in for it on CPU:

* ``MegatronFSDP.__init__`` makes two side streams (``torch.cuda.Stream()``: gradient
  reduce-scatter and parameter all-gather) and names the current device as
  ``torch.device(f"cuda:{torch.cuda.current_device()}")``; its ``ParamAndGradBuffer``
  allocates on ``device``. It runs under the device redirect (``cpu.run_on_cpu``) with
  ``torch.cuda.current_device()`` as index 0 (a GPU rank's own device is index 0 of what it
  sees), and the module on the CPU device we pass; the "device differs" warning it logs
  for that is silenced while it runs.
* The reduce-scatter and all-gather pipelines enter ``torch.cuda.stream(side_stream)``, make
  the side stream wait for the current one, record events on it and wait for them before a
  bucket is reused or read. CPU kernels and gloo collectives issued without ``async_op``
  are complete when the call returns; the all-gathers issued with ``async_op`` are waited
  through their ``Work`` handles, which megatron-core keeps beside the event. So on CPU a
  stream is one synchronous queue: ``torch.cuda.Stream`` / ``torch.cuda.Event`` are objects
  whose waits return at once and ``torch.cuda.stream(s)`` is an empty context.

* With TP > 1 the adapter (``FullyShardedDataParallel.__init__``) broadcasts TP rank 0's RNG
  states over the TP group (``_get_rng_state_dict`` / ``_load_rng_state_dict``), the CUDA
  generator's among them: on CPU that one is the CPU generator (as ``cpu.py``'s RNG tracker).

Nothing else of Megatron-FSDP's CPU path touches CUDA (read in megatron-core 0.16.1's
``megatron_fsdp.py`` and ``param_and_grad_buffer.py``); ``nccl_ub``, ``fsdp_double_buffer``
and ``num_distributed_optimizer_instances > 1`` are not on our path (no flag sets them).

Torch FSDP2 (``enable_torch_fsdp2_on_cpu()``, for ``--use-torch-fsdp2 --device cpu``): torch's
``fully_shard`` runs on a CPU device mesh with gloo (all-gather and reduce-scatter of flat
shards); megatron-core 0.16.1's ``TorchFullyShardedDataParallel.__init__`` names its mesh's
device ``"cuda"`` (``DeviceMesh.from_group(group, "cuda")``), so while it runs the mesh is made
on ``"cpu"``. Nothing else of it touches CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch

from megatron_zeppelin.megatron.common import cpu, cpu_replacements

FSDP_MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp"
FSDP2_MODULE = "megatron.core.distributed.torch_fully_sharded_data_parallel"
ADAPTER_MODULE = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"


class CpuEvent:
    """``torch.cuda.Event`` on CPU: recorded work is already done when it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Any CUDA event options (timing, blocking, interprocess) mean nothing here."""

    def record(self, stream: Any = None) -> None:
        """Nothing to mark: the work before it is complete."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing runs asynchronously."""

    def query(self) -> bool:
        return True


class CpuSideStream(cpu_replacements.CpuStream):
    """``torch.cuda.Stream()`` on CPU: work "on" it runs at once, in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Any device or priority: there is one CPU queue."""

    def record_event(self, event: Any = None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def query(self) -> bool:
        return True


def _cpu_stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(s)`` on CPU: the one queue is always current."""
    return contextlib.nullcontext()


def _cuda_index_zero() -> int:
    return 0


def _fsdp_init_on_cpu(original: Callable) -> Callable:
    """``MegatronFSDP.__init__`` under the device redirect, naming device ``cuda:0``."""
    redirected = cpu.run_on_cpu(original)

    @functools.wraps(original)
    def replacement(self, *args: Any, **kwargs: Any) -> None:
        bridged = torch.cuda.current_device
        log = logging.getLogger(FSDP_MODULE)
        level = log.level
        torch.cuda.current_device = _cuda_index_zero
        log.setLevel(logging.ERROR)
        try:
            redirected(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = bridged
            log.setLevel(level)

    return replacement


def _cuda_rng_on_cpu(original: Callable) -> Callable:
    """The adapter's RNG-state helper with the CUDA generator's state read and set as the
    CPU generator's."""

    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        get, set_ = torch.cuda.get_rng_state, torch.cuda.set_rng_state
        torch.cuda.get_rng_state = cpu_replacements.cpu_get_rng_state  # (device) as torch's
        torch.cuda.set_rng_state = cpu_replacements.cpu_set_rng_state  # (state, device)
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.get_rng_state, torch.cuda.set_rng_state = get, set_

    return replacement


def _specs() -> list[tuple[str, str, Callable[[Any], Any]]]:
    return [
        ("torch.cuda", "Stream", lambda _: CpuSideStream),
        ("torch.cuda", "Event", lambda _: CpuEvent),
        ("torch.cuda", "stream", lambda _: _cpu_stream_context),
        (FSDP_MODULE, "MegatronFSDP.__init__", _fsdp_init_on_cpu),
        (ADAPTER_MODULE, "_get_rng_state_dict", _cuda_rng_on_cpu),
        (ADAPTER_MODULE, "_load_rng_state_dict", _cuda_rng_on_cpu),
    ]


def enable_megatron_fsdp_on_cpu() -> None:
    """Add the Megatron-FSDP bridges to ``cpu.py``'s (which must be on); idempotent."""
    if not cpu.cpu_mode_enabled():
        raise RuntimeError("the Megatron-FSDP CPU bridge needs cpu.enable_cpu_mode() first")
    cpu.apply_patches(_specs())


class _CpuDeviceMesh:
    """The ``DeviceMesh`` name of megatron-core's FSDP2 module while its ``__init__`` runs on
    CPU: ``from_group`` builds the mesh on the CPU device."""

    @staticmethod
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def _fsdp2_init_on_cpu(original: Callable) -> Callable:
    """``TorchFullyShardedDataParallel.__init__`` with its device mesh on the CPU."""

    @functools.wraps(original)
    def replacement(self, *args: Any, **kwargs: Any) -> None:
        import importlib

        module = importlib.import_module(FSDP2_MODULE)
        mesh = module.DeviceMesh
        module.DeviceMesh = _CpuDeviceMesh
        try:
            original(self, *args, **kwargs)
        finally:
            module.DeviceMesh = mesh

    return replacement


def enable_torch_fsdp2_on_cpu() -> None:
    """Add the torch FSDP2 bridge to ``cpu.py``'s (which must be on); idempotent."""
    if not cpu.cpu_mode_enabled():
        raise RuntimeError("the torch FSDP2 CPU bridge needs cpu.enable_cpu_mode() first")
    cpu.apply_patches([(FSDP2_MODULE, "TorchFullyShardedDataParallel.__init__",
                        _fsdp2_init_on_cpu)])
