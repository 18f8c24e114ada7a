"""Backend ``torch``: exact, any device and dtype; the fallback for what no fused kernel takes.

Per pair of pieces: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward),
which returns and accepts the logsumexp; elsewhere, and for causal pairs with ``tq != tk``, an
exact math path (scores materialised per pair in row chunks, accumulated in float32, float64
for float64). Sliding windows (``base.band``) on CPU: a window that excludes no key of a pair
is dropped (``cpu_window.effective_band``); the pairs where Megatron's ``(L, 0)`` binds run
together through the CPU flash kernel in chunks of ``L`` rows (``cpu_window``, O(tokens x
L)); other bands (a ring step's trimmed pairs, at most about ``L x L``) take the math path,
masked; off CPU every band takes the math path. The CPU flash kernel
needs one head dim for q, k and v: a different value head dim (multi-latent attention) is
zero-padded there (``base.pad_head_dims``), equal ones are passed as strided views (no copy per
pair); the math path takes it as it is. On CUDA this is the slow path (``base.select`` warns once when ``auto`` lands
here): fp32/fp64 tensors and head dims the native kernel refuses.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_zeppelin.runtime.kernels import cpu_window
from megatron_zeppelin.runtime.kernels.base import (Pieces, Window, accum_dtype, band,
                                                    pad_head_dims, register)

MATH_SCORE_ELEMENTS = 1 << 26  # scores the math path materialises at once (fp32: 256 MiB)


class _Split(NamedTuple):
    """The pairs of a call by path: ``flash`` (query rows, key rows, causal) for the CPU flash
    kernel, ``banded`` ``cpu_window.Chunks`` or None, ``math`` (query rows, key rows, band)."""

    flash: list[tuple[slice, slice, bool]]
    banded: cpu_window.Chunks | None
    math: list[tuple[slice, slice, Window]]


def _cpu_kernels(q: torch.Tensor) -> bool:
    """Whether the CPU flash kernel takes this call's pairs (else all take the math path)."""
    return q.device.type == "cpu"


def _split(q: torch.Tensor, k: torch.Tensor, pieces: Pieces, causal: bool,
           window: Window | None) -> _Split:
    cpu = _cpu_kernels(q)
    flash, banded, math = [], [], []
    for qs, ks in _pairs(pieces):
        tq, tk = qs.stop - qs.start, ks.stop - ks.start
        pair_band = cpu_window.effective_band(tq, tk, band(causal, window))
        if cpu and (pair_band == (-1, -1) or (pair_band == (-1, 0) and tq == tk)):
            flash.append((qs, ks, pair_band == (-1, 0)))
        elif cpu and cpu_window.takes(tq, tk, pair_band):
            banded.append((qs, ks))
        else:
            math.append((qs, ks, pair_band))
    chunks = cpu_window.Chunks.of(banded, window[0], q.shape[0], k.shape[0]) if banded else None
    return _Split(flash, chunks, math)


def _cpu_flash_forward(q, k, v, causal, scale):
    """``(out [tq, h, dv], lse [h, tq])`` of one pair by the CPU flash kernel."""
    qp, kp, vp = _flash_inputs(q, k, v)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qp, kp, vp, 0.0, causal,
                                                                         scale=scale)
    return o[0, ..., :v.shape[-1]].transpose(0, 1), lse[0]


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    """``(dq, dk, dv)`` of one pair by the CPU flash kernel (``lse [h, tq]``)."""
    qp, kp, vp, dop, op = _flash_inputs(q, k, v, dout, out)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dop, qp, kp, vp, op, lse.unsqueeze(0).contiguous(), 0.0, causal, scale=scale)
    return tuple(g[0, ..., :x.shape[-1]].transpose(0, 1) for g, x in zip(grads, (q, k, v)))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[t, heads, d]`` -> ``[1, heads, t, d]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _flash_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor
                  ) -> list[torch.Tensor]:
    """q, k, v (then out/dout) ``[t, h, d]`` as the CPU flash kernel's ``[1, h, t, d]``: views
    where the head dims agree (the kernel reads any strides with a unit last one, bit for bit
    as from contiguous copies, and its outputs then come back ``[t, h, d]``-contiguous), else
    zero-padded copies (``pad_head_dims``)."""
    if q.shape[-1] != v.shape[-1]:
        return pad_head_dims(*(_bhsd(x) for x in (q, k, v, *rest)))
    return [_bhsd(x if x.stride(-1) == 1 else x.contiguous()) for x in (q, k, v, *rest)]


def _pairs(pieces: Pieces):
    """(query rows, key rows) of every pair with work."""
    cq, ck = pieces.cu_q, pieces.cu_k
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if qs.stop > qs.start and ks.stop > ks.start:
            yield qs, ks


