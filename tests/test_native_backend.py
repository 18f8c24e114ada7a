"""The native backend's whole code path on CPU, through the kernel stand-in (flash_standin).

The stand-in has the contract of torch's varlen flash kernel (int32 offsets on the device,
+inf lse for rows without keys, fp16/bf16 only, uint64 rng state); the backend must build its
arguments, convert the LSE both ways and pass the final out/lse to the backward. Results are
compared with a float64 reference at the dtype's rounding.
"""
from __future__ import annotations

import types
import warnings

import pytest
import torch

from flash_standin import install
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.kernels import base, native
from megatron_zeppelin.runtime.merge import merge_into_
from test_kernels import (EQUAL, UNEQUAL, assert_backward_matches, random_block,
                          reference_block)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}  # output/gradient rounding
HEADS = [(4, 4), (4, 2), (4, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("causal,pieces", [(True, EQUAL), (False, UNEQUAL), (True, UNEQUAL)])
def test_native_backend_matches_float64(dtype, heads, kv_heads, causal, pieces, monkeypatch):
    standin = install(monkeypatch)
    q, k, v, cu_q, cu_k = random_block(11, heads, kv_heads, pieces, dtype=dtype)
    scale, tol = 0.37, TOLERANCE[dtype]
    out, lse = kernels.block_forward(q, k, v, cu_q, cu_k, causal, scale, backend="native")
    want_out, want_lse = reference_block(q, k, v, cu_q, cu_k, causal, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == want_lse.shape
    assert not torch.isposinf(lse).any(), "the kernel's +inf must become the engine's -inf"
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=0)
    assert_backward_matches(q, k, v, out, lse, cu_q, cu_k, causal, scale, "native", tol * 2,
                            seed=3)
    assert standin.calls == {"forward": 1, "backward": 1}


def test_native_merge_and_backward_with_rows_that_see_no_key_in_a_block(monkeypatch):
    """Two blocks over 6 query rows (pieces A = rows 0..2, B = rows 3..5): a full block where
    A sees 6 keys and B none (+inf from the kernel, -inf after), and a causal block where each
    piece sees its own 3 keys. The merge is exact and the backward of each block with the FINAL
    out/lse sums to the float64 gradients of the union."""
    install(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    q, k1, v1, k2, v2, dout = (torch.randn(6, 4, 8, generator=gen).to(torch.bfloat16)
                               for _ in range(6))
    scale = 0.4
    full = kernels.make_pieces([0, 3, 6], [0, 6, 6])
    diag = kernels.make_pieces([0, 3, 6], [0, 3, 6])
    acc_out, acc_lse = torch.zeros(6, 4, 8), torch.full((4, 6), float("-inf"))
    for pieces, k, v, causal in ((full, k1, v1, False), (diag, k2, v2, True)):
        out, lse = kernels.block_forward(q, k, v, pieces, None, causal, scale, backend="native")
        merge_into_(acc_out, acc_lse, out, lse)
    leaves = [t.double().requires_grad_() for t in (q, k1, v1, k2, v2)]
    qd, k1d, v1d, k2d, v2d = leaves
    keys, values = torch.cat([k1d, k2d]), torch.cat([v1d, v2d])
    visible = torch.zeros(6, 12, dtype=torch.bool)
    visible[:3, :6] = True
    for a in (0, 3):
        visible[a:a + 3, 6 + a:9 + a] = torch.ones(3, 3, dtype=torch.bool).tril()
    s = torch.einsum("qhd,khd->hqk", qd, keys).masked_fill(~visible, float("-inf")) * scale
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), values)
    torch.testing.assert_close(acc_out.double(), want.detach(), atol=2e-2, rtol=0)
    torch.testing.assert_close(acc_lse.double(), torch.logsumexp(s, -1).detach(), atol=1e-5,
                               rtol=0)
    final_out = acc_out.to(torch.bfloat16)
    dq = torch.zeros(6, 4, 8, dtype=torch.float64)
    grads = []
    for pieces, k, v, causal in ((full, k1, v1, False), (diag, k2, v2, True)):
        gq, gk, gv = kernels.block_backward(dout, q, k, v, final_out, acc_lse, pieces, None,
                                            causal, scale, backend="native")
        dq += gq.double()
        grads += [gk, gv]
    want.backward(dout.double())
    torch.testing.assert_close(dq, qd.grad, atol=5e-2, rtol=0)
    for got, leaf in zip(grads, leaves[1:]):
        torch.testing.assert_close(got.double(), leaf.grad, atol=5e-2, rtol=0)


def test_auto_picks_native_for_half_tensors_it_accepts(monkeypatch):
    install(monkeypatch)
    half = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    assert kernels.resolve_backend("auto", half) == "native"
    assert kernels.resolve_backend("auto", half.float()) == "torch"  # fp32: the math path
    assert kernels.resolve_backend("auto", torch.zeros(4, 4, 12, dtype=torch.float16)) == "torch"
    with pytest.raises(ValueError, match="head dim that is a multiple of 8 and <= 256, got 12"):
        kernels.resolve_backend("native", torch.zeros(4, 4, 12, dtype=torch.float16))


def test_real_kernel_refuses_cpu_tensors_at_run_time():
    """Without the stand-in the native backend never falls back: it calls the real kernel or
    refuses, naming why."""
    assert isinstance(native.BACKEND.ops, native.AtenFlashOps)
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    assert native.BACKEND.refuses(q) == "needs CUDA tensors, got cpu"
    with pytest.raises(ValueError, match="'native' cannot run this block: needs CUDA"):
        kernels.block_forward(q, q, q, [0, 4], [0, 4], True, 0.1, backend="native")


def test_math_path_on_cuda_warns_once_with_the_reason(monkeypatch):
    monkeypatch.setattr(base, "_WARNED", set())
    fake = types.SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=(8, 4, 64),
                                 device=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert kernels.select("auto", fake).name == "torch"
    assert len(caught) == 1
    assert "native: needs fp16/bf16 tensors, got torch.float32" in str(caught[0].message)
    assert "tens of times slower" in str(caught[0].message)


def test_backends_are_registered_objects_behind_one_protocol():
    assert kernels.choices()[0] == "auto"
    assert set(kernels.names()) >= {"native", "torch", "flash_attn", "flash_attn3", "te"}
    for name in kernels.names():
        backend = kernels.get(name)
        assert isinstance(backend, kernels.KernelBackend) and backend.name == name
        assert backend.kernel in {"fa2", "fa3", "cudnn", "cpu"}
    with pytest.raises(ValueError, match="already taken"):
        kernels.register(kernels.get("torch"))


def test_pieces_record_rows_without_keys():
    equal = kernels.make_pieces([0, 3, 5], [0, 3, 5])
    assert (equal.max_q, equal.max_k) == (3, 3)
    assert not equal.keyless_rows(True) and not equal.keyless_rows(False)
    longer_q = kernels.make_pieces([0, 4], [0, 2])
    assert longer_q.keyless_rows(True) and not longer_q.keyless_rows(False)
    empty_k = kernels.make_pieces([0, 2, 4], [0, 2, 2])
    assert empty_k.keyless_rows(False)
    assert empty_k.cu_q_dev.dtype == torch.int32 and empty_k.cu_k_dev.tolist() == [0, 2, 2]


# ----------------------------------------------------------------------------- stand-in strictness
def _raw_call(d=64, heads=4, kv_heads=2, pieces=((3, 3), (2, 4)), dtype=torch.bfloat16):
    """Kernel arguments of a small block, as the backend builds them."""
    q, k, v, cu_q, cu_k = random_block(5, heads, kv_heads, list(pieces), dtype=dtype, d=d)
    meta = kernels.make_pieces(cu_q, cu_k)
    return q, k, v, meta


def test_the_stand_in_fails_loudly_on_what_the_real_kernel_would_misread():
    from flash_standin import StandInFlashOps

    ops = StandInFlashOps()
    q, k, v, meta = _raw_call()
    out, lse, rng, unused, _ = ops.forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, meta.max_q,
                                           meta.max_k, 0.0, True, False, scale=0.1)
    assert rng.device == unused.device == q.device and rng.dtype == torch.uint64
    dout = torch.randn_like(out)

    def backward(lse_arg):
        return ops.backward(dout, q, k, v, out, lse_arg, meta.cu_q_dev, meta.cu_k_dev,
                            meta.max_q, meta.max_k, 0.0, True, rng, unused, scale=0.1)

    backward(lse)
    strided = torch.empty(lse.shape[1], lse.shape[0]).t().copy_(lse)  # same values, [h, t]
    assert strided.shape == lse.shape and not strided.is_contiguous()
    for bad, match in ((strided, "contiguous"), (lse.double(), "float32"),
                       (lse[:, :-1], r"\[4, 5\]")):
        with pytest.raises(RuntimeError, match=f"logsumexp must be .*{match}"):
            backward(bad)
    cu_q = torch.tensor([0, 9, 3, 9, 5], dtype=torch.int32)[::2]  # [0, 3, 5], stride 2
    for bad in (cu_q, meta.cu_q_dev.long()):
        with pytest.raises(RuntimeError, match="cum_seq_q must be a contiguous 1-D int32"):
            ops.forward(q, k, v, bad, meta.cu_k_dev, 3, 4, 0.0, True, False, scale=0.1)
    with pytest.raises(RuntimeError, match="max length 2 given .* skip the rows"):
        ops.forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, 2, 4, 0.0, True, False, scale=0.1)
    ops.forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, 8, 4, 0.0, True, False, scale=0.1)
    for d in (12, 264):
        q, k, v, meta = _raw_call(d=d)
        with pytest.raises(RuntimeError, match=f"head dim {d}: the kernel takes multiples of 8"):
            ops.forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, 3, 4, 0.0, True, False)


