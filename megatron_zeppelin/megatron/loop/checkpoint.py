"""Checkpoints in Megatron's distributed format, resumed exactly, loaded safely.

Layout (Megatron-LM's ``--ckpt-format torch_dist``): ``{save}/iter_NNNNNNN/`` written by
megatron-core's ``dist_checkpointing`` (``metadata.json``, torch DCP's ``.metadata`` and
``__R_S.distcp`` shards, ``common.pt``) and ``{save}/latest_checkpointed_iteration.txt``.
The sharded state dict holds

* ``model``: ``GPTModel.sharded_state_dict()`` (Megatron-LM's keys, e.g.
  ``decoder.layers.self_attention.linear_qkv.weight``), resharded by dist_checkpointing on load
  (another TP size, another number of ranks);
* ``optimizer``: the Adam state, sharded like the parameters it belongs to;
* ``rng_state``: one shard per global rank (Python, numpy, torch CPU/CUDA generators and
  Megatron's RNG tracker; ranks draw differently in zeppelin mode), restored when the number
  of ranks is the same;

and, in ``common.pt`` (tensors and plain values only): ``iteration``, ``checkpoint_version``,
``opt_param_scheduler`` (megatron-core's ``OptimizerParamScheduler`` state) and ``zeppelin``
(mode, layout and the data position, ``corpus.MicroBatchSampler.state_dict``). Model state is
the same in both modes, so a checkpoint loads in either mode and on any pool size.

Safety: ``common.pt`` and the RNG shards are read with ``torch.load(weights_only=True)``;
DCP's ``.metadata`` is a pickle, so it is first read with an unpickler that only accepts
torch's checkpoint-metadata classes (``inspect``) before dist_checkpointing reads it. A
missing, truncated, foreign or mismatched checkpoint is a ``ConfigError`` naming the path.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import queue
import random
import shutil
import time
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.loop.checkpoint_fsdp import full_state_view

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


# ----------------------------------------------------------------------------- inspection
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


def _refuse(path: str, problem: str) -> ConfigError:
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
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ConfigError(f"--load {load!r}: {tracker} holds {text[:40]!r}: expected the "
                          "iteration number of the latest checkpoint")
    iteration = int(text)
    path = iteration_dir(load, iteration)
    if not os.path.isdir(path):
        raise _refuse(path, f"named by {tracker} does not exist")
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise _refuse(path, f"has no readable metadata.json ({exc}): not a Megatron "
                      "distributed checkpoint") from None
    if backend != "torch_dist":
        raise _refuse(path, f"is in format {backend!r}: expected 'torch_dist' (Megatron's "
                      "--ckpt-format torch_dist)")
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise _refuse(path, f"has an unreadable .metadata (truncated or not written by "
                      f"torch.distributed.checkpoint: {exc})") from None
    _check_data_files(path, metadata)
    try:
        common = torch.load(os.path.join(path, "common.pt"), map_location="cpu",
                            weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, missing file
        raise _refuse(path, f"has an unreadable common.pt ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    schedule = common.get("opt_param_scheduler") if isinstance(common, dict) else None
    saved = common.get("zeppelin") if isinstance(common, dict) else None
    return Found(path, iteration, metadata, schedule if isinstance(schedule, dict) else {},
                 saved if isinstance(saved, dict) else {})


def check_pipeline(found: Found, pp: int, chunks: int) -> None:
    """The checkpoint was saved with this ``--pipeline-model-parallel-size`` and as many
    virtual chunks per stage: the model's state is keyed per chunk (``model``, or ``model0``,
    ``model1``... with virtual stages, Megatron-LM's keys) and the RNG shards per rank, so
    another pipeline shape is refused before any process group exists."""
    saved_pp, saved_chunks = found.saved.get("pp", 1), found.saved.get("vpp_chunks", 1)
    if (saved_pp, saved_chunks) != (pp, chunks):
        raise _refuse(found.path, f"was saved with --pipeline-model-parallel-size {saved_pp} "
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
            raise _refuse(path, f"is incomplete: {name} {what} (truncated copy or interrupted "
                          "save)")


def optimizer_metadata(run: "Training") -> dict | None:
    """``sharded_state_dict`` metadata (saved as the checkpoint's content metadata): the
    distributed optimizer writes ``fully_reshardable`` state, one tensor per parameter and
    state in model space, the same keys as the plain optimizers' (``optimizer.state.exp_avg.
    <param>``), so that its checkpoints load on other DP sizes, in either mode and into the
    plain optimizer."""
    if not run.chunks[0].ddp_config.use_distributed_optimizer:
        return None
    return {"distrib_optim_sharding_type": "fully_reshardable",
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _saved_distributed(common: dict) -> bool:
    """Whether the checkpoint's optimizer state was written by the distributed optimizer."""
    from megatron.core.dist_checkpointing.serialization import load_content_metadata

    metadata = load_content_metadata(preloaded_state_dict=common) or {}
    return "distrib_optim_sharding_type" in metadata


