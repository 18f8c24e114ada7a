"""Everything a run needs, checked before any process group exists (``check``).

``args.validate_args`` checks the flags and the pool layout; this module checks what lies
outside the flags, so that a bad value fails on every rank at once with one line (printed by
rank 0, ``fatal.user_error``) instead of one rank failing while the others wait for it:

* environment variables (``env.py``'s readers: backends, timeouts) and the watchdog bound
  against the P2P timeout;
* the model's size against the memory of the device (``check_memory``: a lower bound);
* the planner's cluster and hardware files (``--zeppelin-cluster``, ``--zeppelin-hardware``);
* the device (CUDA visible for ``--device cuda``), optional packages (TensorBoard);
* the corpus (the built-in one, or ``--data-path``'s index and data file) and the overlong
  policy against its longest document;
* where results go (``--save`` can be created, ``--log-json``'s folder exists);
* the checkpoint ``--load`` names (``checkpoint.inspect``: format, safety, completeness) and
  the LR/weight-decay schedule it was trained with against the flags' (``check_schedule``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass

from megatron_zeppelin import env
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.output_paths import unwritable_folder
from megatron_zeppelin.megatron.loop import args as train_args, checkpoint, pipeline
from megatron_zeppelin.megatron.loop.corpus import DocumentSource, check_overlong, open_source
from megatron_zeppelin.megatron.loop.watchdog import check_timeout


@dataclass(frozen=True)
class Ready:
    """What the checks opened: the document source and the checkpoint to resume (or None)."""

    source: DocumentSource
    resume: checkpoint.Found | None


def check_environment(args: argparse.Namespace) -> None:
    """Every environment variable the run reads, read now (a bad one is a ConfigError)."""
    from megatron_zeppelin.runtime import kernels

    try:
        env.attention_backend(kernels.choices())
        env.transport()
        env.router_backend()
        env.planner_backend()
        env.planner_timeout_s()
        env.remap_exchange()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_timeout(args.zeppelin_watchdog_timeout)  # and ZEPPELIN_P2P_TIMEOUT_S


def check_device_and_packages(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu")
    if args.device == "cuda" and env.local_rank() >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={env.local_rank()} but this node shows "
                          f"{torch.cuda.device_count()} GPU(s): start at most one process per "
                          "GPU (torchrun --nproc-per-node)")
    check_attention_backend(args)
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"--tensorboard-dir {args.tensorboard_dir!r} needs TensorBoard, "
                          "which is not installed: pip install 'megatron-zeppelin[tensorboard]'")


def check_memory(args: argparse.Namespace, world: int, local: int) -> None:
    """Refuse a model whose weights and gradients alone, sharded over all ``world`` ranks
    (``local`` of them on this node), exceed this node's memory (``--device cpu``: its RAM
    shared by its ranks) or one GPU's: a lower bound on what training needs (tied
    embeddings, no optimizer state, no activations), so never a false refusal; without it
    such a model fails in the allocator with a traceback on every rank."""
    import torch

    from megatron_zeppelin.megatron.loop.train import model_spec

    spec = model_spec(args)
    count = spec.parameter_count() - spec.vocab_size * spec.hidden_size
    need = count * 2 * (2 if args.bf16 else 4) / world  # bytes per rank
    if args.device == "cuda":
        have, where = torch.cuda.get_device_properties(env.local_rank()).total_memory, "GPU"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
        where = f"rank's share of this node's RAM ({local} ranks)"
    if need > have:
        raise ConfigError(
            f"the model has {count:,} parameters or more (--num-layers {args.num_layers}, "
            f"--hidden-size {args.hidden_size}, --ffn-hidden-size {spec.ffn}, --vocab-size "
            f"{spec.vocab_size}): their weights and gradients alone, spread over all {world} "
            f"ranks, take {need / 2**30:,.1f} GiB per rank, more than a {where} holds "
            f"({have / 2**30:,.1f} GiB); shrink the model or add ranks")


def check_attention_backend(args: argparse.Namespace) -> None:
    """An explicit ``--zeppelin-attention-backend`` is installed and, on CPU, runs there (a
    CUDA one is checked by the engine on its first block, on the device)."""
    import torch

    from megatron_zeppelin.runtime import kernels

    name = getattr(args, "zeppelin_attention_backend", "auto")
    if name == "auto":
        return
    why = kernels.backend_problem(name, args.device,
                                  torch.bfloat16 if args.bf16 else torch.float32)
    if why:
        raise ConfigError(f"--zeppelin-attention-backend {name}: {why}")


def check_planner_files(args: argparse.Namespace) -> None:
    """``--zeppelin-cluster`` and ``--zeppelin-hardware`` load (a bad one is named by flag)."""
    from megatron_zeppelin.config import load_cluster, load_hardware

    for flag, value, load in (("--zeppelin-cluster", args.zeppelin_cluster, load_cluster),
                              ("--zeppelin-hardware", args.zeppelin_hardware, load_hardware)):
        if value:
            try:
                load(value)
            except ConfigError as exc:
                raise ConfigError(f"{flag} {value!r}: {exc}") from None


def check_outputs(args: argparse.Namespace) -> None:
    if args.save:
        try:
            os.makedirs(args.save, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--save {args.save!r}: cannot create the folder ({exc})") from None
        reason = unwritable_folder(args.save)
        if reason:
            raise ConfigError(f"--save {args.save!r}: {reason}")
    if args.log_json:
        folder = os.path.dirname(os.path.abspath(args.log_json))
        if not os.path.isdir(folder):
            raise ConfigError(f"--log-json {args.log_json!r}: folder {folder} does not exist")
        if os.path.isdir(args.log_json):
            raise ConfigError(f"--log-json {args.log_json!r} is a folder: expected a file "
                              "(one JSON line per iteration is appended to it)")
        exists = os.path.exists(args.log_json)
        if (exists and not os.access(args.log_json, os.W_OK)) or \
                (not exists and unwritable_folder(folder)):
            raise ConfigError(f"--log-json {args.log_json!r}: not writable")


def check(args: argparse.Namespace) -> Ready:
    """Run every check (``args`` already passed ``validate_args``)."""
    check_environment(args)
    check_device_and_packages(args)
    world = env.world_size() or 1
    check_memory(args, world, env.local_world_size() or world)
    check_planner_files(args)
    source = open_source(args.mock_data, args.data_path, train_args.vocab_size(args))
    what = "--mock-data" if args.mock_data else f"--data-path {args.data_path!r}"
    check_overlong(source.lengths(), args.seq_length, args.zeppelin_overlong, what)
    check_outputs(args)
    resume = checkpoint.inspect(args.load, args.exit_on_missing_checkpoint) if args.load else None
    if resume is not None:
        checkpoint.check_pipeline(resume, args.pipeline_model_parallel_size,
                                  pipeline.virtual_size(args) or 1)
    if resume is not None and args.load_optim and not (
            args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler):
        checkpoint.check_schedule(resume, train_args.schedule(args))
    return Ready(source, resume)
