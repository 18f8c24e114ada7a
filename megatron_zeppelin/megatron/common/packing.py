"""Packed token layouts for Megatron-Core: ``ZeppelinPackedSeqParams`` and per-document RoPE.

A rank's tokens are packed along Megatron's sequence dimension with batch 1 (``sbhd`` with b=1):
``[tokens, 1, hidden]`` activations, ``[1, tokens]`` input/position/label ids. The packed buffer is
a list of pieces ``Segment(seq, start, end)`` (``Plan.linear[rank]`` in zeppelin mode; whole
documents ``Segment(i, 0, len_i)`` for a local packed batch). Everything outside core attention is
token-wise, so it runs on such a buffer as-is, provided RoPE rotates every token by its position
inside its own document: position ids restart at each document (Megatron-LM's
``reset_position_ids``), and a piece ``Segment(seq, start, end)`` holds positions
``start .. end-1``.

How RoPE gets those positions, without forking megatron-core 0.16.1:

* ``GPTModel._preprocess`` builds ``rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len, ...)``,
  a table ``[rotary_seq_len, 1, 1, rot_dim]`` of angles for positions ``0..rotary_seq_len-1``
  (``rotary_percent``, ``rotary_interleaved``, ``seq_len_interpolation_factor`` and rope scaling
  already folded in); with ``packed_seq_params`` given, ``rotary_seq_len = max(max_seqlen_q,
  max_seqlen_kv)``. It ignores ``position_ids`` for RoPE.
* ``SelfAttention`` applies it with ``apply_rotary_pos_emb(q, freqs, config, cu_seqlens, mscale)``:
  for ``qkv_format != 'thd'`` this is the bshd path ``t * cos(freqs) + rotate_half(t) *
  sin(freqs)`` with ``freqs`` broadcast along the sequence dim (``mscale`` is the YaRN factor
  from the config, 1.0 otherwise; with ``apply_rope_fusion`` TE's fused sbhd kernel reads
  ``freqs[i]`` for token ``i`` the same way).
* ``PackedGPTModel`` overrides ``_preprocess`` only: when the packed params are
  ``ZeppelinPackedSeqParams`` it replaces that table by ``table[position_ids]`` ->
  ``[tokens, 1, 1, rot_dim]``, so token ``i`` is rotated by its in-document position.
  ``qkv_format='sbhd'`` keeps q/k/v as ``[tokens, 1, heads, head_dim]`` through ``SelfAttention``
  (no ``thd`` squeeze, no per-sequence ``cu_seqlens`` RoPE split, no Megatron-CP slicing).
* Multi-latent attention builds its RoPE inside the attention module
  (``MLASelfAttention.get_query_key_value_tensors``: ``self.rotary_pos_emb(rotary_seq_len)``,
  then ``[0:tokens]`` and the bshd apply on ``[tokens, heads, qk_pos_emb_head_dim]``, squeezed
  because packed params are given), and ``TransformerLayer`` passes it no position ids.
  ``PackedGPTModel.forward`` puts the batch's position ids on the packed params
  (``ZeppelinPackedSeqParams.positions``) and ``PackedMLASelfAttention`` gathers that table by
  them for the call: ``[tokens, 1, rot_dim]``, the full (never CP-sliced) table's rows, so the
  RoPE part of q and k rotates by in-document position too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_zeppelin.megatron.common import mtp
from megatron_zeppelin.megatron.common.compat import fix_mla_without_te
from megatron_zeppelin.plan import Plan, Segment
from megatron_zeppelin.runtime.device_index import to_device

QKV_FORMAT = "sbhd"


class OneRankGroup:
    """What RoPE reads of a context-parallel group (``size()``, ``rank()``): one rank.

    ``RotaryEmbedding.forward`` slices its table for Megatron's CP when the group it is given
    has more than one rank; zeppelin-packed batches carry this group so that the table stays
    whole (each rank gathers its tokens' rows by position id). It is not a process group:
    a collective on it fails loudly.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


ONE_RANK_GROUP = OneRankGroup()


@dataclass
class ZeppelinPackedSeqParams(PackedSeqParams):
    """Packed pieces of documents on one rank, in buffer order (Megatron's ``PackedSeqParams``).

    segments: host-side ``Segment(seq, start, end)`` per piece, in buffer order; none when the
        plan gives this rank no tokens in this micro-batch (then one pad token keeps Megatron's
        layers working, and the rank still joins every collective).
    cu_seqlens_q / cu_seqlens_kv: int32 ``[pieces + 1]`` piece boundaries in the packed buffer.
    max_seqlen_q / max_seqlen_kv: the largest in-document end position ``max(end)``: an upper
        bound on every piece length and the RoPE table length.
    plan / rank: the zeppelin plan and the rank whose linear layout this is (None for a local
        packed batch of whole documents).
    pad_tokens: tokens appended after the last piece (sequence parallelism needs a multiple of
        TP; a rank without pieces gets one); they belong to no sequence, carry no loss and skip
        core attention.
    cp_group: a one-rank group, so that RoPE is never sliced for Megatron's own CP (in
        Megatron-LM's zeppelin mode Megatron keeps its CP groups: they are the pools).
    qkv_format is always ``'sbhd'``: q/k/v stay ``[tokens, 1, heads, head_dim]``.
    positions: ``[1, tokens]`` in-document position ids of the buffer, set by
        ``PackedGPTModel.forward`` for attention that builds its own RoPE (multi-latent).
    mtp_shift: ``mtp.PlanShift``, the plan's shift by one within documents across the pool,
        set by ``PackedGPTModel.forward`` when the model has MTP layers (``mtp.py``).
    """

    segments: tuple[Segment, ...] = ()
    plan: Optional[Plan] = None
    rank: Optional[int] = None
    pad_tokens: int = 0
    positions: Optional[Tensor] = None
    mtp_shift: Optional[Any] = None

    def __post_init__(self) -> None:
        if self.qkv_format != QKV_FORMAT:
            raise ValueError(f"qkv_format={self.qkv_format!r} is invalid: zeppelin packing keeps "
                             f"Megatron's {QKV_FORMAT!r} layout with batch 1")
        if self.pad_tokens < 0:
            raise ValueError(f"pad_tokens={self.pad_tokens} is invalid: expected >= 0")
        if self.cp_group is None:
            self.cp_group = ONE_RANK_GROUP

    @property
    def num_tokens(self) -> int:
        """Tokens of the pieces (padding excluded)."""
        return sum(s.length for s in self.segments)

    @property
    def piece_lengths(self) -> list[int]:
        return [s.length for s in self.segments]

    def position_ids(self, device: torch.device | str = "cpu") -> Tensor:
        """``[1, tokens]`` int64 in-document positions of the packed buffer (GPTModel's layout);
        pad tokens at position 0."""
        ids = position_ids_from_segments(self.segments, device)
        if self.pad_tokens:
            ids = torch.cat([ids, ids.new_zeros(self.pad_tokens)])
        return ids.unsqueeze(0)


def _check_segments(segments: Sequence[Segment]) -> None:
    for i, seg in enumerate(segments):
        if not isinstance(seg, Segment):
            raise TypeError(f"segments[{i}]={seg!r} is not a Segment(seq, start, end)")
        if not 0 <= seg.start < seg.end:
            raise ValueError(f"segments[{i}]={seg!r} is invalid: expected 0 <= start < end")


def position_ids_from_segments(segments: Sequence[Segment],
                               device: torch.device | str = "cpu") -> Tensor:
    """``[tokens]`` int64: ``start .. end-1`` for every piece, concatenated in buffer order."""
    _check_segments(segments)
    pieces = [torch.arange(s.start, s.end, dtype=torch.int64) for s in segments]
    return torch.cat(pieces).to(device) if pieces else torch.zeros(0, dtype=torch.int64,
                                                                   device=device)


def packed_seq_params_from_segments(segments: Sequence[Segment], *,
                                    device: torch.device | str = "cpu",
                                    plan: Optional[Plan] = None,
                                    rank: Optional[int] = None, pad_tokens: int = 0,
                                    max_position: Optional[int] = None
                                    ) -> ZeppelinPackedSeqParams:
    """Build the packed params of a buffer made of ``segments`` (pieces in buffer order) and
    ``pad_tokens`` trailing pad tokens. ``max_position``: the RoPE table length, at least the
    largest ``end`` (pass a larger one when position ids are not in-piece offsets, e.g.
    Megatron-LM's position ids without ``--reset-position-ids``)."""
    segments = tuple(segments)
    _check_segments(segments)
    bounds = [0]
    for seg in segments:
        bounds.append(bounds[-1] + seg.length)
    cu_seqlens, = to_device([torch.tensor(bounds, dtype=torch.int32)], device)  # no host wait
    max_position = max([s.end for s in segments] + [max_position or 1])
    return ZeppelinPackedSeqParams(
        qkv_format=QKV_FORMAT, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_position, max_seqlen_kv=max_position,
        segments=segments, plan=plan, rank=rank, pad_tokens=pad_tokens)


def packed_seq_params_for_documents(lengths: Sequence[int], *,
                                    device: torch.device | str = "cpu") -> ZeppelinPackedSeqParams:
    """Packed params of whole documents ``0..n-1`` of the given token lengths, in that order."""
    for i, length in enumerate(lengths):
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"lengths[{i}]={length!r} is invalid: expected an integer >= 1")
    return packed_seq_params_from_segments(
        [Segment(i, 0, length) for i, length in enumerate(lengths)], device=device)


