"""GPT layer specs for zeppelin mode: Megatron's own specs with ``core_attention`` swapped.

``swap_core_attention(spec, state)`` takes any spec Megatron's builders make (a layer
``ModuleSpec``, or a ``TransformerBlockSubmodules`` with one spec per layer: MoE, heterogeneous
and ``--spec`` models) and returns a copy in which every self-attention's core attention is
zeppelin's: ``ZeppelinCoreAttention`` where Megatron's local ``DotProductAttention`` was, the
``TEDotProductAttention`` subclass where TE's was. Everything else (norms, MLP or MoE, qk norms,
linear layers) stays what Megatron chose; a multi-latent ``MLASelfAttention`` becomes
``PackedMLASelfAttention`` (its RoPE part by in-document position, ``packing.py``). ``get_gpt_layer_zeppelin_spec(state)`` is the swap
applied to Megatron's TE or local GPT layer spec. The shared ``ZeppelinAttentionState`` reaches
every layer through ``ModuleSpec.params``.
"""
from __future__ import annotations

import copy
from typing import Any

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.megatron.common.compat import MTP_INNER_LAYER
from megatron_zeppelin.megatron.common.core_attention import (ZeppelinAttentionState,
                                                       ZeppelinCoreAttention,
                                                       te_core_attention_class)
from megatron_zeppelin.megatron.common.model import gpt_layer_spec
from megatron_zeppelin.megatron.common.packing import PackedMLASelfAttention


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _module_of(builder: Any) -> Any:
    return builder.module if isinstance(builder, ModuleSpec) else builder


def _zeppelin_core_attention(core: Any, state: ZeppelinAttentionState, where: str) -> ModuleSpec:
    """The zeppelin replacement of Megatron core attention class ``core``."""
    cls = _module_of(core)
    if isinstance(cls, type) and issubclass(cls, (DotProductAttention, ZeppelinCoreAttention)):
        zeppelin = ZeppelinCoreAttention
    elif getattr(cls, "__name__", "") in ("TEDotProductAttention",
                                           "ZeppelinTEDotProductAttention"):
        zeppelin = te_core_attention_class()
    else:
        raise ConfigError(f"{where}: core attention {getattr(cls, '__name__', cls)!r} has no "
                          "zeppelin replacement (expected Megatron's DotProductAttention or "
                          "TEDotProductAttention)")
    return ModuleSpec(module=zeppelin, params={"zeppelin_state": state})


def _swap_layer(layer: Any, state: ZeppelinAttentionState, where: str) -> Any:
    """One transformer layer spec with its self-attention's core attention swapped (a layer
    without attention, ``IdentityOp``, is kept as it is; a multi-token prediction layer's
    transformer layer is swapped)."""
    for field in MTP_INNER_LAYER:
        mtp_layer = getattr(getattr(layer, "submodules", None), field, None)
        if mtp_layer is not None:
            setattr(layer.submodules, field, _swap_layer(mtp_layer, state, f"{where} (MTP)"))
            return layer
    if hasattr(getattr(layer, "submodules", None), "eh_proj"):  # an MTP layer, inner unknown
        raise ConfigError(f"{where}: an MTP layer spec without a {' or '.join(MTP_INNER_LAYER)} "
                          "field (this megatron-core's MultiTokenPredictionLayerSubmodules): "
                          "zeppelin cannot swap the core attention of its transformer layer")
    attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
    cls = _module_of(attention)
    if cls is None or getattr(cls, "__name__", "") == "IdentityOp":
        return layer
    if not (isinstance(attention, ModuleSpec) and isinstance(cls, type)
            and issubclass(cls, (SelfAttention, MLASelfAttention))):
        raise ConfigError(f"{where}: self-attention {getattr(cls, '__name__', cls)!r} is not "
                          "Megatron's SelfAttention or MLASelfAttention; zeppelin mode swaps the "
                          "core attention of those layers only")
    if issubclass(cls, MLASelfAttention):
        attention.module = PackedMLASelfAttention
    attention.submodules.core_attention = _zeppelin_core_attention(
        attention.submodules.core_attention, state, where)
    return layer


def swap_core_attention(spec: Any, state: ZeppelinAttentionState,
                        where: str = "the layer spec") -> Any:
    """A copy of ``spec`` (layer ``ModuleSpec``, ``TransformerBlockSubmodules`` or the
    ``MultiTokenPredictionBlockSubmodules`` of MTP layers) whose self-attention layers run
    zeppelin core attention. ``where`` names the spec's origin in
    errors (e.g. ``--spec my.module``)."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None)
    if layers is None:
        return _swap_layer(spec, state, where)
    spec.layer_specs = [_swap_layer(layer, state, f"{where}, layer {i + 1}")
                        for i, layer in enumerate(layers)]
    return spec


def get_gpt_layer_zeppelin_spec(state: ZeppelinAttentionState, *, use_te: bool | None = None,
                                normalization: str = "RMSNorm", qk_layernorm: bool = False,
                                multi_latent_attention: bool = False) -> ModuleSpec:
    """A transformer layer spec whose core attention is zeppelin's (TE subclass when TE is used;
    ``multi_latent_attention``: Megatron's MLA spec).

    use_te: None picks TE when importable; True without TE raises ImportError naming the extra.
    """
    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        te_core_attention_class()  # ImportError naming the extra when TE is missing
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)

        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention)
    else:
        spec = gpt_layer_spec(DotProductAttention, normalization=normalization,
                              qk_layernorm=qk_layernorm,
                              multi_latent_attention=multi_latent_attention)
    return swap_core_attention(spec, state)
