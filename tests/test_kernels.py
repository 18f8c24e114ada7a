"""Kernels and the LSE merge alone (no processes): exact against a float64 reference."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.kernels import flash_attn as flash_backend
from megatron_zeppelin.runtime.kernels import torch_math
from megatron_zeppelin.runtime.merge import merge_into_, merge_lse

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


def reference_block(q, k, v, cu_q, cu_k, causal, scale):
    """float64 (out, lse) of a varlen block by explicit masking (END-aligned causal)."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        tq, tk = qs.stop - qs.start, ks.stop - ks.start
        if tq == 0 or tk == 0:
            continue
        kk = k[ks].double().repeat_interleave(group, 1)
        vv = v[ks].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[qs].double(), kk) * scale
        if causal:
            visible = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
            s = s.masked_fill(~visible, float("-inf"))
        piece_lse = torch.logsumexp(s, -1)
        probs = torch.exp(s - piece_lse.masked_fill(torch.isneginf(piece_lse), 0).unsqueeze(-1))
        out[qs] = torch.einsum("hqk,khd->qhd", probs, vv)
        lse[:, qs] = piece_lse
    return out, lse


def random_block(seed, heads, kv_heads, pieces, dtype=torch.float32, d=8):
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = [0], [0]
    for tq, tk in pieces:
        cu_q.append(cu_q[-1] + tq)
        cu_k.append(cu_k[-1] + tk)
    q = torch.randn(cu_q[-1], heads, d, generator=gen).to(dtype)
    k = torch.randn(cu_k[-1], kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(cu_k[-1], kv_heads, d, generator=gen).to(dtype)
    return q, k, v, cu_q, cu_k


def against_math_path(name, pieces, causal, window, heads, kv_heads, d, v_dim, seed):
    """``[(out, lse, dq, dk, dv) of backend ``name`` on a random bf16 block, the same of the
    float64 math path (the reference)]``, with a value head dim ``v_dim`` (MLA when unlike
    ``d``) and the same ``causal``/``window``."""
    q, k, v, cu_q, cu_k = random_block(seed, heads, kv_heads, pieces, torch.bfloat16, d=d)
    v = torch.randn(v.shape[0], kv_heads, v_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    dout = torch.randn(q.shape[0], heads, v_dim,
                       generator=torch.Generator().manual_seed(seed + 2)).bfloat16()
    results = []
    for backend, tensors in ((kernels.get(name), (q, k, v, dout)),
                             ("torch", [x.double() for x in (q, k, v, dout)])):
        out, lse = kernels.block_forward(*tensors[:3], cu_q, cu_k, causal, 0.3, backend,
                                         window)
        grads = kernels.block_backward(tensors[3], *tensors[:3], out, lse, cu_q, cu_k, causal,
                                       0.3, backend, window)
        results.append((out, lse, *grads))
    return results


def assert_like_math_path(got, want, atol: float):
    """``against_math_path``'s two results agree: the same rows without keys (-inf lse,
    never +inf), values within ``atol`` (times the largest reference value; lse 1e-5)."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        finite = torch.isfinite(w)
        assert torch.equal(torch.isfinite(g), finite) and not torch.isposinf(g).any(), name
        largest = float(w[finite].abs().max()) if finite.any() else 0.0
        tol = 1e-5 if name == "lse" else atol * max(1.0, largest)
        torch.testing.assert_close(g.double()[finite], w[finite], atol=tol, rtol=0, msg=name)


EQUAL = [(5, 5), (1, 1), (17, 17), (0, 0), (33, 33)]
UNEQUAL = [(5, 9), (7, 3), (1, 12), (4, 0), (0, 6), (16, 16), (2, 1)]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("causal,pieces", [(True, EQUAL), (False, UNEQUAL), (True, UNEQUAL)])
@pytest.mark.parametrize("force_math", [False, True])
def test_block_forward_backward_exact(heads, kv_heads, causal, pieces, force_math, monkeypatch):
    if force_math:  # the exact math path (GPU's torch path) on every pair, in row chunks
        monkeypatch.setattr(torch_math, "_cpu_kernels", lambda q: False)
        monkeypatch.setattr(torch_math, "MATH_SCORE_ELEMENTS", 150)
    q, k, v, cu_q, cu_k = random_block(1, heads, kv_heads, pieces)
    scale = 0.37
    out, lse = kernels.block_forward(q, k, v, cu_q, cu_k, causal, scale, backend="torch")
    want_out, want_lse = reference_block(q, k, v, cu_q, cu_k, causal, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    assert_backward_matches(q, k, v, out, lse, cu_q, cu_k, causal, scale, "torch", 1e-5, seed=2)


def assert_backward_matches(q, k, v, out, lse, cu_q, cu_k, causal, scale, backend, atol, seed):
    """``block_backward`` of a whole block (its out/lse are final) against float64 autograd of
    ``reference_block_autograd`` (tensors on any device); returns the gradients."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q)
    grads = kernels.block_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale,
                                   backend=backend)
    leaves = [t.cpu().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_block_autograd(*leaves, cu_q, cu_k, causal, scale)
    ref_out.backward(dout.cpu().double())
    for got, leaf in zip(grads, leaves):
        assert got.dtype == q.dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu().double(), leaf.grad, atol=atol, rtol=0)
    return grads


def reference_block_autograd(q, k, v, cu_q, cu_k, causal, scale):
    """Differentiable float64 twin of ``reference_block`` (rows without keys give 0)."""
    outs, group = [], q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        tq, tk = qi.shape[0], ki.shape[0]
        s = torch.einsum("qhd,khd->hqk", qi, ki.repeat_interleave(group, 1)) * scale
        visible = torch.ones(tq, tk, dtype=torch.bool)
        if causal:
            visible = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
        s = s.masked_fill(~visible, -1e300)
        p = torch.softmax(s, -1) * visible.any(-1)[None, :, None]
        outs.append(torch.einsum("hqk,khd->qhd", p, vi.repeat_interleave(group, 1)))
    return torch.cat(outs), None


def test_rows_without_keys_have_neg_inf_lse_and_zero_output():
    q, k, v, cu_q, cu_k = random_block(3, 4, 2, [(6, 2), (3, 0)])
    out, lse = kernels.block_forward(q, k, v, cu_q, cu_k, True, 0.5, backend="torch")
    # END alignment: row r of a 6-row piece sees key c iff c <= r - 4; rows 0..3 see nothing
    assert torch.isneginf(lse[:, :4]).all() and torch.isfinite(lse[:, 4:6]).all()
    assert torch.isneginf(lse[:, 6:]).all()
    assert (out[:4] == 0).all() and (out[6:] == 0).all()
    dq, dk, dv = kernels.block_backward(torch.ones_like(q), q, k, v, out, lse, cu_q, cu_k, True,
                                        0.5, backend="torch")
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:4] == 0).all() and (dq[6:] == 0).all()


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_ring_split_merge_and_backward_are_exact(heads, kv_heads):
    """Keys of one causal sequence cut into blocks (the diagonal causal, the rest full): the
    merged output and the summed block gradients (with the final out/lse) equal the whole."""
    n, cut = 23, [0, 7, 15, 23]
    q, k, v, _, _ = random_block(4, heads, kv_heads, [(n, n)])
    scale, last = 0.41, slice(cut[2], cut[3])
    acc_out = torch.zeros(n - cut[2], heads, q.shape[2])
    acc_lse = torch.full((heads, n - cut[2]), float("-inf"))
    blocks = [(slice(0, 7), False), (slice(7, 15), False), (last, True)]
    for ks, causal in reversed(blocks):  # any order: the merge commutes
        out, lse = kernels.block_forward(q[last], k[ks], v[ks], [0, 8], [0, ks.stop - ks.start],
                                         causal, scale, backend="torch")
        merge_into_(acc_out, acc_lse, out, lse)
    want, want_lse = reference_block(q, k, v, [0, n], [0, n], True, scale)
    torch.testing.assert_close(acc_out.double(), want[last], atol=1e-5, rtol=0)
    torch.testing.assert_close(acc_lse.double(), want_lse[:, last], atol=1e-5, rtol=0)
    dout = torch.randn(8, heads, q.shape[2], generator=torch.Generator().manual_seed(5))
    dq, dk = torch.zeros(8, heads, q.shape[2]), torch.zeros_like(k)
    for ks, causal in blocks:
        gq, gk, _ = kernels.block_backward(dout, q[last], k[ks], v[ks], acc_out, acc_lse,
                                           [0, 8], [0, ks.stop - ks.start], causal, scale,
                                           backend="torch")
        dq += gq
        dk[ks] += gk
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_block_autograd(*leaves, [0, n], [0, n], True, scale)
    ref[last].backward(dout.double())
    torch.testing.assert_close(dq.double(), leaves[0].grad[last], atol=1e-5, rtol=0)
    torch.testing.assert_close(dk.double(), leaves[1].grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.bfloat16, 3e-2)])
