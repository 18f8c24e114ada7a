"""The attention tests' reference: every sequence alone, causal attention in float64 with
autograd, and helpers to compare a rank's attention buffer with it."""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_zeppelin.plan import Plan


# ----------------------------------------------------------------------------- reference

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float, window: int | None = None,
                        sink: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence: q ``[s, h, d]``, k ``[s, g, d]``, v ``[s, g, dv]`` ->
    ``[s, h, dv]``; window: each query sees itself and the ``window`` keys before it; sink
    ``[h]``: one more logit per head in every row's softmax (Megatron's ``SoftmaxOne``: the
    scores with the sink appended, softmaxed, the sink's column dropped)."""
    s, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    if window is not None:
        mask |= torch.ones(s, s, dtype=torch.bool, device=q.device).tril(-window - 1)
    scores = scores.masked_fill(mask, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.to(scores.dtype)[:, None, None].expand(-1, s, 1)], -1)
    probs = torch.softmax(scores, dim=-1)[..., :s]
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_batch(seqlens: Sequence[int], heads: int, kv_heads: int, head_dim: int,
               seed: int, v_head_dim: int | None = None) -> dict[str, list[torch.Tensor]]:
    """Per sequence float64 q, k, v, dout (the same on every rank for a seed); v and dout
    have ``v_head_dim`` (default ``head_dim``)."""
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim if v_head_dim is None else v_head_dim
    shapes = {"q": (heads, head_dim), "k": (kv_heads, head_dim), "v": (kv_heads, dv),
              "dout": (heads, dv)}
    return {name: [torch.randn(n, h, d, generator=gen, dtype=torch.float64)
                   for n in seqlens] for name, (h, d) in shapes.items()}


def reference_grads(batch: dict[str, list[torch.Tensor]], seqs: Sequence[int],
                    scale: float, window: int | None = None, sink: torch.Tensor | None = None
                    ) -> dict[int, dict[str, torch.Tensor]]:
    """out, dq, dk, dv of sequences ``seqs`` (float64), each alone; with a ``sink``, also
    each sequence's part of the sink's gradient (``"sink"``)."""
    result = {}
    for s in seqs:
        q, k, v = (batch[n][s].clone().requires_grad_() for n in ("q", "k", "v"))
        leaf = None if sink is None else sink.detach().double().clone().requires_grad_()
        out = reference_attention(q, k, v, scale, window, leaf)
        out.backward(batch["dout"][s])
        result[s] = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        if leaf is not None:
            result[s]["sink"] = leaf.grad
    return result


def gather_rows(plan: Plan, rank: int, per_seq: dict) -> torch.Tensor:
    """The rank's attention buffer ``[tokens, ...]`` built from per-sequence tensors."""
    return torch.cat([per_seq[seq][start:end] for seq, start, end in plan.attention[rank]])


def max_errors(plan: Plan, rank: int, got: dict[str, torch.Tensor],
               ref: dict[int, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Largest |got - reference| of out, dq, dk, dv on this rank's rows."""
    if not plan.attention[rank]:
        return {name: 0.0 if tensor.numel() == 0 else float("inf") for name, tensor in got.items()}
    errors = {}
    for name, tensor in got.items():
        want = gather_rows(plan, rank, {s: r[name] for s, r in ref.items()})
        errors[name] = (tensor.double() - want).abs().max().item()
    return errors
