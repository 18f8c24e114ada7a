"""Run megatron-core 0.16.1 on CPU with gloo: the one place our package patches Megatron.

``enable_cpu_mode()`` (called only for ``--device cpu``) bridges the CUDA assumptions megatron-core
makes on the paths a GPT training step takes: model build, forward/backward, RoPE, the local
``DotProductAttention``, ``DistributedDataParallel`` grad buffers, ``get_forward_backward_func()``
schedules and the fp32 ``get_megatron_optimizer`` (Adam), gradient clipping included.
``disable_cpu_mode()`` restores every original object. Patches, by kind (the replacement
functions of kinds 1, 2 and 5 live in ``cpu_replacements.py``; this module applies them):

1. Global torch patches (the only four): ``torch.cuda.current_device`` -> ``torch.device("cpu")``,
   ``torch.cuda.synchronize`` -> no-op (CPU kernels are synchronous),
   ``torch.cuda.current_stream`` -> a stream whose waits are no-ops (megatron-core 0.19's DDP
   asks for it before every gradient reduction), and ``torch.nn.functional.embedding``, whose
   plain calls on a bf16/fp16 weight sum the weight's gradient in fp32 as CUDA's backward does
   (CPU's sums in bf16; ``cpu_replacements.make_cpu_embedding``). About forty
   megatron-core call sites pass ``current_device()`` inline as ``device=`` inside large
   functions, e.g. ``RotaryEmbedding.get_emb`` (moves ``inv_freq`` "to the GPU" on first use),
   the DDP grad buffer (``_ParamAndGradBuffer.__init__``), ``GlobalMemoryBuffer.get_tensor``
   (attention scores of ``DotProductAttention``), the tensor-parallel layers when
   ``use_cpu_initialization=False`` and the TP/SP mappings; ``synchronize`` is called
   unconditionally by ``dist_checkpointing`` (async writer preload), ``parallel_state`` timeout
   updates and DDP buffer offloading. On a CPU-only torch both originals raise "Torch not
   compiled with CUDA enabled".
2. Narrow replacements of small megatron-core functions that are CUDA-only by construction:
   * ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the "device"
     generator is the CPU generator (``torch.get_rng_state`` / ``torch.set_rng_state``); used by
     ``CudaRNGStatesTracker.fork`` and activation recompute (``CheckpointFunction``).
   * ``CudaRNGStatesTracker.add``: called by ``model_parallel_cuda_manual_seed``; the original
     reads ``torch.cuda.get_rng_state()``. Ours seeds a CPU generator state.
   * ``CudaRNGStatesTracker.fork``: same state swapping, without the "CPU RNG state changed within
     GPU RNG context" check, which fires on every forked init/dropout once the tracked generator
     is the CPU one.
   * ``transformer.utils.get_default_causal_mask`` / ``get_sliding_window_causal_mask``: create the
     mask on "cuda"; used by ``FusedScaleMaskSoftmax`` (``DotProductAttention`` with no mask).
   * ``rope_utils.get_pos_emb_on_this_cp_rank``: ``pin_memory=True`` + ``.cuda()``; used by RoPE
     when Megatron's own context parallelism is > 1.
   * ``optimizer.clip_grads.clip_grad_by_total_norm_fp32``: asserts
     ``grad.type() == 'torch.cuda.FloatTensor'``; called by every ``optimizer.step()`` with
     ``clip_grad > 0``.
3. Functions whose CUDA use is a literal ``device="cuda"`` / ``.cuda()`` inline in a larger body
   run under ``CudaToCpuMode`` (a ``TorchFunctionMode`` that redirects CUDA devices to CPU,
   drops ``pin_memory`` and makes ``Tensor.cuda()`` the identity), only while they run:
   ``schedules.forward_backward_no_pipelining`` and the two pipelining schedules (1F1B,
   interleaved: ``total_num_tokens`` on "cuda"; their P2P shape and activation buffers use
   ``current_device()``, bridged above; gloo runs the sends and receives),
   ``FP32Optimizer.__init__`` (``_scale``), the bf16 optimizer's ``MixedPrecisionOptimizer.
   __init__`` (``_scale_one``) and ``Float16OptimizerWithFloat16Params.__init__`` (its
   ``param.type()`` checks name CUDA types: the redirect names a CPU tensor's CUDA twin),
   ``clip_grads.get_grad_norm_fp32`` /
   ``count_zeros_fp32`` (scratch buffers), ``utils.local_multi_tensor_l2_norm`` (its result) and
   ``dist_checkpointing.serialization.save`` / ``load`` (``state_dict_saver`` and
   ``exchange_utils`` build tensors on "cuda"; the torch_dist writer also needs ``psutil``).
   The schedule being wrapped, a training step's forward/backward runs under the mode too: each
   torch call pays a Python dispatch (~10-25% on a tiny GPT), CPU runs only.

4. Names a megatron-core version reads but never defines without Transformer Engine
   (``compat.CPU_BRIDGE_MISSING_NAMES``: 0.16.x's MoE router reads ``te_general_gemm``)
   are defined as ``None`` while the bridge is on.

A replaced function is swapped in its defining module and in every loaded ``megatron.core``
module that bound it by name (``from .clip_grads import clip_grad_by_total_norm_fp32``,
``l2_norm_impl = local_multi_tensor_l2_norm``), found by identity.

5. The fp32 ``DistributedOptimizer`` (``--use-distributed-optimizer``): its ``__init__`` and
   ``get_parameter_state_dp_zero`` run under the device redirect, which also makes
   ``Tensor.type()`` name a CPU tensor's CUDA twin (its ``param.type() ==
   'torch.cuda.FloatTensor'`` checks); gloo does the reduce-scatter and all-gather. Three
   megatron-core paths without Apex/TE are mended: ``state_dict`` before the first step
   (torch Adam's state made as its first step would), ``load_state_dict`` (each parameter
   its own ``step`` tensor, not one shared) and ``_set_main_param_and_optimizer_states``
   (keeps ``step``; copies under ``no_grad``).

6. Megatron-FSDP (``--use-megatron-fsdp``): its CUDA side streams and events, added by
   ``cpu_fsdp.enable_megatron_fsdp_on_cpu()`` when a run wraps its model with it (cpu_fsdp.py).

Not bridged (not on our path; they fail loudly): fp16's loss scaler (our script offers no
``--fp16``), other CUDA streams/events
(``num_distributed_optimizer_instances > 1``, the combined 1F1B schedule, ``StragglerDetector``),
``overlap_p2p_comm`` of the interleaved schedule, ``torch.autocast("cuda")`` (``enable_autocast``) and the
``torch.compile``-decorated fused kernels (keep the ``*_fusion`` config flags off on CPU).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_zeppelin.megatron.common import cpu_replacements as replace
from megatron_zeppelin.megatron.common.compat import (bridge_series, check_cpu_bridge,
                                               cpu_bridge_missing_names, cpu_bridge_redirects)

_CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- device redirect
def _is_cuda_device(device: Any) -> bool:
    """True for anything torch would read as a CUDA device: 'cuda', 'cuda:1', cuda device, int."""
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _identity_method(args: tuple, kwargs: dict) -> Any:
    """``Tensor.cuda(...)`` / ``Tensor.pin_memory()`` on CPU: the tensor itself."""
    return args[0]


def _to_method(args: tuple, kwargs: dict) -> Any:
    """``Tensor.to(device, ...)`` with a positional CUDA device: keep it on CPU."""
    if len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], _CPU) + tuple(args[2:])
    return torch.Tensor.to(*args, **kwargs)


def _type_method(args: tuple, kwargs: dict) -> Any:
    """``Tensor.type()`` (no target type) of a CPU tensor: the name its CUDA twin has
    (``'torch.cuda.FloatTensor'``), which megatron-core's optimizers test parameters
    against; ``Tensor.type(dtype)`` converts as usual."""
    name = torch.Tensor.type(*args, **kwargs)
    if len(args) == 1 and not kwargs and isinstance(name, str) and ".cuda." not in name:
        return name.replace("torch.", "torch.cuda.", 1)
    return name


_METHOD_REDIRECTS: dict[Callable, Callable[[tuple, dict], Any]] = {
    torch.Tensor.type: _type_method,
    torch.Tensor.cuda: _identity_method,
    torch.Tensor.pin_memory: _identity_method,
    torch.Tensor.to: _to_method,
}


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA device arguments of torch calls to CPU while the mode is active.

    ``device="cuda"``/``"cuda:N"``/int/cuda ``torch.device`` keyword arguments become CPU,
    ``pin_memory=True`` becomes False, ``Tensor.cuda()``/``Tensor.pin_memory()`` return the tensor
    and ``Tensor.to("cuda")`` stays on CPU. Every other call passes through unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs = {**kwargs, "device": _CPU}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
        else:
            kwargs = {}
        redirect = _METHOD_REDIRECTS.get(func)
        if redirect is not None:
            return redirect(args, kwargs)
        return func(*args, **kwargs)


_REDIRECT_STATE = threading.local()


def run_on_cpu(fn: Callable) -> Callable:
    """Wrap ``fn`` so that it runs under ``CudaToCpuMode`` (entered once per thread, not nested)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_REDIRECT_STATE, "active", False):
            return fn(*args, **kwargs)
        _REDIRECT_STATE.active = True
        try:
            with CudaToCpuMode():
                return fn(*args, **kwargs)
        finally:
            _REDIRECT_STATE.active = False

    wrapper.__zeppelin_cpu_wrapped__ = fn
    return wrapper


