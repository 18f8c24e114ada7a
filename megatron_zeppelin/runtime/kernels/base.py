"""The kernel-backend protocol, the varlen block metadata, and the registry of backends.

A *block* is one fused kernel call: ``B`` pairs of a query piece and a key/value piece that
attend each other. ``Pieces`` cuts the packed tensors: pair ``i`` is query rows
``[cu_q[i], cu_q[i+1])`` against key rows ``[cu_k[i], cu_k[i+1])``; pieces may be empty.

Causal convention: aligned at the END (bottom-right, as flash-attn >= 2.1, torch's varlen flash
kernel and TE's ``padding_causal_bottom_right``): query row ``r`` of a piece of ``tq`` rows sees
key ``c`` of a piece of ``tk`` keys iff ``c <= r + tk - tq``. On the diagonal chunk of a zigzag
ring step ``tq == tk`` and this is the plain lower triangle; ``causal=False`` is a full block.
A row that sees no key (``tq > tk``, or an empty key piece) gets output 0 and lse ``-inf``
(backends whose kernel says ``+inf``, flash-attn's convention, convert at their boundary).

Sliding windows: ``window=(left, right)`` (None: the band ``causal`` says) limits query row
``r`` of a piece to keys ``c`` with ``r + tk - tq - left <= c <= r + tk - tq + right``, the
bottom-right aligned band of flash-attn, torch's varlen flash kernel and Transformer Engine
(``-1``: unbounded on that side). ``causal`` is the band ``(-1, 0)``; Megatron's
``window_size=(L, 0)`` on a diagonal block is ``(L, 0)``. ``band(causal, window)`` resolves it.

Layouts: ``q``/``dq`` ``[tq, heads, head_dim]``; ``k``/``dk`` ``[tk, kv_heads, head_dim]``;
``v``/``dv`` ``[tk, kv_heads, v_head_dim]`` and ``out``/``dout`` ``[tq, heads, v_head_dim]``
(``v_head_dim`` may differ from ``head_dim``: multi-latent attention), with ``kv_heads``
dividing ``heads`` (GQA/MQA: query head ``i`` uses KV head ``i // (heads // kv_heads)``,
Megatron's grouping); ``lse`` ``[heads, tq]`` natural log of the softmax denominator, float32
(float64 for float64 inputs). Kernels that need one head dim for q, k and v (flash kernels)
zero-pad the smaller one (``pad_head_dims``): zero value columns give zero output columns, zero
query/key columns leave the scores unchanged.

``backward`` takes the FINAL (merged over all blocks) ``out`` and ``lse`` of the rows, so its
gradients are this block's exact contribution to the full attention's gradients: the softmax
probabilities ``exp(s - lse_final)`` and ``delta = rowsum(dout * out_final)`` are those of the
whole row.

A backend is an object with the ``KernelBackend`` protocol, registered once by its module
(``register``); ``select`` resolves a choice (a name, ``auto`` or None for the environment's
``ZEPPELIN_ATTENTION_BACKEND``, read once per process) for the tensors of a call.
"""
from __future__ import annotations

import functools
import importlib
import warnings
from typing import NamedTuple, Protocol, Sequence, Union, runtime_checkable

import torch

from megatron_zeppelin import env

HALF = (torch.float16, torch.bfloat16)
AUTO = "auto"


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype of outputs, lse and gradients: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- block metadata

class Pieces(NamedTuple):
    """The varlen pieces of one block, built once per plan (never per call).

    cu_q/cu_k: host offsets (``B + 1`` ints each); max_q/max_k: longest query/key piece;
    keyless_full: some non-empty query piece has an empty key piece (its rows see no key);
    keyless_causal: some query piece is longer than its key piece (with ``causal``, its first
    rows see no key); cu_q_dev/cu_k_dev: the offsets as int32 tensors on the block's device.
    """

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int
    keyless_full: bool
    keyless_causal: bool
    cu_q_dev: torch.Tensor
    cu_k_dev: torch.Tensor

    @property
    def total_q(self) -> int:
        return self.cu_q[-1]

    @property
    def total_k(self) -> int:
        return self.cu_k[-1]

    @property
    def empty(self) -> bool:
        """No query or no key rows: nothing for a kernel to run (``empty_forward``)."""
        return self.total_q == 0 or self.total_k == 0

    def keyless_rows(self, causal: bool) -> bool:
        """Whether some query row of the block sees no key (host fact of the plan)."""
        return self.keyless_full or (causal and self.keyless_causal)


CuSeqlens = Union[Sequence[int], Pieces]