def pad_count(tokens: int, pad_multiple: int) -> int:
    """Pad tokens after ``tokens`` real ones: up to a multiple of ``pad_multiple`` (sequence
    parallelism: TP), and ``pad_multiple`` of them on a rank without tokens (Megatron's layers
    cannot run on an empty micro-batch)."""
    return -tokens % pad_multiple if tokens else pad_multiple


def packed_seq_params_for_rank(plan: Plan, rank: int, *, device: torch.device | str = "cpu",
                               pad_tokens: int = 0, max_position: Optional[int] = None
                               ) -> ZeppelinPackedSeqParams:
    """Packed params of ``plan.linear[rank]``: the rank's token-balanced linear layout."""
    if not 0 <= rank < len(plan.linear):
        raise ValueError(f"rank={rank} is invalid: the plan has {len(plan.linear)} ranks")
    return packed_seq_params_from_segments(plan.linear[rank], device=device, plan=plan,
                                           rank=rank, pad_tokens=pad_tokens,
                                           max_position=max_position)


def gather_rotary_pos_emb(table: Tensor, position_ids: Tensor) -> Tensor:
    """RoPE angles per packed token: ``table[position_ids]``.

    table: ``[max_len, 1, 1, rot_dim]`` from ``RotaryEmbedding.forward``.
    position_ids: ``[1, tokens]`` (GPTModel's layout, batch 1) or ``[tokens]``, int.
    Returns ``[tokens, 1, 1, rot_dim]``, the ``freqs`` that megatron's sbhd RoPE broadcasts over
    ``[tokens, 1, heads, head_dim]``.
    """
    if table.dim() != 4 or table.shape[1:3] != (1, 1):
        raise ValueError(f"RoPE table shape {tuple(table.shape)} is invalid: expected "
                         "[max_len, 1, 1, rot_dim] (Megatron context parallelism must be 1)")
    if position_ids.dim() == 2:
        if position_ids.shape[0] != 1:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} is invalid: packed "
                             "layouts have batch 1, expected [1, tokens]")
        position_ids = position_ids[0]
    elif position_ids.dim() != 1:
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)} is invalid: expected "
                         "[1, tokens] or [tokens]")
    return table.index_select(0, position_ids.to(device=table.device, dtype=torch.long))


