"""Checkpoint folders and what is checked of them before any process group exists.

The format (``checkpoint.py`` says what the state holds): ``{save}/iter_NNNNNNN/`` written by
megatron-core's ``dist_checkpointing`` (Megatron-LM's ``--ckpt-format torch_dist``:
``metadata.json``, torch DCP's ``.metadata`` and ``__R_S.distcp`` shards, ``common.pt`` up to
megatron-core 0.18, the shards' ``common_state`` object from 0.19) and
``{save}/latest_checkpointed_iteration.txt``. ``inspect`` reads the one ``--load`` names
safely: the common state with ``torch.load(weights_only=True)``, DCP's ``.metadata`` (a pickle)
with an unpickler that only accepts torch's checkpoint-metadata classes; ``check_pipeline``,
``check_schedule`` and ``check_shapes`` compare it with this run. A missing, truncated,
foreign or mismatched checkpoint is a ``ConfigError`` naming the path. ``Training``: what a
checkpoint holds, live (the argument of ``checkpoint.py`` and ``checkpoint_optimizer.py``).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.common import compat

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP's ``.metadata`` and nothing else: classes of
    ``torch.distributed.checkpoint``, ``torch.Size``, torch dtypes, torch's layout helper and
    paths (torch's own writer records the checkpoint folder); none runs code when built."""

    SAFE = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module.startswith("torch.distributed.checkpoint.") or
                   (module, name) in self.SAFE or
                   (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not checkpoint "
                                         "metadata)")
        return super().find_class(module, name)


@dataclass(frozen=True)
class Found:
    """A checkpoint to load: its folder, iteration, DCP metadata (read safely) and the LR
    schedule it was trained with (``OptimizerParamScheduler.state_dict``, from common.pt)."""

    path: str
    iteration: int
    metadata: Any
    schedule: dict = dataclasses.field(default_factory=dict)
    saved: dict = dataclasses.field(default_factory=dict)  # common.pt's ``zeppelin`` entry


def refuse(path: str, problem: str) -> ConfigError:
    return ConfigError(f"--load: checkpoint {path} {problem}")


def inspect(load: str, exit_on_missing: bool) -> Found | None:
    """The checkpoint ``--load`` points at, checked before any process group exists: the
    tracker, Megatron's ``metadata.json``, DCP's ``.metadata`` (safe unpickler), ``common.pt``
    (weights only) and the size of every data file the metadata names. None when the folder
    holds no checkpoint (training starts from scratch, as in Megatron) unless
    ``exit_on_missing``."""
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        if exit_on_missing:
            raise ConfigError(f"--load {load!r}: no checkpoint there (no {TRACKER}) and "
                              "--exit-on-missing-checkpoint is set")
        return None
    iteration = _tracked_iteration(load, tracker)
    path = iteration_dir(load, iteration)
    if not os.path.isdir(path):
        raise refuse(path, f"named by {tracker} does not exist")
    _check_backend(path)
    metadata = _read_metadata(path)
    _check_data_files(path, metadata)
    common = _read_common(path)
    schedule = common.get("opt_param_scheduler") if isinstance(common, dict) else None
    saved = common.get("zeppelin") if isinstance(common, dict) else None
    return Found(path, iteration, metadata, schedule if isinstance(schedule, dict) else {},
                 saved if isinstance(saved, dict) else {})


def scheduler_rates(args: Any, found: Found | None) -> Any:
    """``args`` (the training flags' namespace) with ``--lr`` / ``--min-lr`` the checkpoint's
    when ``found`` is resumed under ``--use-checkpoint-opt_param-scheduler`` (its scheduler
    then sets the rates anyway): megatron-core 0.19 matches the saved optimizer's parameter
    groups by their rates, so groups built from other flags would not load."""
    if found is None or not args.use_checkpoint_opt_param_scheduler:
        return args
    saved = {flag: found.schedule.get(key) for flag, key in (("lr", "max_lr"),
                                                             ("min_lr", "min_lr"))}
    return type(args)(**{**vars(args), **{k: v for k, v in saved.items()
                                          if isinstance(v, (int, float))}})


def _tracked_iteration(load: str, tracker: str) -> int:
    with open(tracker) as f:
        text = f.read().strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"--load {load!r}: {tracker} holds {text[:40]!r}: expected the "
                          "iteration number of the latest checkpoint")
    return int(text)


def _check_backend(path: str) -> None:
    """Megatron's ``metadata.json`` says the folder is a ``torch_dist`` checkpoint."""
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise refuse(path, f"has no readable metadata.json ({exc}): not a Megatron "
                     "distributed checkpoint") from None
    if backend != "torch_dist":
        raise refuse(path, f"is in format {backend!r}: expected 'torch_dist' (Megatron's "
                     "--ckpt-format torch_dist)")