def make_pieces(cu_q: Sequence[int], cu_k: Sequence[int],
                device: torch.device | str = "cpu") -> Pieces:
    """Validated ``Pieces`` of host offsets ``cu_q``/``cu_k`` (offset tensors on ``device``)."""
    cq, ck = tuple(int(x) for x in cu_q), tuple(int(x) for x in cu_k)
    for name, cu in (("cu_q", cq), ("cu_k", ck)):
        if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name}={list(cu)} is invalid: expected non-decreasing offsets "
                             "from 0 to the packed length")
    if len(cq) != len(ck):
        raise ValueError(f"cu_q has {len(cq) - 1} pieces and cu_k {len(ck) - 1}: expected one key "
                         "piece per query piece")
    tq = [b - a for a, b in zip(cq, cq[1:])]
    tk = [b - a for a, b in zip(ck, ck[1:])]
    return Pieces(cq, ck, max(tq, default=0), max(tk, default=0),
                  any(a > 0 and b == 0 for a, b in zip(tq, tk)),
                  any(a > b for a, b in zip(tq, tk)),
                  torch.tensor(cq, dtype=torch.int32, device=device),
                  torch.tensor(ck, dtype=torch.int32, device=device))


Window = tuple[int, int]


def band(causal: bool, window: Window | None) -> Window:
    """The ``(left, right)`` band of a call (``-1``: unbounded; see the module docstring)."""
    if window is not None:
        return window
    return (-1, 0) if causal else (-1, -1)


def pad_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor,
                  multiple: int = 1) -> list[torch.Tensor]:
    """q, k, v (then ``rest``: out/dout ``[t, h, v_head_dim]``) zero-padded to one head dim,
    the larger of the two rounded up to ``multiple``, contiguous (unchanged when equal)."""
    dim = max(q.shape[-1], v.shape[-1])
    dim += -dim % multiple
    return [(x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1])))
            .contiguous() for x in (q, k, v, *rest)]


def kernel_max_q(pieces: Pieces, heads: int, kv_heads: int) -> int:
    """The ``max_q`` to pass a FlashAttention-2 varlen kernel (``native``, ``flash_attn``):
    the longest query piece, but 2 where it is 1 under GQA. With ``max_q == 1`` and more query
    than KV heads the kernel takes its "ngroups swapped" decode path, which reshapes q to
    ``[pieces, kv_heads, groups, head_dim]``: it fails when a query piece is empty (a ring
    block whose piece of some sequence holds no query row; flash-attn issue 1619), and it is
    the path whose split-KV LSE a fork of the kernel had to fix. The kernel sizes its grid by
    ``max_q`` and reads every piece's true length from the offsets, so 2 only turns that path
    off (same results; causal with one row sees every key either way). Host facts of the plan
    only (no device read)."""
    return 2 if pieces.max_q == 1 and heads > kv_heads else pieces.max_q


def check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces) -> None:
    """Validate a block's shapes against its pieces (ValueError naming the bad value)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q [tq, heads, head_dim], k [tk, kv_heads, head_dim] and v [tk, "
                         "kv_heads, v_head_dim]")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads or q.shape[2] != k.shape[2]:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} and head dims must match"
                         f" (q {q.shape[2]}, k {k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, cu, total in (("cu_q", pieces.cu_q, q.shape[0]), ("cu_k", pieces.cu_k, k.shape[0])):
        if cu[-1] != total:
            raise ValueError(f"{name}={list(cu)} is invalid: expected non-decreasing offsets "
                             f"from 0 to {total} (the packed length)")


def lse_from_kernel(lse: torch.Tensor, pieces: Pieces, causal: bool) -> torch.Tensor:
    """A flash-convention lse (``+inf`` for rows without keys) in the engine's (``-inf``);
    untouched (no kernel launched) when the plan says every row sees a key."""
    if pieces.keyless_rows(causal):
        return lse.masked_fill(torch.isposinf(lse), float("-inf"))
    return lse


def lse_to_kernel(lse: torch.Tensor, pieces: Pieces, causal: bool) -> torch.Tensor:
    """The engine's lse as flash kernels take it: float32, contiguous, ``+inf`` for rows
    without keys."""
    lse = lse.float()
    if pieces.keyless_rows(causal):
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    return lse.contiguous()


def empty_forward(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of a block without query or key rows (``Pieces.empty``), with no kernel
    launch: output 0 ``[tq, h, v_head_dim]``, lse ``-inf`` ``[h, tq]`` float32."""
    heads = q.shape[1]
    return (q.new_zeros((q.shape[0], heads, v.shape[-1])),
            torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float32,
                       device=q.device))