class PackedGPTModel(GPTModel):
    """Megatron ``GPTModel`` whose RoPE uses ``position_ids`` on zeppelin-packed batches.

    With ``packed_seq_params`` a ``ZeppelinPackedSeqParams``, ``forward(input_ids [1, tokens],
    position_ids [1, tokens], attention_mask=None, ..., packed_seq_params=params)`` rotates token
    ``i`` by ``position_ids[0, i]`` (see the module docstring); learned absolute position
    embeddings read the same ``position_ids``. Any other call is plain ``GPTModel``.
    Multi-latent attention gets the same positions (``PackedMLASelfAttention``); mRoPE builds
    its rotary inputs elsewhere and is refused.
    Megatron's own CP size may be > 1 (Megatron-LM keeps its CP groups as the zeppelin pools):
    zeppelin-packed params carry a one-rank ``cp_group`` so RoPE is not sliced for it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zeppelin_state = next((m.zeppelin_state for m in self.modules()
                                    if getattr(m, "zeppelin_state", None) is not None), None)
        if self.mtp_process:  # MTP layers here (the last stage with pipeline parallelism)
            mtp.install()
            if self.zeppelin_state is not None:  # the shift is prepared with each plan
                self.zeppelin_state.shifts = tuple(sorted({*self.zeppelin_state.shifts, 1}))
                self._check_mtp_attention()
        if self.position_embedding_type == "mrope":
            raise ValueError("PackedGPTModel supports position_embedding_type 'rope'/'yarn'/"
                             f"'learned_absolute'/'none'; got {self.position_embedding_type!r}")

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                *args: Any, packed_seq_params: PackedSeqParams = None,
                padding_mask: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        """GPTModel's forward. On a zeppelin-packed batch MoE routing gets ``padding_mask``
        ``[1, tokens]`` (True on the pad tokens) unless the caller passed one: with a mask,
        Megatron's router counts the pool's tokens by all-reducing them instead of assuming
        every rank holds as many as this one, which the linear layout does not promise."""
        if (padding_mask is None and isinstance(packed_seq_params, ZeppelinPackedSeqParams)
                and self.config.num_moe_experts):
            padding_mask = torch.zeros_like(input_ids, dtype=torch.bool)
            padding_mask[:, padding_mask.shape[1] - packed_seq_params.pad_tokens:] = True
        if isinstance(packed_seq_params, ZeppelinPackedSeqParams):
            packed_seq_params.positions = position_ids
            if self.mtp_process and packed_seq_params.plan is not None:
                packed_seq_params.mtp_shift = self._mtp_shift(packed_seq_params, input_ids.device)
        return super().forward(input_ids, position_ids, attention_mask, *args,
                               packed_seq_params=packed_seq_params, padding_mask=padding_mask,
                               **kwargs)

    def _check_mtp_attention(self) -> None:
        """ValueError unless every MTP layer runs zeppelin core attention (a spec built from
        Megatron's own layer spec would attend each piece alone on zeppelin batches)."""
        layers = getattr(getattr(self, "mtp", None), "layers", ())
        plain = [i + 1 for i, layer in enumerate(layers)
                 if not any(getattr(m, "zeppelin_state", None) is not None
                            for m in layer.modules())]
        if plain:
            raise ValueError(f"MTP layer(s) {plain} have no zeppelin core attention: build them "
                             "from the zeppelin layer spec or pass mtp_block_spec="
                             "api.swap_core_attention(<MTP block spec>, runtime)")

    def _mtp_shift(self, params: ZeppelinPackedSeqParams, device: torch.device) -> mtp.PlanShift:
        """The plan's shift by one within documents on this rank, for MTP (``mtp.py``)."""
        state = self.zeppelin_state
        if state is None or params.rank != state.rank:
            raise ValueError("multi-token prediction on a zeppelin plan needs the model built with "
                             "zeppelin core attention (api.layer_spec) of this rank's pool; got "
                             f"{'no zeppelin state' if state is None else f'pool rank {state.rank}'}"
                             f" for the plan of rank {params.rank}")
        return mtp.PlanShift(state.shift_index(params.plan, device, 1), state.pool_group)

    def _preprocess(self, input_ids: Tensor, position_ids: Tensor, decoder_input: Tensor = None,
                    inference_context: Any = None, packed_seq_params: PackedSeqParams = None,
                    padding_mask: Optional[Tensor] = None):
        """GPTModel's preprocessing; the RoPE table is gathered by position id when packed."""
        out = super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context,
                                  packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        rotary_pos_emb = out[1]
        if not isinstance(packed_seq_params, ZeppelinPackedSeqParams) or rotary_pos_emb is None:
            return out
        if position_ids is None:
            raise ValueError("position_ids=None: zeppelin-packed batches need in-document "
                             "position ids [1, tokens] for RoPE")
        return (out[0], gather_rotary_pos_emb(rotary_pos_emb, position_ids)) + tuple(out[2:])


class PackedMLASelfAttention(MLASelfAttention):
    """Megatron's ``MLASelfAttention`` whose RoPE part rotates by in-document position on
    zeppelin-packed batches (``ZeppelinPackedSeqParams.positions``, see the module docstring);
    any other call is Megatron's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fix_mla_without_te()
        super().__init__(*args, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None, *args, **kwargs):
        if not isinstance(packed_seq_params, ZeppelinPackedSeqParams):
            return super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                       position_ids, packed_seq_params, *args,
                                                       **kwargs)
        positions = packed_seq_params.positions
        if positions is None:
            raise ValueError("zeppelin-packed params without positions: multi-latent attention "
                             "runs inside PackedGPTModel, which sets them")
        rotary, table_of = self.rotary_pos_emb, self.rotary_pos_emb.forward

        def gathered(max_seq_len: int, *unused, **also_unused):
            out = table_of(max_seq_len, packed_seq=True)  # the whole table, never CP-sliced
            table = out[0] if isinstance(out, tuple) else out
            rows = gather_rotary_pos_emb(table, positions)[:, 0]  # [tokens, 1, rot_dim]
            return (rows, *out[1:]) if isinstance(out, tuple) else rows

        rotary.forward = gathered  # this call only: nn.Module.__call__ reads self.forward
        try:
            return super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                       position_ids, packed_seq_params, *args,
                                                       **kwargs)
        finally:
            del rotary.forward