class TorchMath:
    """The ``torch`` backend (see the module docstring)."""

    name = "torch"
    kernel = "cpu"
    auto = False  # ``auto`` lands here only when no fused backend takes the block
    window_limit = None
    description = "exact reference: CPU flash per pair, math path elsewhere (slow on CUDA)"

    def unavailable(self) -> str | None:
        return None

    def refuses(self, q: torch.Tensor) -> str | None:
        return None

    def forward(self, q, k, v, pieces: Pieces, causal: bool, scale: float,
                window: Window | None = None):
        tq_all, heads, _ = q.shape
        out = q.new_zeros((tq_all, heads, v.shape[-1]))
        lse = torch.full((heads, tq_all), float("-inf"), dtype=accum_dtype(q.dtype),
                         device=q.device)
        split = _split(q, k, pieces, causal, window)
        for qs, ks, pair_causal in split.flash:
            out[qs], lse[:, qs] = _cpu_flash_forward(q[qs], k[ks], v[ks], pair_causal, scale)
        if split.banded is not None:
            rows = split.banded.q_index
            out[rows], lse[:, rows] = cpu_window.forward(q, k, v, split.banded, scale)
        for qs, ks, pair_band in split.math:
            out[qs], lse[:, qs] = _math_forward(q[qs], k[ks], v[ks], pair_band, scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, causal: bool, scale: float,
                 window: Window | None = None):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # a row that sees no key anywhere has lse -inf: +inf makes its probabilities 0
        lse = lse.to(accum_dtype(q.dtype)).masked_fill(torch.isneginf(lse), float("inf"))
        split = _split(q, k, pieces, causal, window)
        for qs, ks, pair_causal in split.flash:
            dq[qs], dk[ks], dv[ks] = _cpu_flash_backward(dout[qs], q[qs], k[ks], v[ks], out[qs],
                                                         lse[:, qs], pair_causal, scale)
        if split.banded is not None:
            q_rows, k_rows = split.banded.q_index, split.banded.k_index
            dq[q_rows], dk[k_rows], dv[k_rows] = cpu_window.backward(dout, q, k, v, out, lse,
                                                                     split.banded, scale)
        for qs, ks, pair_band in split.math:
            dq[qs], dk[ks], dv[ks] = _math_backward(dout[qs], q[qs], k[ks], v[ks], out[qs],
                                                    lse[:, qs], pair_band, scale)
        return dq, dk, dv


def _row_chunks(tq: int, tk: int, heads: int) -> list[tuple[int, int]]:
    """Query row ranges whose scores ``[heads, rows, tk]`` fit ``MATH_SCORE_ELEMENTS``."""
    rows = max(1, MATH_SCORE_ELEMENTS // max(1, heads * tk))
    return [(a, min(tq, a + rows)) for a in range(0, tq, rows)]


def _scores(q: torch.Tensor, k: torch.Tensor, window: Window, scale: float, row0: int,
            tq: int) -> torch.Tensor:
    """Scores ``[kv_heads, group, rows, tk]`` of query rows ``row0..`` of a ``tq``-row piece,
    in the accumulation dtype, the END-aligned band ``window`` (``base.band``) applied."""
    rows, heads, d = q.shape
    tk, kv_heads, _ = k.shape
    acc = accum_dtype(q.dtype)
    qg = q.to(acc).reshape(rows, kv_heads, heads // kv_heads, d)
    s = torch.einsum("qgrd,kgd->grqk", qg, k.to(acc)) * scale
    left, right = window
    if left >= 0 or right >= 0:
        r = torch.arange(row0, row0 + rows, device=q.device).unsqueeze(1) + (tk - tq)
        c = torch.arange(tk, device=q.device).unsqueeze(0)
        hidden = torch.zeros((rows, tk), dtype=torch.bool, device=q.device)
        if right >= 0:
            hidden |= c > r + right
        if left >= 0:
            hidden |= c < r - left
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _math_forward(q, k, v, window, scale):
    """Exact attention of one pair: ``(out [tq, h, dv], lse [h, tq])``, row chunk by chunk."""
    tq, heads, _ = q.shape
    d = v.shape[-1]
    out = q.new_empty((tq, heads, d))
    lse = torch.empty((heads, tq), dtype=accum_dtype(q.dtype), device=q.device)
    for a, b in _row_chunks(tq, k.shape[0], heads):
        s = _scores(q[a:b], k, window, scale, a, tq)
        chunk_lse = torch.logsumexp(s, dim=-1)  # [g, r, rows]; -inf for rows without keys
        p = torch.exp(s - chunk_lse.masked_fill(torch.isneginf(chunk_lse), 0.0).unsqueeze(-1))
        out[a:b] = torch.einsum("grqk,kgd->qgrd", p, v.to(s.dtype)).reshape(b - a, heads, d)
        lse[:, a:b] = chunk_lse.reshape(heads, b - a)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, window, scale):
    """Exact gradients of one pair given the rows' final ``out`` and ``lse`` (+inf: no keys)."""
    tq, heads, d = q.shape
    dv_dim = v.shape[-1]
    kv_heads, acc = k.shape[1], accum_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    kf, vf = k.to(acc), v.to(acc)
    for a, b in _row_chunks(tq, k.shape[0], heads):
        s = _scores(q[a:b], k, window, scale, a, tq)
        rows = (b - a, kv_heads, heads // kv_heads, d)
        v_rows = (*rows[:3], dv_dim)
        p = torch.exp(s - lse[:, a:b].to(acc).reshape(kv_heads, -1, b - a).unsqueeze(-1))
        do = dout[a:b].to(acc).reshape(v_rows)
        delta = (do * out[a:b].to(acc).reshape(v_rows)).sum(-1).permute(1, 2, 0)  # [g, r, rows]
        dv += torch.einsum("grqk,qgrd->kgd", p, do)
        ds = p * (torch.einsum("qgrd,kgd->grqk", do, vf) - delta.unsqueeze(-1)) * scale
        dq[a:b] = torch.einsum("grqk,kgd->qgrd", ds, kf).reshape(b - a, heads, d)
        dk += torch.einsum("grqk,qgrd->kgd", ds, q[a:b].to(acc).reshape(rows))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


BACKEND = register(TorchMath())
