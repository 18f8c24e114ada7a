"""Optional fused backends of ``kernels``: flash-attn varlen and Transformer Engine (THD).

Same conventions as ``kernels`` (packed ``[t, heads, head_dim]`` tensors, ``cu`` offsets as
tuples of ints, causal aligned at the END, lse ``[heads, tq]`` float32 with ``-inf`` for rows
that see no key). Both need CUDA fp16/bf16 tensors; ``kernels.resolve_backend`` checks that.

* flash-attn 2.6+: ``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` /
  ``_flash_attn_varlen_backward`` (the lower-level calls that return and take ``softmax_lse``
  ``[heads, total_q]``). flash-attn marks a row without keys with lse ``+inf``; it is mapped to
  ``-inf`` here and back. Head dims are padded to a multiple of 8 as flash-attn requires.
* Transformer Engine: ``cpp_extensions.fused_attn_fwd`` / ``fused_attn_bwd`` with layout
  ``thd_thd_thd``, mask ``padding_causal_bottom_right`` or ``padding``; its softmax stats are
  ``[total_q, heads, 1]`` (cuDNN >= 9.6) or ``[batch, heads, max_q, 1]`` before, converted to
  and from ``[heads, tq]``. No dropout is used, so the RNG state passed back is unused (zeros).
"""
from __future__ import annotations

import importlib
import inspect
from functools import lru_cache
from typing import Sequence

import torch

_EXTRAS = {"flash_attn": "flash-attn", "te": "te"}
_MODULES = {"flash_attn": "flash_attn.flash_attn_interface",
            "te": "transformer_engine.pytorch.cpp_extensions.fused_attn"}


@lru_cache(maxsize=None)
def _load(name: str):
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError:
        return None


def available(name: str) -> bool:
    """Whether optional backend ``name`` (``flash_attn`` or ``te``) can be imported."""
    return _load(name) is not None


def require(name: str) -> None:
    """ImportError naming the pip extra unless backend ``name`` can be imported."""
    if name not in _MODULES:
        raise ValueError(f"attention backend={name!r} is not an optional backend: expected one "
                         f"of {list(_MODULES)}")
    if not available(name):
        raise ImportError(f"attention backend {name!r} needs {_MODULES[name].split('.')[0]}, "
                          f"which is not installed: pip install \"megatron-zeppelin"
                          f"[{_EXTRAS[name]}]\" (or use backend 'torch')")


def forward(name: str, q, k, v, cq: Sequence[int], ck: Sequence[int], causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [tq, h, d], lse [h, tq] fp32)`` with backend ``name``."""
    require(name)
    if name == "flash_attn":
        return _flash_forward(q, k, v, cq, ck, causal, scale)
    return _te_forward(q, k, v, cq, ck, causal, scale)


def backward(name: str, dout, q, k, v, out, lse, cq: Sequence[int], ck: Sequence[int],
             causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` with backend ``name`` given the rows' final ``out`` and ``lse``."""
    require(name)
    if name == "flash_attn":
        return _flash_backward(dout, q, k, v, out, lse, cq, ck, causal, scale)
    return _te_backward(dout, q, k, v, out, lse, cq, ck, causal, scale)


def _cu_tensor(cu: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(cu), dtype=torch.int32, device=device)


def _max_len(cu: Sequence[int]) -> int:
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


# ----------------------------------------------------------------------------- flash-attn

def _pad8(*tensors: torch.Tensor) -> list[torch.Tensor]:
    d = tensors[0].shape[-1]
    if d % 8 == 0:
        return [t.contiguous() for t in tensors]
    return [torch.nn.functional.pad(t, (0, 8 - d % 8)).contiguous() for t in tensors]


def _flash_kwargs(fn, positional: int, **kwargs) -> dict:
    """Keyword arguments that fit this flash-attn version of ``fn``: 2.6+ takes
    window_size_left/right (and softcap), older ones a window_size pair; parameters without a
    default that the caller does not set (block_table, ...) get None."""
    try:
        params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters  # custom_op wraps
    except (TypeError, ValueError):
        params = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, -1)
    else:
        kwargs.update(window_size_left=-1, window_size_right=-1)
    if "softcap" in params or not params:
        kwargs["softcap"] = 0.0
    for name, param in list(params.items())[positional:]:
        if name not in kwargs and param.default is inspect.Parameter.empty:
            kwargs[name] = None
    return kwargs


