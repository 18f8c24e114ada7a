"""Attention kernels for one varlen block, behind one interface (torch, flash-attn, TE).

A *block* is one fused kernel call: ``B`` pairs of a query piece and a key/value piece that
attend each other. ``cu_q``/``cu_k`` (``B + 1`` cumulative offsets, a list or an int32 tensor)
cut the packed tensors into pieces: pair ``i`` is query rows ``[cu_q[i], cu_q[i+1])`` against
key rows ``[cu_k[i], cu_k[i+1])``. Pieces may be empty.

Causal convention: aligned at the END (bottom-right, as flash-attn >= 2.1 and TE's
``padding_causal_bottom_right``): query row ``r`` of a piece of ``tq`` rows sees key ``c`` of a
piece of ``tk`` keys iff ``c <= r + tk - tq``. On the diagonal chunk of a zigzag ring step
``tq == tk`` and this is the plain lower triangle; ``causal=False`` is a full block. A row that
sees no key (``tq > tk``, or an empty key piece) gets output 0 and lse ``-inf``.

Layouts: ``q``/``out``/``dout``/``dq`` ``[tq, heads, head_dim]``; ``k``/``v``/``dk``/``dv``
``[tk, kv_heads, head_dim]`` with ``kv_heads`` dividing ``heads`` (GQA/MQA: query head ``i``
uses KV head ``i // (heads // kv_heads)``, Megatron's grouping); ``lse`` ``[heads, tq]`` natural
log of the softmax denominator, float32 (float64 for float64 inputs).

``block_backward`` takes the FINAL (merged over all blocks) ``out`` and ``lse`` of the rows, so
its gradients are this block's exact contribution to the full attention's gradients: the
softmax probabilities ``exp(s - lse_final)`` and ``delta = rowsum(dout * out_final)`` are those
of the whole row.

Backends (``ZEPPELIN_ATTENTION_BACKEND`` via ``env.attention_backend()``, or ``backend=``):
* ``torch``: exact. On CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward)
  per pair, which returns and accepts the logsumexp; elsewhere, and for causal pairs with
  ``tq != tk``, an exact math path (scores materialised per pair, accumulated in float32).
* ``flash_attn``: ``flash_attn`` 2.6+ varlen kernels (CUDA, fp16/bf16); ``pip install
  "megatron-zeppelin[flash-attn]"``.
* ``te``: Transformer Engine fused attention, THD layout (CUDA, fp16/bf16); ``pip install
  "megatron-zeppelin[te]"`` (see ``kernels_ext``).
* ``auto``: ``flash_attn``, then ``te``, when installed and the tensors are CUDA fp16/bf16;
  ``torch`` otherwise.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from megatron_zeppelin import env

CuSeqlens = Union[Sequence[int], torch.Tensor]
BACKENDS = ("torch", "flash_attn", "te")
_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- public API

def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: CuSeqlens,
                  cu_k: CuSeqlens, causal: bool, scale: float,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one varlen block: ``(out [tq, h, d] q.dtype, lse [h, tq])``.

    See the module docstring for the pair and causal conventions; ``scale`` multiplies the
    scores (usually ``head_dim ** -0.5``); ``backend`` overrides the environment's choice.
    """
    cq, ck = check_block(q, k, v, cu_q, cu_k)
    name = resolve_backend(backend, q)
    if name == "torch":
        return _torch_forward(q, k, v, cq, ck, causal, scale)
    from megatron_zeppelin.runtime import kernels_ext

    return kernels_ext.forward(name, q, k, v, cq, ck, causal, scale)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, cu_q: CuSeqlens, cu_k: CuSeqlens,
                   causal: bool, scale: float, backend: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block ``(dq [tq, h, d], dk [tk, g, d], dv [tk, g, d])``, input dtype.

    ``out [tq, h, d]`` and ``lse [h, tq]`` are the rows' FINAL output and logsumexp (merged over
    every block the rows attend), ``dout`` the gradient of that final output.
    """
    cq, ck = check_block(q, k, v, cu_q, cu_k)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must have q's shape "
                         f"{tuple(q.shape)} and lse {tuple(lse.shape)} must be "
                         f"{(q.shape[1], q.shape[0])} ([heads, tq])")
    name = resolve_backend(backend, q)
    if name == "torch":
        return _torch_backward(dout, q, k, v, out, lse, cq, ck, causal, scale)
    from megatron_zeppelin.runtime import kernels_ext

    return kernels_ext.backward(name, dout, q, k, v, out, lse, cq, ck, causal, scale)


def resolve_backend(backend: str | None, q: torch.Tensor) -> str:
    """The backend a call on ``q`` uses: ``backend``, else ``env.attention_backend()``.

    ``auto`` picks flash_attn, then te, when importable and ``q`` is CUDA fp16/bf16, else
    torch. An explicit optional backend that is not installed raises ImportError naming the
    extra; one that cannot take ``q`` raises ValueError naming its device and dtype.
    """
    from megatron_zeppelin.runtime import kernels_ext

    choice = env.attention_backend() if backend is None else backend
    if choice not in BACKENDS + ("auto",):
        raise ValueError(f"attention backend={choice!r} is invalid: expected one of "
                         f"{['auto', *BACKENDS]}")
    fused_ok = q.is_cuda and q.dtype in _HALF
    if choice == "auto":
        for name in ("flash_attn", "te"):
            if fused_ok and kernels_ext.available(name):
                return name
        return "torch"
    if choice != "torch":
        kernels_ext.require(choice)
        if not fused_ok:
            raise ValueError(f"attention backend {choice!r} needs CUDA fp16/bf16 tensors, got "
                             f"{q.dtype} on {q.device}: use backend 'torch' or 'auto'")
    return choice


def check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: CuSeqlens,
                cu_k: CuSeqlens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a block's shapes; return ``cu_q``/``cu_k`` as tuples of ints."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q [tq, heads, head_dim] and k, v [tk, kv_heads, head_dim]")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads or q.shape[2] != k.shape[2]:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} and head dims must match"
                         f" (q {q.shape[2]}, k {k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    cq, ck = _host(cu_q), _host(cu_k)
    for name, cu, total in (("cu_q", cq, q.shape[0]), ("cu_k", ck, k.shape[0])):
        if len(cu) < 1 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name}={list(cu)} is invalid: expected non-decreasing offsets "
                             f"from 0 to {total} (the packed length)")
    if len(cq) != len(ck):
        raise ValueError(f"cu_q has {len(cq) - 1} pieces and cu_k {len(ck) - 1}: expected one key "
                         "piece per query piece")
    return cq, ck


def _host(cu: CuSeqlens) -> tuple[int, ...]:
    if isinstance(cu, torch.Tensor):
        return tuple(int(x) for x in cu.tolist())
    return tuple(int(x) for x in cu)


# ----------------------------------------------------------------------------- torch backend

def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_aten_cpu(q: torch.Tensor, tq: int, tk: int, causal: bool) -> bool:
    return q.device.type == "cpu" and (not causal or tq == tk)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[t, heads, d]`` -> ``[1, heads, t, d]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _pairs(cq, ck):
    """(query rows, key rows) of every pair with work: pair i is cq[i]:cq[i+1] x ck[i]:ck[i+1]."""
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if qs.stop > qs.start and ks.stop > ks.start:
            yield qs, ks


def _torch_forward(q, k, v, cq, ck, causal, scale):
    tq_all, heads, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((heads, tq_all), float("-inf"), dtype=_accum_dtype(q.dtype),
                     device=q.device)
    for qs, ks in _pairs(cq, ck):
        if _use_aten_cpu(q, qs.stop - qs.start, ks.stop - ks.start, causal):
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q[qs]), _bhsd(k[ks]), _bhsd(v[ks]), 0.0, causal, scale=scale)
            out[qs] = o[0].transpose(0, 1)
            lse[:, qs] = l[0]
        else:
            out[qs], lse[:, qs] = _math_forward(q[qs], k[ks], v[ks], causal, scale)
    return out, lse


def _torch_backward(dout, q, k, v, out, lse, cq, ck, causal, scale):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # a row that sees no key anywhere has lse -inf: +inf makes its probabilities exp(s - inf) = 0
    lse = lse.to(_accum_dtype(q.dtype)).masked_fill(torch.isneginf(lse), float("inf"))
    for qs, ks in _pairs(cq, ck):
        if _use_aten_cpu(q, qs.stop - qs.start, ks.stop - ks.start, causal):
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout[qs]), _bhsd(q[qs]), _bhsd(k[ks]), _bhsd(v[ks]), _bhsd(out[qs]),
                lse[:, qs].unsqueeze(0).contiguous(), 0.0, causal, scale=scale)
            dq[qs], dk[ks], dv[ks] = (g[0].transpose(0, 1) for g in (gq, gk, gv))
        else:
            dq[qs], dk[ks], dv[ks] = _math_backward(dout[qs], q[qs], k[ks], v[ks], out[qs],
                                                    lse[:, qs], causal, scale)
    return dq, dk, dv


MATH_SCORE_ELEMENTS = 1 << 26  # scores the math path materialises at once (fp32: 256 MiB)


def _row_chunks(tq: int, tk: int, heads: int) -> list[tuple[int, int]]:
    """Query row ranges whose scores ``[heads, rows, tk]`` fit ``MATH_SCORE_ELEMENTS``."""
    rows = max(1, MATH_SCORE_ELEMENTS // max(1, heads * tk))
    return [(a, min(tq, a + rows)) for a in range(0, tq, rows)]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, row0: int,
            tq: int) -> torch.Tensor:
    """Scores ``[kv_heads, group, rows, tk]`` of query rows ``row0..`` of a ``tq``-row piece,
    in the accumulation dtype, causal (END-aligned) mask applied."""
    rows, heads, d = q.shape
    tk, kv_heads, _ = k.shape
    acc = _accum_dtype(q.dtype)
    qg = q.to(acc).reshape(rows, kv_heads, heads // kv_heads, d)
    s = torch.einsum("qgrd,kgd->grqk", qg, k.to(acc)) * scale
    if causal:
        r = torch.arange(row0, row0 + rows, device=q.device).unsqueeze(1)
        c = torch.arange(tk, device=q.device).unsqueeze(0)
        s = s.masked_fill(c > r + (tk - tq), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    """Exact attention of one pair: ``(out [tq, h, d], lse [h, tq])``, row chunk by chunk."""
    tq, heads, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((heads, tq), dtype=_accum_dtype(q.dtype), device=q.device)
    for a, b in _row_chunks(tq, k.shape[0], heads):
        s = _scores(q[a:b], k, causal, scale, a, tq)
        chunk_lse = torch.logsumexp(s, dim=-1)  # [g, r, rows]; -inf for rows without keys
        p = torch.exp(s - chunk_lse.masked_fill(torch.isneginf(chunk_lse), 0.0).unsqueeze(-1))
        out[a:b] = torch.einsum("grqk,kgd->qgrd", p, v.to(s.dtype)).reshape(b - a, heads, d)
        lse[:, a:b] = chunk_lse.reshape(heads, b - a)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    """Exact gradients of one pair given the rows' final ``out`` and ``lse`` (+inf: no keys)."""
    tq, heads, d = q.shape
    kv_heads, acc = k.shape[1], _accum_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    kf, vf = k.to(acc), v.to(acc)
    for a, b in _row_chunks(tq, k.shape[0], heads):
        s = _scores(q[a:b], k, causal, scale, a, tq)
        rows = (b - a, kv_heads, heads // kv_heads, d)
        p = torch.exp(s - lse[:, a:b].to(acc).reshape(kv_heads, -1, b - a).unsqueeze(-1))
        do = dout[a:b].to(acc).reshape(rows)
        delta = (do * out[a:b].to(acc).reshape(rows)).sum(-1).permute(1, 2, 0)  # [g, r, rows]
        dv += torch.einsum("grqk,qgrd->kgd", p, do)
        ds = p * (torch.einsum("qgrd,kgd->grqk", do, vf) - delta.unsqueeze(-1)) * scale
        dq[a:b] = torch.einsum("grqk,kgd->qgrd", ds, kf).reshape(b - a, heads, d)
        dk += torch.einsum("grqk,qgrd->kgd", ds, q[a:b].to(acc).reshape(rows))
    return dq, dk.to(k.dtype), dv.to(v.dtype)
