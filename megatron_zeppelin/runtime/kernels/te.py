"""Backend ``te``: Transformer Engine fused attention (cuDNN), THD layout (CUDA sm90+, fp16/bf16).

``pip install "megatron-zeppelin[te]"`` (or the NGC PyTorch image). Calls
``transformer_engine.pytorch.cpp_extensions.fused_attn``'s ``fused_attn_fwd`` / ``fused_attn_bwd``
with layout ``thd_thd_thd`` and mask ``padding_causal_bottom_right`` or ``padding``, adapted to
the installed TE by the functions' signatures (``TeApi``, read from TE 2.9-2.18's sources):

* TE <= 2.14's backward takes a positional ``dqkv_dtype``, TE 2.15+ does not: every argument
  after the ten that never moved is passed by name;
* TE 2.15+ takes the output/gradient formats (``o_format``, ``do_format``, ``dqkv_layout``,
  defaults ``sbhd``/``sbh3d``): they are set to THD;
* TE 2.12+ takes ``bottom_right_diagonal`` and its cuDNN graph sets a band's right bound too.

Requirements (TE's backend selection, ``fused_attn.cpp``): sm90+ and cuDNN 9.6+ (THD with a
bottom-right causal mask or GQA), not 9.10.0/9.10.1 (no F16 fused attention); ``refuses``
names them. Softmax stats: ``[total_q, heads, 1]`` (cuDNN >= 9.6, except sm120 from TE 2.14)
or ``[batch, heads, max_q, 1]``: the forward reads the layout from the tensor TE returns and
the backward builds the same (``stats_packed``), converted to and from ``[heads, tq]``. A row
without keys gets ``-inf`` from cuDNN's kernels, but cuDNN's frontend before 9.10 masks with
float's lowest value, which leaves stats near ``-3.4e38`` and the mean of the masked keys'
values as output: where the plan says a block has such rows, stats below ``DEAD_LSE`` (or NaN)
become ``-inf`` with output 0, the engine's convention; the backward gets ``+inf`` for them
(``exp(s - inf) = 0`` under either mask value). A block without query or key rows runs no
kernel (TE sizes its graph by the log2 of the totals). ``max_q``/``max_k`` are rounded up to a
multiple of 64 (as TE's own ``DotProductAttention`` does for THD; cuDNN 9.6 takes bottom-right
masks only so) and ``max_k >= max_q`` (TE refuses a sliding window otherwise, and cuDNN 9.6 a
bottom-right mask); both are upper bounds: the kernel reads every piece's length from the
offsets.

Sliding windows: TE documents ``window_size=(left, right)`` as query ``i`` seeing keys
``[i + sk - sq - left, i + sk - sq + right]`` (bottom-right aligned, ``-1`` unbounded;
``base.band``). They need cuDNN 9.10.2+ (``BANDS_CUDNN``: before, cuDNN's frontend refuses a
left bound on a bottom-right diagonal when ``s_q == s_kv`` on sm90, and THD's graph dims are
bucketed token totals, nearly always equal). TE 2.12+ runs every band so
(``bottom_right_diagonal=True``). The cuDNN graph of TE 2.9-2.11 sets only a causal band's left
bound, bottom-right aligned only for the ``*_bottom_right`` masks: a causal band ``(left, 0)``
runs (mask ``padding_causal_bottom_right``); a band with ``right > 0`` (a windowed ring's blocks
between zigzag chunks) would run with no right bound and top-left aligned, and a left bound
without a causal mask likewise. There such a block is refused, and so is a windowed model with
this backend, at set-up (``window_limit``). A value head dim different from the query/key one
(multi-latent attention) is passed as it is: TE's THD fused attention takes ``head_dim_qk !=
head_dim_v`` (cuDNN arbitrary-seqlen backend). No dropout is used, so the RNG state passed back
is unused (zeros). Only ever chosen explicitly.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from megatron_zeppelin.runtime.kernels import base
from megatron_zeppelin.runtime.kernels.base import (OptionalCudaBackend, Pieces, Window, band,
                                                    empty_backward, empty_forward,
                                                    lse_from_kernel, lse_to_kernel, register)

THD_CUDNN = (9, 6, 0)    # TE's selection: THD with bottom-right causal masks and GQA
BROKEN_CUDNN = ((9, 10, 0), (9, 10, 1))  # no F16 fused attention in TE's selection
BANDS_CUDNN = (9, 10, 2)  # windows: cuDNN's frontend refuses a left bound on a bottom-right
#                          diagonal with s_q == s_kv (THD's bucketed totals) on sm90 before
BANDS_BROKEN_CUDNN = ((9, 14, 0),)  # TE refuses a left bound with max_seqlen_kv > 1024 and
#                                    a padding mask there (its selection, TE 2.11+)
THD_ARCH = (9, 0)        # TE's fused attention takes THD from sm90 (its backend selection)
DEAD_LSE = -1e30         # stats below it mark rows without keys (cuDNN < 9.10 masks with
#                          float's lowest, not -inf)
SEQLEN_MULTIPLE = 64     # TE rounds THD max_seqlen so; cuDNN 9.6 needs it for bottom-right


@dataclasses.dataclass(frozen=True)
class TeApi:
    """What the installed ``fused_attn_fwd`` / ``fused_attn_bwd`` take (their signatures)."""

    dqkv_dtype: bool  # the backward's dqkv_dtype (TE <= 2.14)
    formats: bool     # o_format / do_format / dqkv_layout (TE 2.15+; defaults sbhd)
    diagonal: bool    # bottom_right_diagonal, and bands with a right bound (TE 2.12+)

    @classmethod
    def of(cls, module) -> "TeApi":
        fwd = inspect.signature(module.fused_attn_fwd).parameters
        bwd = inspect.signature(module.fused_attn_bwd).parameters
        return cls(dqkv_dtype="dqkv_dtype" in bwd, formats="o_format" in fwd,
                   diagonal="bottom_right_diagonal" in fwd)


@functools.lru_cache(maxsize=None)
def api(module) -> TeApi:
    """``TeApi`` of a loaded fused-attention module, read once."""
    return TeApi.of(module)


@functools.lru_cache(maxsize=None)
def cudnn_version() -> tuple[int, ...]:
    """The cuDNN version TE runs on (TE's ``get_cudnn_version``), read once."""
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version())