def test_other_dtypes(dtype, tol):
    q, k, v, cu_q, cu_k = random_block(6, 4, 2, EQUAL, dtype=dtype)
    out, lse = kernels.block_forward(q, k, v, cu_q, cu_k, True, 0.3, backend="torch")
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64
                                                 else torch.float32)
    want, want_lse = reference_block(q, k, v, cu_q, cu_k, True, 0.3)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=0)


def partial(seed, t=6, h=2, d=4, empty_rows=()):
    gen = torch.Generator().manual_seed(seed)
    out, lse = torch.randn(t, h, d, generator=gen), torch.randn(h, t, generator=gen) * 3
    for row in empty_rows:
        out[row], lse[:, row] = 0.0, float("-inf")
    return out, lse


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, 5), max_size=3))
def test_merge_is_associative_and_commutative(seed, empty_rows):
    a, b, c = (partial(seed + i, empty_rows=empty_rows[i:]) for i in range(3))
    left = merge_lse(*merge_lse(*a, *b), *c)
    right = merge_lse(*a, *merge_lse(*b, *c))
    swapped = merge_lse(*c, *merge_lse(*b, *a))
    for x, y in ((left, right), (left, swapped)):
        torch.testing.assert_close(x[0], y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x[1], y[1], atol=1e-5, rtol=1e-5)


