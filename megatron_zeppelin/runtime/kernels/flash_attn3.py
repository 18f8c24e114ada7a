"""Backend ``flash_attn3``: FlashAttention-3 varlen kernels (CUDA sm80+, fp16/bf16).

FlashAttention-3 is built from flash-attention's ``hopper/`` folder (package ``flash_attn_3``,
module ``flash_attn_interface``; not on PyPI as a wheel). Calls its lower-level
``_flash_attn_forward`` / ``_flash_attn_backward`` by keyword, adapted to the installed version
by their signatures (``flash_attn.flash_kwargs``): 2025's take ``window_size=(left, right)``
and ``causal``, the ``torch.library`` custom ops of later versions ``window_size_left/right``
and, in the backward, ``is_causal``; parameters without a default that the engine does not use
(``k_new``, ``page_table``, ...) get None. Builds before 2025-01, whose ``_flash_attn_forward``
takes no offsets (varlen was another function), are reported as unusable. The forward returns
``(out, softmax_lse, ...)``, ``softmax_lse`` ``[heads, total_q]`` float32; a row without keys
gets ``-inf`` (``+inf`` only on FlashAttention-3's no-key shortcut, which the backend never
takes: a block without query or key rows runs no kernel; converted at the boundary anyway, as
for flash-attn 2), and ``+inf`` goes back, which every version's backward reads as "no key".
The backward writes into ``dq``/``dk``/``dv`` passed in. Causal and windows are bottom-right
aligned as in FlashAttention-2 (``base.band``).

Head dims: multiples of 8, the larger at most 256 (the backward's limit). A value head dim
different from the query/key one (multi-latent attention) runs as it is where FlashAttention-3
trains it (Hopper; query/key dim in (128, 192] with value dim in (96, 128], e.g. DeepSeek's
192/128: ``native_dims``; from flash-attention's 2025-04 sources: an older build refuses it, and
the backend then pads from that call on), else both are zero-padded to the larger
(``base.pad_head_dims``), as for flash-attn 2. Only ever chosen explicitly; its hardware
profile is the cluster's ``<hardware>-fa3`` (``h100-fa3``...).
"""
from __future__ import annotations

import torch

from megatron_zeppelin.runtime.kernels import base
from megatron_zeppelin.runtime.kernels.base import (OptionalCudaBackend, Pieces, Window, band,
                                                    empty_backward, empty_forward,
                                                    lse_from_kernel, lse_to_kernel,
                                                    pad_head_dims, register)
from megatron_zeppelin.runtime.kernels.flash_attn import flash_kwargs, parameters

MIN_ARCH = (8, 0)     # FlashAttention-3's own check ("Ampere GPUs or newer")
SPLIT_DIMS_ARCH = 9   # different query/key and value head dims: Hopper only
MAX_HEAD_DIM = 256    # the backward's limit on the larger head dim
SPLIT_DIMS_REFUSAL = "v must have shape (total_k, num_heads_k, head_size)"  # before 2025-04


def native_dims(head_dim: int, v_head_dim: int, major: int) -> bool:
    """Whether FlashAttention-3 trains these query/key and value head dims unpadded on a GPU of
    compute capability ``major`` (its ``mha_fwd`` check, less the decode-only pairs beyond the
    backward's ``MAX_HEAD_DIM``)."""
    if head_dim == v_head_dim:
        return True
    return major == SPLIT_DIMS_ARCH and 128 < head_dim <= 192 and 96 < v_head_dim <= 128


def _names(fn) -> tuple[str, ...]:
    """The parameter names of a FlashAttention-3 function (``flash_attn.parameters``)."""
    return tuple(name for name, _ in parameters(fn))


def _causal_name(fn) -> str:
    """The backward's name for the causal flag: ``is_causal`` (custom ops) or ``causal``."""
    return "is_causal" if "is_causal" in _names(fn) else "causal"


