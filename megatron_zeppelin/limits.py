"""The longest document a cluster can train on at all, and the check that refuses longer ones.

A document's tokens must sit in GPU memory together (attention over the whole document needs
every one of them in the same step). The least memory per token Megatron can spend is with
full activation recomputation: each layer keeps only its input, ``hidden_size`` elements per
token (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", s.4: 2sbh bytes per layer in 16-bit). So no pool of the cluster can hold more than

    world_size x gpu_memory / (num_layers x hidden_size x bytes_per_element)

tokens of one document; weights, optimizer state and the attention working set only lower the
real limit. This is a necessary condition, never a false refusal. Standard library only.
"""
from __future__ import annotations

from typing import Sequence

from megatron_zeppelin.config import ClusterSpec, ConfigError, ModelSpec


def longest_trainable_document(model: ModelSpec, cluster: ClusterSpec) -> int:
    per_token = model.num_layers * model.hidden_size * model.bytes_per_element
    return int(cluster.world_size * cluster.gpu_memory_gib * 2**30 // per_token)


def refuse_untrainable(lengths: Sequence[int], model: ModelSpec, cluster: ClusterSpec,
                       where: str) -> None:
    """ConfigError naming the first document of ``where`` longer than any pool can hold."""
    bound = longest_trainable_document(model, cluster)
    if max(lengths) <= bound:  # the common case in one pass (it runs on every planned batch)
        return
    for index, length in enumerate(lengths):
        if length > bound:
            raise ConfigError(
                f"{where}: document {index} has {length:,} tokens; {cluster.nodes} x "
                f"{cluster.name} ({cluster.world_size} GPUs x {cluster.gpu_memory_gib:g} GiB) "
                f"holds at most {bound:,} tokens of one document of {model.name} "
                f"({model.num_layers} layers x hidden {model.hidden_size} x "
                f"{model.bytes_per_element} bytes per token, even with full recomputation)")