SINGLE_ROWS = [(1, 3), (0, 2), (1, 1), (0, 0), (1, 4)]  # max_q 1 with empty query pieces


def test_the_stand_in_fails_like_the_kernel_on_single_row_gqa_with_empty_query_pieces():
    from flash_standin import StandInFlashOps

    ops = StandInFlashOps()
    q, k, v, meta = _raw_call(pieces=SINGLE_ROWS)
    assert meta.max_q == 1
    with pytest.raises(RuntimeError, match=r"max_q=1 with GQA \(4 heads over 2\) reshapes q "
                       r"\(3, 4, 64\) to \[5, 2, 2, 64\]"):
        ops.forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, 1, meta.max_k, 0.0, True, False)
    for pieces, kv_heads in ((SINGLE_ROWS, 4), ([(1, 3), (1, 2)], 2)):  # MHA; one row each
        q, k, v, meta = _raw_call(pieces=pieces, kv_heads=kv_heads)
        ops.forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, 1, meta.max_k, 0.0, True, False)


class StandInFlashAttn:
    """flash-attn 2.7's varlen entry points over the kernel stand-in: the same FlashAttention-2
    code as torch's, its ``max_q == 1`` GQA reshape included (``flash_attn`` backend's
    ``load()``); ``max_q`` records what the backend passed."""

    def __init__(self) -> None:
        from flash_standin import StandInFlashOps

        self.ops, self.max_q = StandInFlashOps(), []

    def _flash_attn_varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal,
                                   window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False):
        self.max_q.append(max_seqlen_q)
        out, lse, rng_state, _, _ = self.ops.forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
            False, scale=softmax_scale, window_size_left=window_size_left,
            window_size_right=window_size_right)
        return out, lse, None, rng_state

    def _flash_attn_varlen_backward(self, dout, q, k, v, out, softmax_lse, dq, dk, dv,
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, softmax_scale, causal, window_size_left=-1,
                                    window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                    deterministic=False, rng_state=None):
        self.max_q.append(max_seqlen_q)
        grads = self.ops.backward(
            dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, dropout_p, causal, torch.zeros(2, dtype=torch.uint64),
            torch.zeros((), dtype=torch.uint64), scale=softmax_scale,
            window_size_left=window_size_left, window_size_right=window_size_right)
        for into, grad in zip((dq, dk, dv), grads):
            into.copy_(grad)


