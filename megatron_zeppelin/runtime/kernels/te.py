"""Backend ``te``: Transformer Engine fused attention (cuDNN), THD layout (CUDA, fp16/bf16).

``pip install "megatron-zeppelin[te]"`` (or the NGC PyTorch image). Calls
``transformer_engine.pytorch.cpp_extensions.fused_attn``'s ``fused_attn_fwd`` / ``fused_attn_bwd``
with layout ``thd_thd_thd`` and mask ``padding_causal_bottom_right`` or ``padding``. Its softmax
stats are ``[total_q, heads, 1]`` (cuDNN >= 9.6) or ``[batch, heads, max_q, 1]`` before,
converted to and from ``[heads, tq]``; rows without keys carry ``+inf`` there. Sliding windows:
TE documents ``window_size=(left, right)`` as query ``i`` seeing keys ``[i + sk - sq - left,
i + sk - sq + right]`` (bottom-right aligned, ``-1`` unbounded; ``base.band``), but the cuDNN
graph of TE 2.9-2.11 sets only the band's left bound, on a causal mask, bottom-right aligned
only for the ``*_bottom_right`` masks: a causal band ``(left, 0)`` runs (mask
``padding_causal_bottom_right``); a band with ``right > 0`` (a windowed ring's blocks between
zigzag chunks) would run with no right bound and top-left aligned, and a left bound without a
causal mask likewise. Such a block is refused (``WINDOW_LIMIT``), and so is a windowed model
with this backend, at set-up (``window_limit``). A value head dim different from the
query/key one (multi-latent attention) is passed as it is: TE's THD fused attention takes
``head_dim_qk != head_dim_v`` (cuDNN arbitrary-seqlen backend). No dropout is
used, so the RNG state passed back is unused (zeros). Only ever chosen explicitly.
"""
from __future__ import annotations

import torch

from megatron_zeppelin.runtime.kernels.base import (OptionalCudaBackend, Pieces, Window, band,
                                                    lse_from_kernel, lse_to_kernel, register)


def stats_packed() -> bool:
    """Whether this cuDNN keeps TE's softmax stats packed ``[total_q, heads, 1]``."""
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version()) >= (9, 6, 0)


def _rows(pieces: Pieces, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(piece index, row in piece) of every packed query row (padded stats, old cuDNN), built
    on the device from the block's offsets with host-known sizes: no copy, no host sync."""
    cu = pieces.cu_q_dev.to(device).long()
    piece = torch.repeat_interleave(torch.arange(len(pieces.cu_q) - 1, device=device),
                                    cu.diff(), output_size=pieces.total_q)
    return piece, torch.arange(pieces.total_q, device=device) - cu[piece]


def lse_from_te(stats: torch.Tensor, pieces: Pieces, heads: int) -> torch.Tensor:
    """TE softmax stats -> ``[heads, tq]`` float32."""
    if stats_packed():
        return stats.reshape(-1, heads)[: pieces.total_q].t().float().contiguous()
    piece, row = _rows(pieces, stats.device)
    return stats[piece, :, row, 0].t().float().contiguous()


def lse_to_te(lse: torch.Tensor, pieces: Pieces) -> torch.Tensor:
    """``[heads, tq]`` -> TE softmax stats (packed ``[tq, h, 1]`` or ``[b, h, max_q, 1]``)."""
    heads = lse.shape[0]
    if stats_packed():
        return lse.t().contiguous().unsqueeze(-1)
    piece, row = _rows(pieces, lse.device)
    stats = torch.full((len(pieces.cu_q) - 1, heads, max(pieces.max_q, 1), 1), float("inf"),
                       dtype=torch.float32, device=lse.device)
    stats[piece, :, row, 0] = lse.t()
    return stats


WINDOW_LIMIT = ("Transformer Engine's fused attention (cuDNN graph of TE 2.9-2.11) takes a "
                "sliding window only as a causal band (right bound 0), and a windowed ring's "
                "blocks between zigzag chunks need one with a right bound")


def _common(pieces: Pieces, causal: bool, scale: float, window: Window | None) -> dict:
    """Keyword arguments shared by TE's forward and backward."""
    left, right = band(causal, window)
    if right != 0 and (left, right) != (-1, -1):  # a band that is neither causal nor full
        raise ValueError(f"backend 'te' cannot run the band window={tuple(window)}: "
                         f"{WINDOW_LIMIT}; use backend 'native' or 'flash_attn'")
    return dict(cu_seqlens_q_padded=pieces.cu_q_dev, cu_seqlens_kv_padded=pieces.cu_k_dev,
                attn_scale=scale, dropout=0.0, qkv_layout="thd_thd_thd",
                attn_bias_type="no_bias",
                attn_mask_type="padding_causal_bottom_right" if right == 0 else "padding",
                window_size=(left, right))


class TransformerEngine(OptionalCudaBackend):
    """The ``te`` backend (see the module docstring)."""

    name = "te"
    kernel = "cudnn"
    window_limit = WINDOW_LIMIT
    description = "Transformer Engine fused attention, THD (CUDA, fp16/bf16; pip extra te)"
    module = "transformer_engine.pytorch.cpp_extensions.fused_attn"
    package, extra = "transformer_engine", "te"

    def forward(self, q, k, v, pieces: Pieces, causal: bool, scale: float,
                window: Window | None = None):
        te = self.load()
        out, aux = te.fused_attn_fwd(True, pieces.max_q, pieces.max_k, pieces.cu_q_dev,
                                     pieces.cu_k_dev, q.contiguous(), k.contiguous(),
                                     v.contiguous(), q.dtype,
                                     te.FusedAttnBackend["F16_arbitrary_seqlen"],
                                     **_common(pieces, causal, scale, window))
        keyless = causal or window is not None
        return out, lse_from_kernel(lse_from_te(aux[0], pieces, q.shape[1]), pieces, keyless)

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, causal: bool, scale: float,
                 window: Window | None = None):
        te = self.load()
        from transformer_engine.pytorch.constants import TE_DType

        stats = lse_to_te(lse_to_kernel(lse, pieces, causal or window is not None), pieces)
        unused_rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        grads = te.fused_attn_bwd(pieces.max_q, pieces.max_k, pieces.cu_q_dev, pieces.cu_k_dev,
                                  q.contiguous(), k.contiguous(), v.contiguous(),
                                  out.contiguous(), dout.contiguous(), q.dtype,
                                  TE_DType[dout.dtype], [stats, unused_rng_state],
                                  te.FusedAttnBackend["F16_arbitrary_seqlen"],
                                  deterministic=False,
                                  **_common(pieces, causal, scale, window))
        return grads[0], grads[1], grads[2]


BACKEND = register(TransformerEngine())
