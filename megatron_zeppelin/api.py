"""Public API: zeppelin context parallelism in your own Megatron-Core training loop.

What ``scripts/pretrain_gpt.py`` (``megatron/loop/train.py``) and the Megatron-LM glue
(``megatron/lm/glue.py``) use, in one place (``docs/api.md`` shows a whole loop):

* ``pool_runtime(layout, model, seq_length=...)``: the process groups of the pools
  (``PoolLayout``: a pool = the CP ranks of one data-parallel replica and TP rank), the
  planner's cost model, the attention state core attention runs on and the planner
  (document lengths -> ``Plan``); ``process_groups(layout)`` alone gives the groups;
* ``layer_spec(runtime)`` / ``swap_core_attention(spec, runtime)``: Megatron's GPT layer spec
  (or any spec of yours) with every self-attention's core attention swapped for zeppelin's;
* ``planned_micro_batches(batches, runtime)``: wraps an iterator of micro-batches (lists of
  1-D token tensors, one per document, the same on every rank of a pool) into this rank's
  planned ``MicroBatch``es (tokens, labels, loss mask, positions, packed params), planning the
  next micro-batch while the current one trains;
* ``loss_func(batch)``: the loss function a Megatron ``forward_step_func`` returns: the sum
  of per-token losses and the token count of this rank's share. With
  ``TransformerConfig(calculate_per_token_loss=True)`` Megatron's schedules and DDP divide
  gradients by the tokens of the whole global batch (ranks of a pool hold different token
  counts, so a per-rank mean would be wrong); ``global_mean_loss(stored)`` is the logged mean.

Model layouts: tokens / labels / positions ``[1, tokens]`` int64, loss mask ``[1, tokens]``
float32 (Megatron's layout, batch 1; every rank holds its ``Plan.linear[rank]`` pieces).
"""
from __future__ import annotations

import argparse
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_zeppelin.config import ModelSpec
from megatron_zeppelin.megatron.common.data import MicroBatch, ZeppelinDataIterator
from megatron_zeppelin.megatron.common.groups import Pool, new_pool_groups
from megatron_zeppelin.parallel import PoolLayout

MODES = ("zeppelin", "static")
DEVICES = ("cuda", "cpu")
# flags ``runtime_options`` takes from its own arguments or from the ``PoolLayout``
SET_ELSEWHERE = {"context_parallel_mode": "pass mode=", "device": "pass device=",
                 "seq_length": "pass seq_length=",
                 "context_parallel_size": "the PoolLayout gives the CP size (layout.cp)",
                 "tensor_model_parallel_size": "the PoolLayout gives the TP size (layout.tp)",
                 "zeppelin_gpus_per_node": "the PoolLayout gives the node size "
                                           "(layout.gpus_per_node)"}


def process_groups(layout: PoolLayout) -> Pool:
    """Every pool's process groups (every rank calls it, in the same order); this rank's
    ``Pool`` (``.group``: ring P2P and remap all-to-all, ``.rank``: rank in the pool,
    ``.index``: data-parallel replica)."""
    return new_pool_groups(layout)


