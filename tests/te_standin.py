"""A CPU stand-in of Transformer Engine's fused-attention functions, per TE version (tests only).

``StandInTE(version, cudnn, packed)`` has ``fused_attn_fwd`` / ``fused_attn_bwd`` with the
parameter lists of ``transformer_engine.pytorch.cpp_extensions.fused_attn`` in TE 2.9-2.11,
2.12-2.14 and 2.15-2.18 (read from TE's sources at those tags; the ``te`` backend reads these
signatures to adapt), and ``FusedAttnBackend``. It computes in float64 and checks what the real
functions and their C++ core do with the arguments the backend passes (TE's
``fused_attn.cpp`` backend selection and ``fused_attn_f16_arbitrary_seqlen.cu`` graph):

* THD only (``qkv_layout`` ``thd_thd_thd``; from 2.15 also ``o_format``/``do_format`` ``thd``
  and ``dqkv_layout`` ``thd_thd_thd``, whose defaults ``sbhd``/``sbh3d`` would misread the
  tensors), int32 offsets, the padded offsets equal to the offsets (no padding between
  pieces), ``max_seqlen`` at least the longest piece, fp16/bf16, no bias, no dropout;
* the backend selection: THD with ``padding_causal_bottom_right`` or GQA needs cuDNN >= 9.6,
  and cuDNN 9.10.0/9.10.1 have no F16 path; under cuDNN 9.6 that mask needs both max lengths
  multiples of 64 and ``q <= kv``; a band other than causal/full needs
  ``max_seqlen_q <= max_seqlen_kv``, before 2.12 only ``(left, 0)`` with a causal mask, and a
  left bound on a bottom-right diagonal fails in cuDNN's frontend before 9.10.2 (sm90, THD's
  equal bucketed totals), and cuDNN 9.14.0 takes none over 1024 keys with a padding mask.
  Otherwise TE fails, as here;
* the graph: 2.9-2.11 set a causal mask and only the band's LEFT bound, aligned bottom-right
  only for the ``*_bottom_right`` masks (top-left otherwise); 2.12+ set both bounds, aligned by
  ``bottom_right_diagonal`` (default: bottom-right for those masks);
* masked scores: ``-inf`` from cuDNN 9.10, float32's lowest before (cuDNN's frontend), so a
  row without keys gets stats ``-inf`` and output 0, or stats near ``-3.4e38`` and the mean of
  its piece's values; a row of an empty key piece gets ``-inf`` and 0;
* the softmax stats: float32 ``[total_q, heads, 1]`` when ``packed`` (THD, cuDNN >= 9.6, not
  sm120 from TE 2.14) else ``[batch, heads, max_seqlen_q, 1]``; the backward demands exactly
  that tensor back, with ``+inf`` (not ``-inf``: ``exp(s + inf)``) for rows without keys;
* TE <= 2.14's backward takes ``dqkv_dtype`` (here: ``("DType", torch dtype)``, what the
  tests make ``te.te_dtype`` return).
"""
from __future__ import annotations

import inspect

import torch

HALF = (torch.float16, torch.bfloat16)
BOTTOM_RIGHT = ("padding_causal_bottom_right", "causal_bottom_right")
_ABSENT = object()


def _fail(message: str) -> None:
    raise RuntimeError(f"TE stand-in: {message}")


# --- the parameter lists of each TE version (keyword defaults as TE has them) ---------------

def _fwd_2_11(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
              fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
              cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
              s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
              attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
              rng_gen=None, softmax_offset=None, return_max_logit=False, cuda_graph=False):
    return dict(locals())


def _bwd_2_11(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
              fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
              dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
              attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
              deterministic=False, cuda_graph=False):
    return dict(locals())


def _fwd_2_12(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
              fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
              cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
              s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
              attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
              bottom_right_diagonal=None, rng_gen=None, softmax_offset=None,
              return_max_logit=False, cuda_graph=False):
    return dict(locals())


def _bwd_2_12(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
              fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
              dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
              attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
              bottom_right_diagonal=None, deterministic=False, cuda_graph=False):
    return dict(locals())


def _fwd_2_15(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
              fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
              cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
              s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
              fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd",
              qkv_scale_inv_format=None, attn_bias_type="no_bias", attn_mask_type="padding",
              softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
              rng_gen=None, softmax_offset=None, return_max_logit=False, cuda_graph=False):
    return dict(locals())


