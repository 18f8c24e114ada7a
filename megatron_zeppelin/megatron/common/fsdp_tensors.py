"""Megatron-FSDP's sharded tensors as whole tensors, and back.

megatron-core 0.16.1's Megatron-FSDP keeps each parameter (and its ``main_grad``) as a DTensor
whose local shard is this rank's piece of a flattened bucket: shards may be uneven, and empty
on some ranks. ``full_tensor`` gathers the whole tensor on every rank of the FSDP group (DP x
CP); ``scatter_into`` copies this rank's piece of a whole tensor back into its shard. Used by
the checkpoints of our loop (``loop/checkpoint_fsdp.py``) and by the shared-embedding gradient
sum across pipeline stages (``fsdp_stages.py``), which both entry points run.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def is_megatron_fsdp(chunk: Any) -> bool:
    """Whether a model chunk is wrapped in megatron-core's Megatron-FSDP."""
    return bool(getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False))


def full_tensor(dtensor: Any, group: Any, local: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor of an (unevenly) sharded DTensor on every rank of ``group`` (the
    FSDP group, collective). ``local``: this rank's shard of a tensor sharded as ``dtensor``
    (its Adam state; empty where the rank's shard is). Shards are padded to one size: gloo's
    all-gather takes equal sizes only."""
    local = (dtensor.to_local() if local is None else local).detach()
    where = local_slices(dtensor)
    infos: list = [None] * group.size()
    dist.all_gather_object(infos, (tuple(local.shape), [s.start for s in where]), group=group)
    size = max(1, max(math.prod(shape) for shape, _ in infos))
    flat = torch.zeros(size, dtype=local.dtype, device=local.device)
    flat[:local.numel()] = local.reshape(-1)
    parts = [torch.empty_like(flat) for _ in infos]
    dist.all_gather(parts, flat, group=group)
    full = torch.empty(tuple(dtensor.shape), dtype=local.dtype, device=local.device)
    for (shape, offsets), part in zip(infos, parts):
        if math.prod(shape):
            full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))] = \
                part[:math.prod(shape)].view(shape)
    return full


def local_slices(dtensor: Any) -> tuple[slice, ...]:
    """Where this rank's shard of ``dtensor`` lies in the full tensor (collective the first
    time: megatron-core gathers every rank's chunk metadata)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata)

    if not hasattr(dtensor._local_tensor, "__create_chunk_list__"):
        update_uneven_dtensor_chunk_metadata(dtensor)
    meta, = dtensor.__create_chunk_list__()
    return tuple(slice(o, o + s) for o, s in zip(meta.offsets, meta.sizes))


@torch.no_grad()
def scatter_into(full: torch.Tensor, local: torch.Tensor, what: str, like: Any) -> None:
    """Copy this rank's slice of ``full`` into ``local``, its shard of a tensor sharded as
    the DTensor ``like``."""
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"{what}: loaded shape {tuple(full.shape)}, the model's "
                         f"{tuple(like.shape)}")
    local.copy_(full[local_slices(like)].reshape(local.shape))