def test_merge_of_empty_rows_is_neutral_and_never_nan():
    a = partial(1, empty_rows=(0, 1))
    b = partial(2, empty_rows=(1, 2))
    out, lse = merge_lse(*a, *b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[:, 1]).all() and (out[1] == 0).all()  # empty on both sides
    torch.testing.assert_close(out[0], b[0][0])  # empty on one side: the other side's row
    torch.testing.assert_close(lse[:, 2], a[1][:, 2])
    want = torch.logaddexp(a[1][:, 3], b[1][:, 3])
    torch.testing.assert_close(lse[:, 3], want)
    w_a, w_b = torch.exp(a[1][:, 3] - want), torch.exp(b[1][:, 3] - want)
    torch.testing.assert_close(out[3], a[0][3] * w_a[:, None] + b[0][3] * w_b[:, None])


def test_merge_into_rows():
    acc_out, acc_lse = partial(3, t=8, empty_rows=(5, 6, 7))
    out, lse = partial(4, t=3)
    rows = torch.tensor([7, 0, 5])
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    merged = merge_lse(acc_out[rows], acc_lse[:, rows], out, lse)
    want_out[rows], want_lse[:, rows] = merged
    merge_into_(acc_out, acc_lse, out, lse, rows)
    torch.testing.assert_close(acc_out, want_out)
    torch.testing.assert_close(acc_lse, want_lse)
    assert torch.isneginf(acc_lse[:, 6]).all()


