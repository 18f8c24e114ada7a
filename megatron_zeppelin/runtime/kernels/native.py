"""Backend ``native``: torch's own varlen flash attention, the default for CUDA fp16/bf16.

Every CUDA torch wheel carries it (FlashAttention-2 code inside ATen, sm80+); the contract,
checked on an H100 with torch 2.11 (``shared/design/GPU-FACTS.md``)::

    aten::_flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
        is_causal, return_debug_mask, *, scale) -> (out, softmax_logsumexp, rng_state, unused,
        debug_attn_mask)
    aten::_flash_attention_backward(grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k,
        max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale) -> (dq, dk, dv)

Packed ``[total, heads, head_dim]`` q and ``[total, kv_heads, head_dim]`` k/v (GQA native),
int32 ``cum_seq`` offsets on the device, causal aligned bottom-right (the engine's convention),
lse ``[heads, total_q]`` float32 with ``+inf`` for a row that sees no key, ``rng_state`` a
``(2,)`` uint64 and ``unused`` a 0-d uint64 tensor (zeros serve the backward without dropout).

Its FlashAttention-2 code needs one head dim for q, k and v (torch's SDPA checks it as "Q/K/V
should have the same head size"; the CPU flash kernel refuses it with that message): a value
head dim different from the query/key one (multi-latent attention, e.g. 192/128) is zero-padded
to the larger (``base.pad_head_dims``; zero value columns make zero output columns, zero q/k
columns leave the scores unchanged) and the output and gradients sliced back, at the cost of
the padded FLOPs and copies. Sliding windows go to the kernel as ``window_size_left/right``
(``base.band``; bottom-right aligned, ``-1`` unbounded), and the head-dim limit
(``MAX_HEAD_DIM``) applies to the padded dim.

What the block call adds to the raw kernel: nothing per call but the kernel itself, unless the
block's pieces leave rows without keys (a host fact of the plan, ``Pieces.keyless_rows``): then
one ``masked_fill`` turns the kernel's ``+inf`` lse into the engine's ``-inf`` (and back for the
backward). The offsets and max lengths come precomputed in ``Pieces``; nothing is read back
from the device.

One call the kernel cannot take: with ``max_q == 1`` and GQA its forward reshapes q to
``[pieces, kv_heads, groups, head_dim]`` (a fast path that assumes one query row per piece),
which fails when a query piece is empty (a ring block whose piece of some sequence holds no
query row). The backend passes ``max_q = 2`` for every single-row GQA block
(``base.kernel_max_q``, shared with ``flash_attn``): the kernel sizes its grid by ``max_q``
and reads every piece's true length from the offsets, so a larger value only turns the fast
path off (same results; causal with one row sees every key either way).

``NativeFlash.ops`` is the kernel the backend calls (``AtenFlashOps``); tests replace it with a
CPU stand-in of exactly this contract (``tests/flash_standin.py``), so CI runs this module's
whole code path. At run time the backend calls the real kernel or refuses (``refuses``).
"""
from __future__ import annotations

import torch

from megatron_zeppelin.runtime.kernels.base import (HALF, Pieces, Window, band, device_capability,
                                                    empty_backward, empty_forward, kernel_max_q,
                                                    lse_from_kernel, lse_to_kernel,
                                                    pad_head_dims, register)

MAX_HEAD_DIM = 256


class AtenFlashOps:
    """The real kernel: ``aten._flash_attention_forward`` / ``_backward`` (CUDA, sm80+)."""

    def refuses(self, q: torch.Tensor) -> str | None:
        """Why the real kernel cannot run on ``q``'s device (host facts), else None."""
        if not q.is_cuda:
            return f"needs CUDA tensors, got {q.device}"
        if torch.version.hip is None and device_capability(q.device) < (8, 0):
            major, minor = device_capability(q.device)
            return f"needs an sm80+ GPU (Ampere or newer), got sm{major}{minor}"
        return None

    def forward(self, *args, **kwargs):
        return torch.ops.aten._flash_attention_forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return torch.ops.aten._flash_attention_backward(*args, **kwargs)


class NativeFlash:
    """The ``native`` backend (see the module docstring)."""

    name = "native"
    kernel = "fa2"
    auto = True
    window_limit = None
    description = "torch's built-in varlen flash attention (CUDA sm80+, fp16/bf16)"

    def __init__(self) -> None:
        self.ops = AtenFlashOps()
        self._rng: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def unavailable(self) -> str | None:
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return f"torch {torch.__version__} has no aten._flash_attention_forward"
        return None

    def refuses(self, q: torch.Tensor) -> str | None:
        if q.dtype not in HALF:
            return f"needs fp16/bf16 tensors, got {q.dtype}"
        d = q.shape[-1]  # a different value head dim is padded to the larger (MLA)
        if d % 8 or d > MAX_HEAD_DIM:
            return f"needs a head dim that is a multiple of 8 and <= {MAX_HEAD_DIM}, got {d}"
        return self.ops.refuses(q)

    def _unused_rng(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rng_state (2,) uint64, unused 0-d uint64)`` zeros on ``device``, made once."""
        if device not in self._rng:
            self._rng[device] = (torch.zeros(2, dtype=torch.uint64, device=device),
                                 torch.zeros((), dtype=torch.uint64, device=device))
        return self._rng[device]

    def forward(self, q, k, v, pieces: Pieces, causal: bool, scale: float,
                window: Window | None = None):
        heads = q.shape[1]
        if pieces.empty:
            return empty_forward(q, v)
        out, lse, *_ = self.ops.forward(
            *pad_head_dims(q, k, v), pieces.cu_q_dev, pieces.cu_k_dev,
            kernel_max_q(pieces, heads, k.shape[1]), pieces.max_k, 0.0, causal, False,
            scale=scale, **_window(causal, window))
        out = out[..., :v.shape[-1]]
        if tuple(lse.shape) != (heads, pieces.total_q) or lse.dtype != torch.float32:
            raise RuntimeError(f"aten._flash_attention_forward returned lse {tuple(lse.shape)} "
                               f"{lse.dtype}: the native backend expects [{heads}, "
                               f"{pieces.total_q}] float32 (torch {torch.__version__}); use "
                               "backend 'flash_attn' or 'torch'")
        return out, lse_from_kernel(lse, pieces, causal or window is not None)

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, causal: bool, scale: float,
                 window: Window | None = None):
        if pieces.empty:
            return empty_backward(q, k, v)
        rng_state, unused = self._unused_rng(q.device)
        qp, kp, vp, dop, op = pad_head_dims(q, k, v, dout, out)
        dq, dk, dv = self.ops.backward(
            dop, qp, kp, vp, op, lse_to_kernel(lse, pieces, causal or window is not None),
            pieces.cu_q_dev, pieces.cu_k_dev, kernel_max_q(pieces, q.shape[1], k.shape[1]),
            pieces.max_k, 0.0, causal, rng_state, unused, scale=scale, **_window(causal, window))
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


def _window(causal: bool, window: Window | None) -> dict:
    """The kernel's window keywords: none without a window (its default, full band)."""
    if window is None:
        return {}
    left, right = band(causal, window)
    return {"window_size_left": left, "window_size_right": right}


BACKEND = register(NativeFlash())