def _flash_forward(q, k, v, cq, ck, causal, scale):
    fa = _load("flash_attn")
    d = q.shape[-1]
    qp, kp, vp = _pad8(q, k, v)
    fn = fa._flash_attn_varlen_forward
    out, lse, *_ = fn(qp, kp, vp, _cu_tensor(cq, q.device), _cu_tensor(ck, q.device),
                      _max_len(cq), _max_len(ck),
                      **_flash_kwargs(fn, 7, dropout_p=0.0, softmax_scale=scale, causal=causal,
                                      alibi_slopes=None, return_softmax=False))
    lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
    return out[..., :d].contiguous(), lse


def _flash_backward(dout, q, k, v, out, lse, cq, ck, causal, scale):
    fa = _load("flash_attn")
    d = q.shape[-1]
    dop, qp, kp, vp, op = _pad8(dout, q, k, v, out)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    lse = lse.float().masked_fill(torch.isneginf(lse), float("inf")).contiguous()
    fn = fa._flash_attn_varlen_backward
    fn(dop, qp, kp, vp, op, lse, dq, dk, dv, _cu_tensor(cq, q.device), _cu_tensor(ck, q.device),
       _max_len(cq), _max_len(ck),
       **_flash_kwargs(fn, 13, dropout_p=0.0, softmax_scale=scale, causal=causal,
                       alibi_slopes=None, deterministic=False, rng_state=None))
    return dq[..., :d], dk[..., :d], dv[..., :d]


# ----------------------------------------------------------------------------- Transformer Engine

def _te_stats_packed() -> bool:
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version()) >= (9, 6, 0)


def _te_common(q, cq, ck, causal, scale) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Keyword arguments shared by TE's forward and backward, and the cu tensors."""
    cu_q, cu_k = _cu_tensor(cq, q.device), _cu_tensor(ck, q.device)
    return dict(cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k, attn_scale=scale,
                dropout=0.0, qkv_layout="thd_thd_thd", attn_bias_type="no_bias",
                attn_mask_type="padding_causal_bottom_right" if causal else "padding",
                window_size=(-1, 0) if causal else (-1, -1)), cu_q, cu_k


def _te_forward(q, k, v, cq, ck, causal, scale):
    te = _load("te")
    kwargs, cu_q, cu_k = _te_common(q, cq, ck, causal, scale)
    out, aux = te.fused_attn_fwd(True, _max_len(cq), _max_len(ck), cu_q, cu_k, q.contiguous(),
                                 k.contiguous(), v.contiguous(), q.dtype,
                                 te.FusedAttnBackend["F16_arbitrary_seqlen"], **kwargs)
    return out, _lse_from_te(aux[0], cq, q.shape[1])


def _te_backward(dout, q, k, v, out, lse, cq, ck, causal, scale):
    te = _load("te")
    from transformer_engine.pytorch.constants import TE_DType

    kwargs, cu_q, cu_k = _te_common(q, cq, ck, causal, scale)
    stats = _lse_to_te(lse.float().masked_fill(torch.isneginf(lse), float("inf")), cq)
    unused_rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    grads = te.fused_attn_bwd(_max_len(cq), _max_len(ck), cu_q, cu_k, q.contiguous(),
                              k.contiguous(), v.contiguous(), out.contiguous(),
                              dout.contiguous(), q.dtype, TE_DType[dout.dtype],
                              [stats, unused_rng_state],
                              te.FusedAttnBackend["F16_arbitrary_seqlen"],
                              deterministic=False, **kwargs)
    return grads[0], grads[1], grads[2]


def _te_rows(cq: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(piece index, row in piece) of every packed query row."""
    lengths = torch.tensor([b - a for a, b in zip(cq, cq[1:])], device=device)
    piece = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    starts = torch.tensor(list(cq[:-1]), device=device)
    return piece, torch.arange(cq[-1], device=device) - starts[piece]


def _lse_from_te(stats: torch.Tensor, cq: Sequence[int], heads: int) -> torch.Tensor:
    """TE softmax stats -> ``[heads, tq]`` float32."""
    if _te_stats_packed():
        return stats.reshape(-1, heads)[: cq[-1]].t().float().contiguous()
    piece, row = _te_rows(cq, stats.device)
    return stats[piece, :, row, 0].t().float().contiguous()


def _lse_to_te(lse: torch.Tensor, cq: Sequence[int]) -> torch.Tensor:
    """``[heads, tq]`` -> TE softmax stats (packed ``[tq, h, 1]`` or ``[b, h, max_q, 1]``)."""
    heads = lse.shape[0]
    if _te_stats_packed():
        return lse.t().contiguous().unsqueeze(-1)
    piece, row = _te_rows(cq, lse.device)
    stats = torch.full((len(cq) - 1, heads, max(_max_len(cq), 1), 1), float("inf"),
                       dtype=torch.float32, device=lse.device)
    stats[piece, :, row, 0] = lse.t()
    return stats
