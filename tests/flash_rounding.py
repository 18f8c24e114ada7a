"""Where torch's flash kernel (FlashAttention-2 in ATen) rounds, emulated on CPU: an error
model for the GPU tolerances (``tests/test_gpu.py``), checked against the bf16 errors measured
on an H100 (``shared/design/GPU-FACTS.md``). Test scaffolding; never used at run time.

The kernel's GEMMs take half-precision operands and accumulate in float32; everything else
(softmax statistics, lse, ``D = rowsum(dout * out)``, ``dS``) is float32. A value is rounded to
the half dtype exactly where the kernel stores or feeds one (FlashAttention-2's forward and
backward kernels, ``flash_fwd_kernel.h`` / ``flash_bwd_kernel.h``):

* forward: ``P = exp(S - lse)`` is converted to the half dtype for ``P @ V``; ``out`` is stored
  in the half dtype;
* backward: ``P`` and ``dS`` are converted for the ``dV``, ``dK`` and ``dQ`` GEMMs; ``dq``,
  ``dk``, ``dv`` are stored in the half dtype; with GQA ``dk``/``dv`` are stored per query head
  in the half dtype and then summed over the group (``at::sum_out`` into half tensors).

Not modelled: the order of the float32 sums (tiles, the atomic adds into dq); float32 rounding
(2^-24 relative) is 2^13 to 2^16 times finer than bf16/fp16 rounding, so it does not show in
the maxima. What is left scales with the half dtype's unit roundoff: bf16 2^-8, fp16 2^-11,
so fp16 errors are about 1/8 of bf16's on the same inputs (``python tests/flash_rounding.py``
prints both, next to the H100's bf16 figures).
"""
from __future__ import annotations

import torch


def _half(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


def _visible(tq: int, tk: int, causal: bool) -> torch.Tensor:
    """[tq, tk] keys each query row sees (causal aligned bottom-right, as the kernel)."""
    if not causal:
        return torch.ones(tq, tk, dtype=torch.bool)
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)


def emulate_piece(q, k, v, dout, causal: bool, scale: float):
    """Forward + backward of one piece as the kernel rounds them: half ``q [tq, h, d]``,
    ``k``/``v`` ``[tk, kv_h, d]``, ``dout [tq, h, d]`` -> (out, lse, dq, dk, dv), out and
    gradients in the half dtype's values (as float64), lse float32's."""
    dtype = q.dtype
    group = q.shape[1] // k.shape[1]
    f32 = torch.float32
    qd, kd, vd, dod = (t.double() for t in (q, k, v, dout))
    kk, vv = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kk).to(f32).double() * scale  # fp32 accumulate
    tq, tk = q.shape[0], k.shape[0]
    s = s.masked_fill(~_visible(tq, tk, causal), float("-inf"))
    lse = torch.logsumexp(s, -1).to(f32).double()  # [h, tq]; -inf: a row without keys
    p = torch.exp(s - lse.nan_to_num(0.0, 0.0, 0.0).unsqueeze(-1)).to(f32).double()
    out = _half(torch.einsum("hqk,khd->qhd", _half(p, dtype), vv).to(f32).double(), dtype)
    delta = (dod * out).sum(-1).to(f32).double().t()  # [h, tq]
    dp = torch.einsum("qhd,khd->hqk", dod, vv).to(f32).double()
    ds = (p * (dp - delta.unsqueeze(-1))).to(f32).double()
    dsh = _half(ds, dtype)
    dq = _half(torch.einsum("hqk,khd->qhd", dsh, kk).to(f32).double() * scale, dtype)
    dk_heads = _half(torch.einsum("hqk,qhd->khd", dsh, qd).to(f32).double() * scale, dtype)
    dv_heads = _half(torch.einsum("hqk,qhd->khd", _half(p, dtype), dod).to(f32).double(), dtype)
    grouped = (tk, k.shape[1], group, q.shape[2])
    dk = _half(dk_heads.reshape(grouped).sum(2), dtype)
    dv = _half(dv_heads.reshape(grouped).sum(2), dtype)
    return out, lse, dq, dk, dv


