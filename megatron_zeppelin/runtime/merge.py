"""The LSE merge every ring-attention path shares (the P2P ring helper is ``ring_comm``).

LSE merge (online softmax). A partial result of attention over some keys is ``(out, lse)``:
``out [t, heads, head_dim]`` normalised over those keys and ``lse [heads, t]`` the natural log of
their softmax denominator. Two partials over disjoint key sets merge exactly into the partial
over their union: ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b
exp(lse_b - lse)``. The merge is associative and commutative; a row that saw no key has
``lse = -inf`` and ``out = 0`` and is neutral (two such rows merge to ``-inf``/0, never NaN).
"""
from __future__ import annotations

import torch


# ----------------------------------------------------------------------------- LSE merge

def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint keys: ``(out [t, h, d], lse [h, t])``, new tensors.

    Computed in the dtype of ``out_a`` (use float32 or float64 accumulators); rows with
    ``lse = -inf`` on both sides stay ``-inf`` with output 0.
    """
    out, lse = out_a.clone(), lse_a.to(out_a.dtype, copy=True)
    _merge_(out, lse, out_b, lse_b)
    return out, lse


def _merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """``(acc_out, acc_lse)`` merged with ``(out, lse)`` in place (views allowed), in 5 ops
    (6 when ``out`` is not in the accumulator dtype): the weight of the new partial is
    ``w = exp(lse - logaddexp(acc_lse, lse)) = sigmoid(lse - acc_lse)`` (0 where both are
    ``-inf``: NaN there), ``acc_out += w (out - acc_out)`` (one ``lerp``: exactly ``out``
    where ``w = 1``, exactly ``acc_out`` where ``w = 0``), ``acc_lse = logaddexp``."""
    weight = torch.sub(lse, acc_lse).sigmoid_().nan_to_num_(nan=0.0)
    acc_out.lerp_(out.to(acc_out.dtype), weight.t().unsqueeze(-1))
    torch.logaddexp(acc_lse, lse, out=acc_lse)


def merge_into_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, rows: torch.Tensor | slice | None = None) -> None:
    """Merge the partial ``(out, lse)`` of rows ``rows`` into the accumulators, in place.

    acc_out ``[T, h, d]`` and acc_lse ``[h, T]`` (the accumulator dtype); ``out [t, h, d]`` and
    ``lse [h, t]`` hold the partial of rows ``rows``, in that order: None (all rows) or a slice
    (merged in place on views: no gather), or int64 ``[t]`` distinct indices (gathered, merged,
    scattered back: 4 more ops).
    """
    if rows is None or isinstance(rows, slice):
        rows = slice(None) if rows is None else rows
        _merge_(acc_out[rows], acc_lse[:, rows], out, lse)
        return
    part_out, part_lse = acc_out.index_select(0, rows), acc_lse.index_select(1, rows)
    _merge_(part_out, part_lse, out, lse)
    acc_out.index_copy_(0, rows, part_out)
    acc_lse.index_copy_(1, rows, part_lse)


# ----------------------------------------------------------------------------- attention sinks

def with_sink(out: torch.Tensor, lse: torch.Tensor,
              sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with a sink (Megatron's ``softmax_type`` ``off-by-one``: 0, ``learnable``: a
    parameter): one more logit per head, ``sink [heads]``, in every row's softmax denominator,
    attending a zero value. That is the partial ``(0, sink)`` merged into the row's result:
    ``lse' = logaddexp(lse, sink)``, ``out' = out exp(lse - lse') = out sigmoid(lse - sink)``
    (no zero partial is built). ``out [t, heads, d]``, ``lse [heads, t]`` in; new tensors out,
    ``out'`` in ``out``'s dtype (scaled in float32), ``lse'`` in float32. The
    attention backward run with ``(out', lse')`` gives the sink softmax's dq, dk, dv
    (``softmax = exp(s - lse')``, ``delta = rowsum(dout out')``); ``sink_grad`` the sink's."""
    if tuple(sink.shape) != (lse.shape[0],):
        raise ValueError(f"sink {tuple(sink.shape)}: expected [{lse.shape[0]}] (one logit per "
                         "query head)")
    lse, sink = lse.float(), sink.float()[:, None]
    kept = torch.sub(lse, sink).sigmoid_()  # [heads, t]: 0 where a row saw no key
    return (out.float() * kept.t().unsqueeze(-1)).to(out.dtype), torch.logaddexp(lse, sink)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              sink: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits ``[heads]`` (``with_sink``'s ``out'``/``lse'``):
    ``d sink[h] = -sum_t exp(sink[h] - lse'[h, t]) rowsum(dout out')[t, h]`` (the sink's
    probability times the row's delta), in ``sink``'s dtype."""
    delta = (dout.float() * out.float()).sum(-1)  # [t, heads]
    weight = torch.exp(sink.detach().float()[:, None] - lse.float())  # [heads, t]
    return -(weight * delta.t()).sum(1).to(sink.dtype)