def test_backend_selection(monkeypatch):
    q = torch.zeros(2, 4, 8)
    for value, want in (("auto", "torch"), ("torch", "torch")):  # CPU tensors: always torch
        monkeypatch.setenv("ZEPPELIN_ATTENTION_BACKEND", value)
        kernels.configured.cache_clear()
        assert kernels.resolve_backend(None, q) == want
    with pytest.raises(ValueError, match="attention backend='cuda'.*expected one of"):
        kernels.resolve_backend("cuda", q)
    monkeypatch.setenv("ZEPPELIN_ATTENTION_BACKEND", "tensorrt")
    kernels.configured.cache_clear()
    with pytest.raises(ValueError, match="ZEPPELIN_ATTENTION_BACKEND='tensorrt'.*'native'"):
        kernels.resolve_backend(None, q)
    kernels.configured.cache_clear()
    with pytest.raises(ValueError, match="backend 'native' cannot run this block: needs "
                                         "fp16/bf16 tensors, got torch.float32"):
        kernels.resolve_backend("native", q)
    with pytest.raises(ValueError, match="backend 'native' cannot run this block: needs CUDA"):
        kernels.resolve_backend("native", q.bfloat16())


@pytest.mark.parametrize("name,extra", [("flash_attn", "flash-attn"), ("te", "te")])
def test_missing_optional_backend_names_the_extra(name, extra, monkeypatch):
    if kernels.get(name).unavailable() is None:
        with pytest.raises(ValueError, match="needs CUDA fp16/bf16"):  # CPU fp32 tensors
            kernels.resolve_backend(name, torch.zeros(2, 4, 8))
        return
    monkeypatch.setenv("ZEPPELIN_ATTENTION_BACKEND", name)
    kernels.configured.cache_clear()
    q, k, v, cu_q, cu_k = random_block(7, 4, 2, [(3, 3)])
    with pytest.raises(ImportError, match=rf'pip install "megatron-zeppelin\[{extra}\]"'):
        kernels.block_forward(q, k, v, cu_q, cu_k, True, 0.5)
    kernels.configured.cache_clear()


@pytest.mark.parametrize("bad,match", [
    (dict(cu_q=[0, 2, 3]), r"cu_q=\[0, 2, 3\] is invalid.*0 to 4"),
    (dict(cu_k=[0, 4, 2, 6]), r"cu_k=\[0, 4, 2, 6\] is invalid"),
    (dict(cu_q=[0, 4], cu_k=[0, 3, 6]), "cu_q has 1 pieces and cu_k 2"),
    (dict(kv_heads=3), "kv_heads=3 must divide heads=4"),
])
def test_block_validation_names_the_bad_value(bad, match):
    kv_heads = bad.get("kv_heads", 2)
    q = torch.zeros(4, 4, 8)
    k = v = torch.zeros(6, kv_heads, 8)
    with pytest.raises(ValueError, match=match):
        kernels.block_forward(q, k, v, bad.get("cu_q", [0, 1, 4]), bad.get("cu_k", [0, 2, 6]),
                              False, 1 / math.sqrt(8), backend="torch")


