"""Glue for Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1), called by ``patches/``.

The patch adds four calls to Megatron-LM and nothing else:

* ``extra_args_provider(other)``: ``--context-parallel-mode {static,zeppelin}`` and the
  ``--zeppelin-*`` options join Megatron-LM's parser;
* ``adjust_megatron_args(args)`` (first thing in ``validate_args``): in zeppelin mode the
  ``--context-parallel-size`` ranks become the zeppelin pool and Megatron's own CP runs at 1,
  so Megatron's data-parallel group is DP x CP and its DDP reduces over all of it;
* ``select_builder(gpt_builder)``: in zeppelin mode the model is a ``PackedGPTModel`` whose
  layer spec swaps ``core_attention`` for zeppelin's (a ``TEDotProductAttention`` subclass with
  ``--transformer-impl transformer_engine``);
* ``get_batch(data_iterator)``: Megatron's fixed-length samples of the pool's ranks are
  all-gathered, split at EOD into documents, planned, and each rank gets its linear layout.

Static mode leaves Megatron-LM untouched (TE / Megatron CP). Megatron-LM keeps its state in
globals (``get_args``); this glue does the same for the one object it builds, in ``_STATE``.
"""
from __future__ import annotations

import argparse
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.config import ConfigError, ModelSpec
from megatron_zeppelin.megatron import args as cli, train
from megatron_zeppelin.megatron.groups import new_pool_groups
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.megatron.data import ZeppelinDataIterator

_STATE: dict = {}  # Megatron-LM runs one model per process: its pool, attention state, data


def extra_args_provider(other: Callable | None = None) -> Callable:
    """Megatron-LM's ``extra_args_provider``: zeppelin's flags, then ``other``'s."""
    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        cli.add_zeppelin_args(parser, with_mode=True)
        return other(parser) if other is not None else parser

    return provide


def adjust_megatron_args(args: argparse.Namespace) -> None:
    """Zeppelin mode: the CP ranks form the pool; Megatron's own CP runs at 1."""
    if getattr(args, "context_parallel_mode", "static") != "zeppelin":
        return
    if args.pipeline_model_parallel_size != 1:
        raise ConfigError(f"--pipeline-model-parallel-size={args.pipeline_model_parallel_size}:"
                          " zeppelin mode runs without pipeline parallelism (expected 1)")
    if not args.calculate_per_token_loss:
        raise ConfigError("--context-parallel-mode zeppelin needs --calculate-per-token-loss: "
                          "ranks hold different token counts, so the loss must be normalised "
                          "over the tokens of the whole global batch")
    if getattr(args, "hybrid_context_parallel", False):
        raise ConfigError("--hybrid-context-parallel and --context-parallel-mode zeppelin "
                          "are alternatives: pick one")
    layout = PoolLayout.resolve(args.world_size, args.tensor_model_parallel_size,
                                args.context_parallel_size, args.zeppelin_gpus_per_node,
                                env.local_world_size())
    args.zeppelin_layout = layout
    args.context_parallel_size = 1
    args.zeppelin_gpus_per_node = layout.gpus_per_node
    args.device, args.bf16 = "cuda", getattr(args, "bf16", False)


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(name="megatron-lm", num_layers=args.num_layers,
                     hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                     num_query_groups=args.num_query_groups if args.group_query_attention
                     else None, ffn_hidden_size=args.ffn_hidden_size,
                     kv_channels=args.kv_channels, vocab_size=args.padded_vocab_size,
                     swiglu=args.swiglu)


def _state(args: argparse.Namespace) -> dict:
    """Pool groups, cost model and attention state, built once after Megatron's init."""
    if not _STATE:
        layout = args.zeppelin_layout
        pool = new_pool_groups(layout)
        cost = train.make_cost_model(args, _model_spec(args), layout)
        _STATE.update(pool=pool, cost=cost, attention=train.build_state(args, pool, cost),
                      planner=train.make_planner(args, cost, layout), iterators={})
    return _STATE


def select_builder(default_builder: Callable) -> Callable:
    """The model builder for Megatron-LM's ``model_provider``: zeppelin's in zeppelin mode."""
    def build(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        if getattr(args, "context_parallel_mode", "static") != "zeppelin":
            return default_builder(args, pre_process, post_process, vp_stage, config=config,
                                   pg_collection=pg_collection)
        return zeppelin_gpt_builder(args, config, pg_collection)

    return build


def zeppelin_gpt_builder(args, config=None, pg_collection=None):
    """A ``PackedGPTModel`` (RoPE by in-document position) with zeppelin core attention."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_zeppelin.megatron.packing import PackedGPTModel
    from megatron_zeppelin.megatron.spec import get_gpt_layer_zeppelin_spec

    if args.position_embedding_type not in ("rope", "yarn"):
        raise ConfigError(f"--position-embedding-type {args.position_embedding_type}: zeppelin "
                          "mode needs rope (positions restart in every document)")
    config = config or core_transformer_config_from_args(args)
    spec = get_gpt_layer_zeppelin_spec(_state(args)["attention"],
                                       use_te=args.transformer_impl == "transformer_engine",
                                       normalization=args.normalization,
                                       qk_layernorm=args.qk_layernorm)
    return PackedGPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        pg_collection=pg_collection)


def documents_of_samples(text: torch.Tensor, eod: int) -> list[torch.Tensor]:
    """Samples ``[n, seq + 1]`` -> documents: each sample split after every EOD token."""
    docs = []
    for sample in text:
        ends = (sample == eod).nonzero().flatten().tolist()
        start = 0
        for end in [e + 1 for e in ends] + [sample.numel()]:
            if end > start:
                docs.append(sample[start:end])
                start = end
    return docs


def _pool_documents(data_iterator, pool, eod: int) -> Iterator[list[torch.Tensor]]:
    """The pool's micro-batch: every rank's Megatron samples, all-gathered, as documents."""
    from megatron.training.utils import get_batch_on_this_tp_rank

    while True:
        batch = get_batch_on_this_tp_rank(data_iterator)
        text = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1).contiguous()
        parts = [torch.empty_like(text) for _ in range(pool.size)]
        dist.all_gather(parts, text, group=pool.group)
        yield documents_of_samples(torch.cat(parts).cpu(), eod)


def get_batch(data_iterator, vp_stage=None):
    """Megatron-LM's ``get_batch`` in zeppelin mode: (tokens, labels, loss_mask,
    attention_mask=None, position_ids, packed_seq_params) of this rank's linear layout."""
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    state = _state(args)
    key = id(data_iterator)
    if key not in state["iterators"]:
        docs = _pool_documents(data_iterator, state["pool"], get_tokenizer().eod)
        state["iterators"][key] = ZeppelinDataIterator(docs, state["planner"],
                                                       state["pool"].rank, device="cuda")
    batch = next(state["iterators"][key])
    return (batch.tokens, batch.labels, batch.loss_mask, None, batch.position_ids,
            batch.packed_seq_params)


__all__ = ["extra_args_provider", "adjust_megatron_args", "select_builder", "get_batch",
           "documents_of_samples"]
