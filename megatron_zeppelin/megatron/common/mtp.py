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

From megatron-core 0.17 the MTP module makes every shift (the GPT model none), and under
``calculate_per_token_loss`` that count also weighs the depth's gradient: Megatron scales each
rank's MTP loss by ``original / count`` (``original``: the rank's mask sum before any shift),
meant as the micro-batch's ratio. The count returned is then ``rolled_pool x original_rank /
original_pool``, which makes that ratio the micro-batch's on every rank (gradients exact);
the logged ``sum / count`` is corrected by ``R x original_rank / original_pool`` in the MTP
loss logger (``MTPLossLoggingHelper``, rebound like ``roll_tensor``), so the log stays the pool's
per-token mean.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_zeppelin.megatron.common.compat import mtp_count_scales_gradient
from megatron_zeppelin.runtime.shift import ShiftIndex, shift

# the modules that call roll_tensor: megatron-core 0.16's GPT model (labels, loss mask) and
# its MTP module, which defines it and, from 0.17, makes every call
_MODULES = ("megatron.core.models.gpt.gpt_model",
            "megatron.core.transformer.multi_token_prediction")
_DEFINED_IN = _MODULES[-1]
_MEGATRON_ROLL: dict[str, Any] = {}  # the function the first module bound, kept once
# >= 0.17: the MTP loss logger's entries (MTPLossLoggingHelper) and the factor that turns the
# depth's logged loss, divided by the count that weighs the gradient, into the pool's mean
_LOGGERS = ("save_loss_to_tracker", "save_metrics_to_tracker")
_LOGGED: list = []


class PlanShift:
    """The shift by one position within documents of one plan on this rank (``[tokens]``)."""

    def __init__(self, index: ShiftIndex, group: dist.ProcessGroup) -> None:
        if index.k != 1:
            raise ValueError(f"MTP shifts one position per depth: got an index for k={index.k}")
        self.index, self.group = index, group
        self.scales_gradient = mtp_count_scales_gradient()
        self.original: tuple | None = None  # (rank's, pool's) sum of the first mask shifted

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return shift(tensor, self.index, self.group)

    def count(self, tensor: torch.Tensor, rolled: torch.Tensor) -> torch.Tensor:
        """The count returned with ``rolled`` (``tensor`` shifted; module doc): ``rolled.sum()``
        for integers; for the loss mask the pool's sum over its ranks (megatron-core 0.16),
        or scaled so that this rank's gradient weight is the micro-batch's (>= 0.17)."""
        total = rolled.sum()
        if not rolled.is_floating_point():
            return total
        if not self.scales_gradient:
            return self._pooled(total) / dist.get_world_size(self.group)
        if self.original is None:  # the first mask shifted: the one Megatron counted first
            first = tensor.sum().detach()
            self.original = (first, self._pooled(first))
        local, pool = self.original  # no branch on them: no host sync (an empty pool: 0)
        share = local / pool.clamp(min=1)
        _LOGGED[:] = [dist.get_world_size(self.group) * share]  # for the depth's log line
        return self._pooled(total) * share

    def _pooled(self, total: torch.Tensor) -> torch.Tensor:
        """The pool's sum of ``total`` over its ranks."""
        pooled = total.detach().clone()
        dist.all_reduce(pooled, group=self.group)
        return pooled


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
    return rolled, plan_shift.count(tensor, rolled)


def _logged_as_pool_mean(save):
    """``save`` (an MTP loss logger entry) taking the depth's loss times the factor the last
    zeppelin shift left (``_LOGGED``; once): ``sum / count x R x local / pool`` is
    ``sum x R / rolled``, whose mean over the pool's ranks is the micro-batch's per-token
    loss, as one process logs it. Other calls unchanged."""
    def logged(loss, *args, **kwargs):
        factor = _LOGGED.pop() if _LOGGED else None
        return save(loss if factor is None else loss * factor, *args, **kwargs)

    logged.zeppelin = True
    return logged


def _install_logger(module) -> None:
    helper = getattr(module, "MTPLossLoggingHelper", None)
    for name in _LOGGERS:
        save = getattr(helper, name, None)
        if save is not None and not getattr(save, "zeppelin", False):
            setattr(helper, name, staticmethod(_logged_as_pool_mean(save)))


def install() -> None:
    """Rebind ``roll_tensor`` in megatron-core's modules that call it (idempotent)."""
    import importlib

    for name in _MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "roll_tensor", None)
        if current is None and name != _DEFINED_IN:
            continue  # megatron-core >= 0.17: the GPT model leaves the shifts to MTP
        if current is None:
            raise RuntimeError(f"{name} has no roll_tensor: this megatron-core's multi-token "
                               "prediction is not the one zeppelin mode supports (0.16 to "
                               "0.19)")
        if current is not roll_tensor:
            _MEGATRON_ROLL.setdefault("roll_tensor", current)
            module.roll_tensor = roll_tensor
        if name == _DEFINED_IN and mtp_count_scales_gradient():
            _install_logger(module)


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
