"""A CPU stand-in of torch's varlen flash kernel, with exactly its contract (tests only).

``StandInFlashOps`` has the signatures and return values of ``aten._flash_attention_forward``
and ``aten._flash_attention_backward`` as measured on an H100 (``shared/design/GPU-FACTS.md``):
packed ``[total, heads, head_dim]`` q and ``[total, kv_heads, head_dim]`` k/v (GQA), int32
``cum_seq`` offsets on the inputs' device, ``max_q``/``max_k`` the longest pieces, causal
aligned bottom-right, fp16/bf16 only, lse ``[heads, total_q]`` float32 with ``+inf`` for a row
that sees no key, ``rng_state`` ``(2,)`` uint64 and ``unused`` a 0-d uint64. It computes in
float64 and checks every argument the way the real kernel's contract demands, so a test that
injects it (``install``) runs the native backend's whole code path: argument building, the
+inf/-inf LSE conversion, the merge and the backward plumbing. It is never used at run time.

It is as strict as the real kernel (torch 2.11's ``flash_api.cpp``: ``mha_varlen_fwd`` /
``mha_varlen_bwd``, where the stand-in's checks come from):

* offsets: 1-D, int32, contiguous, on q's device, one more than the pieces (at least one), and
  ``max_q``/``max_k`` at least the longest piece (the kernel sizes its grid by them and never
  checks them: a smaller value silently drops rows; a larger one is harmless);
* head dim a multiple of 8 and at most 256, fp16/bf16, q/k/v of one dtype, last dim contiguous;
* the backward reads the lse as raw memory (``softmax_lse.data_ptr()``, no shape, dtype or
  stride check): the stand-in demands exactly a contiguous ``[heads, total_q]`` float32 tensor
  on q's device, so a transposed, strided or float64 lse fails here instead of giving wrong
  gradients on a GPU;
* ``max_q == 1`` with GQA (``heads > kv_heads``): the forward takes its "ngroups swapped" path,
  ``q.reshape(batch, kv_heads, groups, head_dim)``, which needs one query row per piece: an
  empty query piece makes that reshape fail (emulated here with the same condition);
* ``rng_state``/``unused`` are returned on q's device, as the kernel allocates them.

``calls`` counts the kernel calls, so a test can show that the native path really ran.
"""
from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _fail(message: str) -> None:
    raise RuntimeError(f"flash stand-in: {message}")


def _offsets(cu: torch.Tensor, total: int, device: torch.device, name: str,
             longest: int) -> list[int]:
    """Host offsets of ``cu`` after checking the kernel's contract for them (the stand-in may
    read device values; the backend under test may not)."""
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != device or \
            not cu.is_contiguous() or cu.numel() < 2:
        _fail(f"{name} must be a contiguous 1-D int32 tensor of at least 2 offsets on {device}, "
              f"got {cu.dtype} {tuple(cu.shape)} strides {cu.stride()} on {cu.device}")
    host = cu.tolist()
    if host[0] != 0 or host[-1] != total or any(b < a for a, b in zip(host, host[1:])):
        _fail(f"{name}={host} must rise from 0 to {total}")
    actual = max(b - a for a, b in zip(host, host[1:]))
    if longest < actual:
        _fail(f"max length {longest} given for {name}={host}: the kernel would skip the rows "
              f"past it (longest piece {actual})")
    return host


