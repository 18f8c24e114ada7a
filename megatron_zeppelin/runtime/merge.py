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
    """Merge two partials over disjoint keys: ``(out [t, h, d], lse [h, t])``.

    Computed in the dtype of ``out_a`` (use float32 or float64 accumulators); rows with
    ``lse = -inf`` on both sides stay ``-inf`` with output 0.
    """
    acc = out_a.dtype
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    ref = lse.masked_fill(torch.isneginf(lse), 0.0)
    w_a = torch.exp(lse_a - ref).t().unsqueeze(-1)  # [t, h, 1]
    w_b = torch.exp(lse_b - ref).t().unsqueeze(-1)
    return out_a * w_a + out_b.to(acc) * w_b, lse


def merge_into_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Merge the partial ``(out, lse)`` of rows ``rows`` (None: all) into the accumulators.

    acc_out ``[T, h, d]`` and acc_lse ``[h, T]`` are updated in place; ``out [t, h, d]`` and
    ``lse [h, t]`` hold the partial of rows ``rows`` (int64 ``[t]``, distinct), in that order.
    """
    if rows is None:
        merged_out, merged_lse = merge_lse(acc_out, acc_lse, out, lse)
        acc_out.copy_(merged_out)
        acc_lse.copy_(merged_lse)
        return
    merged_out, merged_lse = merge_lse(acc_out.index_select(0, rows),
                                       acc_lse.index_select(1, rows), out, lse)
    acc_out.index_copy_(0, rows, merged_out)
    acc_lse.index_copy_(1, rows, merged_lse)
