"""Attention sinks (Megatron's ``--softmax-type off-by-one`` / ``learnable``, GPT-OSS style) for
the core attentions of our model: zeppelin's (``core_attention.py``) and the one-process
reference (``model.PackedCoreAttention``).

A sink is one more logit per head in every row's softmax denominator, attending a zero value
(megatron-core's ``SoftmaxOne``): ``off-by-one`` fixes it at 0, ``learnable`` trains it. The
engine applies it after merging a row's ring blocks (``runtime/merge.with_sink``) and trains it
(``merge.sink_grad``). ``SinkMixin`` gives a core attention megatron-core's
``DotProductAttention`` state for it: the same ``softmax_offset`` (shape ``[heads per TP rank]``,
dtype, initialisation, the same random draws at the same point of the model's construction, so
that zeppelin and static mode build the same model) and the same checkpoint key, split by head
over TP (read in megatron-core 0.16.1 and 0.19.2).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig


class SinkMixin:
    """``_init_sink`` in ``__init__``; ``sink()`` the logits ``[heads]`` for the engine (None:
    vanilla softmax); ``sharded_state_dict`` as ``DotProductAttention``'s."""

    def _init_sink(self, config: TransformerConfig,
                   pg_collection: Optional[ProcessGroupCollection]) -> None:
        kind = getattr(config, "softmax_type", "vanilla")
        if kind not in ("vanilla", "off-by-one", "learnable"):  # megatron-core's Literal
            raise ValueError(f"softmax_type={kind!r} is invalid: expected vanilla, off-by-one "
                             "or learnable")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        heads = config.num_attention_heads // self.tp_group.size()
        if kind == "learnable":
            self.register_parameter("softmax_offset", torch.nn.Parameter(torch.empty(
                heads, device=torch.cuda.current_device(), dtype=config.params_dtype)))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)
        else:
            self.softmax_offset = None if kind == "vanilla" else torch.zeros(
                heads, device=torch.cuda.current_device(), dtype=config.params_dtype)

    def sink(self, like: Tensor) -> Optional[Tensor]:
        """The sink logits on ``like``'s device (None without a sink)."""
        offset = self.softmax_offset
        return None if offset is None else offset.to(like.device)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's: the learnable sink under ``<prefix>softmax_offset``, split by head
        over TP (``DotProductAttention.sharded_state_dict``); the module's own otherwise."""
        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)
