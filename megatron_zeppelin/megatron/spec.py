"""GPT layer specs for zeppelin mode: Megatron's own specs with ``core_attention`` swapped.

``get_gpt_layer_zeppelin_spec(state)`` follows Megatron-Core's spec system
(``gpt_layer_specs.py``): with Transformer Engine importable (and ``use_te``), it is
``get_gpt_layer_with_transformer_engine_spec()`` with a ``TEDotProductAttention`` subclass as
core attention; otherwise the local spec with ``ZeppelinCoreAttention``. The shared
``ZeppelinAttentionState`` reaches every layer through ``ModuleSpec.params``.
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_zeppelin.megatron.core_attention import (ZeppelinAttentionState, ZeppelinCoreAttention,
                                                       te_core_attention_class)
from megatron_zeppelin.megatron.model import gpt_layer_spec


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def get_gpt_layer_zeppelin_spec(state: ZeppelinAttentionState, *, use_te: bool | None = None,
                                normalization: str = "RMSNorm",
                                qk_layernorm: bool = False) -> ModuleSpec:
    """A transformer layer spec whose core attention is zeppelin's (TE subclass when TE is used).

    use_te: None picks TE when importable; True without TE raises ImportError naming the extra.
    """
    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        core = te_core_attention_class()
    else:
        spec = gpt_layer_spec(ZeppelinCoreAttention, normalization=normalization,
                              qk_layernorm=qk_layernorm)
        core = ZeppelinCoreAttention
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(module=core, params={"zeppelin_state": state})
    return spec
