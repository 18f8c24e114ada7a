"""Data-iterator hook: documents -> planned micro-batches in each rank's linear layout.

A stream of micro-batches (lists of 1-D int64 token tensors, the same on every rank of a pool:
``corpus.MicroBatchSampler`` in training) is planned one micro-batch ahead: in training by the
planner process (``planner.service.PlannerService``: planning never holds this process's GIL),
awaited and prepared for the attention engine on a worker thread; and each rank takes its
``Plan.linear[rank]`` tokens:

* tokens / position ids: the pieces of documents the rank holds, positions restarting at 0 in
  every planned sequence (RoPE by in-document position);
* labels / loss mask: cut from whole documents *before* the layout splits them, so the label
  of a piece's last token is the next token of its document (possibly held by another rank),
  and a document's last token has no target (mask 0).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from megatron_zeppelin.megatron.common.packing import (ZeppelinPackedSeqParams, pad_count,
                                                      packed_seq_params_for_rank)
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.service import PlannerService
from megatron_zeppelin.runtime.device_index import to_device


@dataclass(frozen=True)
class MicroBatch:
    """One rank's share of a planned micro-batch, Megatron's layout with batch 1.

    tokens / labels / position_ids: ``[1, tokens]`` int64; loss_mask ``[1, tokens]`` float32.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: ZeppelinPackedSeqParams
    plan: Plan


def slice_rank(plan: Plan, rank: int, documents: Sequence[torch.Tensor],
               device: torch.device | str = "cpu", max_position: int | None = None
               ) -> MicroBatch:
    """Cut ``rank``'s linear-layout tokens, labels, mask and positions out of the documents.
    max_position: the RoPE table length (``--seq-length``: one table for every micro-batch;
    None: this micro-batch's longest position)."""
    tokens, labels, mask = [], [], []
    for seq, start, end in plan.linear[rank]:
        doc, offset, _ = plan.sources[seq]
        text = documents[doc]
        piece_end = offset + plan.seqlens[seq]  # the planned sequence ends here in its document
        lo, hi = offset + start, offset + end
        tokens.append(text[lo:hi])
        nxt = text[lo + 1:min(hi + 1, piece_end)]
        pad = hi - lo - nxt.numel()  # the sequence's last token has no target
        labels.append(torch.cat([nxt, nxt.new_zeros(pad)]))
        mask.append(torch.cat([torch.ones(nxt.numel()), torch.zeros(pad)]))
    # a rank the plan gives no tokens this time holds one pad token (no loss, no attention)
    pad = pad_count(sum(t.numel() for t in tokens), 1)
    params = packed_seq_params_for_rank(plan, rank, device=device, pad_tokens=pad,
                                        max_position=max_position)
    zeros = [torch.zeros(pad, dtype=torch.int64)]
    # built on the host, moved by one asynchronous copy per dtype (no host wait on CUDA)
    tokens, labels, mask, positions = to_device(
        [torch.cat(tokens + zeros).unsqueeze(0), torch.cat(labels + zeros).unsqueeze(0),
         torch.cat(mask + [torch.zeros(pad)]).unsqueeze(0), params.position_ids()], device)
    return MicroBatch(tokens=tokens, labels=labels, loss_mask=mask, position_ids=positions,
                      packed_seq_params=params, plan=plan)


# the integer dtypes (bool, float and complex tensors are not token ids)
TOKEN_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                          torch.uint16, torch.uint32, torch.uint64})


def check_documents(docs, index: int) -> list[int]:
    """The lengths of micro-batch ``index`` (a non-empty list of non-empty 1-D integer token
    tensors); ValueError naming the micro-batch, the document and what it is otherwise."""
    if not isinstance(docs, (list, tuple)) or not docs:
        what = "empty" if isinstance(docs, (list, tuple)) else f"a {type(docs).__name__}"
        raise ValueError(f"micro-batch {index} is {what}: expected a non-empty list of 1-D "
                         "int64 token tensors (one per document)")
    lengths = []
    for i, doc in enumerate(docs):  # one pass: it runs on every micro-batch
        if not (isinstance(doc, torch.Tensor) and doc.dtype in TOKEN_DTYPES and
                doc.dim() == 1 and doc.numel() > 0):
            what = (f"a {doc.dim()}-D {doc.dtype} tensor of {doc.numel()} elements"
                    if isinstance(doc, torch.Tensor) else type(doc).__name__)
            raise ValueError(f"micro-batch {index}, document {i} is {what}: expected a non-empty "
                             "1-D integer tensor of token ids")
        lengths.append(doc.numel())
    return lengths


