"""Megatron-LM's micro-batch -> this rank's share of it in zeppelin's linear layout.

In Megatron-LM's zeppelin mode every rank of a pool (Megatron's CP group) loads the same
micro-batch, as in static CP: ``micro-batch-size`` samples of ``seq-length`` tokens with the
fields Megatron's datasets make (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, and
``cu_seqlens`` for packed SFT samples). Static CP splits every sample over the CP ranks; zeppelin
plans the micro-batch's *sequences* over the pool and each rank takes ``Plan.linear[rank]``.

The sequences attention runs on are those Megatron's own attention mask describes:

* ``cu_seqlens`` given (``--sft`` packing, Megatron-LM 0.19's
  ``--dataloader-inter-document-masking``): its segments;
* ``--reset-attention-mask``: each sample split after every end-of-document token (what
  ``GPTDataset`` masks);
* otherwise: each whole sample is one causal sequence (Megatron's default).

Labels, loss mask and position ids are Megatron's, sliced along with the tokens: the label of a
piece's last token is the next token of its sequence even when another rank holds that token,
prompts and padding keep their zero loss mask (SFT), ``--eod-mask-loss`` and
``--reset-position-ids`` keep their meaning. With sequence parallelism a rank's token count is
padded to a multiple of TP; a rank the plan leaves empty (e.g. a whole sample placed on another
rank of the pool) holds one pad token, or TP of them with sequence parallelism, as our own loop
does (``megatron/common/data.py``): Megatron's layers cannot run on zero tokens. Pad tokens
carry loss mask 0, skip core attention and are counted (``PoolStats``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_plan, iteration_seconds
from megatron_zeppelin.megatron.common.packing import (ZeppelinPackedSeqParams, pad_count,
                                                      packed_seq_params_for_rank)
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.runtime.device_index import to_device

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def sample_sequences(tokens: Tensor, eod: int, split_at_eod: bool,
                     cu_seqlens: Optional[Tensor] = None) -> list[int]:
    """Sequence lengths of a micro-batch, sample by sample (in token order).

    tokens: host ``[samples, seq]`` int; cu_seqlens: host int boundaries of each sample's
    sequences, ``[samples, k]`` (or ``[k]`` for one sample): packed SFT samples (``--sft``,
    one sample) or documents (Megatron-LM 0.19's ``--dataloader-inter-document-masking``,
    whose rows are padded to one length by repeating ``seq``); each row runs from 0 to
    ``seq`` in increasing order.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} is invalid: expected "
                         "[micro-batch-size, seq-length]")
    samples, seq = tokens.shape
    if cu_seqlens is not None:
        if cu_seqlens.numel() % samples:
            raise ValueError(f"cu_seqlens of {cu_seqlens.numel()} entries for a micro-batch of "
                             f"{samples} samples: expected one row per sample")
        rows = cu_seqlens.reshape(samples, -1).tolist()
        return [n for row in rows for n in _row_lengths(row, seq, samples)]
    if not split_at_eod:
        return [seq] * samples
    lengths = []
    for row in tokens:
        ends = (row == eod).nonzero().flatten().tolist()
        start = 0
        for end in [e + 1 for e in ends] + [seq]:
            if end > start:
                lengths.append(end - start)
                start = end
    return lengths


def _row_lengths(bounds: list[int], seq: int, samples: int) -> list[int]:
    """One sample's sequence lengths from its ``cu_seqlens`` row (trailing ``seq`` repeats:
    padding)."""
    while len(bounds) > 2 and bounds[-1] == bounds[-2] == seq:
        bounds = bounds[:-1]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq or \
            any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} do not cover a sample of {seq} tokens "
                         f"(micro-batch of {samples}) in increasing order")
    return [b - a for a, b in zip(bounds, bounds[1:])]


class HostBatchTap:
    """Megatron's data iterator, remembering the host batch it hands out (``batch``: the
    dict TP rank 0 reads before Megatron moves it to the GPU; None on the other TP ranks,
    which receive the batch by broadcast)."""

    def __init__(self, iterator: Any) -> None:
        self.iterator, self.batch = iterator, None

    def __iter__(self) -> "HostBatchTap":
        return self

    def __next__(self) -> Any:
        self.batch = next(self.iterator)
        return self.batch


