"""A Megatron-Core GPT whose core attention is pluggable, and an exact packed reference attention.

``make_transformer_config(spec)`` turns our ``ModelSpec`` into a ``TransformerConfig`` (bias off,
SwiGLU or GELU, RMSNorm or LayerNorm, no fused kernels so that it also runs on CPU);
``gpt_layer_spec(core_attention)`` is megatron-core's ``get_gpt_layer_local_spec`` with
``self_attention.submodules.core_attention`` swapped; ``build_gpt_model`` builds a
``PackedGPTModel`` (RoPE by in-document position, see ``packing.py``).

``SelfAttention`` (megatron-core 0.16.1) builds the core attention as
``core_attention(config=, layer_number=, attn_mask_type=, attention_type=, cp_comm_type=,
softmax_scale=, pg_collection=)`` and calls it as ``core_attention(query, key, value,
attention_mask, attn_mask_type=, attention_bias=, packed_seq_params=)``. With our packed params
(``qkv_format='sbhd'``) q is ``[tokens, 1, heads, head_dim]``, k/v ``[tokens, 1, kv_heads,
head_dim]`` after RoPE, and the result must be ``[tokens, 1, heads * head_dim]`` (per TP rank).
``PackedCoreAttention`` is the local, exact version of that contract; the zeppelin attention
(remap + rings) implements the same one.

Multi-latent attention (``attention_options(multi_latent_attention=True, ...)`` ->
``MLATransformerConfig``; ``gpt_layer_spec(..., multi_latent_attention=True)``: megatron-core's
MLA local spec with ``PackedMLASelfAttention``) hands core attention q/k ``[tokens, heads,
qk_head_dim + qk_pos_emb_head_dim]`` and v ``[tokens, heads, v_head_dim]`` (3-D: MLA squeezes
the batch dim when packed params are given) and expects ``[tokens, 1, heads * v_head_dim]``.
Sliding windows: ``window_size=(L, 0)`` with Megatron's per-layer pattern
``window_attn_skip_freq`` (``layer_window``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_zeppelin.config import ModelSpec
from megatron_zeppelin.megatron.common import mtp
from megatron_zeppelin.megatron.common.sink import SinkMixin
from megatron_zeppelin.megatron.common.packing import (PackedGPTModel, PackedMLASelfAttention,
                                                ZeppelinPackedSeqParams)

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


def make_transformer_config(spec: ModelSpec, *, normalization: str = "RMSNorm",
                            params_dtype: torch.dtype = torch.float32,
                            calculate_per_token_loss: bool = True,
                            use_cpu_initialization: bool = False,
                            hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                            init_method_std: float = 0.02,
                            tensor_model_parallel_size: int = 1,
                            attention: Optional[dict] = None,
                            mtp: Optional[dict] = None,
                            pipeline_model_parallel_size: int = 1,
                            virtual_pipeline_model_parallel_size: Optional[int] = None
                            ) -> TransformerConfig:
    """``TransformerConfig`` for ``spec``: no biases, no fused kernels, Megatron CP 1.

    ``calculate_per_token_loss=True`` makes megatron's schedules divide gradients by the number of
    tokens of the whole global batch (see ``docs/megatron-cpu-notes.md``). ``attention``: extra
    config fields (``window_size``, ``window_attn_skip_freq``, and with
    ``multi_latent_attention`` the MLA fields, giving an ``MLATransformerConfig``); ``mtp``:
    multi-token prediction's (``mtp_num_layers``, ``mtp_loss_scaling_factor``).
    """
    attention = dict(attention or {})
    config_class = MLATransformerConfig if attention.get("multi_latent_attention") else \
        TransformerConfig
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} is invalid: expected one of "
                         f"{list(NORMALIZATIONS)}")
    if spec.num_experts is not None:
        raise ValueError(f"model.num_experts={spec.num_experts} is not supported by the GPT "
                         "builder yet: expected None (dense model)")
    return config_class(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn,
        add_bias_linear=False, gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu, normalization=normalization,
        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
        init_method_std=init_method_std, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        calculate_per_token_loss=calculate_per_token_loss,
        tensor_model_parallel_size=tensor_model_parallel_size, context_parallel_size=1,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_dtype=params_dtype if pipeline_model_parallel_size > 1 else None,
        variable_seq_lengths=pipeline_model_parallel_size > 1,
        # megatron-core refuses the (default) allgather MoE dispatcher with variable lengths;
        # this builder is dense (no experts: refused above), so the dispatcher is never built
        moe_token_dispatcher_type="alltoall" if pipeline_model_parallel_size > 1 else "allgather",
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False, **attention, **(mtp or {}))


def windowed_layers(window_size, window_attn_skip_freq, num_layers: int
                    ) -> tuple[Optional[int], Optional[int]]:
    """``(L, how many of num_layers attend it)`` for Megatron's ``window_size=(L, 0)`` and
    ``window_attn_skip_freq`` (megatron-core's own per-layer rule), or ``(None, None)``
    without a window: the planner's ``ModelSpec.window_size``/``window_layers``."""
    if window_size is None or window_size[0] < 0:
        return None, None
    count = sum(bool(is_layer_window_attention(window_size, window_attn_skip_freq, n))
                for n in range(1, num_layers + 1))
    return int(window_size[0]), count


def layer_window(config: TransformerConfig, layer_number: int) -> Optional[int]:
    """The sliding window ``L`` of layer ``layer_number`` (1-based; Megatron's
    ``window_size=(L, 0)`` and ``window_attn_skip_freq`` pattern), None for full causal
    attention. ValueError for windows zeppelin attention does not run (``right != 0``)."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
        return None
    left, right = config.window_size
    if right != 0 or left < -1:
        raise ValueError(f"window_size={config.window_size} is invalid for causal attention: "
                         "expected (L, 0) with L >= 0 (or -1: no window)")
    return None if left == -1 else left


def gpt_layer_spec(core_attention: type, *, normalization: str = "RMSNorm",
                   qk_layernorm: bool = False, multi_latent_attention: bool = False
                   ) -> ModuleSpec:
    """megatron-core's local GPT layer spec with ``core_attention`` as the core attention class
    (multi-latent: MLA's spec with ``PackedMLASelfAttention``)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} is invalid: expected one of "
                         f"{list(NORMALIZATIONS)}")
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm,
                                    multi_latent_attention=multi_latent_attention)
    if multi_latent_attention:
        spec.submodules.self_attention.module = PackedMLASelfAttention
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def build_gpt_model(spec: ModelSpec, config: TransformerConfig, *, max_sequence_length: int,
                    layer_spec: Optional[ModuleSpec] = None,
                    pg_collection: Optional[ProcessGroupCollection] = None,
                    share_embeddings_and_output_weights: bool = False,
                    rotary_base: int = 10000, mtp_use_te: bool = False,
                    pre_process: bool = True, post_process: bool = True,
                    vp_stage: Optional[int] = None) -> PackedGPTModel:
    """A ``PackedGPTModel`` with RoPE; ``layer_spec`` defaults to ``PackedCoreAttention``.
    With ``config.mtp_num_layers`` its MTP layers are megatron-core's around ``layer_spec``
    (``mtp_use_te``: Transformer Engine's norms and projection, as the layer spec's).
    pre_process / post_process / vp_stage: the pipeline stage's part (Megatron's meanings:
    embedding on the first stage, output layer and loss on the last, model chunk index)."""
    if layer_spec is None:
        layer_spec = gpt_layer_spec(PackedCoreAttention, normalization=config.normalization,
                                    multi_latent_attention=config.multi_latent_attention)
    return PackedGPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=spec.vocab_size,
        max_sequence_length=max_sequence_length, position_embedding_type="rope",
        rotary_base=rotary_base, parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        pg_collection=pg_collection, pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage,
        mtp_block_spec=mtp.mtp_block_spec(config, layer_spec, use_transformer_engine=mtp_use_te,
                                          vp_stage=vp_stage))