def te_dtype(dtype: torch.dtype):
    """TE's ``tex.DType`` of a torch dtype (the ``dqkv_dtype`` of TE <= 2.14)."""
    from transformer_engine.pytorch.constants import TE_DType

    return TE_DType[dtype]


def bands(module) -> str:
    """Which sliding-window bands this TE and cuDNN run on THD: ``all`` (TE 2.12+ with
    cuDNN >= 9.10.2: both bounds, bottom-right aligned), ``causal`` (before TE 2.12:
    ``(left, 0)`` only) or ``none`` (cuDNN before 9.10.2, see ``BANDS_CUDNN``, or 9.14.0)."""
    if cudnn_version() < BANDS_CUDNN or cudnn_version() in BANDS_BROKEN_CUDNN:
        return "none"
    return "all" if api(module).diagonal else "causal"


_SEEN_LAYOUT: dict[str, bool] = {}  # the stats layout TE's forward returned in this process


def stats_packed() -> bool:
    """Whether TE keeps the softmax stats packed ``[total_q, heads, 1]``: as its forward
    returned them in this process, else by TE's rule (THD with cuDNN >= 9.6; sm120 is
    padded from TE 2.14, which a forward always shows before a backward)."""
    if "packed" in _SEEN_LAYOUT:
        return _SEEN_LAYOUT["packed"]
    return cudnn_version() >= THD_CUDNN