def flash_backend(name: str, monkeypatch):
    """The registered backend ``name`` running on the CPU stand-in; returns (backend, the
    ``max_q`` values it passed the kernel)."""
    if name == "native":
        return kernels.get(name), install(monkeypatch).max_q_seen
    module = StandInFlashAttn()
    backend = kernels.get(name)
    monkeypatch.setattr(backend, "load", lambda: module)
    return backend, module.max_q


@pytest.mark.parametrize("name", ["native", "flash_attn"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pieces", [SINGLE_ROWS, [(1, 3), (1, 1), (1, 4)]],
                         ids=["empty query pieces", "one row each"])
def test_flash_backends_never_send_single_row_gqa_to_the_kernel(name, causal, pieces,
                                                                monkeypatch):
    """A single-row GQA block (with or without empty query pieces) runs exactly through both
    FlashAttention-2 backends with ``max_q`` 2, off the kernel's swapped-groups path (which
    fails on empty pieces: the stand-in, as the real kernel, raises there)."""
    backend, max_q = flash_backend(name, monkeypatch)
    q, k, v, cu_q, cu_k = random_block(9, 4, 2, pieces, dtype=torch.bfloat16)
    out, lse = kernels.block_forward(q, k, v, cu_q, cu_k, causal, 0.3, backend=backend)
    want_out, want_lse = reference_block(q, k, v, cu_q, cu_k, causal, 0.3)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    assert_backward_matches(q, k, v, out, lse, cu_q, cu_k, causal, 0.3, backend, 4e-2, seed=2)
    assert max_q == [2, 2]
    meta = kernels.make_pieces(cu_q, cu_k)
    assert base.kernel_max_q(meta, 4, 4) == 1  # MHA keeps the longest piece


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_real_kernel_fails_where_the_stand_in_says_and_the_backend_avoids_it():
    """On a GPU: the raw kernel refuses max_q = 1 GQA with an empty query piece (what the
    stand-in emulates); the native backend runs the same block, exactly."""
    q, k, v, cu_q, cu_k = random_block(9, 4, 2, SINGLE_ROWS, dtype=torch.bfloat16, d=64)
    meta = kernels.make_pieces(cu_q, cu_k, "cuda")
    q, k, v = (t.cuda() for t in (q, k, v))
    with pytest.raises(RuntimeError):
        native.AtenFlashOps().forward(q, k, v, meta.cu_q_dev, meta.cu_k_dev, 1, meta.max_k,
                                      0.0, True, False)
    out, lse = kernels.block_forward(q, k, v, meta, None, True, 0.125, backend="native")
    want_out, want_lse = reference_block(q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, True, 0.125)
    torch.testing.assert_close(out.cpu().double(), want_out, atol=2e-2, rtol=0)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.cpu().double()[finite], want_lse[finite], atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gradient_tolerances_cover_the_kernels_rounding(dtype):
    """The GPU check's gradient tolerance (test_gpu.TOL) is at least 1.5x the error model's
    (flash_rounding: the kernel's roundings emulated) on the very blocks it checks."""
    from flash_rounding import emulate_piece, exact_piece
    from test_gpu import CASES, HEAD_DIM, TOL

    worst = 0.0
    for causal, pieces in CASES.values():
        q, k, v, cu_q, cu_k = random_block(21, 8, 2, pieces, dtype=dtype, d=HEAD_DIM)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        for a, b, c, e in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
            if b > a and e > c:
                got = emulate_piece(q[a:b], k[c:e], v[c:e], dout[a:b], causal, HEAD_DIM ** -0.5)
                want = exact_piece(q[a:b], k[c:e], v[c:e], dout[a:b], causal, HEAD_DIM ** -0.5)
                worst = max(worst, *(float((x - y).abs().max()) for x, y in
                                     zip(got[2:], want[1:])))
    unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    assert 2 * unit < worst < TOL[dtype]["grad"] / 1.5, worst  # rounding shows, and fits