def _check_optimizer_kind(found: Found, common: dict, run: "Training") -> None:
    """Optimizer state crosses between the distributed and the plain optimizer in fp32
    (``convert_optimizer_state``); megatron-core's bf16 optimizer keeps its fp32 main
    parameters in another layout, so a crossing with bf16 is refused in one line."""
    saved, now = _saved_distributed(common), run.chunks[0].ddp_config.use_distributed_optimizer
    if saved != now and run.chunks[0].config.bf16:
        kind, flag = ("distributed", "without") if saved else ("plain", "with")
        raise _refuse(found.path, f"holds the {kind} optimizer's state: loading it {flag} "
                      "--use-distributed-optimizer is supported in fp32 only (megatron-core's "
                      "bf16 optimizers keep fp32 main parameters in other layouts); use the "
                      "same --use-distributed-optimizer setting, or pass --no-load-optim")


MAIN_PARAMS = "optimizer.state.param."  # the distributed optimizer's fp32 main parameters


def _main_params_from_model(common: dict, run: "Training") -> bool:
    """A plain fp32 checkpoint loaded into the distributed optimizer: its main parameters
    are the model's weights (the plain fp32 optimizer steps the model's own tensors)."""
    return run.chunks[0].ddp_config.use_distributed_optimizer and \
        not _saved_distributed(common)


def _take_main_params(sharded: dict, found: Found) -> None:
    """Keep the main-parameter tensors the checkpoint lacks out of the read (in place: each
    becomes a local object, returned as it is by DCP, which reads a tensor once per rank;
    the model reads these ones); ``_give_main_params`` fills them after the load."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    saved = found.metadata.state_dict_metadata

    def keep(value):
        key = getattr(value, "key", None)
        if isinstance(key, str) and key.startswith(MAIN_PARAMS) and key not in saved:
            return LocalNonpersistentObject(value)
        return value

    dict_list_map_inplace(keep, sharded["optimizer"])


def _shard_identity(value, prefix: str = "") -> tuple | None:
    """(key without ``prefix``, global offset) of a sharded tensor or factory: unique in a
    checkpoint (a key alone is not: layers share one key, stacked along a layer axis)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(value, ShardedTensorFactory):
        built = value.build()
        value = built[0] if isinstance(built, list) else built
    if not isinstance(value, ShardedTensor) or not value.key.startswith(prefix):
        return None
    return value.key[len(prefix):], tuple(value.global_offset)


def _model_shards(models: dict) -> dict:
    """``{shard identity: (chunk key, state-dict name)}`` of the chunks' sharded state dicts
    (``model_state``)."""
    return {_shard_identity(t): (key, name) for key, model in models.items()
            for name, t in model.items()}