def _rows(pieces: Pieces, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(piece index, row in piece) of every packed query row (padded stats), built on the
    device from the block's offsets with host-known sizes: no copy, no host sync."""
    cu = pieces.cu_q_dev.to(device).long()
    piece = torch.repeat_interleave(torch.arange(len(pieces.cu_q) - 1, device=device),
                                    cu.diff(), output_size=pieces.total_q)
    return piece, torch.arange(pieces.total_q, device=device) - cu[piece]


def lse_from_te(stats: torch.Tensor, pieces: Pieces, heads: int) -> torch.Tensor:
    """TE softmax stats (``[tq, h, 1]`` or ``[b, h, max_q, 1]``) -> ``[heads, tq]`` float32."""
    if stats.dim() == 3:
        return stats.reshape(-1, heads)[: pieces.total_q].t().float().contiguous()
    piece, row = _rows(pieces, stats.device)
    return stats[piece, :, row, 0].t().float().contiguous()


def lse_to_te(lse: torch.Tensor, pieces: Pieces, max_q: int | None = None) -> torch.Tensor:
    """``[heads, tq]`` -> TE softmax stats (``stats_packed``: ``[tq, h, 1]``, else
    ``[b, h, max_q, 1]`` with the ``max_q`` passed to the kernel)."""
    heads = lse.shape[0]
    if stats_packed():
        return lse.t().contiguous().unsqueeze(-1)
    piece, row = _rows(pieces, lse.device)
    stats = torch.full((len(pieces.cu_q) - 1, heads, max(max_q or pieces.max_q, 1), 1),
                       float("inf"), dtype=torch.float32, device=lse.device)
    stats[piece, :, row, 0] = lse.t()
    return stats


WINDOW_LIMIT = ("Transformer Engine's fused attention runs a sliding window on THD from cuDNN "
                f"{'.'.join(map(str, BANDS_CUDNN))} (not 9.14.0, which refuses one over 1024 "
                "keys), and one with a right bound (a windowed ring's blocks between zigzag "
                "chunks) from TE 2.12; before, only as a causal band")


def _bounded(left: int, right: int) -> tuple[bool, bool]:
    """(windowed: the band bounds more than causal/full does; causal: right bound 0)."""
    return (left, right) not in ((-1, -1), (-1, 0)), right == 0


def seqlens(pieces: Pieces) -> tuple[int, int]:
    """``(max_seqlen_q, max_seqlen_kv)`` for TE: the longest pieces rounded up to 64, and
    ``kv >= q`` (TE's selection refuses a window, and cuDNN 9.6 a bottom-right mask,
    otherwise; see the module docstring)."""
    up = lambda n: max(-(-n // SEQLEN_MULTIPLE), 1) * SEQLEN_MULTIPLE  # noqa: E731
    max_q = up(pieces.max_q)
    return max_q, max(up(pieces.max_k), max_q)


def _common(module, pieces: Pieces, causal: bool, scale: float, window: Window | None) -> dict:
    """Keyword arguments shared by TE's forward and backward."""
    left, right = band(causal, window)
    windowed, causal_band = _bounded(left, right)
    support = bands(module) if windowed else "all"
    if support == "none" or (support == "causal" and not causal_band):
        raise ValueError(f"backend 'te' cannot run the band window={tuple(window)}: "
                         f"{WINDOW_LIMIT}; use backend {' or '.join(base.WINDOW_BACKENDS)}")
    kwargs = dict(cu_seqlens_q_padded=pieces.cu_q_dev, cu_seqlens_kv_padded=pieces.cu_k_dev,
                  attn_scale=scale, dropout=0.0, qkv_layout="thd_thd_thd",
                  attn_bias_type="no_bias",
                  attn_mask_type="padding_causal_bottom_right" if causal_band else "padding",
                  window_size=(left, right))
    if api(module).diagonal:
        kwargs["bottom_right_diagonal"] = True
    if api(module).formats:
        kwargs["o_format"] = "thd"
    return kwargs


class TransformerEngine(OptionalCudaBackend):
    """The ``te`` backend (see the module docstring)."""

    name = "te"
    kernel = "cudnn"
    description = "Transformer Engine fused attention, THD (CUDA sm90+, fp16/bf16; pip extra te)"
    module = "transformer_engine.pytorch.cpp_extensions.fused_attn"
    package, extra = "transformer_engine", "te"

    @property
    def window_limit(self) -> str | None:
        """Why this TE cannot run windowed rings (None when it can, or is not installed:
        ``unavailable`` says so)."""
        module = self.load()
        if module is None or bands(module) == "all":
            return None
        return f"{WINDOW_LIMIT} (this process has cuDNN {_dotted(cudnn_version())})"

    def refuses(self, q: torch.Tensor) -> str | None:
        problem = super().refuses(q)
        if problem is not None:
            return problem
        capability, cudnn = base.device_capability(q.device), cudnn_version()
        if capability < THD_ARCH:
            return (f"needs sm{THD_ARCH[0]}{THD_ARCH[1]}+ for THD fused attention, got "
                    f"sm{''.join(map(str, capability))}")
        if cudnn < THD_CUDNN or cudnn in BROKEN_CUDNN:
            broken = "/".join(map(_dotted, BROKEN_CUDNN))
            return (f"needs cuDNN {_dotted(THD_CUDNN)}+ (not {broken}) for THD causal and GQA "
                    f"fused attention, this process has cuDNN {_dotted(cudnn)}")
        return None

    def forward(self, q, k, v, pieces: Pieces, causal: bool, scale: float,
                window: Window | None = None):
        if pieces.empty:  # TE sizes graphs by log2 of totals
            return empty_forward(q, v)
        te = self.load()
        max_q, max_k = seqlens(pieces)
        out, aux = te.fused_attn_fwd(True, max_q, max_k, pieces.cu_q_dev, pieces.cu_k_dev,
                                     q.contiguous(), k.contiguous(), v.contiguous(), q.dtype,
                                     te.FusedAttnBackend["F16_arbitrary_seqlen"],
                                     **_common(te, pieces, causal, scale, window))
        _SEEN_LAYOUT["packed"] = aux[0].dim() == 3
        keyless = causal or window is not None
        lse = lse_from_kernel(lse_from_te(aux[0], pieces, q.shape[1]), pieces, keyless)
        if not pieces.keyless_rows(keyless):
            return out, lse
        dead = ~(lse > DEAD_LSE)  # -inf, float's lowest (cuDNN < 9.10) or NaN: no key
        return (out.masked_fill(dead.t().unsqueeze(-1), 0.0),
                lse.masked_fill(dead, float("-inf")))

    def backward(self, dout, q, k, v, out, lse, pieces: Pieces, causal: bool, scale: float,
                 window: Window | None = None):
        if pieces.empty:
            return empty_backward(q, k, v)
        te = self.load()
        max_q, max_k = seqlens(pieces)
        stats = lse_to_te(lse_to_kernel(lse, pieces, causal or window is not None), pieces,
                          max_q)
        kwargs = _common(te, pieces, causal, scale, window)
        if api(te).dqkv_dtype:
            kwargs["dqkv_dtype"] = te_dtype(dout.dtype)
        if api(te).formats:
            kwargs.update(do_format="thd", dqkv_layout="thd_thd_thd")
        grads = te.fused_attn_bwd(max_q, max_k, pieces.cu_q_dev, pieces.cu_k_dev,
                                  q.contiguous(), k.contiguous(), v.contiguous(),
                                  out.contiguous(), dout.contiguous(), q.dtype,
                                  aux_ctx_tensors=[stats, _unused_rng(q.device)],
                                  fused_attention_backend=te.FusedAttnBackend[
                                      "F16_arbitrary_seqlen"],
                                  deterministic=False, **kwargs)
        return grads[0], grads[1], grads[2]


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


_RNG: dict[torch.device, torch.Tensor] = {}


def _unused_rng(device: torch.device) -> torch.Tensor:
    """The backward's RNG state (int64 ``(2,)``, as TE's forward makes it; unused without
    dropout), made once per device."""
    if device not in _RNG:
        _RNG[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return _RNG[device]


BACKEND = register(TransformerEngine())
