"""Checkpoints in Megatron's distributed format, resumed exactly, loaded safely: save and load.

``save`` writes ``{save}/iter_NNNNNNN/`` collectively through megatron-core's
``dist_checkpointing`` (the folder format, and what is checked of a checkpoint before any
process group exists: ``checkpoint_files.py``); ``load`` restores it. The sharded state dict
holds

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
the same in both modes, so a checkpoint loads in either mode and on any pool size. Optimizer
state crosses between the distributed and the plain optimizer (``checkpoint_optimizer.py``);
Megatron-FSDP's is saved as full tensors (``checkpoint_fsdp.py``). The names callers use of
``checkpoint_files`` and ``checkpoint_optimizer`` are importable from here too.
"""
from __future__ import annotations

import os
import queue
import random
import shutil
import time

import torch
import torch.distributed as dist

from megatron_zeppelin.megatron.loop.checkpoint_files import (
    CHECKPOINT_VERSION, SCHEDULE_FLAGS, TRACKER, Found, Training, check_pipeline,
    check_precision, check_schedule, check_shapes, inspect, iteration_dir, refuse)
from megatron_zeppelin.megatron.loop.checkpoint_fsdp import full_state_view
from megatron_zeppelin.megatron.loop.checkpoint_optimizer import (
    MAIN_PARAMS, convert_optimizer_state, give_main_params,
    main_params_from_model, model_shards, optimizer_metadata, read_main_params_as_saved,
    saved_distributed, take_main_params)

__all__ = ["CHECKPOINT_VERSION", "MAIN_PARAMS", "SCHEDULE_FLAGS", "TRACKER", "Found", "Training",
           "check_pipeline", "check_schedule", "check_shapes", "convert_optimizer_state",
           "inspect", "iteration_dir", "load", "model_state", "optimizer_metadata", "rng_state",
           "save", "set_rng_state"]


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


def load(found: Found, run: Training, load_optim: bool, load_rng: bool) -> dict:
    """Restore model (+ optimizer, LR schedule and RNG states) from ``found``, collectively;
    returns the ``zeppelin`` entry of the checkpoint (data position, saved layout)."""
    from megatron.core import dist_checkpointing

    started = time.perf_counter()
    run = full_state_view(run)
    common = dist_checkpointing.load_common_state_dict(found.path)
    saved = common.get("zeppelin", {})
    from_model = load_optim and main_params_from_model(common, run)
    _check_request(found, common, run, load_optim, from_model)
    models = model_state(run)
    request: dict = dict(models)
    if load_optim:
        request["optimizer"] = _optimizer_request(run, models, common)
        if from_model:
            take_main_params(request, found)
    names = model_shards(models) if from_model else {}
    same_world = saved.get("world_size") == dist.get_world_size()
    if load_rng and same_world:
        request["rng_state"] = _rng_object(None)
    loaded = _read(found, request)
    if from_model:
        give_main_params(loaded, names)
    restored = _restore(loaded, common, run, list(models), load_optim)
    if dist.get_rank() == 0:
        skipped = ("" if not load_rng or same_world else
                   f"; RNG states not restored (saved by {saved.get('world_size')} ranks, "
                   f"this run has {dist.get_world_size()})")
        print(f"loaded checkpoint at iteration {found.iteration} from {found.path} "
              f"({', '.join(restored)}{skipped}; saved in {saved.get('mode', '?')} mode; "
              f"{time.perf_counter() - started:.2f} s)", flush=True)
    return saved


def _check_request(found: Found, common: dict, run: Training, load_optim: bool,
                   from_model: bool) -> None:
    """What this run would read (factories applied: global shapes) is in the checkpoint,
    and the optimizer state is of this precision; refused in one line naming the path
    otherwise."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    probe = model_state(run)
    if load_optim:
        check_precision(found, probe)
        probe["optimizer"] = _optimizer_request(run, dict(probe), common)
    apply_factories(probe)
    if from_model:
        take_main_params(probe, found)
    check_shapes(found, probe)


def _optimizer_request(run: Training, models: dict, common: dict) -> dict:
    """The optimizer's sharded state dict to load (over the model request ``models``), its
    main parameters read under the keys the checkpoint's optimizer kind saved them."""
    request = run.optimizer.sharded_state_dict(models, is_loading=True,
                                               metadata=optimizer_metadata(run))
    read_main_params_as_saved(request, common, run)
    return request


def _read(found: Found, request: dict) -> dict:
    """``dist_checkpointing.load`` of ``request``; its failure (raised on every rank: DCP
    gathers them) as one line naming the path."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(request, found.path)
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        if isinstance(exc, CheckpointException) and exc.failures:  # rank -> (its exception,
            failure = next(iter(exc.failures.values()))  # traceback)
            exc = failure[0] if isinstance(failure, tuple) else failure
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise refuse(found.path, f"cannot be loaded: {type(exc).__name__}: "
                     f"{first[:300]}") from None


def _restore(loaded: dict, common: dict, run: Training, keys: list, load_optim: bool
             ) -> list[str]:
    """Put what was read into the live run (``keys``: the model chunks' entries); returns
    what was restored, for the log line."""
    for key, chunk in zip(keys, run.chunks):
        chunk.module.load_state_dict(loaded[key])
    restored = ["model"]
    if load_optim:
        convert_optimizer_state(loaded["optimizer"], saved_distributed(common), run)
        run.optimizer.load_state_dict(loaded["optimizer"])
        run.scheduler.load_state_dict(common["opt_param_scheduler"])
        restored += ["optimizer", "LR schedule"]
    if "rng_state" in loaded:
        set_rng_state(loaded["rng_state"], run.device)
        restored.append("RNG states")
    return restored