def empty_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of such a block: zeros."""
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


# The CUDA backends that run every sliding-window band on any version of their kernel: what
# a refusal of windows by another backend (``window_limit``) points to.
WINDOW_BACKENDS = ("native", "flash_attn", "flash_attn3")


# ----------------------------------------------------------------------------- protocol

@runtime_checkable
class KernelBackend(Protocol):
    """One way to run a block (see the module docstring for layouts and conventions).

    name: the registry key (``ZEPPELIN_ATTENTION_BACKEND`` / ``--zeppelin-attention-backend``);
    kernel: the hardware-profile kernel it runs (``config.ATTENTION_KERNELS``); auto: whether
    ``auto`` may pick it (in registration order); description: one line for ``--help``;
    window_limit: why it cannot run sliding-window rings (None: it runs every band).
    """

    name: str
    kernel: str
    auto: bool
    description: str
    window_limit: str | None

    def unavailable(self) -> str | None:
        """Why this process cannot use the backend at all (not installed), else None."""

    def refuses(self, q: torch.Tensor) -> str | None:
        """Why the backend cannot run a block of ``q``'s device, dtype and head dim, else None
        (host facts only: never reads tensor values)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: Pieces,
                causal: bool, scale: float, window: Window | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [tq, h, v_head_dim] q.dtype, lse [h, tq] accumulator dtype)``."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, pieces: Pieces, causal: bool,
                 scale: float, window: Window | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` in the input dtype, given the rows' FINAL ``out`` and ``lse``."""


class OptionalCudaBackend:
    """Shared parts of the optional packaged backends (flash_attn, flash_attn3, te): importable
    only once installed (``module``, ``package``; ``install_hint``: their pip ``extra`` by
    default), CUDA fp16/bf16 tensors only, never picked by ``auto``. ``load()`` returns the
    module or None."""

    module = package = extra = ""
    auto = False
    window_limit: str | None = None

    def load(self):
        return _import_once(self.module)

    def install_hint(self) -> str:
        """How to install what ``load()`` imports."""
        return f"pip install \"megatron-zeppelin[{self.extra}]\""

    def unavailable(self) -> str | None:
        if self.load() is None:
            return (f"needs {self.package}, which is not installed: {self.install_hint()} "
                    "(or use backend 'native')")
        return None

    def refuses(self, q: torch.Tensor) -> str | None:
        if not q.is_cuda or q.dtype not in HALF:
            return f"needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}"
        return None


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device (host query, once per device)."""
    return tuple(torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def _import_once(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


_REGISTRY: dict[str, KernelBackend] = {}
FALLBACK = "torch"  # the backend that takes every block (exact; slow on CUDA)


def register(backend: KernelBackend) -> KernelBackend:
    """Add ``backend`` under its name (once per process); returns it."""
    if not isinstance(backend, KernelBackend):
        raise TypeError(f"{backend!r} does not implement KernelBackend")
    if backend.name in _REGISTRY or backend.name == AUTO:
        raise ValueError(f"attention backend name {backend.name!r} is already taken")
    _REGISTRY[backend.name] = backend
    return backend


def names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(_REGISTRY)


def choices() -> tuple[str, ...]:
    """What ``ZEPPELIN_ATTENTION_BACKEND`` and ``--zeppelin-attention-backend`` accept."""
    return (AUTO, *_REGISTRY)


def get(name: str) -> KernelBackend:
    """The backend registered as ``name``; ValueError naming the choices otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"attention backend={name!r} is invalid: expected one of "
                         f"{list(choices())}")
    return _REGISTRY[name]


@functools.lru_cache(maxsize=None)
def configured() -> str:
    """``ZEPPELIN_ATTENTION_BACKEND`` (default ``auto``), read once per process."""
    return env.attention_backend(choices())


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A RuntimeWarning, once per process and message."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def select(choice: str | KernelBackend | None, q: torch.Tensor) -> KernelBackend:
    """The backend that runs blocks of ``q`` for ``choice`` (None: ``configured()``).

    ``auto``: the first registered backend with ``auto`` set that is available and accepts
    ``q`` (the native kernel for CUDA fp16/bf16), else the ``torch`` backend, with a one-time
    warning naming why when ``q`` is on CUDA. An explicit backend that is not installed raises
    ImportError naming the extra; one that refuses ``q`` raises ValueError naming the reason.
    Call it once per engine and phase, not per block.
    """
    if not isinstance(choice, (str, type(None))):
        return choice
    name = configured() if choice is None else choice
    if name != AUTO:
        backend = get(name)
        missing = backend.unavailable()
        if missing:
            raise ImportError(f"attention backend {name!r}: {missing}")
        reason = backend.refuses(q)
        if reason:
            raise ValueError(f"attention backend {name!r} cannot run this block: {reason}; "
                             f"use backend 'auto' or '{FALLBACK}'")
        return backend
    reasons = []
    for backend in _REGISTRY.values():
        if not backend.auto:
            continue
        why = backend.unavailable() or backend.refuses(q)
        if why is None:
            return backend
        reasons.append(f"{backend.name}: {why}")
    fallback = get(FALLBACK)
    if q.is_cuda:
        warn_once(f"attention backend auto runs the '{FALLBACK}' math path on CUDA "
                  f"({q.dtype}, head_dim {q.shape[-1]}) because {'; '.join(reasons)}: scores "
                  "are materialised per sequence pair, tens of times slower than the native "
                  "flash kernel (use bf16/fp16 and a head dim that is a multiple of 8, <= 256)")
    return fallback