def _give_main_params(loaded: dict, names: dict) -> None:
    """Replace what ``_take_main_params`` kept with copies of the loaded model weights
    (``names``: ``_model_shards`` of the model request)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    def give(value):
        shard = _shard_identity(value, MAIN_PARAMS)
        if shard is None:
            return value
        key, name = names[shard]
        return loaded[key][name].detach().clone()

    dict_list_map_inplace(give, loaded["optimizer"])


def convert_optimizer_state(state: dict, saved_distributed: bool, run: "Training") -> None:
    """Loaded optimizer state (in place) into the layout ``run.optimizer.load_state_dict``
    expects when the other optimizer kind saved it (fp32). The tensors are the
    same (Adam's ``exp_avg``/``exp_avg_sq`` per parameter in model space,
    ``fully_reshardable``); the rest differs: the distributed optimizer keeps
    ``{optimizer: {param_groups (with step)}, param_state, ...}``, the plain one
    ``{state: {..., common_step}, param_groups}``."""
    distributed = run.chunks[0].ddp_config.use_distributed_optimizer
    if saved_distributed == distributed:
        return
    if distributed:  # plain -> distributed: hyper-parameters and the step from the plain state
        step = state.get("state", {}).get("common_step")
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in state.pop("param_groups", [])]
        for group in groups:
            if step is not None:
                group["step"] = int(step)
        state.pop("state", None)
        state["optimizer"] = {"param_groups": groups}
        sharding = optimizer_metadata(run)["distrib_optim_sharding_type"]
        state["param_state_sharding_type"] = sharding
        return
    groups = state.pop("optimizer")["param_groups"]
    asked = state["param_groups"]
    state["param_groups"] = [{**{k: v for k, v in g.items() if k != "step"},
                              "params": a["params"]} for g, a in zip(groups, asked)]
    steps = {g["step"] for g in groups if "step" in g}
    if steps:
        state["state"]["common_step"] = torch.tensor(float(steps.pop()))
    for key in ("param_state", "param_state_sharding_type"):
        state.pop(key, None)


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
            raise _refuse(found.path, f"has no tensor {tensor.key}: it was saved for another "
                          f"model{hint}")
        shape = tuple(getattr(saved[tensor.key], "size", ()))
        if shape != tuple(tensor.global_shape):
            raise _refuse(found.path, f"was saved for another model: {tensor.key} has shape "
                          f"{shape} there, {tuple(tensor.global_shape)} here (check "
                          "--num-layers, --hidden-size, --num-attention-heads, "
                          "--num-query-groups, --ffn-hidden-size, --vocab-size)")


# ----------------------------------------------------------------------------- RNG states
def rng_state(device: str) -> dict:
    """Every generator training draws from, as tensors and plain values (weights_only)."""
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"random": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                       "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "tracker": get_cuda_rng_tracker().get_states()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, device: str) -> None:
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _rng_object(device: str | None):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    data = rng_state(device) if device else None
    return ShardedObject("rng_state", data, (world,), (rank,), replica_id=0)


# ----------------------------------------------------------------------------- save / load
def _in_process_write_results() -> None:
    """megatron-core's checkpoint writer returns its results through a queue served by a
    ``multiprocessing.Manager`` it spawns on the first save (made for saves finishing in a
    background process). Our saves are synchronous: the results come back in this process,
    so an in-process queue carries them. The Manager would be a process per rank that
    outlives a rank leaving with ``os._exit`` (a fault) and holds its output pipes open."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


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


def model_state(run: Training) -> dict:
    """The sharded state dicts of the model chunks, under Megatron-LM's keys: ``model``, or
    ``model0``, ``model1``... with virtual pipeline stages (each chunk's keys are global:
    megatron-core offsets its layers by stage and chunk)."""
    if len(run.chunks) == 1:
        return {"model": run.chunks[0].module.sharded_state_dict()}
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(run.chunks)}


