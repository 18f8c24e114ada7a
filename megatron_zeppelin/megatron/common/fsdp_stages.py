"""Megatron-FSDP with pipeline stages: each stage's model chunks sharded over that stage's
DP x CP ranks.

megatron-core 0.16.1's ``FullyShardedDataParallel`` builds its device mesh in
``mcore_fsdp_adapter._get_dp_tp_mesh`` from *every* rank of the world, laid out as
``(dp_cp ep tp)``: with pipeline stages the world is ``pp`` times larger than that and the
layout fails (einops: "Shape mismatch, 4 != 2" on PP 2 x CP 2), so Megatron-LM runs
Megatron-FSDP without pipeline parallelism. Nothing else in it depends on the world: the
shards, buffers and collectives live on the DP x CP group and the TP group it is given, which
Megatron's rank order (TP fastest, PP slowest: ``tp-cp-ep-dp-pp``) lays out as one contiguous
block of ranks per stage. ``stage_mesh(pp_group)`` builds the mesh over that block instead,
while the wrapper is constructed (the same layout and checks as megatron-core's, on the
stage's ranks); with one stage it is megatron-core's own mesh.

With TP, Megatron-FSDP makes each TP-split parameter a DTensor with ``run_check=True``, and
torch's ``DTensor.from_local`` then checks the tensor's metadata (dtype, requires_grad) with an
``all_gather_object`` over the *world* (``check_tensor_meta``, torch 2.13). The stages hold
different numbers of TP-split parameters, so with stages those gathers pair up with other
collectives (measured, TP 2 x PP 2 on CPU/gloo, megatron-core 0.18.2/0.19.2, static mode too:
it failed building the optimizer). While ``stage_mesh`` is open the same check runs over the
stage's own ranks (megatron-core's TP x DP x CP group), which is where the DTensor lives.

Layout: ranks of stage ``s`` are ``s * S .. (s + 1) * S - 1`` with ``S = TP x CP x EP x DP``
(EP inside DP, as megatron-core's expert mesh reads them).

Weights shared across stages (the word embedding tied to the output layer, or multi-token
prediction's copy of it on the last stage) have their gradients summed over the embedding group
by ``finalize_model_grads``. megatron-core 0.16.1 does that with Megatron-FSDP by all-reducing
each rank's *local shard* and assigning it as the whole gradient (RuntimeError: "a gradient of
size [576, 64] to a tensor of size [1152, 64]"); and the two stages' shards need not cover the
same rows, as each stage buckets its own parameters. ``summing_shared_embeddings(finalize)``
sums the right rows instead (``fsdp_tensors.add_other_stages``): each rank exchanges with the
ranks of the other stage whose shards overlap its own only those rows, and adds what it
receives (per rank about one shard each way; gathering the whole gradient and all-reducing it
over the embedding group, the first version, moved the whole vocab x hidden gradient, 4 GiB in
fp32 at 128k x 8k, twice per rank and step).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
DTENSOR_API = "torch.distributed.tensor._api"  # where DTensor.from_local calls check_tensor_meta
FINALIZE = "megatron.core.distributed.finalize_model_grads"


def stage_ranks(pp_group: Any) -> list[int]:
    """The world ranks of this rank's pipeline stage (a contiguous block in Megatron's rank
    order); ValueError naming the layout when they are not contiguous (another rank order)."""
    world, stages = dist.get_world_size(), dist.get_world_size(pp_group)
    size = world // stages
    first = (dist.get_rank() // size) * size
    ranks = list(range(first, first + size))
    peers = dist.get_process_group_ranks(pp_group)
    if sorted(peers) != [dist.get_rank() % size + stage * size for stage in range(stages)]:
        raise ValueError(f"pipeline group {peers} of rank {dist.get_rank()}: Megatron-FSDP with "
                         f"pipeline stages needs Megatron's default rank order (stages of "
                         f"{size} contiguous ranks)")
    return ranks


def _stage_dp_tp_mesh(ranks: list[int], dp_cp_group: Any, tp_group: Any,
                      ep_size: int = 1) -> torch.Tensor:
    """megatron-core's ``_get_dp_tp_mesh`` over ``ranks`` (one stage) instead of the world:
    the ``[dp_cp, tp]`` mesh of this rank's expert-parallel slice, checked against the DP x CP
    and TP groups' ranks."""
    dp_cp, tp = dp_cp_group.size(), dist.get_world_size(tp_group) if tp_group is not None else 1
    if len(ranks) != dp_cp * ep_size * tp:
        raise ValueError(f"a pipeline stage of {len(ranks)} ranks is not DP x CP {dp_cp} x EP "
                         f"{ep_size} x TP {tp}")
    mesh = torch.tensor(ranks).view(dp_cp, ep_size, tp).permute(1, 0, 2)  # ep, dp_cp, tp
    dp_ranks = sorted(dist.get_process_group_ranks(dp_cp_group))
    tp_ranks = sorted(dist.get_process_group_ranks(tp_group)) if tp_group is not None else None
    rank = dist.get_rank()
    for per_ep in mesh:
        if rank in per_ep.reshape(-1).tolist():
            columns = [sorted(per_ep[:, t].tolist()) for t in range(tp)]
            rows = [sorted(row.tolist()) for row in per_ep]
            if dp_ranks not in columns or (tp_ranks is not None and tp_ranks not in rows):
                raise ValueError(f"rank {rank}: the stage mesh {per_ep.tolist()} does not hold "
                                 f"its DP x CP group {dp_ranks} and TP group {tp_ranks}")
            return per_ep
    raise ValueError(f"rank {rank} is not in its stage's mesh {mesh.tolist()}")


