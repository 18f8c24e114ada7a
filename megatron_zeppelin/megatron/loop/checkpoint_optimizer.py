"""Optimizer state across optimizer kinds: megatron-core's distributed optimizer and the plain
one save the same Adam tensors (``fully_reshardable``, one tensor per parameter and state in
model space) but other layouts around them; a checkpoint of one loads into the other in fp32
(``convert_optimizer_state``), and a plain fp32 checkpoint gives the distributed optimizer its
main parameters from the model's weights (``take_main_params`` / ``give_main_params``).
"""
from __future__ import annotations

import torch

from megatron_zeppelin.megatron.loop.checkpoint_files import Found, Training, refuse


def optimizer_metadata(run: Training) -> dict | None:
    """``sharded_state_dict`` metadata (saved as the checkpoint's content metadata): the
    distributed optimizer writes ``fully_reshardable`` state, one tensor per parameter and
    state in model space, the same keys as the plain optimizers' (``optimizer.state.exp_avg.
    <param>``), so that its checkpoints load on other DP sizes, in either mode and into the
    plain optimizer."""
    if not run.chunks[0].ddp_config.use_distributed_optimizer:
        return None
    return {"distrib_optim_sharding_type": "fully_reshardable",
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def saved_distributed(common: dict) -> bool:
    """Whether the checkpoint's optimizer state was written by the distributed optimizer."""
    from megatron.core.dist_checkpointing.serialization import load_content_metadata

    metadata = load_content_metadata(preloaded_state_dict=common) or {}
    return "distrib_optim_sharding_type" in metadata


def check_optimizer_kind(found: Found, common: dict, run: Training) -> None:
    """Optimizer state crosses between the distributed and the plain optimizer in fp32
    (``convert_optimizer_state``); megatron-core's bf16 optimizer keeps its fp32 main
    parameters in another layout, so a crossing with bf16 is refused in one line."""
    saved, now = saved_distributed(common), run.chunks[0].ddp_config.use_distributed_optimizer
    if saved != now and run.chunks[0].config.bf16:
        kind, flag = ("distributed", "without") if saved else ("plain", "with")
        raise refuse(found.path, f"holds the {kind} optimizer's state: loading it {flag} "
                     "--use-distributed-optimizer is supported in fp32 only (megatron-core's "
                     "bf16 optimizers keep fp32 main parameters in other layouts); use the "
                     "same --use-distributed-optimizer setting, or pass --no-load-optim")


MAIN_PARAMS = "optimizer.state.param."  # the distributed optimizer's fp32 main parameters


def main_params_from_model(common: dict, run: Training) -> bool:
    """A plain fp32 checkpoint loaded into the distributed optimizer: its main parameters
    are the model's weights (the plain fp32 optimizer steps the model's own tensors)."""
    return run.chunks[0].ddp_config.use_distributed_optimizer and \
        not saved_distributed(common)


def take_main_params(sharded: dict, found: Found) -> None:
    """Keep the main-parameter tensors the checkpoint lacks out of the read (in place: each
    becomes a local object, returned as it is by DCP, which reads a tensor once per rank;
    the model reads these ones); ``give_main_params`` fills them after the load."""
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


def model_shards(models: dict) -> dict:
    """``{shard identity: (chunk key, state-dict name)}`` of the chunks' sharded state dicts
    (``model_state``)."""
    return {_shard_identity(t): (key, name) for key, model in models.items()
            for name, t in model.items()}


def give_main_params(loaded: dict, names: dict) -> None:
    """Replace what ``take_main_params`` kept with copies of the loaded model weights
    (``names``: ``model_shards`` of the model request)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    def give(value):
        shard = _shard_identity(value, MAIN_PARAMS)
        if shard is None:
            return value
        key, name = names[shard]
        return loaded[key][name].detach().clone()

    dict_list_map_inplace(give, loaded["optimizer"])


def convert_optimizer_state(state: dict, saved_distributed: bool, run: Training) -> None:
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