def save(root: str, iteration: int, run: Training, extra: dict) -> str:
    """Write ``{root}/iter_N`` collectively, then the tracker (rank 0); returns the folder.
    ``extra``: plain values stored under ``zeppelin`` (mode, layout, data position)."""
    from megatron.core import dist_checkpointing

    started = time.perf_counter()
    run = full_state_view(run)
    _in_process_write_results()
    path = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # a partial save of the same iteration
        os.makedirs(path)
    dist.barrier()
    models = model_state(run)
    metadata = optimizer_metadata(run)
    state = {**models,
             "optimizer": run.optimizer.sharded_state_dict(models, metadata=metadata),
             "rng_state": _rng_object(run.device), "iteration": iteration,
             "checkpoint_version": CHECKPOINT_VERSION,
             "opt_param_scheduler": run.scheduler.state_dict(), "zeppelin": extra}
    dist_checkpointing.save(state, path, content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path)
                   for n in names)
        print(f"saved checkpoint at iteration {iteration} to {path} ({size / 2**20:.1f} MiB, "
              f"{time.perf_counter() - started:.2f} s)", flush=True)
    return path


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
            raise _refuse(found.path, f"was trained with another LR/weight-decay schedule: {flag} "
                          f"gives {key}={found.schedule[key]!r} there, {wanted[key]!r} now (steps "
                          "count samples: iterations x --global-batch-size); resume with that "
                          "run's flags (to stop a longer run early, give the first leg the full "
                          "--train-iters and --exit-interval), or pass "
                          "--override-opt_param-scheduler (this run's schedule) or "
                          "--use-checkpoint-opt_param-scheduler (the checkpoint's), or "
                          "--no-load-optim")


def load(found: Found, run: Training, load_optim: bool, load_rng: bool) -> dict:
    """Restore model (+ optimizer, LR schedule and RNG states) from ``found``, collectively;
    returns the ``zeppelin`` entry of the checkpoint (data position, saved layout)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factories

    started = time.perf_counter()
    run = full_state_view(run)
    common = dist_checkpointing.load_common_state_dict(found.path)
    saved = common.get("zeppelin", {})
    probe = model_state(run)  # factories applied: shapes
    metadata = optimizer_metadata(run)
    if load_optim:
        _check_optimizer_kind(found, common, run)
        probe["optimizer"] = run.optimizer.sharded_state_dict(dict(probe), is_loading=True,
                                                              metadata=metadata)
    apply_factories(probe)
    from_model = load_optim and _main_params_from_model(common, run)
    if from_model:
        _take_main_params(probe, found)
    check_shapes(found, probe)
    models = model_state(run)
    request: dict = dict(models)
    if load_optim:
        request["optimizer"] = run.optimizer.sharded_state_dict(models, is_loading=True,
                                                                metadata=metadata)
        if from_model:
            _take_main_params(request, found)
    names = _model_shards(models) if from_model else {}

    same_world = saved.get("world_size") == dist.get_world_size()
    if load_rng and same_world:
        request["rng_state"] = _rng_object(None)
    try:
        loaded = dist_checkpointing.load(request, found.path)
    except Exception as exc:  # raised on every rank (DCP gathers the failures)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise _refuse(found.path, f"cannot be loaded: {type(exc).__name__}: "
                      f"{first[:300]}") from None
    if from_model:
        _give_main_params(loaded, names)
    for key, chunk in zip(models, run.chunks):
        chunk.module.load_state_dict(loaded[key])
    restored = ["model"]
    if load_optim:
        convert_optimizer_state(loaded["optimizer"], _saved_distributed(common), run)
        run.optimizer.load_state_dict(loaded["optimizer"])
        run.scheduler.load_state_dict(common["opt_param_scheduler"])
        restored += ["optimizer", "LR schedule"]
    if "rng_state" in loaded:
        set_rng_state(loaded["rng_state"], run.device)
        restored.append("RNG states")
    if dist.get_rank() == 0:
        skipped = ("" if not load_rng or same_world else
                   f"; RNG states not restored (saved by {saved.get('world_size')} ranks, "
                   f"this run has {dist.get_world_size()})")
        print(f"loaded checkpoint at iteration {found.iteration} from {found.path} "
              f"({', '.join(restored)}{skipped}; saved in {saved.get('mode', '?')} mode; "
              f"{time.perf_counter() - started:.2f} s)", flush=True)
    return saved