def _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, split_dims=None
                  ) -> tuple[list[int], list[int]]:
    """``split_dims``: FlashAttention-3's rule for a value head dim unlike q/k's (None: one
    head dim, as FlashAttention-2)."""
    if q.dtype not in HALF or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q/k/v must be one of fp16/bf16, got {q.dtype}/{k.dtype}/{v.dtype}")
    same_v = v.shape == k.shape or (split_dims is not None and v.shape[:2] == k.shape[:2] and
                                    split_dims(q.shape[2], v.shape[2]))
    if q.dim() != 3 or k.dim() != 3 or not same_v or q.shape[1] % k.shape[1] or \
            q.shape[2] != k.shape[2]:
        _fail(f"packed shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if q.shape[2] % 8 or q.shape[2] > MAX_HEAD_DIM or v.shape[2] % 8:
        _fail(f"head dim {q.shape[2]}: the kernel takes multiples of 8 up to {MAX_HEAD_DIM}")
    if any(t.stride(-1) != 1 for t in (q, k, v)) or k.device != q.device or \
            v.device != q.device:
        _fail("q/k/v must be on one device with a contiguous last dimension")
    if dropout_p != 0.0:
        _fail(f"dropout_p={dropout_p}: the engine never uses dropout")
    if cu_q.numel() != cu_k.numel():
        _fail(f"cum_seq_q has {cu_q.numel()} offsets, cum_seq_k {cu_k.numel()}")
    return (_offsets(cu_q, q.shape[0], q.device, "cum_seq_q", max_q),
            _offsets(cu_k, k.shape[0], q.device, "cum_seq_k", max_k))


def _check_grouped_single_row(q, k, cu_q: list[int], max_q: int) -> None:
    """The forward's ``max_q == 1`` GQA path reshapes q to ``[pieces, kv_heads, groups, d]``:
    every piece must hold exactly one query row (the real kernel fails on an empty one)."""
    pieces = len(cu_q) - 1
    if max_q == 1 and q.shape[1] > k.shape[1] and q.shape[0] != pieces:
        _fail(f"max_q=1 with GQA ({q.shape[1]} heads over {k.shape[1]}) reshapes q "
              f"{tuple(q.shape)} to [{pieces}, {k.shape[1]}, {q.shape[1] // k.shape[1]}, "
              f"{q.shape[2]}]: invalid with empty query pieces (the real kernel fails here)")


def _band(causal, left, right) -> tuple[int, int]:
    """The kernel's ``(left, right)`` window (None: unbounded; causal forces right = 0)."""
    left = -1 if left is None else left
    right = 0 if causal else (-1 if right is None else right)
    return left, right


def _scores(q, k, a, b, c, d, band, scale):
    """float64 scores ``[heads, tq, tk]`` of one piece, the bottom-right aligned window
    ``band`` (``-1``: unbounded side) applied."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q[a:b].double(),
                     k[c:d].double().repeat_interleave(group, 1)) * scale
    tq, tk = b - a, d - c
    row, col = torch.arange(tq)[:, None] + (tk - tq), torch.arange(tk)[None, :]
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if band[1] >= 0:
        visible &= col <= row + band[1]
    if band[0] >= 0:
        visible &= col >= row - band[0]
    return s.masked_fill(~visible.to(s.device), float("-inf"))


class StandInFlashOps:
    """Drop-in for ``native.AtenFlashOps`` on CPU (see the module docstring)."""

    def __init__(self, split_dims=None, swapped_gqa: bool = True) -> None:
        """split_dims: which (q/k, v) head dims the kernel takes unlike (None: none, as
        FlashAttention-2); swapped_gqa: FlashAttention-2's ``max_q == 1`` GQA reshape."""
        self.calls = {"forward": 0, "backward": 0}
        self.max_q_seen: list[int] = []  # the max_q of every call, in order
        self.split_dims, self.swapped_gqa = split_dims, swapped_gqa

    def refuses(self, q: torch.Tensor) -> str | None:
        return None

    def forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                window_size_right=None, seqused_k=None, alibi_slopes=None):
        self.calls["forward"] += 1
        self.max_q_seen.append(max_q)
        cq, ck = _check_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                               self.split_dims)
        if self.swapped_gqa:
            _check_grouped_single_row(query, key, cq, max_q)
        if return_debug_mask or seqused_k is not None:
            _fail("debug mask and seqused_k are not part of the engine's contract")
        band = _band(is_causal, window_size_left, window_size_right)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        heads, group = query.shape[1], query.shape[1] // key.shape[1]
        out = torch.zeros(*query.shape[:2], value.shape[2], dtype=torch.float64)
        lse = torch.full((heads, query.shape[0]), float("inf"), dtype=torch.float64)
        for i in range(len(cq) - 1):
            a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
            if b == a or d == c:
                continue
            s = _scores(query, key, a, b, c, d, band, scale)
            piece = torch.logsumexp(s, -1)  # [h, tq]; -inf for rows without keys
            seen = torch.isfinite(piece)
            p = torch.exp(s - piece.masked_fill(~seen, 0.0).unsqueeze(-1))
            vv = value[c:d].double().repeat_interleave(group, 1)
            out[a:b] = torch.einsum("hqk,khd->qhd", p, vv)
            lse[:, a:b] = piece.masked_fill(~seen, float("inf"))
        device = query.device
        return (out.to(query.dtype), lse.float(), torch.zeros(2, dtype=torch.uint64, device=device),
                torch.zeros((), dtype=torch.uint64, device=device),
                torch.empty(0, dtype=query.dtype, device=device))

    def backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                 max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                 window_size_left=None, window_size_right=None):
        self.calls["backward"] += 1
        self.max_q_seen.append(max_q)
        cq, ck = _check_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                               self.split_dims)
        heads, out_shape = query.shape[1], (*query.shape[:2], value.shape[2])
        if grad_out.shape != out_shape or out.shape != out_shape or \
                grad_out.dtype != query.dtype or out.dtype != query.dtype:
            _fail(f"grad_out {grad_out.dtype} {tuple(grad_out.shape)} and out {out.dtype} "
                  f"{tuple(out.shape)} must match q {query.dtype} {tuple(query.shape)}")
        if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (heads, query.shape[0]) \
                or not logsumexp.is_contiguous() or logsumexp.device != query.device:
            _fail(f"logsumexp must be a contiguous [{heads}, {query.shape[0]}] float32 tensor on "
                  f"{query.device} (the backward reads it as raw memory), got "
                  f"{tuple(logsumexp.shape)} {logsumexp.dtype} strides {logsumexp.stride()} on "
                  f"{logsumexp.device}")
        if torch.isneginf(logsumexp).any() or torch.isnan(logsumexp).any():
            _fail("logsumexp holds -inf/NaN: the kernel marks rows without keys with +inf")
        if rng_state.dtype != torch.uint64 or tuple(rng_state.shape) != (2,) or \
                unused.dtype != torch.uint64 or unused.dim() != 0:
            _fail(f"rng_state {rng_state.dtype} {tuple(rng_state.shape)} / unused {unused.dtype} "
                  f"{tuple(unused.shape)}: expected (2,) uint64 and 0-d uint64")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        band = _band(is_causal, window_size_left, window_size_right)
        group = heads // key.shape[1]
        dq = torch.zeros(query.shape, dtype=torch.float64)
        dk = torch.zeros(key.shape, dtype=torch.float64)
        dv = torch.zeros(value.shape, dtype=torch.float64)
        for i in range(len(cq) - 1):
            a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
            if b == a or d == c:
                continue
            s = _scores(query, key, a, b, c, d, band, scale)
            p = torch.exp(s - logsumexp[:, a:b].double().unsqueeze(-1))  # +inf rows: 0
            do, o = grad_out[a:b].double(), out[a:b].double()
            delta = (do * o).sum(-1).t()  # [h, tq]
            vv = value[c:d].double().repeat_interleave(group, 1)
            kk = key[c:d].double().repeat_interleave(group, 1)
            ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta.unsqueeze(-1)) * scale
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk)
            grouped = (d - c, key.shape[1], group, query.shape[2])
            dk[c:d] = torch.einsum("hqk,qhd->khd", ds, query[a:b].double()).reshape(
                grouped).sum(2)
            dv[c:d] = torch.einsum("hqk,qhd->khd", p, do).reshape(
                (*grouped[:3], value.shape[2])).sum(2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def install(monkeypatch) -> StandInFlashOps:
    """Inject the stand-in where the native backend calls the kernel (undone by the
    monkeypatch fixture); returns it."""
    from megatron_zeppelin.runtime.kernels import native

    standin = StandInFlashOps()
    monkeypatch.setattr(native.BACKEND, "ops", standin)
    return standin


def install_in_process() -> StandInFlashOps:
    """``install`` for a worker process (run_world ranks): nothing to undo there."""
    from megatron_zeppelin.runtime.kernels import native

    native.BACKEND.ops = StandInFlashOps()
    return native.BACKEND.ops