def runtime_options(seq_length: int, mode: str = "zeppelin", device: str = "cuda",
                    **flags: Any) -> argparse.Namespace:
    """The options ``pool_runtime`` reads, as ``scripts/pretrain_gpt.py`` would parse them:
    defaults of every flag, then ``flags`` by destination name (``zeppelin_cluster=``,
    ``zeppelin_attention_backend=``, ``zeppelin_capacity_tokens_per_gpu=``, ``bf16=``...).
    An unknown name is a ``ValueError`` naming it."""
    from megatron_zeppelin.megatron.loop import args as train_args

    from megatron_zeppelin.options import check_types, from_flags

    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {list(MODES)}")
    if not (isinstance(seq_length, int) and not isinstance(seq_length, bool) and
            seq_length >= 2):
        raise ValueError(f"seq_length={seq_length!r} is invalid: expected an integer >= 2 (the "
                         "longest document, Megatron's --seq-length)")
    options = vars(train_args.build_parser().parse_args([]))
    unknown = sorted(set(flags) - set(options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}: expected flag destinations of "
                         "scripts/pretrain_gpt.py (e.g. zeppelin_cluster)")
    given = sorted(set(flags) & set(SET_ELSEWHERE))
    if given:
        raise ValueError(f"option(s) {given} are invalid here: "
                         f"{'; '.join(SET_ELSEWHERE[g] for g in given)}")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is invalid: expected one of {list(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid here: torch.cuda.is_available() is False")
    options.update(flags, seq_length=seq_length, context_parallel_mode=mode, device=device)
    args = argparse.Namespace(**options)
    for section, fixed in ((train_args.ZeppelinRuntimeArgs, {}),
                           (train_args.ZeppelinConfig, {"max_seqlen": None})):
        check_types(from_flags(section, args, train_args.ZEPPELIN_PREFIX, **fixed))
    return args


def pool_runtime(layout: PoolLayout, model: ModelSpec, *, seq_length: int,
                 mode: str = "zeppelin", device: str = "cuda", **flags: Any):
    """This rank's ``PoolRuntime`` (``.pool``, ``.cost``, ``.state``, ``.planner``;
    ``.close()`` when done): groups -> cost model -> attention state -> planner, built
    collectively. ``model``: the planner's view of the model (layers, hidden size, heads);
    ``flags``: as ``runtime_options``."""
    if not isinstance(layout, PoolLayout):
        raise ValueError(f"layout={layout!r} is invalid: expected a PoolLayout")
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model={model!r} is invalid: expected a ModelSpec (layers, hidden "
                         "size, heads: config.load_model or ModelSpec(...))")
    return pool_runtime_from_args(runtime_options(seq_length, mode, device, **flags), layout,
                                  model)


def pool_runtime_from_args(args: argparse.Namespace, layout: PoolLayout, model: ModelSpec):
    """``pool_runtime`` from a parsed namespace (ours, or Megatron-LM's with ``device``)."""
    from megatron_zeppelin.megatron.loop.train import build_pool_runtime

    return build_pool_runtime(args, layout, model)


def _state(runtime: Any):
    return getattr(runtime, "state", runtime)


def layer_spec(runtime: Any, *, use_te: bool | None = None, normalization: str = "RMSNorm",
               qk_layernorm: bool = False, multi_latent_attention: bool = False):
    """Megatron's GPT layer spec (TE when ``use_te`` or importable, else local) with zeppelin
    core attention (multi-latent attention's self-attention with ``multi_latent_attention``);
    ``runtime``: a ``PoolRuntime`` or its attention state."""
    from megatron_zeppelin.megatron.common.spec import get_gpt_layer_zeppelin_spec

    return get_gpt_layer_zeppelin_spec(_state(runtime), use_te=use_te,
                                       normalization=normalization, qk_layernorm=qk_layernorm,
                                       multi_latent_attention=multi_latent_attention)


def swap_core_attention(spec: Any, runtime: Any, where: str = "the layer spec"):
    """A copy of any Megatron layer or block spec with zeppelin core attention."""
    from megatron_zeppelin.megatron.common.spec import swap_core_attention as swap

    return swap(spec, _state(runtime), where)


def planned_micro_batches(batches: Iterator[list[torch.Tensor]], runtime: Any,
                          device: torch.device | str = "cpu", *,
                          max_position: int | None = None, prefetch: bool = True,
                          planner: Any = None) -> ZeppelinDataIterator:
    """This rank's planned micro-batches from ``batches`` (lists of 1-D int64 documents, the
    same on every rank of the pool); ``close()`` when done. ``max_position``: the RoPE table
    length (the model's ``max_sequence_length``); ``planner``: another lengths -> ``Plan``
    callable or ``PlannerService`` than ``runtime.planner``."""
    if max_position is not None and not (isinstance(max_position, int) and
                                         not isinstance(max_position, bool) and max_position >= 1):
        raise ValueError(f"max_position={max_position!r} is invalid: expected None or an "
                         "integer >= 1 (the RoPE table length)")
    if planner is None and not hasattr(runtime, "planner"):
        raise ValueError(f"runtime={runtime!r} is invalid: expected the PoolRuntime of "
                         "pool_runtime (or pass planner=)")
    return ZeppelinDataIterator(batches, planner or runtime.planner, runtime.pool.rank,
                                device=device, prefetch=prefetch,
                                prepare=_state(runtime).prepare, max_position=max_position)


def loss_func(batch: MicroBatch):
    """Megatron's loss function for ``batch``: ``output [1, tokens]`` per-token losses ->
    (sum over the rank's labelled tokens, token count, ``{"lm loss": [sum, count]}``), the
    per-token form megatron-core normalises over the global batch."""

    def per_token_loss(output: torch.Tensor):
        total = (output.float() * batch.loss_mask).sum()
        count = batch.loss_mask.sum().to(torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return per_token_loss


def global_mean_loss(stored: list[dict], group: dist.ProcessGroup | None = None) -> float:
    """The iteration's mean loss per token over every rank of ``group`` (default: the world;
    use the DP x CP group with TP or pipelines) from what the schedule returned."""
    sums = torch.stack([d["lm loss"] for d in stored]).sum(0) if stored else torch.zeros(2)
    dist.all_reduce(sums, group=group)
    return (sums[0] / sums[1].clamp(min=1)).item()


__all__ = ["MicroBatch", "Pool", "PoolLayout", "ModelSpec", "process_groups",
           "runtime_options", "pool_runtime", "pool_runtime_from_args", "layer_spec",
           "swap_core_attention", "planned_micro_batches", "loss_func", "global_mean_loss"]