class ZeppelinDataIterator:
    """Wraps a stream of global micro-batches (lists of documents) into this rank's
    ``MicroBatch``es; the plan of micro-batch i+1 is computed while micro-batch i trains.

    ``planner``: a ``planner.service.PlannerService`` (planning in its own process, never
    holding this process's GIL; its failures raise ``PlannerServiceError`` here), or a
    ``lengths -> Plan`` callable run on a worker thread of this process. Either must be
    deterministic so that every rank of the pool computes the same plan. ``state_dict()`` is
    the data position of what was handed out so far: ``batches.state_dict()`` (when the stream
    has one) taken before the micro-batch planned ahead was drawn.
    """

    def __init__(self, batches: Iterator[list[torch.Tensor]],
                 planner: PlannerService | Callable[[list[int]], Plan], rank: int,
                 device: torch.device | str = "cpu", prefetch: bool = True,
                 prepare: Callable[[Plan], None] | None = None,
                 max_position: int | None = None) -> None:
        """``prepare(plan)`` runs where the plan is awaited (the worker thread when
        ``prefetch``): e.g. building the attention runtime of the next micro-batch ahead;
        max_position: as ``slice_rank``."""
        self.batches, self.planner, self.rank, self.device = batches, planner, rank, device
        self.max_position = max_position
        self.service = planner if isinstance(planner, PlannerService) else None
        self.prepare = prepare
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeppelin-plan") \
            if prefetch else None
        self.ahead: tuple[list[torch.Tensor], Future | Plan] | None = None
        self.submitted = 0  # micro-batches handed to the planner so far
        self.ahead_position: dict | None = None

    def _plan(self, work: int | list[int]) -> Plan:
        """The plan of a submitted micro-batch (a service ticket, or its lengths), prepared."""
        plan = self.service.result(work) if self.service is not None else self.planner(work)
        if self.prepare is not None:
            self.prepare(plan)
        return plan

    def _submit(self) -> tuple[list[torch.Tensor], Future | Plan] | None:
        """Draw the next micro-batch and hand it to the planner; None at the stream's end."""
        self.ahead_position = self._stream_position()
        try:
            docs = next(self.batches)
        except StopIteration:
            return None
        lengths = check_documents(docs, self.submitted)
        # with a service, the planner process plans it meanwhile; the ticket is awaited here
        work = self.service.submit(lengths) if self.service is not None else lengths
        self.submitted += 1
        return docs, self.pool.submit(self._plan, work) if self.pool else self._plan(work)

    def replan(self, planner: Callable[[list[int]], Plan]) -> int:
        """Plan with ``planner`` from the next micro-batch submitted on (the one after the
        micro-batch planned ahead); returns its index (0 = the first this iterator drew).
        Every rank of a pool calls it at the same point, so all switch at that index."""
        if self.service is not None:
            self.service.replace(planner)
        else:
            self.planner = planner
        return self.submitted

    def __iter__(self) -> "ZeppelinDataIterator":
        return self

    def __next__(self) -> MicroBatch:
        current = self.ahead if self.submitted else self._submit()
        if current is None:  # the stream ended (the last micro-batch was handed out)
            self.ahead = None
            raise StopIteration
        docs, work = current
        plan = work.result() if isinstance(work, Future) else work
        self.ahead = self._submit()  # plan the next micro-batch while this one trains
        return slice_rank(plan, self.rank, docs, self.device, self.max_position)

    def _stream_position(self) -> dict | None:
        state_dict = getattr(self.batches, "state_dict", None)
        return state_dict() if state_dict is not None else None

    def state_dict(self) -> dict | None:
        """Where a restart continues: the stream's position before the micro-batch planned
        ahead (None when the stream has no ``state_dict``)."""
        return self.ahead_position if self.ahead is not None else self._stream_position()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.service is not None:
            self.service.close()
