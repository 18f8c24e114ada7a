"""Megatron-FSDP's sharded tensors as whole tensors, and back.

megatron-core 0.16.1's Megatron-FSDP keeps each parameter (and its ``main_grad``) as a DTensor
whose local shard is this rank's piece of a flattened bucket: shards may be uneven, and empty
on some ranks. With tensor parallelism a TP-split weight's DTensor spans the TP ranks too (mesh
``(dp_cp, tp)``, its shape and shard offsets the TP-global ones, read in megatron-core 0.16.1 to
0.19.2): a rank's *model tensor* is its TP part, the tensor the unwrapped model (and Megatron's
sharded checkpoints) hold. ``full_tensor`` gathers the whole model tensor on every rank of the
FSDP group (DP x CP: the ranks that hold this TP part); ``scatter_into`` copies this rank's
piece of a whole model tensor back into its shard (both
used by the checkpoints of our loop, ``loop/checkpoint_fsdp.py``); ``add_other_stages`` sums a
weight shared by pipeline stages, each stage sharding it its own way, by exchanging only
overlapping pieces (the shared-embedding gradient, ``fsdp_stages.py``, which both entry points
run).
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
    where = model_slices(dtensor)
    infos: list = [None] * group.size()
    dist.all_gather_object(infos, (tuple(local.shape), [s.start for s in where]), group=group)
    size = max(1, max(math.prod(shape) for shape, _ in infos))
    flat = torch.zeros(size, dtype=local.dtype, device=local.device)
    flat[:local.numel()] = local.reshape(-1)
    parts = [torch.empty_like(flat) for _ in infos]
    dist.all_gather(parts, flat, group=group)
    full = torch.empty(model_shape(dtensor), dtype=local.dtype, device=local.device)
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


TP_MESH_DIM = "tp"  # megatron-core's name of Megatron-FSDP's tensor-parallel mesh dimension


def tensor_parallel_part(dtensor: Any) -> tuple[int, int, int] | None:
    """``(dim, start, length)``: where this rank's TP part lies in a DTensor that Megatron-FSDP
    shards over TP too (a ``Shard(dim)`` placement on the mesh dimension ``"tp"``); None for
    a tensor each TP rank holds whole (norms, TP size 1, torch FSDP2's DP-only meshes)."""
    names = getattr(dtensor.device_mesh, "mesh_dim_names", None) or ()
    if TP_MESH_DIM not in names:
        return None
    index = names.index(TP_MESH_DIM)
    placement = dtensor.placements[index]
    size = dtensor.device_mesh.size(index)
    if not placement.is_shard() or size == 1:
        return None
    length = dtensor.shape[placement.dim] // size
    return placement.dim, dtensor.device_mesh.get_local_rank(index) * length, length


def model_shape(dtensor: Any) -> tuple[int, ...]:
    """The shape of this rank's model tensor of ``dtensor`` (its TP part)."""
    shape, part = list(dtensor.shape), tensor_parallel_part(dtensor)
    if part is not None:
        shape[part[0]] = part[2]
    return tuple(shape)


def model_slices(dtensor: Any) -> tuple[slice, ...]:
    """Where this rank's shard of ``dtensor`` lies in its model tensor (``local_slices``
    shifted to the TP part)."""
    where, part = local_slices(dtensor), tensor_parallel_part(dtensor)
    if part is None:
        return where
    dim, start, _ = part
    return tuple(slice(s.start - start, s.stop - start) if d == dim else s
                 for d, s in enumerate(where))


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...]) -> tuple[slice, ...] | None:
    """The block both ``a`` and ``b`` cover (None: they do not meet)."""
    both = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return both if all(s.start < s.stop for s in both) else None


def _shift(block: tuple[slice, ...], origin: tuple[slice, ...]) -> tuple[slice, ...]:
    return tuple(slice(s.start - o.start, s.stop - o.start) for s, o in zip(block, origin))


def _exchanges(dtensor: Any, dp_group: Any, shared_group: Any) -> list[tuple[int, tuple]]:
    """``[(world rank, block of this rank's shard)]``: each rank of another stage whose shard
    of the shared tensor meets this rank's, and where (collective over ``dp_group`` and
    ``shared_group``; the shards never move, so the caller keeps the answer)."""
    mine = local_slices(dtensor)
    stage: list = [None] * dp_group.size()
    bounds = tuple((s.start, s.stop) for s in mine)
    dist.all_gather_object(stage, (dist.get_rank(), bounds), group=dp_group)
    stages: list = [None] * dist.get_world_size(shared_group)
    dist.all_gather_object(stages, stage, group=shared_group)
    out = []
    for rank, theirs in (entry for other in stages if other != stage for entry in other):
        block = _overlap(mine, tuple(slice(*b) for b in theirs))
        if block is not None:
            out.append((rank, _shift(block, mine)))
    return out


@torch.no_grad()
def add_other_stages(dtensor: Any, owner: Any, dp_group: Any, shared_group: Any) -> None:
    """Add to this rank's shard of ``dtensor`` (sharded over ``dp_group``, this stage's FSDP
    group) the same elements of the other stages' copies (``shared_group``: one rank per
    stage, this one's counterparts; each stage shards its copy its own way): every rank sends
    each overlapping rank of another stage the block they share and receives its block, one
    batch of P2P ops (per rank about one shard each way). ``owner`` (the parameter) keeps
    who-overlaps-whom after the first call."""
    exchanges = getattr(owner, "_zeppelin_stage_exchanges", None)
    if exchanges is None:
        exchanges = _exchanges(dtensor, dp_group, shared_group)
        owner._zeppelin_stage_exchanges = exchanges
    local = dtensor.to_local()
    ops, received = [], []
    for rank, block in exchanges:
        buffer = torch.empty_like(local[block])
        ops += [dist.P2POp(dist.isend, local[block].contiguous(), rank),
                dist.P2POp(dist.irecv, buffer, rank)]
        received.append((block, buffer))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for block, buffer in received:  # after every send took its copy
        local[block] += buffer


@torch.no_grad()
def scatter_into(full: torch.Tensor, local: torch.Tensor, what: str, like: Any) -> None:
    """Copy this rank's slice of ``full`` (a whole model tensor) into ``local``, its shard of
    a tensor sharded as the DTensor ``like``."""
    if tuple(full.shape) != model_shape(like):
        raise ValueError(f"{what}: loaded shape {tuple(full.shape)}, the model's "
                         f"{model_shape(like)}")
    local.copy_(full[model_slices(like)].reshape(local.shape))
