"""Checkpoints of Megatron-FSDP and torch FSDP2 runs in the format of the other modes
(``checkpoint.py``).

megatron-core 0.16.1 writes Megatron-FSDP's state only as ``fsdp_dtensor`` (one DTensor per
parameter, Megatron-LM's ``--ckpt-format fsdp_dtensor``), which neither Megatron DDP nor the
distributed optimizer reads. Here an FSDP run is checkpointed through a *full-state view*
(``full_state_view``) that looks to ``checkpoint.save`` / ``checkpoint.load`` like a run of
the plain optimizer (fp32, or with ``--bf16`` megatron-core's plain bf16 optimizer):

* the model's sharded state dict is the GPT model's own (Megatron-LM's keys), its tensors
  the full parameters gathered from the FSDP shards over DP x CP (megatron-core's
  ``gather_uneven_dtensor_to_full_tensor``), written by DP rank 0 as in the other modes;
* the optimizer's is the plain optimizer's: Adam's ``exp_avg`` / ``exp_avg_sq`` gathered
  to model space, ``common_step``, torch Adam's param groups;
* loading copies each rank's slice of the loaded full tensors into its shards (the
  optimizer's fp32 main weights, then ``install_optimized_model_weights`` into the model's)
  and into Adam's state;
* with ``--bf16`` (Megatron-FSDP) the model's tensors are the bf16 rounding of the main weights
  (what ``install_optimized_model_weights`` gives the model) and the fp32 main weights are
  saved as the plain bf16 optimizer saves them (``optimizer.state.fp32_param.<name>``); a
  load takes them from there, so a bf16 run resumes exactly, with or without FSDP.

Torch FSDP2 (``--use-torch-fsdp2``, ``FullTorchFSDP2Model``) is viewed the same way: its model's
parameters are the DTensor shards the plain optimizer steps, and Adam's state is sharded as
they are; with ``--bf16`` the shards are fp32 (bf16 only while a layer computes,
``torch_fsdp2.py``): they are the main weights, saved as Megatron-FSDP's are, the model's
tensors their bf16 rounding.

So a checkpoint saved with ``--use-megatron-fsdp`` or ``--use-torch-fsdp2`` loads without it (plain or distributed
optimizer, either mode) and the reverse, through ``checkpoint.py``'s existing conversions.
Saving gathers one parameter at a time (each a full tensor on every rank while it is
written): fine for models whose largest tensor fits a rank, as in our runs.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_zeppelin.megatron.common.fsdp_tensors import (
    full_tensor, is_megatron_fsdp, scatter_into)
from megatron_zeppelin.megatron.loop.checkpoint_optimizer import BF16_MAIN_PARAMS


def full_parameters(fsdp_chunk: Any) -> dict[str, torch.Tensor]:
    """Every parameter of a Megatron-FSDP or torch FSDP2 chunk as a full tensor, by its GPT
    model name (the fp32 weights the optimizer steps; collective over the FSDP group)."""
    if not is_megatron_fsdp(fsdp_chunk):  # torch FSDP2: the model's parameters are the shards
        return {name: full_tensor(param, fsdp_chunk.process_group)
                for name, param in fsdp_chunk.module.named_parameters()}
    group = fsdp_chunk.module.dist_index.get_dp_group()
    named = fsdp_chunk.module.param_and_grad_buffer.optimizer_named_parameters
    return {name: full_tensor(param, group) for name, param in named}


def _scatter_all(state: dict, params: dict[str, Any]) -> None:
    """Copy each rank's slice of the full tensors ``state`` into the DTensor shards
    ``params`` (by name); a parameter the checkpoint lacks is an error naming it."""
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"the checkpoint's model has no {missing[0]} "
                         f"({len(missing)} parameter(s) missing)")
    for name, dtensor in params.items():
        scatter_into(state[name], dtensor.to_local(), name, dtensor)


class FullModel:
    """What ``checkpoint.py`` reads of ``chunk.module``: the GPT model's sharded state dict
    with full tensors, and ``load_state_dict`` of a full (GPT) state dict."""

    def __init__(self, fsdp_chunk: Any) -> None:
        self.fsdp = fsdp_chunk.module  # MegatronFSDP: .module is the GPT model
        self.params = dict(self.fsdp.param_and_grad_buffer.optimizer_named_parameters)
        self.group = self.fsdp.dist_index.get_dp_group()
        # its parameters are the fp32 main weights; with --bf16 the model's are their rounding
        self.dtype = torch.bfloat16 if fsdp_chunk.config.bf16 else None

    def sharded_state_dict(self) -> dict:
        """The GPT model's sharded state dict, built while its parameters are full copies of
        the FSDP ones (megatron-core's checkpoint code reads a DTensor parameter as its local
        shard); each copy is tagged with the FSDP parameter it copies
        (``_zeppelin_fsdp_param``, for ``FullOptimizer``)."""
        from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import (
            _replace_module_parameter)

        fsdp = self.fsdp
        fsdp._replace_param_with_distributed_if_needed()  # the state-dict hooks: no-ops now
        sharded_params = dict(fsdp.module.named_parameters())
        fulls = {name: self._full_parameter(name, param)
                 for name, param in sharded_params.items()}
        for name, full in fulls.items():
            _replace_module_parameter(fsdp.module, name, full)
        fsdp._reestablish_shared_weights(sharded_params, fulls)
        try:
            return fsdp.module.sharded_state_dict()
        finally:
            for name, param in sharded_params.items():
                _replace_module_parameter(fsdp.module, name, param)
            fsdp._reestablish_shared_weights(fulls, sharded_params)

    def _full_parameter(self, name: str, param: Any) -> torch.nn.Parameter:
        """A full copy of FSDP parameter ``name`` with the attributes megatron-core set on
        the model's own parameter (tensor-parallel layout, ``allreduce``, ...)."""
        return _tagged_full(param, self.fsdp.raw_param.get(name), self.group, self.dtype)

    def load_state_dict(self, state: dict) -> None:
        _scatter_all(state, self.params)
        self.fsdp.install_optimized_model_weights()


