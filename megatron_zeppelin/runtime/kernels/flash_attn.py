"""Backend ``flash_attn``: the flash-attn 2.6+ package's varlen kernels (CUDA, fp16/bf16).

``pip install "megatron-zeppelin[flash-attn]"``. Calls the lower-level
``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward``,
which return and take ``softmax_lse`` ``[heads, total_q]``. flash-attn marks a row without keys
with lse ``+inf``; it is mapped to ``-inf`` here and back (only for blocks whose pieces leave
such rows). Head dims are padded to a multiple of 8 as flash-attn requires, and a value head
dim different from the query/key one (multi-latent attention) to the larger of the two
(``base.pad_head_dims``: flash-attn 2 takes one head dim). Sliding windows go to the kernel as
flash-attn documents them: ``window_size=(left, right)`` (2.6) or ``window_size_left/right``
(2.7+), bottom-right aligned, ``-1`` unbounded (``base.band``); ``max_q`` as the native
backend passes it (``base.kernel_max_q``: flash-attn's ``max_q == 1`` GQA path fails on empty
query pieces, as torch's copy of the kernel does). Only ever chosen
explicitly (``auto`` picks ``native``, the same FlashAttention-2 code that every CUDA torch has).
"""
from __future__ import annotations

import functools
import inspect

import torch

from megatron_zeppelin.runtime.kernels.base import (OptionalCudaBackend, Pieces, Window, band,
                                                    kernel_max_q, lse_from_kernel,
                                                    lse_to_kernel, pad_head_dims, register)


@functools.lru_cache(maxsize=None)
def parameters(fn) -> tuple[tuple[str, bool], ...]:
    """``(name, required)`` of each parameter of a flash-attn / FlashAttention-3 function
    (``torch.library`` custom ops unwrapped), read once per function: the kernels are called
    many times per step, and reading a signature costs tens of microseconds. Empty when the
    signature cannot be read."""
    try:
        params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters  # custom_op wraps
    except (TypeError, ValueError):
        return ()
    return tuple((name, p.default is inspect.Parameter.empty) for name, p in params.items())


def flash_kwargs(fn, positional: int, window: Window = (-1, -1), **kwargs) -> dict:
    """Keyword arguments that fit this flash-attn version of ``fn``: 2.7+ takes
    window_size_left/right, 2.6 a window_size pair (softcap where the signature has it);
    parameters without a default that the caller does not set (block_table, ...) get None."""
    params = parameters(fn)
    names = {name for name, _ in params}
    if "window_size" in names:
        kwargs["window_size"] = tuple(window)
    else:
        kwargs.update(window_size_left=window[0], window_size_right=window[1])
    if "softcap" in names or not params:
        kwargs["softcap"] = 0.0
    for name, required in params[positional:]:
        if required and name not in kwargs:
            kwargs[name] = None
    return kwargs


def out_and_lse(result: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, softmax_lse)`` of ``_flash_attn_varlen_forward``'s result: 2.7+ returns
    ``(out, softmax_lse, S_dmask, rng_state)``, 2.6 and older ``(out, q, k, v, out_padded,
    softmax_lse, S_dmask, rng_state)``."""
    if len(result) == 4:
        return result[0], result[1]
    if len(result) == 8:
        return result[0], result[5]
    raise RuntimeError(f"flash-attn's _flash_attn_varlen_forward returned {len(result)} values: "
                       "expected 4 (flash-attn 2.7+) or 8 (2.6); this version is not supported")


class FlashAttn(OptionalCudaBackend):
    """The ``flash_attn`` backend (see the module docstring)."""

    name = "flash_attn"
    kernel = "fa2"
    description = "flash-attn 2.6+ varlen kernels (CUDA, fp16/bf16; pip extra flash-attn)"
    module, package, extra = "flash_attn.flash_attn_interface", "flash_attn", "flash-attn"

    def forward(self, q, k, v, pieces: Pieces, causal: bool, scale: float,
                window: Window | None = None):
        qp, kp, vp = pad_head_dims(q, k, v, multiple=8)
        fn = self.load()._flash_attn_varlen_forward
        max_q = kernel_max_q(pieces, q.shape[1], k.shape[1])
        out, lse = out_and_lse(fn(qp, kp, vp, pieces.cu_q_dev, pieces.cu_k_dev, max_q,
                                  pieces.max_k,
                                  **flash_kwargs(fn, 7, band(causal, window), dropout_p=0.0,
                                                 softmax_scale=scale, causal=causal,
                                                 alibi_slopes=None, return_softmax=False)))
        keyless = causal or window is not None
        return out[..., :v.shape[-1]].contiguous(), lse_from_kernel(lse, pieces, keyless)

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, causal: bool, scale: float,
                 window: Window | None = None):
        qp, kp, vp, dop, op = pad_head_dims(q, k, v, dout, out, multiple=8)
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        fn = self.load()._flash_attn_varlen_backward
        fn(dop, qp, kp, vp, op, lse_to_kernel(lse, pieces, causal or window is not None), dq,
           dk, dv, pieces.cu_q_dev, pieces.cu_k_dev,
           kernel_max_q(pieces, q.shape[1], k.shape[1]), pieces.max_k,
           **flash_kwargs(fn, 13, band(causal, window), dropout_p=0.0, softmax_scale=scale,
                          causal=causal, alibi_slopes=None, deterministic=False,
                          rng_state=None))
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


BACKEND = register(FlashAttn())