def exact_piece(q, k, v, dout, causal: bool, scale: float):
    """float64 (out, dq, dk, dv) of the same half inputs (autograd)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("qhd,khd->hqk", qd, kd.repeat_interleave(group, 1)) * scale
    visible = _visible(q.shape[0], k.shape[0], causal)
    p = torch.softmax(s.masked_fill(~visible, -1e300), -1) * visible.any(-1)[None, :, None]
    out = torch.einsum("hqk,khd->qhd", p, vd.repeat_interleave(group, 1))
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def max_errors(dtype, lengths, heads: int, kv_heads: int, d: int, seed: int) -> dict:
    """Max |emulated - exact| of out, dq, dk, dv over causal pieces of ``lengths`` (randn)."""
    gen = torch.Generator().manual_seed(seed)
    worst = dict.fromkeys(("out", "dq", "dk", "dv"), 0.0)
    for n in lengths:
        q = torch.randn(n, heads, d, generator=gen).to(dtype)
        k, v = (torch.randn(n, kv_heads, d, generator=gen).to(dtype) for _ in range(2))
        dout = torch.randn(n, heads, d, generator=gen).to(dtype)
        got = emulate_piece(q, k, v, dout, True, d ** -0.5)
        want = exact_piece(q, k, v, dout, True, d ** -0.5)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got[:1] + got[2:], want):
            worst[name] = max(worst[name], float((a - b).abs().max()))
    return worst


def block_errors(dtype, cases, seeds, heads: int = 8, kv_heads: int = 2, d: int = 64) -> dict:
    """Per gradient, the max |emulated - exact| of each draw: the blocks ``test_gpu.py``
    checks (``random_block(seed, ...)`` of each case's pieces; dout randn), over ``seeds``."""
    from test_kernels import random_block

    found = {name: [] for name in ("dq", "dk", "dv")}
    for seed in seeds:
        worst = dict.fromkeys(found, 0.0)
        for causal, pieces in cases:
            q, k, v, cu_q, cu_k = random_block(seed, heads, kv_heads, pieces, dtype=dtype, d=d)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
            for i in range(len(cu_q) - 1):
                a, b, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
                if b == a or e == c:
                    continue
                got = emulate_piece(q[a:b], k[c:e], v[c:e], dout[a:b], causal, d ** -0.5)
                want = exact_piece(q[a:b], k[c:e], v[c:e], dout[a:b], causal, d ** -0.5)
                for name, x, y in zip(found, got[2:], want[1:]):
                    worst[name] = max(worst[name], float((x - y).abs().max()))
        for name in found:
            found[name].append(worst[name])
    return found


H100_BF16 = {"out": 7.7e-3, "dq": 1.7e-2, "dk": 1.9e-2, "dv": 3.2e-2}  # GPU-FACTS, d=128


def main() -> None:
    """Emulated maxima at GPU-FACTS's setting (d=128, causal, lengths up to 2048) in bf16 and
    fp16, the H100's measured bf16 maxima beside them."""
    lengths = [1, 7, 64, 300, 1024, 2048]
    print(f"{'':6} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}   (max abs error vs float64)")
    print("H100   " + " ".join(f"{H100_BF16[n]:9.2e}" for n in H100_BF16) + "   bf16, measured")
    rows = {}
    for dtype in (torch.bfloat16, torch.float16):
        rows[dtype] = max_errors(dtype, lengths, heads=4, kv_heads=2, d=128, seed=0)
        name = str(dtype).split(".")[1][:6]
        print(f"{name:6} " + " ".join(f"{rows[dtype][n]:9.2e}" for n in H100_BF16) +
              "   emulated")
    print("ratio  " + " ".join(f"{rows[torch.bfloat16][n] / rows[torch.float16][n]:9.1f}"
                               for n in H100_BF16) + "   bf16 / fp16 (2^-8 / 2^-11 = 8)")


if __name__ == "__main__":
    main()
