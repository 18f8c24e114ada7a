"""The ``flash_attn3`` backend against a CPU stand-in of FlashAttention-3's two Python
interfaces (2025's plain functions: ``window_size`` pair, ``causal``, every parameter required;
later ``torch.library`` custom ops: ``window_size_left/right``, the backward's ``is_causal``),
built on the varlen kernel stand-in with FlashAttention-3's head-dim rule (``flash_standin``):
exact against the float64 math path, forward and backward, with the lse convention of each
build (``-inf`` for rows without keys from 2025, ``+inf`` before)."""
from __future__ import annotations

import types

import pytest
import torch
from flash_standin import StandInFlashOps
from test_kernels import against_math_path, assert_like_math_path

from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.kernels import flash_attn3

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class StandInFA3:
    """``flash_attn_interface``'s ``_flash_attn_forward`` / ``_flash_attn_backward`` over the
    kernel stand-in (``style`` "custom_op" or "2025"; ``neg_inf``: the lse of a row without keys
    is ``-inf``, as FlashAttention-3 writes it since 2025)."""

    def __init__(self, style: str, neg_inf: bool = True, split_dims: bool = True) -> None:
        """split_dims: the build trains unlike q/k and v head dims (2025-04 on)."""
        self.ops = StandInFlashOps(split_dims=lambda d, dv: flash_attn3.native_dims(d, dv, 9),
                                   swapped_gqa=False)
        self.neg_inf, self.split_dims, self.calls = neg_inf, split_dims, []
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
        if self.neg_inf:
            lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
        return out, lse, torch.tensor([]), torch.tensor([])

    def _run_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dq, dk, dv, scale,
                 causal, left, right):
        self._refuse_split(q, v)
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


@pytest.fixture(params=[("custom_op", True, True), ("2025", True, True), ("2025", True, False),
                        ("2025", False, False)],
                ids=["custom-op", "2025-04", "2025-01", "2024-lse"])
def standin(request, monkeypatch) -> StandInFA3:
    module = StandInFA3(*request.param)
    monkeypatch.setattr(kernels.get("flash_attn3"), "load", lambda: module)
    monkeypatch.setattr(kernels.get("flash_attn3"), "split_dims_refused", False)
    monkeypatch.setattr(flash_attn3.base, "device_capability", lambda device: (9, 0))
    return module


PIECES = [(5, 5), (1, 1), (9, 9), (0, 0), (7, 3), (2, 9), (4, 0)]


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, 0)),
                                           (False, (2, 3))],
                         ids=["causal", "full", "band(3,0)", "band(2,3)"])
@pytest.mark.parametrize("heads,kv_heads,d,v_dim", [(4, 4, 16, 16), (4, 2, 16, 16),
                                                    (4, 1, 16, 8), (2, 1, 192, 128),
                                                    (2, 1, 128, 64), (2, 2, 20, 20)],
                         ids=["mha", "gqa", "mqa-small-v", "mla-192-128", "v-unlike-padded",
                              "dims-not-8"])
def test_flash_attn3_runs_blocks_exactly(standin, causal, window, heads, kv_heads, d, v_dim):
    """Causal, full and windowed blocks (rows without keys included), MHA/GQA/MQA, and value
    head dims unlike q/k's: unpadded where FlashAttention-3 trains them (192/128 on Hopper,
    from its 2025-04 build: an older one refuses, and the backend pads from then on), padded
    to one multiple of 8 otherwise; the same results either way."""
    got, want = against_math_path("flash_attn3", PIECES, causal, window, heads, kv_heads, d,
                                  v_dim, seed=3)
    assert_like_math_path(got, want, 3e-2)
    native = flash_attn3.native_dims(d, v_dim, 9) and d % 8 == 0 and v_dim % 8 == 0 and \
        (standin.split_dims or d == v_dim)
    kernel_dims = {(c[1], c[2]) for c in standin.calls}
    if native:
        assert kernel_dims == {(d, v_dim)}  # MLA's 192/128 runs unpadded
    else:
        padded = -(-max(d, v_dim) // 8) * 8
        assert kernel_dims == {(padded, padded)}


def test_flash_attn3_head_dim_rule_and_refusals(monkeypatch):
    """FlashAttention-3 trains q/k 192 with v 128 unpadded on Hopper only, and no head dim
    over 256; below sm80 the backend refuses; not installed, it says how to build it."""
    assert flash_attn3.native_dims(192, 128, 9) and flash_attn3.native_dims(128, 128, 8)
    assert not flash_attn3.native_dims(192, 128, 8) and not flash_attn3.native_dims(128, 64, 9)
    assert not flash_attn3.native_dims(64, 512, 9)  # the forward runs it, the backward not
    backend = kernels.get("flash_attn3")
    big = torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), torch.zeros(1, 1, 320)
    with pytest.raises(ValueError, match=r"backend 'flash_attn3' trains head dims up to 256, "
                                         r"got q/k 64 and v 320"):
        backend._dims(*big)
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    monkeypatch.setattr(flash_attn3.base, "device_capability", lambda device: (7, 5))
    assert backend.refuses(q) == "needs sm80+, got sm75"
    monkeypatch.setattr(flash_attn3.base, "device_capability", lambda device: (9, 0))
    assert backend.refuses(q) is None
    monkeypatch.setattr(backend, "load", lambda: None)
    assert "hopper/ folder" in backend.unavailable()
    assert backend.kernel == "fa3" and backend.window_limit is None