def _read_metadata(path: str) -> Any:
    """DCP's ``.metadata``, through ``_MetadataUnpickler``."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            return _MetadataUnpickler(io.BytesIO(f.read())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise refuse(path, f"has an unreadable .metadata (truncated or not written by "
                     f"torch.distributed.checkpoint: {exc})") from None


def _read_common(path: str) -> Any:
    """The checkpoint's common (non-sharded) state, weights only: ``common.pt`` as megatron-core
    up to 0.18 writes it, else the ``common_state`` object that 0.19 writes inside the DCP
    shards (read by megatron-core's ``load_common_state_dict``, after ``_read_metadata``
    checked the metadata pickle)."""
    legacy = os.path.join(path, "common.pt")
    in_file = os.path.exists(legacy) or not compat.common_state_in_shards()
    try:
        if in_file:
            return torch.load(legacy, map_location="cpu", weights_only=True)
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        return load_common_state_dict(path)
    except Exception as exc:  # truncated zip, foreign pickle, missing file
        where = "common.pt" if in_file else \
            "common state (no common.pt, nor megatron-core 0.19's common_state object)"
        raise refuse(path, f"has an unreadable {where} ({type(exc).__name__}: "
                     f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def check_pipeline(found: Found, pp: int, chunks: int) -> None:
    """The checkpoint was saved with this ``--pipeline-model-parallel-size`` and as many
    virtual chunks per stage: the model's state is keyed per chunk (``model``, or ``model0``,
    ``model1``... with virtual stages, Megatron-LM's keys) and the RNG shards per rank, so
    another pipeline shape is refused before any process group exists."""
    saved_pp, saved_chunks = found.saved.get("pp", 1), found.saved.get("vpp_chunks", 1)
    if (saved_pp, saved_chunks) != (pp, chunks):
        raise refuse(found.path, f"was saved with --pipeline-model-parallel-size {saved_pp} "
                     f"and {saved_chunks} model chunk(s) per stage, this run has {pp} and "
                     f"{chunks}: loading across pipeline shapes is not supported; resume "
                     "with the same --pipeline-model-parallel-size and "
                     "--num-layers-per-virtual-pipeline-stage")


def _check_data_files(path: str, metadata: Any) -> None:
    """Every byte range the metadata names lies inside its file (a truncated shard is found
    here, before any rank starts reading)."""
    needed: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        name = info.relative_path
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual is None or actual < size:
            what = "is missing" if actual is None else f"has {actual} bytes, {size} expected"
            raise refuse(path, f"is incomplete: {name} {what} (truncated copy or interrupted "
                         "save)")


# the scheduler's values (``args.schedule``) and the flags that set them
SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                  "lr_decay_steps": "--lr-decay-iters (default: --train-iters)",
                  "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay",
                  "end_wd": "--weight-decay", "wd_incr_steps": "--train-iters",
                  "wd_incr_style": "--weight-decay"}


def check_schedule(found: Found, wanted: dict) -> None:
    """The LR/weight-decay schedule of the flags (``wanted``, ``args.schedule``) is the
    checkpoint's, as megatron-core's scheduler asserts on load unless told to take one side
    (--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler): refused here, in
    one line, before any process group exists."""
    for key, flag in SCHEDULE_FLAGS.items():
        if key in found.schedule and found.schedule[key] != wanted[key]:
            raise refuse(found.path, f"was trained with another LR/weight-decay schedule: {flag} "
                         f"gives {key}={found.schedule[key]!r} there, {wanted[key]!r} now (steps "
                         "count samples: iterations x --global-batch-size); resume with that "
                         "run's flags (to stop a longer run early, give the first leg the full "
                         "--train-iters and --exit-interval), or pass "
                         "--override-opt_param-scheduler (this run's schedule) or "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's), or "
                         "--no-load-optim")


def check_shapes(found: Found, sharded: dict) -> None:
    """Every tensor of ``sharded`` (a sharded state dict, factories applied) is in the
    checkpoint with the same global shape; else the checkpoint is for another model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = found.metadata.state_dict_metadata
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor):
            continue
        if tensor.key not in saved:
            hint = (" (pass --no-load-optim to load the model only)"
                    if tensor.key.startswith("optimizer.") else "")
            raise refuse(found.path, f"has no tensor {tensor.key}: it was saved for another "
                         f"model{hint}")
        shape = tuple(getattr(saved[tensor.key], "size", ()))
        if shape != tuple(tensor.global_shape):
            raise refuse(found.path, f"was saved for another model: {tensor.key} has shape "
                         f"{shape} there, {tuple(tensor.global_shape)} here (check "
                         "--num-layers, --hidden-size, --num-attention-heads, "
                         "--num-query-groups, --ffn-hidden-size, --vocab-size)")


def check_precision(found: Found, models: dict) -> None:
    """The model's weights were saved in this run's dtype (bf16 with --bf16, else fp32);
    else the optimizer state is of the other precision (fp32 main parameters or none) and the
    load is refused, offering the model alone (its weights cast on load)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = found.metadata.state_dict_metadata
    for tensor in nested_values(models):
        if isinstance(tensor, ShardedTensor) and tensor.key in saved:
            was = getattr(getattr(saved[tensor.key], "properties", None), "dtype", None)
            if was is not None and was != tensor.dtype:
                raise refuse(found.path, f"was saved in {_precision(was)} ({tensor.key}) and "
                             f"this run trains in {_precision(tensor.dtype)}:"
                             " optimizer state does not cross precisions; train with the same "
                             "--bf16 setting, or pass --no-load-optim to load the model only "
                             "(its weights cast)")
            return


def _precision(dtype: Any) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


@dataclass
class Training:
    """What a checkpoint holds, live: the DDP model chunks of this pipeline stage (one
    without virtual stages), their optimizer and LR scheduler."""

    chunks: list
    optimizer: Any
    scheduler: Any
    device: str

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, list):
            self.chunks = [self.chunks]  # one DDP model

    @property
    def model(self) -> Any:
        """The only chunk (no pipeline, or one chunk per stage); else the first."""
        return self.chunks[0]