def host_lengths(tap: HostBatchTap, fields: Mapping[str, Tensor], eod: int,
                 split_at_eod: bool, tp_group: Optional[dist.ProcessGroup]) -> list[int]:
    """The micro-batch's sequence lengths (``sample_sequences``) from the host batch TP rank
    0 read, shared with the other TP ranks over the gloo ``tp_group``: no device-to-host
    copy, so the host never waits for the GPU's queue here. Without a host batch (a data
    iterator yielding device tensors) the tokens are copied back (a host wait)."""
    lengths = None
    if tap.batch is not None:
        host = tap.batch if isinstance(tap.batch, Mapping) and \
            isinstance(tap.batch.get("tokens"), Tensor) else fields
        cu = host.get("cu_seqlens")
        lengths = sample_sequences(host["tokens"].cpu(), eod, split_at_eod,
                                   None if cu is None else cu.cpu())
    if tp_group is not None:
        box = [lengths]
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(tp_group)[0],
                                   group=tp_group)
        lengths = box[0]
    if lengths is None:
        raise RuntimeError("no TP rank read this micro-batch: the data iterator of TP rank 0 "
                           "was not used (Megatron's get_batch_on_this_tp_rank)")
    return lengths


def linear_index(plan: Plan, rank: int, lengths: Sequence[int]) -> Tensor:
    """Host int64 ``[tokens]``: positions in the flattened micro-batch of ``rank``'s linear
    pieces, in buffer order (``lengths``: the planned documents, in token order)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    pieces = []
    for seq, start, end in plan.linear[rank]:
        doc, offset, _ = plan.sources[seq]
        base = starts[doc] + offset
        pieces.append(torch.arange(base + start, base + end, dtype=torch.int64))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class LinearBatch:
    """One rank's micro-batch in Megatron's layout with batch 1: ``tokens``, ``labels``,
    ``position_ids`` ``[1, tokens + pad]`` int64, ``loss_mask`` ``[1, tokens + pad]`` float."""

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    packed_seq_params: ZeppelinPackedSeqParams

    @property
    def pad_tokens(self) -> int:
        return self.packed_seq_params.pad_tokens


def linear_batch(fields: Mapping[str, Tensor], plan: Plan, rank: int, lengths: Sequence[int],
                 pad_multiple: int = 1, max_position: Optional[int] = None) -> LinearBatch:
    """Cut ``rank``'s linear layout out of Megatron's micro-batch ``fields`` (``[samples,
    seq]`` tensors, any device) and pad it to a multiple of ``pad_multiple`` tokens (a rank
    without tokens: ``pad_multiple`` pad tokens, ``pad_count``)."""
    index = linear_index(plan, rank, lengths)
    pad = pad_count(index.numel(), pad_multiple)
    device = fields["tokens"].device
    index, = to_device([index], device)  # one pinned asynchronous copy
    out = {}
    for name in FIELDS:
        flat = fields[name].reshape(-1)
        if flat.numel() != sum(lengths):
            raise ValueError(f"batch field {name!r} holds {flat.numel()} tokens, the planned "
                             f"sequences {sum(lengths)}")
        taken = flat.index_select(0, index)
        out[name] = torch.cat([taken, taken.new_zeros(pad)]).unsqueeze(0)
    params = packed_seq_params_for_rank(plan, rank, device=device, pad_tokens=pad,
                                        max_position=max_position)
    return LinearBatch(out["tokens"], out["labels"], out["loss_mask"], out["position_ids"],
                       params)


class ChunkPlans:
    """Micro-batch ``i``'s plan for every model chunk of this stage: Megatron-LM gives each
    chunk (virtual pipeline stage) its own data iterator over the same samples, and the
    interleaved schedule reads micro-batch ``i`` once per chunk; the first chunk to read it
    plans it, the others reuse that plan (one planning, one attention runtime). Every chunk
    reads as many micro-batches per schedule call, so the chunks' counts stay aligned; a chunk
    whose ``i``-th micro-batch has other sequence lengths is an error naming both."""

    def __init__(self, chunks: int) -> None:
        self.chunks, self.read = chunks, [0] * chunks
        self.pending: dict[int, list] = {}  # i -> [lengths, plan, chunks that read it]

    def plan(self, chunk: int, lengths: Sequence[int], planner: Callable[[list[int]], Plan]
             ) -> tuple[Plan, bool]:
        """``(plan, planned now)`` of ``chunk``'s next micro-batch of ``lengths``."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"model chunk {chunk} is invalid: expected in [0, {self.chunks})")
        index, self.read[chunk] = self.read[chunk], self.read[chunk] + 1
        entry = self.pending.get(index)
        planned = entry is None
        if planned:
            entry = self.pending[index] = [list(lengths), planner(list(lengths)), 0]
        elif entry[0] != list(lengths):
            raise RuntimeError(f"model chunk {chunk} read micro-batch {index} with sequence "
                               f"lengths {list(lengths)}, an earlier chunk with {entry[0]}: the "
                               "chunks' data iterators are out of step")
        entry[2] += 1
        if entry[2] == self.chunks:
            del self.pending[index]
        return entry[1], planned

    @property
    def next_index(self) -> int:
        """The index of the next micro-batch to be planned (0 = the first any chunk read)."""
        return max(self.read)


