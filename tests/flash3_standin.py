"""A CPU stand-in of FlashAttention-3's Python interface (tests only): ``StandInFA3`` has
``flash_attn_interface``'s ``_flash_attn_forward`` / ``_flash_attn_backward`` in its two forms
(2025's plain functions: a ``window_size`` pair, ``causal``, every parameter up to it required;
the later ``torch.library`` custom ops: ``window_size_left/right``, the backward's
``is_causal``), over the varlen kernel stand-in (``flash_standin``) with FlashAttention-3's
head-dim rule and no FlashAttention-2 ``max_q == 1`` GQA path; the lse of a row without keys
is ``-inf``, and a build older than 2025-04 refuses unlike q/k and v head dims with the real
message. ``install_in_process`` makes the ``flash_attn3`` backend
run on it in a worker process (run_world ranks)."""
from __future__ import annotations

import torch
from flash_standin import StandInFlashOps

from megatron_zeppelin.runtime.kernels import flash_attn3


def forward_takes(head_dim: int, v_head_dim: int) -> bool:
    """FlashAttention-3's ``mha_fwd`` check for unlike head dims on Hopper, as flash_api.cpp
    writes it (the backward adds: the larger at most 256)."""
    return (128 < head_dim <= 192 and 96 < v_head_dim <= 128) or \
        (head_dim <= 64 and v_head_dim <= 512)


class StandInFA3:
    """``flash_attn_interface``'s ``_flash_attn_forward`` / ``_flash_attn_backward`` over the
    kernel stand-in (``style`` "custom_op" or "2025"; the lse of a row without keys is
    ``-inf``, as FlashAttention-3 writes it)."""

    def __init__(self, style: str, split_dims: bool = True) -> None:
        """split_dims: the build trains unlike q/k and v head dims (2025-04 on)."""
        self.ops = StandInFlashOps(split_dims=forward_takes, swapped_gqa=False)
        self.split_dims, self.calls = split_dims, []
        self._flash_attn_forward = self._custom_fwd if style == "custom_op" else self._fwd_2025
        self._flash_attn_backward = self._custom_bwd if style == "custom_op" else self._bwd_2025

    def _refuse_split(self, q, v) -> None:
        if not self.split_dims and q.shape[-1] != v.shape[-1]:  # the 2025-01 build's check
            raise RuntimeError("v must have shape (total_k, num_heads_k, head_size)")

    def _run_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right):
        self._refuse_split(q, v)
        self.calls.append(("forward", q.shape[-1], v.shape[-1]))
        out, lse, *_ = self.ops.forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                        scale=scale, window_size_left=left,
                                        window_size_right=right)
        lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
        return out, lse, torch.tensor([]), torch.tensor([])

    def _run_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dq, dk, dv, scale,
                 causal, left, right):
        self._refuse_split(q, v)
        if max(q.shape[-1], v.shape[-1]) > 256:  # mha_bwd's check
            raise RuntimeError("FlashAttention backward only supports head dimension at most 256")
        self.calls.append(("backward", q.shape[-1], v.shape[-1]))
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # both read as "no key"
        grads = self.ops.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0,
                                  causal, torch.zeros(2, dtype=torch.uint64),
                                  torch.zeros((), dtype=torch.uint64), scale=scale,
                                  window_size_left=left, window_size_right=right)
        for into, grad in zip((dq, dk, dv), grads):
            into.copy_(grad)
        return torch.empty(0)

    # the custom-op interface (names and defaults as flash-attention's hopper/ has them)
    def _custom_fwd(self, q, k, v, k_new=None, v_new=None, qv=None, out_=None,
                    cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                    seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None,
                    rotary_sin=None, seqlens_rotary=None, q_descale=None, k_descale=None,
                    v_descale=None, softmax_scale=None, causal=False, window_size_left=-1,
                    window_size_right=-1, attention_chunk=0, softcap=0.0,
                    rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                    pack_gqa=None, sm_margin=0):
        assert softcap == 0.0 and k_new is None and page_table is None
        return self._run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window_size_left, window_size_right)

    def _custom_bwd(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None,
                    sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
                    window_size_left=-1, window_size_right=-1, softcap=0.0,
                    deterministic=False, sm_margin=0):
        assert dq is not None and dk is not None and dv is not None  # the op returns none
        return self._run_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, is_causal,
                             window_size_left, window_size_right)

    # 2025's interface: a window_size pair, ``causal`` in both, no defaults up to it
    def _fwd_2025(self, q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k,
                  cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
                  q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
                  attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                  scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
        return self._run_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, *window_size)

    def _bwd_2025(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q,
                  sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal,
                  window_size=(-1, -1), softcap=0.0, deterministic=False, sm_margin=0):
        return self._run_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal,
                             *window_size)


def install_in_process() -> StandInFA3:
    """The ``flash_attn3`` backend on the stand-in (custom-op form, Hopper), in this process:
    nothing to undo there."""
    module = StandInFA3("custom_op")
    backend = flash_attn3.BACKEND
    backend.load = lambda: module
    backend.refuses = lambda q: None  # CPU tensors: the stand-in takes them
    flash_attn3.base.device_capability = lambda device: (9, 0)
    return module
