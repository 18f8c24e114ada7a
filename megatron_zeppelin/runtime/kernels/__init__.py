"""Attention kernels for one varlen block, behind one protocol (``base.KernelBackend``).

Conventions (pieces, END-aligned causal, layouts, lse) are in ``base``. Backends, one module
each, registered in this order (``auto`` takes the first with ``auto`` set that accepts the
tensors, else ``torch``):

* ``native`` (native.py): torch's built-in varlen flash attention, CUDA sm80+ fp16/bf16. The
  default on GPUs.
* ``torch`` (torch_math.py): exact on any device and dtype; CPU flash per pair on CPU, a math
  path on CUDA (fp32/fp64, head dims the native kernel refuses; warns once).
* ``flash_attn`` (flash_attn.py): the flash-attn 2.6+ package (pip extra ``flash-attn``).
* ``flash_attn3`` (flash_attn3.py): FlashAttention-3, built from flash-attention's ``hopper/``.
* ``te`` (te.py): Transformer Engine fused attention, THD (pip extra ``te``).

Adding a backend: one module with a class implementing the protocol, ending in
``BACKEND = register(MyBackend())``, and its name in ``BACKEND_MODULES``. The choices of
``ZEPPELIN_ATTENTION_BACKEND`` and ``--zeppelin-attention-backend`` come from the registry.

``block_forward``/``block_backward`` validate and run one block from host offsets (tests,
benchmarks); the engine builds ``Pieces`` once per plan, resolves its backend once per phase
(``select``) and calls the backend's ``forward``/``backward`` directly.
"""
from __future__ import annotations

import importlib
from typing import Sequence

import torch

from megatron_zeppelin.runtime.kernels.base import (AUTO, WINDOW_BACKENDS, KernelBackend, Pieces,
                                                    Window, accum_dtype, check_block, choices,
                                                    configured, get, make_pieces, names,
                                                    register, select)

BACKEND_MODULES = ("native", "torch_math", "flash_attn", "flash_attn3", "te")
for _module in BACKEND_MODULES:
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["AUTO", "WINDOW_BACKENDS", "KernelBackend", "Pieces", "Window", "accum_dtype",
           "backend_for", "block_backward", "block_forward", "check_block", "choices",
           "configured", "get", "make_pieces", "names", "register", "resolve_backend", "select"]


def _pieces(q: torch.Tensor, cu_q: Sequence[int] | Pieces, cu_k: Sequence[int] | None
            ) -> Pieces:
    return cu_q if isinstance(cu_q, Pieces) else make_pieces(cu_q, cu_k, q.device)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cu_q: Sequence[int] | Pieces, cu_k: Sequence[int] | None, causal: bool,
                  scale: float, backend: str | KernelBackend | None = None,
                  window: Window | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one varlen block: ``(out [tq, h, dv] q.dtype, lse [h, tq])``.

    ``cu_q``/``cu_k``: host offsets (or ``cu_q`` a ``Pieces`` and ``cu_k`` None); ``scale``
    multiplies the scores (usually ``head_dim ** -0.5``); ``backend``: a name, ``auto``, a
    backend object, or None for the environment's choice; ``window``: ``(left, right)`` band
    (``base.band``).
    """
    pieces = _pieces(q, cu_q, cu_k)
    check_block(q, k, v, pieces)
    return select(backend, q).forward(q, k, v, pieces, causal, scale, window)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, cu_q: Sequence[int] | Pieces,
                   cu_k: Sequence[int] | None, causal: bool, scale: float,
                   backend: str | KernelBackend | None = None, window: Window | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block ``(dq [tq, h, d], dk [tk, g, d], dv [tk, g, dv])``, input dtype.

    ``out [tq, h, d]`` and ``lse [h, tq]`` are the rows' FINAL output and logsumexp (merged over
    every block the rows attend), ``dout`` the gradient of that final output.
    """
    pieces = _pieces(q, cu_q, cu_k)
    check_block(q, k, v, pieces)
    shape = (*q.shape[:2], v.shape[2])
    if dout.shape != shape or out.shape != shape or lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be {shape} "
                         f"([tq, heads, v_head_dim]) and lse {tuple(lse.shape)} must be "
                         f"{(q.shape[1], q.shape[0])} ([heads, tq])")
    return select(backend, q).backward(dout, q, k, v, out, lse, pieces, causal, scale, window)


def backend_for(choice: str | None, device: torch.device | str, dtype: torch.dtype,
                head_dim: int) -> KernelBackend:
    """The backend ``select`` picks for blocks of this device, dtype and head dim (e.g. to
    choose the hardware profile the planner uses: ``backend.kernel``)."""
    return select(choice, torch.empty((0, 1, head_dim), dtype=dtype, device=device))


def backend_problem(name: str, device: str, dtype: torch.dtype) -> str | None:
    """Why the explicitly chosen backend ``name`` cannot run here: not installed, or (on CPU)
    refusing ``dtype`` blocks; None when it can (a CUDA backend's blocks are checked by the
    engine on the device)."""
    backend = get(name)
    why = backend.unavailable()
    if why is None and device == "cpu":
        why = backend.refuses(torch.empty((1, 1, 1), dtype=dtype))
    return why


def resolve_backend(backend: str | None, q: torch.Tensor) -> str:
    """The name of the backend a call on ``q`` uses (see ``base.select``)."""
    return select(backend, q).name
