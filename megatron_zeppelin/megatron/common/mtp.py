"""Multi-token prediction (megatron-core's MTP, ``--mtp-num-layers``) on zeppelin-packed batches.

megatron-core 0.16.1's MTP shifts four per-token tensors by one position per depth with
``roll_tensor(t, shifts=-1, dims=-1, cp_group=, packed_seq_params=)``: the input ids and position
ids ``[1, tokens]`` (``MultiTokenPredictionLayer._get_embeddings``), the labels and the loss mask
``[1, tokens]`` (``GPTModel._postprocess``, which also reads the mask's sum as the depth's token
count). Its packed path rolls each ``cu_seqlens_q`` piece on its own and its CP path knows
Megatron's zigzag halves only; in the linear layout a document's pieces lie on several ranks.

``install()`` (idempotent; ``PackedGPTModel`` calls it when built with MTP layers) rebinds the
name ``roll_tensor`` in those two megatron-core modules to ``roll_tensor`` below, which sends
zeppelin-packed batches whose params carry a ``PlanShift`` (``PackedGPTModel.forward`` puts it
there: the plan's shift by one, ``runtime/shift.py``) through that shift, and every other call
to megatron-core's own function unchanged (static CP, one process, other models).

The count returned with a shifted float tensor (the loss mask: labels, ids and positions are
integers, and Megatron ignores their count) is the pool's count divided by the pool's ranks (one
all-reduce of one number per depth): Megatron logs ``sum(mtp loss) / count`` per rank averaged
over the data-parallel x context-parallel ranks, which is then the micro-batch's per-token mean
on the pool, as one process running the micro-batch logs it (a rank's own count may be 0).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_zeppelin.runtime.shift import ShiftIndex, shift

_MODULES = ("megatron.core.models.gpt.gpt_model",
            "megatron.core.transformer.multi_token_prediction")
_MEGATRON_ROLL: dict[str, Any] = {}  # the function the first module bound, kept once


class PlanShift:
    """The shift by one position within documents of one plan on this rank (``[tokens]``)."""

    def __init__(self, index: ShiftIndex, group: dist.ProcessGroup) -> None:
        if index.k != 1:
            raise ValueError(f"MTP shifts one position per depth: got an index for k={index.k}")
        self.index, self.group = index, group

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return shift(tensor, self.index, self.group)

    def count(self, rolled: torch.Tensor) -> torch.Tensor:
        """``rolled.sum()``; for a float tensor the pool's sum over its ranks (docstring)."""
        total = rolled.sum()
        if not rolled.is_floating_point():
            return total
        pooled = total.detach().clone()
        dist.all_reduce(pooled, group=self.group)
        return pooled / dist.get_world_size(self.group)


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dims: int = -1, cp_group=None,
                packed_seq_params: Optional[Any] = None):
    """megatron-core's ``roll_tensor`` contract (``(rolled, count)``); zeppelin-packed params
    with a ``PlanShift`` shift within documents across the pool's ranks."""
    plan_shift = getattr(packed_seq_params, "mtp_shift", None)
    if plan_shift is None:
        return _MEGATRON_ROLL["roll_tensor"](tensor, shifts=shifts, dims=dims,
                                             cp_group=cp_group,
                                             packed_seq_params=packed_seq_params)
    if shifts != -1 or dims not in (-1, tensor.dim() - 1) or tensor.dim() != 2 or \
            tensor.shape[0] != 1:
        raise ValueError(f"roll_tensor(shape {tuple(tensor.shape)}, shifts={shifts}, dims={dims})"
                         " on a zeppelin-packed batch: MTP shifts [1, tokens] tensors by -1 "
                         "along the tokens")
    rolled = plan_shift(tensor[0])[None]
    return rolled, plan_shift.count(rolled)


def install() -> None:
    """Rebind ``roll_tensor`` in megatron-core's GPT model and MTP modules (idempotent)."""
    import importlib

    for name in _MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "roll_tensor", None)
        if current is None:
            raise RuntimeError(f"{name} has no roll_tensor: this megatron-core's multi-token "
                               "prediction is not the one zeppelin mode supports (0.16.x)")
        if current is not roll_tensor:
            _MEGATRON_ROLL.setdefault("roll_tensor", current)
            module.roll_tensor = roll_tensor


def mtp_block_spec(config, layer_spec, use_transformer_engine: bool,
                   vp_stage: int | None = None):
    """megatron-core's MTP block spec (``config.mtp_num_layers`` layers) around ``layer_spec``
    (its transformer layer: the decoder's, so zeppelin core attention when swapped); None
    without MTP, and with pipeline parallelism on every stage (``vp_stage``: model chunk)
    but the last, where megatron-core places the MTP layers (with a copy of the embedding,
    tied to the first stage's through its embedding group)."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec,
                                  use_transformer_engine=use_transformer_engine,
                                  vp_stage=vp_stage)


__all__ = ["PlanShift", "install", "mtp_block_spec", "roll_tensor"]