@dataclass
class PoolStats:
    """What this rank's zeppelin batches held so far (nothing is padded silently), and the
    training step in progress: its plans and when its first micro-batch was read."""

    micro_batches: int = 0
    tokens: int = 0
    pad_tokens: int = 0
    empty: int = 0  # micro-batches the plan gave this rank no token of
    max_tokens: int = 0
    plan_seconds: float = 0.0
    steps: int = 0
    step_plans: list = field(default_factory=list)  # the step in progress (training only)
    step_started: float | None = None  # perf_counter at its first micro-batch

    def add(self, batch: LinearBatch, plan_seconds: float, plan: Plan | None = None) -> None:
        """A micro-batch; ``plan``: its plan when it trains (evaluation: None)."""
        real = batch.packed_seq_params.num_tokens
        self.micro_batches += 1
        self.tokens += real
        self.pad_tokens += batch.pad_tokens
        self.empty += real == 0
        self.max_tokens = max(self.max_tokens, real + batch.pad_tokens)
        self.plan_seconds += plan_seconds
        if plan is not None:
            if not self.step_plans:
                self.step_started = time.perf_counter()
            self.step_plans.append(plan)

    def end_step(self, cost: CostModel) -> tuple[float, float, int]:
        """``(estimated s, measured s, micro-batches)`` of the step just done: its estimate on
        ``cost`` (``estimate.iteration_seconds``, the profile in force, as our loop's log) and
        the host time from its first micro-batch's read to now."""
        estimated = iteration_seconds([estimate_plan(p, cost) for p in self.step_plans],
                                      cost)
        measured = time.perf_counter() - self.step_started if self.step_plans else 0.0
        micro, self.step_plans, self.step_started = len(self.step_plans), [], None
        self.steps += 1
        return estimated, measured, micro

    def summary(self, iteration: int | None = None,
                step: tuple[float, float, int] | None = None) -> str:
        """One log line; ``step``: ``end_step``'s figures of ``iteration``."""
        n = max(1, self.micro_batches)
        share = self.pad_tokens / max(1, self.tokens + self.pad_tokens)
        line = (f"zeppelin: {self.micro_batches} micro-batches on this rank, tokens per "
                f"micro-batch mean {self.tokens / n:.0f} max {self.max_tokens}, pad tokens "
                f"{self.pad_tokens} ({100 * share:.2f}%), empty (pad only) in {self.empty} "
                f"micro-batches, planning {1000 * self.plan_seconds / n:.2f} ms per "
                "micro-batch")
        if step is None:
            return line
        estimated, measured, micro = step
        return (f"{line}; iteration {iteration}: {micro} micro-batches, step {measured:.3f} s "
                f"(est. {estimated:.3f} s)")
