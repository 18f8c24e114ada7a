"""Pipeline parallelism in our training loop: ``--pipeline-model-parallel-size P`` and
``--num-layers-per-virtual-pipeline-stage N`` (Megatron-LM's names and meanings).

Each pipeline stage holds ``layers / P`` layers (the first stage the embedding, the last the
output layer and the loss); with ``N`` each stage holds ``(layers / P) / N`` model chunks of
``N`` layers, placed round-robin over the stages, and Megatron's interleaved schedule runs them.
Megatron's schedules (``get_forward_backward_func``: 1F1B, interleaved) send activations
``[tokens, 1, hidden]`` whose token count differs per micro-batch (``variable_seq_lengths``).

The plan: every stage of a pipeline reads the same micro-batches (the corpus position is
global, ``corpus.MicroBatchSampler``) and plans them with the same deterministic planner on
the same cost model (the whole model's), so every stage runs micro-batch ``i`` with the same
plan without any message; a middle stage uses the micro-batch's plan, positions and packed
params (its tokens only feed the first stage's embedding). With chunks, each chunk's data
iterator is a view of one planned stream (``ChunkViews``): micro-batch ``i`` is planned once
and handed to every chunk.

Multi-token prediction (``--mtp-num-layers``): megatron-core builds the MTP layers on the last
stage (its last model chunk) with a copy of the word embedding, tied to the first stage's
through the embedding group (equal at start, gradients summed by ``finalize_model_grads``);
the MTP shift (``runtime/shift.py``) runs in the last stage's pools, which hold the same plan.
The logged MTP losses come from the last stage (``train_log.mtp_losses``).
"""
from __future__ import annotations

import argparse
from typing import Iterator

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.parallel import PoolLayout


def virtual_size(args: argparse.Namespace) -> int | None:
    """Model chunks per stage (Megatron's ``virtual_pipeline_model_parallel_size``), None
    without ``--num-layers-per-virtual-pipeline-stage`` (or with one chunk per stage)."""
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_chunk is None:
        return None
    chunks = args.num_layers // args.pipeline_model_parallel_size // per_chunk
    return chunks if chunks > 1 else None


def check(args: argparse.Namespace, layout: PoolLayout) -> None:
    """Refuse pipeline settings Megatron cannot run, naming the flag (before any process
    group exists)."""
    pp, layers = layout.pp, args.num_layers
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if layers % pp:
        raise ConfigError(f"--pipeline-model-parallel-size={pp} is invalid: expected a divisor "
                          f"of --num-layers {layers} (every stage holds as many layers)")
    if per_chunk is not None and pp == 1:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage={per_chunk} needs "
                          "--pipeline-model-parallel-size > 1 (virtual stages interleave "
                          "the stages of a pipeline)")
    if per_chunk is not None and (layers // pp) % per_chunk:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage={per_chunk} is invalid: "
                          f"expected a divisor of the {layers // pp} layers per stage "
                          f"(--num-layers {layers} / --pipeline-model-parallel-size {pp})")
    micro = layout.micro_batches(args.global_batch_size, args.micro_batch_size)
    if virtual_size(args) and micro % pp:
        raise ConfigError(f"--global-batch-size={args.global_batch_size} gives {micro} "
                          "micro-batches per iteration: the interleaved schedule "
                          "(--num-layers-per-virtual-pipeline-stage) needs a multiple of "
                          f"--pipeline-model-parallel-size {pp}")


def runtimes_in_flight(layout: PoolLayout, chunks: int) -> int:
    """Attention runtimes worth keeping for reuse (``ZeppelinAttentionState.keep_used``): the
    interleaved schedule runs a group of ``pp`` micro-batches on chunk c, then the same group
    on chunk c+1; 1F1B never returns to an earlier micro-batch's forward (0)."""
    return layout.pp if chunks > 1 else 0


class ChunkViews:
    """``chunks`` iterators over one stream: each yields the stream's items in order, each
    item drawn once (the first view to reach it draws it) and dropped when every view has
    passed it. Megatron's interleaved schedule runs chunk ``c`` on micro-batch ``i`` through
    ``data_iterator[c]``; all chunks must see the same micro-batch ``i``."""

    def __init__(self, stream: Iterator, chunks: int) -> None:
        self.stream, self.buffer, self.base = stream, [], 0
        self.taken = [0] * chunks

    def _next(self, chunk: int):
        index = self.taken[chunk]
        while index >= self.base + len(self.buffer):
            self.buffer.append(next(self.stream))
        item = self.buffer[index - self.base]
        self.taken[chunk] = index + 1
        done = min(self.taken) - self.base
        if done > 0:
            del self.buffer[:done]
            self.base += done
        return item

    def views(self) -> list[Iterator]:
        def view(chunk: int):
            while True:
                try:
                    item = self._next(chunk)
                except StopIteration:
                    return
                yield item
        return [view(c) for c in range(len(self.taken))]


def data_iterators(stream: Iterator, chunks: int) -> Iterator | list[Iterator]:
    """What Megatron's schedule takes as ``data_iterator``: the stream itself with one chunk
    per stage, else one view per chunk (``ChunkViews``)."""
    return stream if chunks == 1 else ChunkViews(stream, chunks).views()