# ----------------------------------------------------------------------------- patch registry
@dataclass
class _Patch:
    """``owner.name`` was ``original`` and is now ``replacement`` (owner: module or class)."""

    owner: Any
    name: str
    original: Any
    replacement: Any


_APPLIED: list[_Patch] = []
_DEFINED: list[tuple[Any, str]] = []  # names the bridge defined because the version lacks them


def _patch_specs() -> list[tuple[str, str, Callable[[Any], Any]]]:
    """(module, attribute path, original -> replacement) for every bridge, in apply order."""
    random_mod = "megatron.core.tensor_parallel.random"
    fork_default = importlib.import_module(random_mod)._MODEL_PARALLEL_RNG_TRACKER_NAME
    return [
        ("torch.cuda", "current_device", lambda _: replace.cpu_current_device),
        ("torch.cuda", "synchronize", lambda _: replace.cpu_synchronize),
        ("torch.cuda", "current_stream", lambda _: replace.cpu_current_stream),
        ("torch.nn.functional", "embedding", replace.make_cpu_embedding),
        (random_mod, "_get_cuda_rng_state", lambda _: replace.cpu_get_rng_state),
        (random_mod, "_set_cuda_rng_state", lambda _: replace.cpu_set_rng_state),
        (random_mod, "CudaRNGStatesTracker.add", lambda _: replace.cpu_tracker_add),
        (random_mod, "CudaRNGStatesTracker.fork", lambda _: replace.make_cpu_tracker_fork(fork_default)),
        ("megatron.core.transformer.utils", "get_default_causal_mask",
         lambda _: replace.cpu_default_causal_mask),
        ("megatron.core.transformer.utils", "get_sliding_window_causal_mask",
         lambda _: replace.cpu_sliding_window_causal_mask),
        ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
         lambda _: replace.cpu_pos_emb_on_this_cp_rank),
        ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
         lambda _: replace.cpu_clip_grad_by_total_norm_fp32),
        ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", run_on_cpu),
        ("megatron.core.pipeline_parallel.schedules",
         "forward_backward_pipelining_without_interleaving", run_on_cpu),
        ("megatron.core.pipeline_parallel.schedules",
         "forward_backward_pipelining_with_interleaving", run_on_cpu),
        ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__", run_on_cpu),
        ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__", run_on_cpu),
        ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
         run_on_cpu),
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
         run_on_cpu),
        ("megatron.core.optimizer.distrib_optimizer",
         "DistributedOptimizer.get_parameter_state_dp_zero", run_on_cpu),
        ("megatron.core.optimizer.distrib_optimizer",
         "DistributedOptimizer._set_main_param_and_optimizer_states", replace.keep_adam_step),
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict",
         replace.adam_state_before_first_step),
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
         replace.own_adam_steps),
        ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", run_on_cpu),
        ("megatron.core.optimizer.clip_grads", "count_zeros_fp32", run_on_cpu),
        ("megatron.core.utils", "local_multi_tensor_l2_norm", run_on_cpu),
        ("megatron.core.dist_checkpointing.serialization", "save", run_on_cpu),
        ("megatron.core.dist_checkpointing.serialization", "load", run_on_cpu),
    ] + [(module, path, run_on_cpu) for module, path in cpu_bridge_redirects()]