def test_flash_adapter_fits_old_and_new_signatures():
    """The flash-attn call adapts to 2.6+ (window_size_left/right, softcap, optional tail)
    and to older versions (a window_size pair, required block_table)."""
    def new(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
        return dict(locals())

    def old(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size,
            alibi_slopes, return_softmax, block_table):
        return dict(locals())

    for fn, window in ((new, (-1, -1)), (old, (-1, -1))):
        got = fn(*range(7), **flash_backend.flash_kwargs(
            fn, 7, dropout_p=0.0, softmax_scale=0.5, causal=True, alibi_slopes=None,
            return_softmax=False))
        assert got["causal"] is True and got["softmax_scale"] == 0.5
        assert got.get("window_size", (got.get("window_size_left"),
                                       got.get("window_size_right"))) == window
        assert got["block_table"] is None


def test_flash_adapter_reads_the_lse_of_old_and_new_returns():
    """flash-attn 2.7+ returns (out, lse, S_dmask, rng_state); 2.6 (out, q, k, v, out_padded,
    lse, S_dmask, rng_state): the lse is read from its own place in each."""
    out, lse = torch.zeros(5, 2, 8), torch.ones(2, 5)
    q = torch.full((5, 2, 8), 7.0)
    assert flash_backend.out_and_lse((out, lse, None, None))[1] is lse
    assert flash_backend.out_and_lse((out, q, q, q, out, lse, None, None))[1] is lse
    with pytest.raises(RuntimeError, match="returned 3 values"):
        flash_backend.out_and_lse((out, lse, None))


WINDOW_PIECES = [(1, 1), (2, 2), (5, 5), (64, 64), (65, 65), (66, 66), (130, 130), (0, 0),
                 (201, 201), (7, 12), (12, 7)]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("window", [1, 3, 8, 64])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.float64, 1e-12),
                                        (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("v_head_dim", [8, 12])
def test_windowed_blocks_on_cpu_equal_the_masked_math_path(heads, kv_heads, window, dtype, atol,
                                                           v_head_dim, monkeypatch):
    """The torch backend's sliding window on CPU (``cpu_window``: chunks of L rows through the
    CPU flash kernel; pieces no longer than L + 1 as plain causal) against the masked math
    path in float64 (the exact reference it replaced): out, lse and the gradients, pieces of
    every length around the window and chunk edges, GQA/MQA, a wider value head (MLA)."""
    q, k, v, cu_q, cu_k = random_block(5, heads, kv_heads, WINDOW_PIECES, dtype)
    v = torch.randn(v.shape[0], kv_heads, v_head_dim,
                    generator=torch.Generator().manual_seed(6)).to(dtype)
    dout = torch.randn(q.shape[0], heads, v_head_dim,
                       generator=torch.Generator().manual_seed(7)).to(dtype)
    scale, band = 0.3, (window, 0)
    calls = []
    real_forward = torch_math.cpu_window.forward
    monkeypatch.setattr(torch_math.cpu_window, "forward",
                        lambda *a: calls.append(1) or real_forward(*a))
    out, lse = kernels.block_forward(q, k, v, cu_q, cu_k, True, scale, "torch", band)
    grads = kernels.block_backward(dout, q, k, v, out, lse, cu_q, cu_k, True, scale, "torch",
                                   band)
    assert calls == [1]  # the long pieces went through the chunked path, in one call
    monkeypatch.setattr(torch_math, "_cpu_kernels", lambda q: False)
    wide = [x.double() for x in (q, k, v, dout)]
    want_out, want_lse = kernels.block_forward(*wide[:3], cu_q, cu_k, True, scale, "torch",
                                               band)
    want = kernels.block_backward(wide[3], *wide[:3], want_out, want_lse, cu_q, cu_k, True,
                                  scale, "torch", band)
    assert out.dtype == dtype and lse.dtype == kernels.accum_dtype(dtype)
    torch.testing.assert_close(lse.double(), want_lse, atol=atol, rtol=0)
    for got, ref in zip((out, *grads), (want_out, *want)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, atol=atol * max(1, ref.abs().max()),
                                   rtol=0)


def test_a_window_that_excludes_no_key_is_no_window():
    """A band side that excludes nothing is dropped: pieces no longer than L + 1 run as plain
    causal (the CPU flash kernel, as without a window); only (L, 0) on equal pieces that it
    cuts is chunked."""
    from megatron_zeppelin.runtime.kernels import cpu_window

    assert cpu_window.effective_band(5, 5, (4, 0)) == (-1, 0)
    assert cpu_window.effective_band(6, 6, (4, 0)) == (4, 0)
    assert cpu_window.effective_band(3, 9, (8, 2)) == (-1, -1)  # row 0 sees key 8 already
    assert cpu_window.effective_band(3, 9, (8, 1)) == (-1, 1)
    assert cpu_window.effective_band(3, 9, (7, 1)) == (7, 1)
    assert cpu_window.effective_band(4, 4, (-1, 3)) == (-1, -1)
    assert cpu_window.takes(6, 6, (4, 0)) and not cpu_window.takes(6, 7, (4, 0))
    assert not cpu_window.takes(6, 6, (0, 0)) and not cpu_window.takes(6, 6, (4, 1))