@contextlib.contextmanager
def stage_mesh(pp_group: Any) -> Iterator[None]:
    """While it is open, megatron-core's Megatron-FSDP wrapper meshes this rank's pipeline
    stage instead of the world (nothing changes with one stage)."""
    import importlib

    if dist.get_world_size(pp_group) == 1:
        yield
        return
    from megatron.core import parallel_state

    adapter, api = importlib.import_module(ADAPTER), importlib.import_module(DTENSOR_API)
    ranks, original = stage_ranks(pp_group), adapter._get_dp_tp_mesh
    checked = getattr(api, "check_tensor_meta", None)
    adapter._get_dp_tp_mesh = lambda dp_cp_group, tp_group, ep_size=1: _stage_dp_tp_mesh(
        ranks, dp_cp_group, tp_group, ep_size)
    if checked is not None:
        api.check_tensor_meta = _stage_tensor_check(
            parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    try:
        yield
    finally:
        adapter._get_dp_tp_mesh = original
        if checked is not None:
            api.check_tensor_meta = checked


def _stage_tensor_check(stage_group: Any):
    """torch's ``check_tensor_meta`` over ``stage_group`` (this stage's ranks) instead of the
    world: every rank's local tensor has the same dtype and requires_grad (and shape and
    stride if asked); ValueError naming the rank otherwise."""

    def check(local_tensor: torch.Tensor, check_shape_stride: bool = False) -> None:
        mine = {"dtype": local_tensor.dtype, "requires_grad": local_tensor.requires_grad}
        if check_shape_stride:
            mine.update(shape=local_tensor.shape, stride=local_tensor.stride())
        theirs: list = [None] * dist.get_world_size(stage_group)
        dist.all_gather_object(theirs, mine, group=stage_group)
        if any(meta != mine for meta in theirs):
            raise ValueError(f"rank {dist.get_rank()}: a DTensor's local tensors differ across "
                             f"its pipeline stage's ranks ({mine} vs {theirs})")
        return None

    return check


def _embedding_chunk(model: list, pp_group: Any, config: Any) -> Any:
    """The chunk holding the stage's shared weight, as megatron-core's
    ``_allreduce_embedding_grad`` picks it (MTP's copy lives in the last chunk)."""
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

    if is_pp_first_stage(pp_group):
        return model[0]
    if is_pp_last_stage(pp_group) or (getattr(config, "mtp_num_layers", None) or 0) > 0:
        return model[-1]
    return model[0]


def _sum_sharded_embedding_grad(original):
    """megatron-core's ``_allreduce_embedding_grad`` that sums a Megatron-FSDP chunk's shared
    weight across the stages' overlapping shards (``original`` for every other chunk)."""
    from megatron.core.utils import get_attr_wrapped_model, get_pg_size

    from megatron_zeppelin.megatron.common.fsdp_tensors import add_other_stages, is_megatron_fsdp

    def reduce(model, embd_group, pp_group, weight_getter, skip_if_none=True, config=None):
        chunk = _embedding_chunk(model, pp_group, config)
        if not is_megatron_fsdp(chunk) or get_pg_size(embd_group) <= 1 or \
                dist.get_rank() not in dist.get_process_group_ranks(embd_group):
            return original(model, embd_group, pp_group, weight_getter, skip_if_none, config)
        weight = weight_getter(get_attr_wrapped_model(chunk, "pre_process",
                                                      return_model_obj=True))
        # after finish_grad_sync the module holds the optimizer's DTensor, its .grad the shard
        grad = getattr(weight, "main_grad", getattr(weight, "grad", None)) \
            if weight is not None else None
        if grad is None:
            if skip_if_none:
                return
            raise ValueError(f"rank {dist.get_rank()}: a shared weight without a gradient")
        add_other_stages(grad, weight, chunk.module.dist_index.get_dp_group(), embd_group)

    return reduce


def summing_shared_embeddings(finalize):
    """``finalize`` (megatron-core's ``finalize_model_grads``, the function Megatron's schedules
    call after the backward) with the shared-weight gradients of Megatron-FSDP chunks summed
    across pipeline stages, shard by shard (module docstring); identical otherwise."""
    import functools
    import importlib

    if getattr(finalize, "_zeppelin_shared_embeddings", False):
        return finalize

    @functools.wraps(finalize)
    def run(*args, **kwargs):
        module = importlib.import_module(FINALIZE)
        original = module._allreduce_embedding_grad
        module._allreduce_embedding_grad = _sum_sharded_embedding_grad(original)
        try:
            return finalize(*args, **kwargs)
        finally:
            module._allreduce_embedding_grad = original

    run._zeppelin_shared_embeddings = True
    return run