# Imported before patching so that name bindings made at import time are found and swapped.
_MEGATRON_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
)


def _resolve(module_name: str, path: str) -> tuple[Any, str]:
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if name not in vars(owner):
        raise RuntimeError(f"{module_name}.{path} not found: this bridge targets megatron-core "
                           f"{bridge_series()}")
    return owner, name


def _megatron_modules() -> list[Any]:
    return [m for n, m in list(sys.modules.items())
            if m is not None and (n == "megatron.core" or n.startswith("megatron.core."))]


def _rebind_everywhere(old: Any, new: Any) -> list[_Patch]:
    """Swap every module-level binding of ``old`` in loaded megatron.core modules to ``new``."""
    patches = []
    for module in _megatron_modules():
        for name, value in list(vars(module).items()):
            if value is old:
                setattr(module, name, new)
                patches.append(_Patch(module, name, old, new))
    return patches


def apply_patches(specs: list[tuple[str, str, Callable[[Any], Any]]]) -> None:
    """Replace each ``module.path`` by ``make(original)`` (registered for
    ``disable_cpu_mode``); one already replaced by this bridge is left as it is."""
    applied = {(id(p.owner), p.name) for p in _APPLIED}
    for module_name, path, make in specs:
        owner, name = _resolve(module_name, path)
        if (id(owner), name) in applied:
            continue
        original = vars(owner)[name]
        replacement = make(original)
        setattr(owner, name, replacement)
        _APPLIED.append(_Patch(owner, name, original, replacement))
        if not isinstance(owner, type) and module_name != "torch.cuda":
            _APPLIED.extend(_rebind_everywhere(original, replacement))


