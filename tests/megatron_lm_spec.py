"""A ``--spec`` for the Megatron-LM CPU tests: Megatron's local GPT layers with an RMSNorm that
accepts sequence parallelism (test scaffolding).

Megatron's local layers use ``WrappedTorchNorm``, which refuses ``--sequence-parallel``
(Megatron-LM needs Transformer Engine or apex norms for it, neither runs on CPU). This norm is
``torch.nn.RMSNorm`` with its parameters marked ``sequence_parallel``, so that
``finalize_model_grads`` all-reduces their gradients over TP as for TE's norms. Used as
``--spec megatron_lm_spec SPEC`` (two layers), which also exercises zeppelin's ``--spec`` path.
"""
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def _layer():
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


SPEC = TransformerBlockSubmodules(layer_specs=[_layer(), _layer()],
                                  layer_norm=SequenceParallelRMSNorm)