def _bwd_2_15(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
              fake_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
              cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None,
              dqkv_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
              qkv_layout="sbh3d", o_format="sbhd", do_format="sbhd", dqkv_layout="sbh3d",
              qkv_scale_inv_format=None, do_scale_inv_format=None, attn_bias_type="no_bias",
              attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
              bottom_right_diagonal=None, deterministic=False, cuda_graph=False):
    return dict(locals())


SIGNATURES = {(2, 11): (_fwd_2_11, _bwd_2_11), (2, 12): (_fwd_2_12, _bwd_2_12),
              (2, 15): (_fwd_2_15, _bwd_2_15)}


def _wrap(signature, body):
    """A function with ``signature``'s parameters that runs ``body`` on the bound arguments."""
    def fn(*args, **kwargs):
        return body(signature(*args, **kwargs))
    fn.__signature__ = inspect.signature(signature)
    fn.__name__ = signature.__name__
    return fn


class StandInTE:
    """Drop-in for TE's ``fused_attn`` module (see the module docstring)."""

    FusedAttnBackend = {"No_Backend": -1, "F16_max512_seqlen": 0, "F16_arbitrary_seqlen": 1,
                        "FP8": 2}

    def __init__(self, version=(2, 15), cudnn=(9, 11, 0), packed=None) -> None:
        self.version, self.cudnn = version, cudnn
        self.packed = cudnn >= (9, 6, 0) if packed is None else packed
        fwd, bwd = SIGNATURES[max(v for v in SIGNATURES if v <= version)]
        self.fused_attn_fwd = _wrap(fwd, self._forward)
        self.fused_attn_bwd = _wrap(bwd, self._backward)
        self.calls = []  # (direction, max_seqlen_q, max_seqlen_kv, mask, window)

    # --- what TE checks ------------------------------------------------------------------
    def _check(self, a: dict, direction: str) -> tuple[list[int], list[int]]:
        q, k, v = a["q"], a["k"], a["v"]
        if q.dtype not in HALF or k.dtype != q.dtype or v.dtype != q.dtype:
            _fail(f"q/k/v must be fp16/bf16 of one dtype, got {q.dtype}/{k.dtype}/{v.dtype}")
        if any(not t.is_contiguous() for t in (q, k, v)) or q.shape[2] != k.shape[2] or \
                q.shape[1] % k.shape[1] or v.shape[:2] != k.shape[:2]:
            _fail(f"THD shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
        if a["qkv_layout"] != "thd_thd_thd":
            _fail(f"qkv_layout={a['qkv_layout']!r}: the backend's tensors are thd_thd_thd")
        formats = {"o_format": "thd", "do_format": "thd", "dqkv_layout": "thd_thd_thd"}
        for name, want in formats.items():
            if a.get(name, want) != want and (direction == "backward" or name == "o_format"):
                _fail(f"{name}={a[name]!r} (TE's default) would read the THD tensors as {want}")
        if a["attn_bias_type"] != "no_bias" or a["dropout"] != 0.0:
            _fail("bias and dropout are not part of the backend's contract")
        if a["fused_attention_backend"] != self.FusedAttnBackend["F16_arbitrary_seqlen"]:
            _fail(f"fused_attention_backend={a['fused_attention_backend']}")
        cq = self._offsets(a, "q", q.shape[0])
        ck = self._offsets(a, "kv", k.shape[0])
        if len(cq) != len(ck):
            _fail(f"{len(cq)} query offsets, {len(ck)} key offsets")
        self._select(a)
        return cq, ck

    def _offsets(self, a: dict, side: str, total: int) -> list[int]:
        cu, padded = a[f"cu_seqlens_{side}"], a[f"cu_seqlens_{side}_padded"]
        if cu.dtype != torch.int32 or cu.dim() != 1 or padded is None or \
                not torch.equal(cu, padded):
            _fail(f"cu_seqlens_{side} must be int32 1-D and equal its padded offsets")
        host = cu.tolist()
        if host[0] != 0 or host[-1] != total or any(b < a for a, b in zip(host, host[1:])):
            _fail(f"cu_seqlens_{side}={host} must rise from 0 to {total}")
        longest = max(b - a for a, b in zip(host, host[1:]))
        if a[f"max_seqlen_{side}"] < longest:
            _fail(f"max_seqlen_{side}={a[f'max_seqlen_{side}']} below the longest piece "
                  f"{longest}: cuDNN would drop rows")
        return host

    def _select(self, a: dict) -> None:
        """TE's backend selection for the F16 arbitrary-seqlen THD path (fused_attn.cpp)."""
        mask, (left, right) = a["attn_mask_type"], tuple(a["window_size"])
        sq, skv = a["max_seqlen_q"], a["max_seqlen_kv"]
        if mask not in ("padding", "padding_causal", "padding_causal_bottom_right"):
            _fail(f"mask {mask!r} with THD")
        gqa = a["q"].shape[1] != a["k"].shape[1]
        if self.cudnn in ((9, 10, 0), (9, 10, 1)) or (self.cudnn < (9, 6, 0) and (
                gqa or mask == "padding_causal_bottom_right")):
            _fail(f"no backend: cuDNN {self.cudnn} with THD, mask {mask!r}, GQA {gqa}")
        if mask == "padding_causal_bottom_right" and self.cudnn < (9, 7, 0) and \
                (sq % 64 or skv % 64 or sq > skv):
            _fail(f"no backend: cuDNN 9.6 takes padding_causal_bottom_right only with max "
                  f"lengths multiples of 64 and q <= kv (got {sq}, {skv})")
        if (left, right) in ((-1, -1), (-1, 0)):
            return
        if self.cudnn < (9, 6, 0) or sq > skv:
            _fail(f"no backend: window {(left, right)} needs cuDNN 9.6+ and max_seqlen_q <= "
                  f"max_seqlen_kv (got {sq}, {skv})")
        if self.cudnn == (9, 14, 0) and left >= 0 and skv > 1024:  # masks here: not CAUSAL
            _fail("no backend: cuDNN 9.14.0 with a left window bound, max_seqlen_kv > 1024 and "
                  "a padding mask")
        bottom_right = a.get("bottom_right_diagonal") or mask in BOTTOM_RIGHT
        if self.cudnn < (9, 10, 2) and left >= 0 and bottom_right:
            _fail("cuDNN frontend: a left bound on a bottom-right diagonal with s_q == s_kv "
                  "needs cuDNN 9.10.2+ on sm90")
        if self.version < (2, 12) and (right != 0 or "causal" not in mask):
            _fail(f"no backend: TE {self.version} takes only (left, 0) causal windows")

    # --- what the graph computes ---------------------------------------------------------
    def _band(self, a: dict, tq: int, tk: int) -> torch.Tensor:
        """``[tq, tk]`` visibility of one piece as the cuDNN graph of this TE builds it."""
        mask, (left, right) = a["attn_mask_type"], tuple(a["window_size"])
        if self.version < (2, 12):
            bottom_right, right = mask in BOTTOM_RIGHT, -1  # no right bound in the graph
        else:
            diagonal = a.get("bottom_right_diagonal")
            bottom_right = mask in BOTTOM_RIGHT if diagonal is None else diagonal
        shift = tk - tq if bottom_right else 0
        row, col = torch.arange(tq)[:, None] + shift, torch.arange(tk)[None, :]
        visible = torch.ones(tq, tk, dtype=torch.bool)
        if "causal" in mask:
            visible &= col <= row
        if left >= 0:
            visible &= col >= row - left
        if right >= 0:
            visible &= col <= row + right
        return visible

    def _pieces(self, a: dict, cq, ck):
        """(piece, query rows, key rows, float64 scores [h, tq, tk] masked) per non-empty
        piece."""
        q, k = a["q"], a["k"]
        group, scale = q.shape[1] // k.shape[1], a["attn_scale"]
        for i in range(len(cq) - 1):
            qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            if qs.stop > qs.start and ks.stop > ks.start:
                s = torch.einsum("qhd,khd->hqk", q[qs].double(),
                                 k[ks].double().repeat_interleave(group, 1)) * scale
                visible = self._band(a, qs.stop - qs.start, ks.stop - ks.start)
                masked = torch.finfo(torch.float32).min if self.cudnn < (9, 10, 0) else \
                    float("-inf")
                yield i, qs, ks, s.masked_fill(~visible, masked)

    def _forward(self, a: dict):
        cq, ck = self._check(a, "forward")
        self.calls.append(("forward", a["max_seqlen_q"], a["max_seqlen_kv"],
                           a["attn_mask_type"], tuple(a["window_size"])))
        q, v = a["q"], a["v"]
        group = q.shape[1] // v.shape[1]
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
        for _, qs, ks, s in self._pieces(a, cq, ck):
            piece = torch.logsumexp(s, -1)  # -inf, or about float's lowest, without keys
            seen = torch.isfinite(piece)
            p = torch.exp(s - piece.masked_fill(~seen, 0.0).unsqueeze(-1)).nan_to_num(0.0)
            out[qs] = torch.einsum("hqk,khd->qhd", p, v[ks].double().repeat_interleave(group, 1))
            lse[:, qs] = piece
        stats = self._stats(lse.float(), cq, a["max_seqlen_q"])
        return out.to(q.dtype), [stats, torch.zeros(2, dtype=torch.int64)]

    def _stats(self, lse: torch.Tensor, cq: list[int], max_q: int) -> torch.Tensor:
        """``[h, tq]`` -> this TE's stats layout (padded rows +inf: never read)."""
        if self.packed:
            return lse.t().contiguous().unsqueeze(-1)
        stats = torch.full((len(cq) - 1, lse.shape[0], max_q, 1), float("inf"))
        for i in range(len(cq) - 1):
            stats[i, :, : cq[i + 1] - cq[i], 0] = lse[:, cq[i]:cq[i + 1]]
        return stats

    def _backward(self, a: dict):
        cq, ck = self._check(a, "backward")
        self.calls.append(("backward", a["max_seqlen_q"], a["max_seqlen_kv"],
                           a["attn_mask_type"], tuple(a["window_size"])))
        q, k, v, o, do = a["q"], a["k"], a["v"], a["o"], a["d_o"]
        if self.version < (2, 15) and a.get("dqkv_dtype", _ABSENT) != ("DType", do.dtype):
            _fail(f"dqkv_dtype={a.get('dqkv_dtype')!r}: expected TE's DType of {do.dtype}")
        stats, rng = a["aux_ctx_tensors"]
        want = (q.shape[0], q.shape[1], 1) if self.packed else \
            (len(cq) - 1, q.shape[1], a["max_seqlen_q"], 1)
        if stats.dtype != torch.float32 or tuple(stats.shape) != want or \
                not stats.is_contiguous() or rng.dtype != torch.int64 or rng.shape != (2,):
            _fail(f"aux_ctx_tensors: stats {stats.dtype} {tuple(stats.shape)} (want float32 "
                  f"{want}), rng_state {rng.dtype} {tuple(rng.shape)} (want int64 (2,))")
        if torch.isneginf(stats).any() or torch.isnan(stats).any():
            _fail("softmax stats hold -inf/NaN: rows without keys carry +inf")
        group = q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float64)
        dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (k, v))
        for i, qs, ks, s in self._pieces(a, cq, ck):
            lse = (stats[qs, :, 0].t() if self.packed else
                   stats[i, :, : qs.stop - qs.start, 0]).double()
            p = torch.exp(s - lse.unsqueeze(-1))
            dop, op = do[qs].double(), o[qs].double()
            delta = (dop * op).sum(-1).t()
            vv = v[ks].double().repeat_interleave(group, 1)
            kk = k[ks].double().repeat_interleave(group, 1)
            ds = p * (torch.einsum("qhd,khd->hqk", dop, vv) - delta.unsqueeze(-1)) * \
                a["attn_scale"]
            dq[qs] = torch.einsum("hqk,khd->qhd", ds, kk)
            shape_k = (ks.stop - ks.start, k.shape[1], group, k.shape[2])
            shape_v = (ks.stop - ks.start, k.shape[1], group, v.shape[2])
            dk[ks] = torch.einsum("hqk,qhd->khd", ds, q[qs].double()).reshape(shape_k).sum(2)
            dv[ks] = torch.einsum("hqk,qhd->khd", p, dop).reshape(shape_v).sum(2)
        return [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None]


def install_in_process(version=(2, 15), cudnn=(9, 11, 0)) -> StandInTE:
    """The ``te`` backend on the stand-in of one TE/cuDNN (Hopper), in this process (a worker
    of run_world): nothing to undo there."""
    from megatron_zeppelin.runtime.kernels import te

    module = StandInTE(version, cudnn)
    te.BACKEND.load = lambda: module
    te.BACKEND.refuses = lambda q: None  # CPU tensors: the stand-in takes them
    te.cudnn_version = lambda: cudnn
    te.te_dtype = lambda dtype: ("DType", dtype)
    return module