def cpu_mode_enabled() -> bool:
    """Whether ``enable_cpu_mode()`` is in effect."""
    return bool(_APPLIED)


def enable_cpu_mode() -> None:
    """Apply every CPU bridge (module docstring). Idempotent; ``disable_cpu_mode`` undoes it."""
    if _APPLIED:
        return
    check_cpu_bridge()
    for module_name in _MEGATRON_MODULES:
        importlib.import_module(module_name)
    try:
        apply_patches(_patch_specs())
        for module_name, name, value in cpu_bridge_missing_names():
            module = importlib.import_module(module_name)
            if name not in vars(module):
                setattr(module, name, value)
                _DEFINED.append((module, name))
    except Exception:
        disable_cpu_mode()
        raise


def disable_cpu_mode() -> None:
    """Restore every object ``enable_cpu_mode`` replaced, including later name bindings."""
    while _DEFINED:
        module, name = _DEFINED.pop()
        delattr(module, name)
    while _APPLIED:
        patch = _APPLIED.pop()
        if getattr(patch.owner, patch.name, None) is patch.replacement:
            setattr(patch.owner, patch.name, patch.original)
        if not isinstance(patch.owner, type) and patch.owner is not torch.cuda:
            _rebind_everywhere(patch.replacement, patch.original)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """``with cpu_mode():`` enable the bridge for the block, restoring the previous state after."""
    was_enabled = cpu_mode_enabled()
    enable_cpu_mode()
    try:
        yield
    finally:
        if not was_enabled:
            disable_cpu_mode()