class FullTorchFSDP2Model:
    """``FullModel`` of a torch FSDP2 chunk (``torch_fsdp2.py``): its GPT model's parameters
    are the DTensor shards the plain optimizer steps, gathered over the chunk's DP x CP group
    while the state dict is built and sliced back into the shards on load."""

    def __init__(self, chunk: Any) -> None:
        self.model = chunk.module  # the GPT model, its parameters FSDP2's DTensors
        self.params = dict(self.model.named_parameters())
        self.group = chunk.process_group
        # fp32 shards under --bf16 too (the main weights); the model's are their rounding
        self.dtype = torch.bfloat16 if chunk.config.bf16 else None

    def sharded_state_dict(self) -> dict:
        """The GPT model's sharded state dict, built while its parameters are full copies
        tagged with their DTensors (``_zeppelin_fsdp_param``, for ``FullOptimizer``)."""
        fulls = {name: _tagged_full(param, param, self.group, self.dtype)
                 for name, param in self.params.items()}
        _set_parameters(self.model, fulls)
        try:
            return self.model.sharded_state_dict()
        finally:
            _set_parameters(self.model, self.params)

    def load_state_dict(self, state: dict) -> None:
        _scatter_all(state, self.params)


def _tagged_full(param: Any, attributes: Any, group: Any,
                 dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """A full copy of the DTensor ``param`` (in ``dtype`` if given) with the public attributes
    megatron-core set on ``attributes`` (tensor-parallel layout, ``allreduce``, ...), tagged
    with ``param``."""
    full = full_tensor(param, group)
    full = torch.nn.Parameter(full if dtype is None else full.to(dtype), requires_grad=False)
    for key, value in (vars(attributes).items() if attributes is not None else ()):
        if not key.startswith("_"):
            setattr(full, key, value)
    full._zeppelin_fsdp_param = param
    return full


def _set_parameters(model: torch.nn.Module, params: dict[str, Any]) -> None:
    """Register ``params`` (by name in ``model``) in place of the model's parameters."""
    for name, param in params.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = param


class FullOptimizer:
    """What ``checkpoint.py`` reads of the optimizer: the plain optimizer's sharded state dict
    (Adam state in model space) and its ``load_state_dict``. In fp32 the plain fp32
    optimizer's; with ``install_bf16`` (under --bf16: Megatron-FSDP's copies the fp32 main
    weights into the bf16 model weights, torch FSDP2's does nothing, its shards being the
    main weights) megatron-core's plain bf16 optimizer's: the same under ``optimizer``, and
    the fp32 main weights as ``fp32_from_fp16_params``."""

    def __init__(self, optimizer: Any, group: Any,
                 install_bf16: Callable[[], None] | None = None) -> None:
        self.group = group
        self.install_bf16 = install_bf16
        chained = getattr(optimizer, "chained_optimizers", [optimizer])
        if len(chained) != 1:
            raise ValueError(f"{len(chained)} chained optimizers: the FSDP checkpoint view "
                             "takes one")
        # megatron-core's DistributedOptimizer over Megatron-FSDP, its plain one over FSDP2
        self.distributed = chained[0]
        self.adam = self.distributed.optimizer  # torch's Adam
        self.params = [p for group in self.adam.param_groups for p in group["params"]]

    def sharded_state_dict(self, models: dict, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.optimizer import (
            make_sharded_optimizer_tensor, optim_state_to_sharding_state)

        if is_loading and not self.adam.state:
            if hasattr(self.distributed, "_init_optimizer_states_with_dummy_values"):
                self.distributed._init_optimizer_states_with_dummy_values()
            else:  # the plain optimizer (torch FSDP2): Adam's state as its first step makes
                self.distributed.init_state_fn(self.adam, self.distributed.config)
        by_param = {id(v.data._zeppelin_fsdp_param): v for v in nested_values(models)
                    if hasattr(getattr(v, "data", None), "_zeppelin_fsdp_param")}
        state = self.adam.state_dict()
        for index, param in enumerate(self.params):  # a rank with an empty shard has no
            entry = self.adam.state.get(param, {})  # state for it: every rank gathers all
            state["state"][index] = {
                key: full_tensor(param, self.group,
                           entry[key].to_local() if key in entry else param.to_local())
                for key in ("exp_avg", "exp_avg_sq")}
        optim_state_to_sharding_state(
            state, {i: by_param[id(p)] for i, p in enumerate(self.params)})
        step = self._step()
        if step is not None:
            state["state"]["common_step"] = torch.tensor(step)
        if self.install_bf16 is None:
            return state
        prefix = BF16_MAIN_PARAMS.rstrip(".")
        mains = [[make_sharded_optimizer_tensor(by_param[id(p)], full_tensor(p, self.group),
                                                prefix=prefix) for p in group["params"]]
                 for group in self.adam.param_groups]
        return {"optimizer": state, "fp32_from_fp16_params": mains}

    def _step(self) -> float | None:
        """Adam's step count, the same on every rank of the FSDP group (torch's Adam keeps
        it per parameter, TE's FusedAdam per group; a rank whose shards are all empty has
        none); None before the first step."""
        steps = {float(e["step"]) for e in self.adam.state.values() if "step" in e} | \
            {float(g["step"]) for g in self.adam.param_groups if "step" in g}
        if len(steps) > 1:
            raise ValueError(f"Adam's parameters are at different steps {sorted(steps)}")
        step = torch.tensor(steps.pop() if steps else -1.0, dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)
        return float(step) if step >= 0 else None

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if self.install_bf16 is None:
            self._load_adam(state)
            return
        self._load_adam(state["optimizer"])
        for mains, group in zip(state["fp32_from_fp16_params"], self.adam.param_groups):
            for main, param in zip(mains, group["params"]):
                if param.to_local().numel():  # an empty shard: nothing of it on this rank
                    scatter_into(main, param.to_local(), BF16_MAIN_PARAMS, param)
        self.install_bf16()

    def _load_adam(self, state: dict) -> None:
        groups = state["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"])
                                                 for g in self.adam.param_groups]:
            raise ValueError("the checkpoint's optimizer has other parameter groups "
                             f"({[len(g['params']) for g in groups]} parameters) than this "
                             f"run's ({[len(g['params']) for g in self.adam.param_groups]})")
        step = state["state"].get("common_step")
        for saved, group in zip(groups, self.adam.param_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "step")})
            if "step" in group and step is not None:  # TE's FusedAdam: one step per group
                group["step"] = int(step)
            for index, param in zip(saved["params"], group["params"]):
                if param.to_local().numel() == 0:
                    continue  # an empty shard: no Adam state on this rank
                entry = self.adam.state[param]
                for key in ("exp_avg", "exp_avg_sq"):
                    scatter_into(state["state"][index][key], entry[key].to_local(), key, param)
                if step is not None and "step" not in group:
                    entry["step"] = torch.tensor(float(step))


def full_state_view(run: Any) -> Any:
    """``run`` (``checkpoint.Training``) as checkpoint.py reads it: itself, or for a
    Megatron-FSDP or torch FSDP2 run its full-state view (a plain fp32 optimizer's run to checkpoint.py)."""
    from megatron_zeppelin.megatron.common.torch_fsdp2 import is_torch_fsdp2

    if is_torch_fsdp2(run.chunks[0]):
        full = FullTorchFSDP2Model
    elif is_megatron_fsdp(run.chunks[0]):
        full = FullModel
    else:
        return run
    chunks = [types.SimpleNamespace(module=full(chunk), config=chunk.config,
                                    ddp_config=types.SimpleNamespace(
                                        use_distributed_optimizer=False))
              for chunk in run.chunks]
    install_bf16 = None
    if run.chunks[0].config.bf16:  # torch FSDP2's shards are the main weights: nothing to do
        install_bf16 = chunks[0].module.fsdp.install_optimized_model_weights \
            if full is FullModel else lambda: None
    optimizer = FullOptimizer(run.optimizer, chunks[0].module.group, install_bf16)
    return types.SimpleNamespace(chunks=chunks, optimizer=optimizer,
                                 scheduler=run.scheduler, device=run.device, model=chunks[0])
