"""Optimizer state across optimizer kinds: megatron-core's distributed optimizer and the plain
one save the same Adam tensors (``fully_reshardable``, one tensor per parameter and state in
model space) but other layouts around them; a checkpoint of one loads into the other
(``convert_optimizer_state``). A plain fp32 checkpoint gives the distributed optimizer its
main parameters from the model's weights (``take_main_params`` / ``give_main_params``); in
bf16 both keep fp32 main parameters, under other keys (``read_main_params_as_saved``).
"""
from __future__ import annotations

import torch

from megatron_zeppelin.megatron.loop.checkpoint_files import Found, Training


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


MAIN_PARAMS = "optimizer.state.param."  # the distributed optimizer's fp32 main parameters
BF16_MAIN_PARAMS = "optimizer.state.fp32_param."  # megatron-core's plain bf16 optimizer's


def read_main_params_as_saved(sharded: dict, common: dict, run: Training) -> None:
    """A bf16 checkpoint of the other optimizer kind: the two keep the same fp32 main
    parameters under other keys (the distributed optimizer's ``optimizer.state.param.<name>``,
    the plain bf16 optimizer's ``optimizer.state.fp32_param.<name>``); the request's main
    parameters (in place) are read from the saved kind's keys."""
    distributed = run.chunks[0].ddp_config.use_distributed_optimizer
    if not run.chunks[0].config.bf16 or saved_distributed(common) == distributed:
        return
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    now, saved = ((MAIN_PARAMS, BF16_MAIN_PARAMS) if distributed else
                  (BF16_MAIN_PARAMS, MAIN_PARAMS))
    for value in nested_values(sharded):
        key = getattr(value, "key", None)
        if isinstance(key, str) and key.startswith(now):
            value.key = saved + key[len(now):]


def main_params_from_model(common: dict, run: Training) -> bool:
    """A plain fp32 checkpoint loaded into the distributed optimizer: its main parameters
    are the model's weights (the plain fp32 optimizer steps the model's own tensors)."""
    return run.chunks[0].ddp_config.use_distributed_optimizer and \
        not saved_distributed(common) and not run.chunks[0].config.bf16


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
    expects when the other optimizer kind saved it. The tensors are the same (Adam's
    ``exp_avg``/``exp_avg_sq`` per parameter in model space, ``fully_reshardable``; in bf16
    the fp32 main parameters, read as saved: ``read_main_params_as_saved``); the rest
    differs: the distributed optimizer keeps ``{optimizer: {param_groups (with step)},
    param_state, ...}``, the plain fp32 one ``{state: {..., common_step}, param_groups}``, the
    plain bf16 one the same under ``optimizer``, beside ``fp32_from_fp16_params``."""
    distributed = run.chunks[0].ddp_config.use_distributed_optimizer
    if saved_distributed == distributed:
        return
    if distributed:
        _plain_to_distributed(state, run)
    else:
        _distributed_to_plain(state, run.chunks[0].config.bf16)


def _plain_to_distributed(state: dict, run: Training) -> None:
    """Hyper-parameters and the step from the plain state (merged with the request)."""
    plain = state.pop("optimizer") if run.chunks[0].config.bf16 else state
    step = plain.get("state", {}).get("common_step")
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in plain.pop("param_groups", [])]
    for group in groups:
        if step is not None:
            group["step"] = int(step)
    plain.pop("state", None)
    state["optimizer"] = {"param_groups": groups}
    state["param_state_sharding_type"] = optimizer_metadata(run)["distrib_optim_sharding_type"]


def _distributed_to_plain(state: dict, bf16: bool) -> None:
    """The distributed optimizer's groups (with their step) as the plain optimizer's, with
    the parameter indices this run asked for, and one ``common_step``."""
    if bf16:  # the saved and the asked groups were merged under "optimizer"
        plain = state["optimizer"]
        groups = asked = plain["param_groups"]
    else:
        groups, plain = state.pop("optimizer")["param_groups"], state
        asked = state["param_groups"]
    plain["param_groups"] = [{**{k: v for k, v in g.items() if k != "step"},
                              "params": a["params"]} for g, a in zip(groups, asked)]
    steps = {g["step"] for g in groups if "step" in g}
    if steps:
        plain["state"]["common_step"] = torch.tensor(float(steps.pop()))
    for key in ("param_state", "param_state_sharding_type"):
        state.pop(key, None)
