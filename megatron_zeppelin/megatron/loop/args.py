"""Command line and YAML of ``scripts/pretrain_gpt.py``: one typed tree, Megatron-LM's names.

``TrainConfig`` is a tree of sections (frozen dataclasses: model, parallel, optim, training,
data, checkpoint, logging, zeppelin planner options, zeppelin runtime). Every field is declared
once with ``options.setting``; the argparse flags, the YAML keys of ``--yaml-cfg`` and the
validation messages are generated from it (``options.py``). Megatron's flags keep Megatron's
names (``--num-layers``); the planner options are ``ZeppelinConfig``'s fields as
``--zeppelin-<field>`` (the same fields ``zeppelin plan`` takes as ``--<field>``), and
Megatron-LM's own parser gets the zeppelin flags from ``add_zeppelin_args`` through the patch.

``--yaml-cfg FILE`` supplies values for any flag (keys are flag names with ``_`` or ``-``;
unknown keys and values of the wrong type are refused naming the file); flags given on the
command line win. ``validate_args`` builds the tree and the ``PoolLayout`` before any process
group or model exists, refusing bad settings with the flag, the value and what is allowed.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

from megatron_zeppelin.config import ConfigError, ZeppelinConfig, ffn_width
from megatron_zeppelin.config_yaml import load_yaml, read_text
from megatron_zeppelin.options import Parser, add_flags, from_flags, yaml_defaults
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.plan import Topology
from megatron_zeppelin.planner.registry import (add_option_flags, given_options, option_dests,
                                                refuse_unread_settings, strategies_from_flags,
                                                strategy_class)

from megatron_zeppelin.megatron.common import compat, fsdp_limits
from megatron_zeppelin.megatron.loop import pipeline
from megatron_zeppelin.megatron.loop.sections import (
    MODES, ZEPPELIN_PREFIX, AttentionArgs, CheckpointArgs, DataArgs, LoggingArgs, ModelArgs,
    OptimArgs, ParallelArgs, TrainingArgs, ZeppelinRuntimeArgs, schedule, skip_freq)

__all__ = ["MODES", "ZEPPELIN_PREFIX", "AttentionArgs", "ZeppelinRuntimeArgs", "schedule", "TrainConfig",
           "zeppelin_config", "add_megatron_args", "add_zeppelin_args", "planner_strategy",
           "build_parser", "apply_yaml", "parse_args", "resolve_data_source", "validate_args"]


MEGATRON_SECTIONS = {"model": ModelArgs, "attention": AttentionArgs, "parallel": ParallelArgs, "optim": OptimArgs,
                     "training": TrainingArgs, "data": DataArgs, "checkpoint": CheckpointArgs,
                     "logging": LoggingArgs}  # flags with Megatron-LM's names


@dataclass(frozen=True)
class TrainConfig:
    """The whole tree, built from parsed flags (``from_args``): every section validated."""

    model: ModelArgs
    attention: AttentionArgs
    parallel: ParallelArgs
    optim: OptimArgs
    training: TrainingArgs
    data: DataArgs
    checkpoint: CheckpointArgs
    logging: LoggingArgs
    zeppelin: ZeppelinConfig
    runtime: ZeppelinRuntimeArgs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        sections = {name: from_flags(section, args)
                    for name, section in MEGATRON_SECTIONS.items()}
        return cls(**sections, zeppelin=zeppelin_config(args),
                   runtime=from_flags(ZeppelinRuntimeArgs, args, ZEPPELIN_PREFIX))


# The planner's setting names in its messages, and the training flag that sets each
# (``options.name_flags``).
PLANNER_FLAGS = {"max_seqlen": "--seq-length",
                 "capacity_tokens_per_gpu": "--zeppelin-capacity-tokens-per-gpu",
                 "capacity_factor": "--zeppelin-capacity-factor",
                 "the overlong policy": "--zeppelin-overlong"}


def zeppelin_config(args: argparse.Namespace) -> ZeppelinConfig:
    """The planner options of a training run (ours or Megatron-LM's): ``--zeppelin-*`` flags,
    documents up to ``--seq-length``."""
    return from_flags(ZeppelinConfig, args, ZEPPELIN_PREFIX, max_seqlen=args.seq_length)


def add_megatron_args(p: argparse.ArgumentParser) -> None:
    """The Megatron-LM flags the script understands (same names and meanings)."""
    g = p.add_argument_group("megatron")
    for section in MEGATRON_SECTIONS.values():
        add_flags(g, section)
    g.add_argument("--yaml-cfg", default=None, help="YAML file with values for these flags")


def add_zeppelin_args(p: argparse.ArgumentParser, with_mode: bool = False) -> None:
    """``--zeppelin-*``: the planner options and the zeppelin runtime options; ``with_mode``
    also ``--context-parallel-mode`` (for Megatron-LM's parser, through the patch)."""
    g = p.add_argument_group("zeppelin")
    if with_mode:
        add_flags(g, ParallelArgs, only=("context_parallel_mode",))
    add_flags(g, ZeppelinConfig, ZEPPELIN_PREFIX, skip=("max_seqlen",))
    add_flags(g, ZeppelinRuntimeArgs, ZEPPELIN_PREFIX)
    add_option_flags(p.add_argument_group("zeppelin strategy options (each applies to the "
                                          "--zeppelin-strategy values that take it)"),
                     ZEPPELIN_PREFIX)


def planner_strategy(args: argparse.Namespace, pool_size: int, pool: Topology | None = None
                     ) -> tuple[str, dict]:
    """(strategy name, options) that plans each micro-batch of a pool of ``pool_size`` ranks
    (``pool``: options it cannot run are refused): static mode is static CP
    over the whole pool; zeppelin mode is ``--zeppelin-strategy`` with its option flags (an
    option it does not take is refused, naming it)."""
    if args.context_parallel_mode == "static":
        given = [flag for dest, flag in option_dests(ZEPPELIN_PREFIX).items()
                 if getattr(args, dest, None) is not None]
        if getattr(args, "zeppelin_strategy", "zeppelin") != "zeppelin":
            given.insert(0, f"--zeppelin-strategy {args.zeppelin_strategy}")
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --context-parallel-mode zeppelin "
                              "(static mode is static CP over the whole CP group): drop it or "
                              "pass --context-parallel-mode zeppelin")
        _refuse_unread(args, "static-cp", "--context-parallel-mode static (static CP)")
        return "static-cp", {"cp_size": pool_size}
    strategy, = strategies_from_flags([args.zeppelin_strategy], args, ZEPPELIN_PREFIX,
                                      "--zeppelin-strategy", pool)
    _refuse_unread(args, strategy.name, f"--zeppelin-strategy {strategy.name}")
    if strategy.attention == "ulysses":
        _refuse_for_ulysses(args, strategy.name)
    return strategy.name, given_options(strategy)


BYTE_VOCAB = 256  # the built-in corpus's tokens are bytes


def vocab_size(args: argparse.Namespace) -> int:
    """``--vocab-size``, else the built-in byte corpus's ``BYTE_VOCAB``."""
    return args.vocab_size or BYTE_VOCAB


def check_tensor_parallel(args: argparse.Namespace, tp: int) -> None:
    """What megatron-core's tensor-parallel layers split over TP: the heads, the key/value
    groups (MLA: one per head), the FFN width and the vocabulary (not padded here)."""
    mla = getattr(args, "multi_latent_attention", False)
    split = (("--num-attention-heads", args.num_attention_heads),
             ("--num-query-groups", None if mla else args.num_query_groups),
             ("--ffn-hidden-size", ffn_width(args.hidden_size, args.ffn_hidden_size)),
             ("--vocab-size", vocab_size(args)))
    for flag, value in split:
        if value is not None and value % tp:
            raise ConfigError(f"--tensor-model-parallel-size={tp} is invalid: expected a divisor "
                              f"of {flag} {value} (megatron-core splits it over the TP ranks)")


def _refuse_for_ulysses(args: argparse.Namespace, strategy: str) -> None:
    """Refuse what Ulysses attention (``runtime/ulysses.py``, FlexSP's) does not run: it is
    full causal attention with one head dim and the vanilla softmax."""
    window, softmax = getattr(args, "window_size", None), getattr(args, "softmax_type", "vanilla")
    mla = getattr(args, "multi_latent_attention", False)
    qk_dim = args.qk_head_dim + args.qk_pos_emb_head_dim if mla else None
    given = [flag for flag, on in (
        (f"--window-size {window}", window is not None),
        (f"--softmax-type {softmax}", softmax != "vanilla"),
        (f"--multi-latent-attention with --v-head-dim {getattr(args, 'v_head_dim', None)} "
         f"(q/k {qk_dim})", mla and args.v_head_dim != qk_dim)) if on]
    if given:
        raise ConfigError(f"--zeppelin-strategy {strategy} with {given[0]}: its Ulysses "
                          "attention runs full causal attention with one head dim and the "
                          "vanilla softmax; use a ring strategy (e.g. --zeppelin-strategy "
                          "zeppelin)")


def _refuse_unread(args: argparse.Namespace, strategy: str, asked: str) -> None:
    """Refuse a ``--zeppelin-*`` planner setting ``strategy`` does not read (``registry``'s
    ``refuse_unread_settings``)."""
    config = from_flags(ZeppelinConfig, args, ZEPPELIN_PREFIX, max_seqlen=None)
    refuse_unread_settings(config, [strategy_class(strategy)], asked, ZEPPELIN_PREFIX)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pretrain_gpt.py", allow_abbrev=False,  # as Megatron-LM's parser
               description="GPT pretraining on megatron-core with zeppelin CP",
               refuse_repeats=False)  # Megatron-LM's last-one-wins (``Parser``)
    add_megatron_args(p)
    add_zeppelin_args(p)
    return p