class PackedCoreAttention(SinkMixin, MegatronModule):
    """Exact causal attention of every packed piece on its own, with GQA (local reference).

    Same constructor and forward signature as megatron-core's ``DotProductAttention`` (and
    MLA's ``k_channels``/``v_channels``).
    query: ``[s, b, heads, head_dim]``; key/value: ``[s, b, kv_heads, head_dim]`` (this TP rank's
    heads; query head ``j`` uses kv head ``j // (heads // kv_heads)``, Megatron's grouping);
    value's head dim may differ (MLA), and packed MLA inputs come 3-D ``[s, heads, dim]``.
    The layer's sliding window (``layer_window``) masks keys more than ``L`` before a query;
    ``config.softmax_type`` off-by-one / learnable adds a sink logit per head (``sink.py``).
    With ``ZeppelinPackedSeqParams`` (b must be 1) each piece ``cu_seqlens[i]:cu_seqlens[i+1]``
    attends causally to itself only, which is exact per-document attention when every piece is a
    whole document; without packed params each batch column is one causal sequence.
    Returns ``[s, b, heads * head_dim]``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: "
                             "PackedCoreAttention runs with Megatron CP 1")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type={attn_mask_type}: PackedCoreAttention is causal only")
        self.layer_number = max(1, layer_number)
        self.window = layer_window(config, self.layer_number)
        self.attention_type = attention_type
        head_dim = config.kv_channels if k_channels is None else k_channels
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside the softmax: a no-op in exact arithmetic, so it is not applied.
        self.softmax_scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = (config.attention_dropout if attention_dropout is None
                          else attention_dropout)
        self._init_sink(config, pg_collection)  # where DotProductAttention makes it
        if self.softmax_offset is not None and self.dropout_p:
            raise ValueError(f"attention_dropout={self.dropout_p} with softmax_type="
                             f"{config.softmax_type!r}: PackedCoreAttention's sink path has no "
                             "dropout; pass --attention-dropout 0.0")

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        """q ``[s, b, heads, head_dim]`` over k/v; returns ``[s, b, heads * head_dim]``."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("PackedCoreAttention builds its causal masks from the packing: "
                             "attention_mask and attention_bias must be None")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"attn_mask_type={attn_mask_type}: PackedCoreAttention is causal only")
        if query.dim() == 3:  # packed MLA: [s, heads, dim]
            return self.forward(query[:, None], key[:, None], value[:, None], attention_mask,
                                attn_mask_type, attention_bias, packed_seq_params)
        _check_qkv(query, key, value)
        if packed_seq_params is None:
            columns = [self._attend(query[:, i:i + 1], key[:, i:i + 1], value[:, i:i + 1])
                       for i in range(query.shape[1])]
            return torch.cat(columns, dim=1)
        lengths = _piece_lengths(packed_seq_params, query)
        pieces = [self._attend(q, k, v) for q, k, v in zip(query.split(lengths),
                                                          key.split(lengths), value.split(lengths))]
        return torch.cat(pieces, dim=0)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One causal sequence: q ``[L, 1, heads, d]``, k/v ``[L, 1, kv_heads, d]``.

        Returns ``[L, 1, heads * d]``.
        """
        dropout_p = self.dropout_p if self.training else 0.0
        qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [1, heads, L, d]
        gqa = qt.shape[1] != kt.shape[1]
        mask = None
        if self.window is not None:  # keys i - L .. i (a boolean mask: True = attend)
            rows = torch.arange(q.shape[0], device=q.device)
            gap = rows[:, None] - rows[None, :]
            mask = (gap >= 0) & (gap <= self.window)
        sink = self.sink(q)
        if sink is not None:
            return _with_sink(qt, kt, vt, mask, self.softmax_scale, sink).permute(
                2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)
        causal = dict(is_causal=mask is None, attn_mask=mask, scale=self.softmax_scale,
                      enable_gqa=gqa)
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=dropout_p, **causal)
        else:
            out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=dropout_p, **causal)
        return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _with_sink(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
               sink: Tensor) -> Tensor:
    """Causal attention ``[1, heads, L, dv]`` of ``[1, heads or kv_heads, L, d]`` inputs with a
    sink logit per head (megatron-core's ``SoftmaxOne``: the scores with the sink appended,
    softmaxed, the sink's column dropped); ``mask``: True = attend (None: causal)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    length = q.shape[2]
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    column = sink.to(scores.dtype).reshape(1, -1, 1, 1).expand(1, -1, length, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :length]
    return torch.matmul(probs.to(v.dtype), v)


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> None:
    if query.dim() != 4 or key.shape[:3] != value.shape[:3] or key.dim() != 4 or \
            value.dim() != 4:
        raise ValueError(f"q/k/v shapes {tuple(query.shape)}/{tuple(key.shape)}/"
                         f"{tuple(value.shape)} are invalid: expected [s, b, heads, head_dim], "
                         "[s, b, kv_heads, head_dim] and [s, b, kv_heads, v_head_dim]")
    if query.shape[:2] != key.shape[:2] or query.shape[3] != key.shape[3]:
        raise ValueError(f"q shape {tuple(query.shape)} does not match k/v shape "
                         f"{tuple(key.shape)}")
    if query.shape[2] % key.shape[2] != 0:
        raise ValueError(f"{query.shape[2]} query heads are not a multiple of {key.shape[2]} "
                         "kv heads")


def _piece_lengths(params: PackedSeqParams, query: Tensor) -> list[int]:
    """Host-side piece lengths of a packed ``[tokens, 1, ...]`` buffer."""
    if params.qkv_format != "sbhd":
        raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: "
                         "PackedCoreAttention expects 'sbhd' packing with batch 1")
    if query.shape[1] != 1:
        raise ValueError(f"batch {query.shape[1]} is invalid for a packed buffer: expected 1")
    if isinstance(params, ZeppelinPackedSeqParams):
        lengths = params.piece_lengths
    else:
        lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
    if sum(lengths) != query.shape[0]:
        raise ValueError(f"packed pieces hold {sum(lengths)} tokens but q has {query.shape[0]}")
    return lengths