class FlashAttn3(OptionalCudaBackend):
    """The ``flash_attn3`` backend (see the module docstring)."""

    name = "flash_attn3"
    kernel = "fa3"
    description = ("FlashAttention-3 varlen kernels (CUDA sm80+, fp16/bf16; flash-attention's "
                   "hopper/ build)")
    module, package = "flash_attn_interface", "FlashAttention-3 (module flash_attn_interface)"

    def install_hint(self) -> str:
        return "build it from flash-attention's hopper/ folder (cd hopper && pip install .)"

    def unavailable(self) -> str | None:
        missing = super().unavailable()
        if missing is None and "cu_seqlens_q" not in _names(self.load()._flash_attn_forward):
            return ("needs FlashAttention-3 from 2025-01 or later (this build's "
                    "_flash_attn_forward takes no cu_seqlens_q): rebuild it from "
                    "flash-attention's hopper/ folder, or use backend 'native'")
        return missing

    def refuses(self, q: torch.Tensor) -> str | None:
        problem = super().refuses(q)
        if problem is not None:
            return problem
        if q.shape[-1] > MAX_HEAD_DIM:
            return f"trains head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}"
        capability = base.device_capability(q.device)
        if capability < MIN_ARCH:
            return f"needs sm80+, got sm{''.join(map(str, capability))}"
        return None

    split_dims_refused = False  # this build refused unlike head dims once: pad from then on

    def _dims(self, q, k, v, *rest, padded: bool = False):
        """q, k, v (and out/dout) as the kernel takes them: unpadded where ``native_dims``
        (and not ``padded``), else padded to one head dim, a multiple of 8."""
        d, dv = q.shape[-1], v.shape[-1]
        if max(d, dv) > MAX_HEAD_DIM:
            raise ValueError(f"backend 'flash_attn3' trains head dims up to {MAX_HEAD_DIM}, got "
                             f"q/k {d} and v {dv}; use backend 'torch'")
        if not padded and not self.split_dims_refused and d % 8 == 0 and dv % 8 == 0 and \
                native_dims(d, dv, base.device_capability(q.device)[0]):
            return [x.contiguous() for x in (q, k, v, *rest)]
        return pad_head_dims(q, k, v, *rest, multiple=8)

    def _call(self, run, tensors: tuple):
        """``run(*self._dims(*tensors))``; where a build older than 2025-04 refuses unlike
        head dims, again padded, remembered for the process."""
        try:
            return run(*self._dims(*tensors))
        except RuntimeError as exc:
            q, v = tensors[0], tensors[2]
            if q.shape[-1] == v.shape[-1] or SPLIT_DIMS_REFUSAL not in str(exc):
                raise
            self.split_dims_refused = True
            return run(*self._dims(*tensors, padded=True))

    def forward(self, q, k, v, pieces: Pieces, causal: bool, scale: float,
                window: Window | None = None):
        if pieces.empty:
            return empty_forward(q, v)
        fn = self.load()._flash_attn_forward

        def run(qp, kp, vp):
            return fn(**flash_kwargs(fn, 0, band(causal, window), q=qp, k=kp, v=vp,
                                     cu_seqlens_q=pieces.cu_q_dev, cu_seqlens_k=pieces.cu_k_dev,
                                     max_seqlen_q=pieces.max_q, max_seqlen_k=pieces.max_k,
                                     softmax_scale=scale, causal=causal))[:2]

        out, lse = self._call(run, (q, k, v))
        keyless = causal or window is not None
        return out[..., :v.shape[-1]].contiguous(), lse_from_kernel(lse, pieces, keyless)

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, causal: bool, scale: float,
                 window: Window | None = None):
        if pieces.empty:
            return empty_backward(q, k, v)
        fn = self.load()._flash_attn_backward
        flags = {_causal_name(fn): causal}
        kernel_lse = lse_to_kernel(lse, pieces, causal or window is not None)

        def run(qp, kp, vp, dop, op):
            dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
            fn(**flash_kwargs(fn, 0, band(causal, window), dout=dop, q=qp, k=kp, v=vp, out=op,
                              softmax_lse=kernel_lse, cu_seqlens_q=pieces.cu_q_dev,
                              cu_seqlens_k=pieces.cu_k_dev, max_seqlen_q=pieces.max_q,
                              max_seqlen_k=pieces.max_k, dq=dq, dk=dk, dv=dv,
                              softmax_scale=scale, deterministic=False, **flags))
            return dq, dk, dv

        dq, dk, dv = self._call(run, (q, k, v, dout, out))
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


BACKEND = register(FlashAttn3())
