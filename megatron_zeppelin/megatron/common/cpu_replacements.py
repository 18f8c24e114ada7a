"""The narrow replacements of ``cpu.py``'s CPU bridge (its module doc, kinds 1, 2 and 5): what
stands in for ``torch.cuda``'s device/stream/synchronize calls, megatron-core's CUDA RNG state
functions, its "cuda" masks and RoPE slice, its fp32 gradient clipping, and the three mended
paths of the fp32 ``DistributedOptimizer``. ``cpu._patch_specs`` says where each goes."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

_CPU = torch.device("cpu")

class _EmbeddingFp32Grad(torch.autograd.Function):
    """``embedding(ids, weight)`` ``[*ids.shape, dim]`` whose weight gradient is summed in fp32
    and rounded once to the weight's dtype, as CUDA's embedding backward sums half types."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, original: Callable) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return original(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ids, = ctx.saved_tensors
        summed = torch.zeros(ctx.weight_shape, dtype=torch.float32)
        summed.index_add_(0, ids.reshape(-1), grad.reshape(-1, ctx.weight_shape[1]).float())
        return None, summed.to(ctx.weight_dtype), None


def make_cpu_embedding(original: Callable) -> Callable:
    """``torch.nn.functional.embedding`` in CPU mode: a plain call (no padding index, norm or
    sparse options: megatron-core's ``VocabParallelEmbedding``) on a bf16/fp16 weight sums its
    gradient in fp32 (``_EmbeddingFp32Grad``). CPU's own backward sums in the weight's dtype:
    with the tiny GPT's 256-token vocabulary every id repeats hundreds of times per
    micro-batch, and bf16 sums lost 8-14% of the gradient's norm, differently for each way of
    cutting the tokens over ranks (zeppelin and static CP 1.3-2% apart)."""

    def embedding(input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or weight.dtype not in (torch.bfloat16, torch.float16):
            return original(input, weight, *args, **kwargs)
        return _EmbeddingFp32Grad.apply(input, weight, original)

    embedding.__wrapped__ = original
    return embedding


def cpu_current_device() -> torch.device:
    """``torch.cuda.current_device()`` in CPU mode: the CPU device (valid for ``device=``)."""
    return _CPU


def cpu_synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize()`` in CPU mode: nothing runs asynchronously."""


class CpuStream:
    """``torch.cuda.current_stream()`` in CPU mode: CPU kernels are synchronous, so waiting on
    and recording events are no-ops (megatron-core 0.19's DDP asks for the stream before every
    gradient reduction)."""

    def wait_event(self, event: Any = None) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing runs asynchronously."""

    def record_event(self, event: Any = None) -> None:
        """No event is needed."""


_CPU_STREAM = CpuStream()


def cpu_current_stream(device: Any = None) -> CpuStream:
    return _CPU_STREAM


def cpu_get_rng_state(device: Any = "cuda", clone: bool = False,
                       graph_safe: bool = False) -> torch.Tensor:
    """``random._get_cuda_rng_state`` on CPU: the CPU generator state (always a fresh tensor)."""
    if graph_safe:
        raise RuntimeError(f"graph_safe={graph_safe!r}: CUDA-graph-safe RNG states do not exist in "
                           "CPU mode; set use_cudagraphable_rng=False")
    return torch.get_rng_state()


def cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1,
                       graph_safe: bool = False) -> None:
    """``random._set_cuda_rng_state`` on CPU: set the CPU generator state."""
    if graph_safe:
        raise RuntimeError(f"graph_safe={graph_safe!r}: CUDA-graph-safe RNG states do not exist in "
                           "CPU mode; set use_cudagraphable_rng=False")
    torch.set_rng_state(new_state)


def cpu_tracker_add(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on CPU: track a CPU generator state seeded with ``seed``."""
    if getattr(self, "use_cudagraphable_rng", False):
        raise RuntimeError("use_cudagraphable_rng=True is not available in CPU mode")
    if seed in self.seeds_:
        raise ValueError(f"rng seed {seed} is already tracked")
    if name in self.states_:
        raise ValueError(f"rng state {name!r} is already tracked")
    self._is_initialized = True
    self.seeds_.add(seed)
    original = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(original)


def make_cpu_tracker_fork(default_name: str) -> Callable:
    """``CudaRNGStatesTracker.fork`` on CPU: swap the CPU generator to state ``name`` and back."""

    @contextlib.contextmanager
    def fork(self, name: str = default_name) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} is not tracked; known: {sorted(self.states_)}")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise RuntimeError(f"rng state {self._current_state_name!r} is current when "
                                   f"leaving the fork of {name!r}")
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    return fork


def cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """``transformer.utils.get_default_causal_mask`` on CPU: [sq, sq] bool, True = masked."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def cpu_sliding_window_causal_mask(sq: int, skv: int,
                                    window_size: tuple[int, int]) -> torch.Tensor:
    """``utils.get_sliding_window_causal_mask`` on CPU: [sq, skv] bool, True = masked."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int,
                                 cp_group: torch.distributed.ProcessGroup) -> torch.Tensor:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` on CPU: zigzag chunks (r, 2C-1-r) of ``seq_dim``.

    ``pos_emb`` is [seq, ..., dim]-like with the sequence on ``seq_dim``; the result keeps the
    layout with ``seq/cp`` positions: chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank``.
    """
    if cp_group is None:
        raise ValueError("cp_group=None: a context-parallel group is needed to slice RoPE")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    chunked = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    chunked = chunked.index_select(seq_dim, index)
    return chunked.view(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


def cpu_clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                      use_decoupled_grad: bool = False) -> None:
    """``clip_grad_by_total_norm_fp32`` on CPU: scale fp32 grads by max_norm / total_norm."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        if grad.dtype not in allowed:
            raise TypeError(f"gradient dtype {grad.dtype} cannot be clipped: expected {allowed}")
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def keep_adam_step(original: Callable) -> Callable:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every entry of the
    parameter's optimizer state from the loaded tensors, but the loaders leave torch Adam's
    ``step`` out of them (it is restored from the param groups): without Apex/TE (always on
    CPU) the copy fails with KeyError 'step'; the step stays. With fp32 parameters the main
    parameter is a view of the model's (a leaf that requires grad), which the
    ``dp_reshardable`` loader copies into outside ``no_grad``: the copy runs under it."""

    @functools.wraps(original)
    @torch.no_grad()
    def replacement(self, model_param: Any, tensors: dict) -> None:
        if "step" not in tensors:
            index, order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[index]["params"][order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    return replacement


def adam_state_before_first_step(original: Callable) -> Callable:
    """``DistributedOptimizer.state_dict`` without Apex/TE reads torch Adam's ``step`` from
    the per-parameter state, which torch creates at the first step: before it (a checkpoint
    loaded at start-up asks for the state dict to load into) it fails on ``assert
    len(steps) == 1``. The state torch's first step would create (zeros, step 0) is made
    first; the loaded values replace it, and a first step from it is torch's own."""

    @functools.wraps(original)
    def replacement(self) -> dict:
        inner = self.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
        return original(self)

    return replacement


def own_adam_steps(original: Callable) -> Callable:
    """``DistributedOptimizer.load_state_dict`` without Apex/TE gives every parameter's torch
    Adam state the same ``step`` tensor; torch increments each parameter's step in place, so
    a shared one advances once per parameter and every bias correction after a resume is
    wrong. Each parameter gets its own copy."""

    @functools.wraps(original)
    def replacement(self, state_dict: dict) -> None:
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    return replacement