def apply_yaml(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the YAML file's values the parser's defaults (command-line flags still win)."""
    data = load_yaml(read_text(path, "--yaml-cfg"), f"--yaml-cfg {path!r}")
    if data is None:
        raise ConfigError(f"--yaml-cfg {path!r} is empty: expected a mapping of flag names to "
                          "values")
    parser.set_defaults(**yaml_defaults(parser, data, path, ignore=("yaml_cfg",)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    tokens = sys.argv[1:] if argv is None else list(argv)
    given = [t for t in tokens if t == "--yaml-cfg" or t.startswith("--yaml-cfg=")]
    if len(given) > 1:
        raise ConfigError(f"--yaml-cfg is given {len(given)} times: pass one file (its "
                          "values can be overridden by flags)")
    first, _ = parser.parse_known_args(argv)
    if first.yaml_cfg is not None and not first.yaml_cfg.strip():
        raise ConfigError("--yaml-cfg='' is invalid: expected a YAML file")
    if first.yaml_cfg:
        apply_yaml(parser, first.yaml_cfg)
    args = parser.parse_args(argv)
    resolve_data_source(args, sys.argv[1:] if argv is None else list(argv))
    return args


def resolve_data_source(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """``--mock-data`` and ``--data-path`` are one choice (the corpus): the one given on the
    command line replaces the other from ``--yaml-cfg`` (so ``--data-path`` works with the
    README's YAML, which sets ``mock_data: true``); both on the command line is an error.
    ``args.data_note`` says what was replaced (printed in the startup banner)."""
    given = {flag for flag in ("--mock-data", "--data-path")
             for token in argv if token == flag or token.startswith(flag + "=")}
    args.data_note = None
    if given == {"--mock-data", "--data-path"}:
        raise ConfigError("--mock-data and --data-path are both given: pass one (the built-in "
                          "corpus, or a Megatron indexed dataset)")
    if given == {"--data-path"} and args.mock_data:
        args.mock_data = False
        args.data_note = f"--data-path replaces mock_data: true of {args.yaml_cfg}"
    elif given == {"--mock-data"} and args.data_path:
        args.data_note = f"--mock-data replaces data_path: {args.data_path} of {args.yaml_cfg}"
        args.data_path = None


def check_fsdp(args: argparse.Namespace) -> None:
    """``--use-megatron-fsdp`` and ``--data-parallel-sharding-strategy``: what runs with them."""
    strategy = args.data_parallel_sharding_strategy
    if strategy != "no_shard" and not args.use_megatron_fsdp:
        raise ConfigError(f"--data-parallel-sharding-strategy={strategy} without "
                          "--use-megatron-fsdp: it says what Megatron-FSDP shards; add "
                          "--use-megatron-fsdp (or --use-distributed-optimizer for ZeRO-1 "
                          "under Megatron DDP)")
    if args.use_torch_fsdp2:
        check_torch_fsdp2(args)
    if not args.use_megatron_fsdp:
        return
    if strategy == "no_shard" and not compat.since(fsdp_limits.NO_SHARD_EXACT):
        raise ConfigError(f"--use-megatron-fsdp with --data-parallel-sharding-strategy="
                          f"{strategy} (Megatron-LM's default) with megatron-core "
                          f"{compat.megatron_core_version_text()}: {fsdp_limits.NO_SHARD}; "
                          f"{fsdp_limits.NO_SHARD_FIXED}; pass optim_grads or "
                          "optim_grads_params (full FSDP)")
    if strategy == "optim" and args.overlap_grad_reduce and \
            not compat.since(fsdp_limits.OPTIM_OVERLAP_EXACT):
        raise ConfigError("--use-megatron-fsdp --data-parallel-sharding-strategy=optim with "
                          f"--overlap-grad-reduce (the default): {fsdp_limits.OPTIM_OVERLAP}; "
                          f"{fsdp_limits.OPTIM_OVERLAP_FIXED}; "
                          "add --no-overlap-grad-reduce (Megatron-LM's default: one exact "
                          "in-place reduce-scatter after the backward) or pass optim_grads / "
                          "optim_grads_params")
    if args.tensor_model_parallel_size > 1 and not te_layers(args) and \
            not compat.since(fsdp_limits.TP_WITHOUT_TE_EXACT):
        raise ConfigError(f"--use-megatron-fsdp with --tensor-model-parallel-size="
                          f"{args.tensor_model_parallel_size} needs Transformer Engine's layers "
                          f"(--device cuda with transformer_engine installed) with megatron-core "
                          f"{compat.megatron_core_version_text()}: {fsdp_limits.TP_WITHOUT_TE}; "
                          f"{fsdp_limits.TP_WITHOUT_TE_FIXED}; use --use-distributed-optimizer "
                          "with TP here")


def te_layers(args: argparse.Namespace) -> bool:
    """Whether the model is built from Transformer Engine's layers (as ``train.build_chunks``
    decides: on CUDA where TE imports)."""
    from megatron_zeppelin.megatron.common.spec import transformer_engine_available

    return args.device == "cuda" and transformer_engine_available()


def check_torch_fsdp2(args: argparse.Namespace) -> None:
    """``--use-torch-fsdp2``: refused where Megatron-LM refuses it, and with Megatron-FSDP."""
    others = [flag for flag, on in (
        ("--use-megatron-fsdp", args.use_megatron_fsdp),
        ("--use-distributed-optimizer", args.use_distributed_optimizer),
        (f"--pipeline-model-parallel-size={args.pipeline_model_parallel_size}",
         args.pipeline_model_parallel_size > 1)) if on]
    if others:
        raise ConfigError(f"--use-torch-fsdp2 with {others[0]}: torch FSDP2 shards parameters, "
                          "gradients and Adam state itself, without pipeline stages (as in "
                          "Megatron-LM); drop one of the two")


def check_attention(args: argparse.Namespace) -> None:
    """The attention flags that depend on the model's size: the window pattern per layer,
    MLA's one KV head per query head, and an even RoPE head dim."""
    skip_freq(args.window_attn_skip_freq, args.num_layers, "--window-attn-skip-freq")
    if args.window_attn_skip_freq is not None and args.window_size is None:
        raise ConfigError(f"--window-attn-skip-freq={args.window_attn_skip_freq} without "
                          "--window-size: pass the window ('L,0') it applies")
    heads, groups = args.num_attention_heads, args.num_query_groups
    if args.multi_latent_attention and groups not in (None, heads):
        raise ConfigError(f"--num-query-groups={groups} (flag or --yaml-cfg key) is invalid with "
                          f"--multi-latent-attention: expected unset or --num-attention-heads "
                          f"{heads} (MLA has a key/value head per query head)")
    if not args.multi_latent_attention and (args.hidden_size // heads) % 2:
        raise ConfigError(f"--hidden-size={args.hidden_size} is invalid with "
                          f"--num-attention-heads {heads}: expected an even head dim (hidden / "
                          f"heads = {args.hidden_size // heads}; RoPE rotates pairs of dims)")


def validate_args(args: argparse.Namespace, world_size: int, local_world_size: int | None
                  ) -> PoolLayout:
    """Refuse bad settings with the flag, the value and what is allowed (before training);
    returns the pool layout (``args.zeppelin_gpus_per_node`` is set to its node size)."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "global_batch_size", "train_iters"):
        if getattr(args, flag) is None:
            where = f"; --yaml-cfg {args.yaml_cfg!r} leaves it unset or null" \
                if args.yaml_cfg else ""
            raise ConfigError(f"--{flag.replace('_', '-')} is required (flag or --yaml-cfg "
                              f"key{where})")
    config = TrainConfig.from_args(args)
    if not args.mock_data and not args.data_path:
        raise ConfigError("no data: pass --mock-data (built-in corpus) or --data-path PREFIX")
    if args.mock_data and args.data_path:
        raise ConfigError(f"--mock-data and --data-path={args.data_path!r} are both set (in "
                          f"{args.yaml_cfg or 'the flags'}): pass one")
    decay = config.optim.lr_decay_iters or config.training.train_iters
    if config.optim.lr_warmup_iters >= decay:
        raise ConfigError(f"--lr-warmup-iters={config.optim.lr_warmup_iters} is invalid: expected "
                          f"< --lr-decay-iters {decay} (default: --train-iters)")
    check_attention(args)
    tp = config.parallel.tensor_model_parallel_size
    check_tensor_parallel(args, tp)
    layout = PoolLayout.resolve(world_size, tp, config.parallel.context_parallel_size,
                                config.runtime.gpus_per_node, local_world_size,
                                config.parallel.pipeline_model_parallel_size)
    args.zeppelin_gpus_per_node = layout.gpus_per_node
    layout.micro_batches(args.global_batch_size, args.micro_batch_size)
    pipeline.check(args, layout)
    planner_strategy(args, layout.cp, layout.topology)
    check_fsdp(args)
    if args.mock_data and (args.vocab_size or 0) < BYTE_VOCAB:
        raise ConfigError(f"--vocab-size={args.vocab_size}: the built-in byte corpus needs "
                          f">= {BYTE_VOCAB}")
    return layout
