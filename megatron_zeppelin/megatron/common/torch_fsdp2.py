"""Torch FSDP2 (``--use-torch-fsdp2``) through megatron-core 0.16.1's
``TorchFullyShardedDataParallel``, with Megatron's per-token loss normalisation.

megatron-core wraps every ``TransformerLayer``, the embedding and RoPE with torch's
``fully_shard`` over the DP x CP group (the rest, the output layer included, with the root):
each parameter is a ``DTensor`` sharded on dim 0, all-gathered per layer for forward and backward, and its
gradient is reduce-scattered into the sharded ``.grad`` that the plain optimizer (torch Adam on
the shards) steps. 0.16.1's ``no_sync`` is empty, so every micro-batch's backward would
reduce-scatter; ``PerTokenTorchFSDP.no_sync`` turns FSDP2's gradient sync off
(``set_requires_gradient_sync(False)``) for the micro-batches that Megatron's schedules run
inside it (all but a step's last): their unsharded gradients accumulate locally and the last
backward reduce-scatters the sum once per step, as Megatron DDP reduces once per step.

What 0.16.1 gets wrong with ``calculate_per_token_loss`` (our loss, as Megatron-LM's
``--calculate-per-token-loss``): FSDP2 divides each reduce-scatter by the group size, and
``finalize_model_grads`` then calls ``scale_gradients(1 / tokens)``, which
``_BaseDataParallel`` leaves empty. Gradients would be the sum over the group's ranks divided
by the rank count instead of by the global batch's tokens. ``PerTokenTorchFSDP`` sums in
the reduce-scatter (divide factor 1 and SUM reductions, as Megatron DDP under per-token loss)
and scales the sharded gradients by ``scale_gradients``' factor, so its gradients are Megatron
DDP's. It also takes the ``force_all_reduce`` that 0.16.1's ``finalize_model_grads`` passes
and its base class's ``finish_grad_sync`` does not.

Under ``--bf16`` 0.16.1 gives ``fully_shard`` no mixed-precision policy: the bf16 model's
gradients would accumulate over the micro-batches and be reduce-scattered in bf16, where
Megatron DDP under ``--bf16`` does both in fp32 (Megatron-LM's
``--accumulate-allreduce-grads-in-fp32``). ``PerTokenTorchFSDP`` trains Megatron-LM's bf16
model instead: the shards are fp32 (the bf16 weights upcast: the fp32 main weights megatron-core's
bf16 optimizer would copy from them), all-gathered in bf16 for forward and backward
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), so each layer computes with
the bf16 rounding of the main weights; the micro-batches' bf16 gradients accumulate in fp32
(FSDP2 upcasts them while the sync is off) and are reduce-scattered in fp32 into fp32 sharded
gradients that the optimizer steps. No bf16 copy of the weights is kept between steps.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch


def torch_fsdp2(config: Any, module: torch.nn.Module, device: str) -> Any:
    """``module`` wrapped by megatron-core's FSDP2 over DP x CP (collective: every rank of
    the group builds it). ``device``: "cpu" runs it on gloo (``cpu_fsdp.py``'s bridge)."""
    from megatron.core.distributed import TorchFullyShardedDataParallelConfig

    if device == "cpu":
        from megatron_zeppelin.megatron.common.cpu_fsdp import enable_torch_fsdp2_on_cpu

        enable_torch_fsdp2_on_cpu()
    return per_token_torch_fsdp2()(config, TorchFullyShardedDataParallelConfig(), module)


@functools.cache  # built once, on first use (megatron-core is imported then)
def per_token_torch_fsdp2() -> type:
    """megatron-core's ``TorchFullyShardedDataParallel`` mended for per-token loss (module
    doc), with its constructor's signature (Megatron-LM's ``get_model`` builds it as its own).
    It wraps every ``TransformerLayer``, the embedding and RoPE; the rest, the output layer
    included, with the root (megatron-core's default set less ``ColumnParallelLinear``, as
    it does for local layers: our layers' linear layers are megatron-core's own, and
    wrapping them again inside a wrapped ``TransformerLayer`` fails)."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel)
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class PerTokenTorchFSDP(TorchFullyShardedDataParallel):
        """megatron-core's FSDP2 wrapper whose ``scale_gradients`` scales (module doc)."""

        def __init__(self, config, ddp_config, module, sub_modules_to_wrap=None, **kwargs):
            units = sub_modules_to_wrap or {TransformerLayer, LanguageModelEmbedding,
                                            RotaryEmbedding}
            with bf16_compute_fp32_shards(config.bf16, module):
                super().__init__(config, ddp_config, module, sub_modules_to_wrap=units,
                                 **kwargs)
            if config.calculate_per_token_loss:
                for unit in fsdp_units(self.module):
                    unit.set_gradient_divide_factor(1.0)
                    # a plain SUM (a factor of 1 is otherwise a PREMUL_SUM, which gloo lacks)
                    unit.set_force_sum_reduction_for_comms(True)

        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            """Nothing left to reduce: FSDP2 waited for its reduce-scatters at the end of the
            backward. (0.16.1's ``_BaseDataParallel.finish_grad_sync`` takes no
            ``force_all_reduce``, which its own ``finalize_model_grads`` passes.) Under
            ``--bf16`` each fp32 shard's gradient is also its ``main_grad``, where
            megatron-core's bf16 optimizer reads the gradients of fp32 parameters."""
            if self.config.bf16:
                for param in self.module.parameters():
                    param.main_grad = param.grad

        def no_sync(self) -> contextlib.AbstractContextManager[None]:
            return gradient_sync_off(self.module)

        def scale_gradients(self, scaling_factor: float) -> None:
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.mul_(scaling_factor)

    return PerTokenTorchFSDP


@contextlib.contextmanager
def bf16_compute_fp32_shards(bf16: bool, module: torch.nn.Module) -> Iterator[None]:
    """With ``bf16``: ``module``'s parameters upcast to fp32 and every ``fully_shard`` call
    of megatron-core's wrapper made inside given the bf16-compute, fp32-reduce policy
    (module doc). Nothing changes without it."""
    if not bf16:
        yield
        return
    from megatron.core.distributed import torch_fully_sharded_data_parallel as wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy

    module.float()
    # cast_forward_inputs off: as Megatron's Float16Module, which casts no keyword input,
    # float inputs stay as given (the loss mask MTP counts tokens with, RoPE's frequencies)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    shard = wrapper.fully_shard
    wrapper.fully_shard = functools.partial(shard, mp_policy=policy)
    try:
        yield
    finally:
        wrapper.fully_shard = shard


@contextlib.contextmanager
def gradient_sync_off(module: torch.nn.Module) -> Iterator[None]:
    """Gradients of the backwards run inside accumulate unsharded on this rank and are
    reduce-scattered, summed, by the first backward after (module doc)."""
    units = fsdp_units(module)
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def fsdp_units(module: torch.nn.Module) -> list[Any]:
    """The modules of ``module`` (itself included) that ``fully_shard`` wrapped."""
    from torch.distributed.fsdp import FSDPModule

    return [sub_module for sub_module in module.modules() if isinstance(sub_module, FSDPModule)]


def is_torch_fsdp2(chunk: Any) -> bool:
    """Whether a model chunk is wrapped by megatron-core's torch FSDP2."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel)

    return isinstance(chunk, TorchFullyShardedDataParallel)
