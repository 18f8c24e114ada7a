"""Data-iterator hook: documents -> planned micro-batches in each rank's linear layout.

A *document source* gives variable-length documents (1-D int64 token tensors). The sampler
fills each global micro-batch with documents up to a token budget (Megatron's micro-batch
size x sequence length x pool ranks), shuffled per epoch with a fixed seed, so every rank of a
pool draws the same documents. The partitioner plans the micro-batch on a worker thread one
micro-batch ahead (planning is pure Python and runs while torch releases the GIL), and each
rank takes its ``Plan.linear[rank]`` tokens:

* tokens / position ids: the pieces of documents the rank holds, positions restarting at 0 in
  every planned sequence (RoPE by in-document position);
* labels / loss mask: cut from whole documents *before* the layout splits them, so the label
  of a piece's last token is the next token of its document (possibly held by another rank),
  and a document's last token has no target (mask 0).
"""
from __future__ import annotations

import os
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch

from megatron_zeppelin.megatron.packing import ZeppelinPackedSeqParams, packed_seq_params_for_rank
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.overlong import OverlongTally
from megatron_zeppelin.planner.service import PlannerService


class DocumentSource(Protocol):
    """Random access to documents: ``len(source)`` and ``source[i]`` -> 1-D int64 tokens."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor: ...


class StdlibCorpus:
    """Built-in corpus present on every machine: the Python standard library's source files as
    byte tokens (vocab 256). Long-tailed like code: most files are a few thousand bytes, a few
    are hundreds of thousands. ``max_bytes`` clips each file (a document) to its first bytes."""

    def __init__(self, max_bytes: int | None = None) -> None:
        from megatron_zeppelin.sim.workloads import stdlib_files

        self.paths = stdlib_files()
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.paths[index], "rb") as f:
            data = f.read(self.max_bytes or -1) or b"\n"
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class IndexedDocuments:
    """Megatron's indexed dataset (``--data-path PREFIX`` for ``PREFIX.bin``/``PREFIX.idx``):
    each stored sequence is one document."""

    def __init__(self, prefix: str) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
            raise FileNotFoundError(f"--data-path {prefix!r}: expected {prefix}.bin and "
                                    f"{prefix}.idx (Megatron's indexed dataset)")
        self.dataset = IndexedDataset(prefix)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.dataset[index].astype("int64"))


# What the overlong policy did to the stream so far (nothing is dropped silently): the planner's
# one tally of the policy (``planner/overlong.py``).
DocumentStats = OverlongTally


def _documents(source: DocumentSource, seed: int, max_len: int, overlong: str,
               stats: DocumentStats) -> Iterator[torch.Tensor]:
    """Documents in a per-epoch shuffled order, overlong ones split or dropped (or refused)."""
    epoch = 0
    while True:
        order = list(range(len(source)))
        random.Random(seed * 1000003 + epoch).shuffle(order)
        epoch += 1
        for index in order:
            doc = source[index]
            for start, end in stats.admit(index, doc.numel(), max_len, overlong, what="document",
                                          why="--seq-length", setting="--zeppelin-overlong"):
                yield doc[start:end]


def sample_documents(source: DocumentSource, tokens_per_batch: int, seed: int,
                     max_len: int | None = None, overlong: str = "error",
                     stats: DocumentStats | None = None) -> Iterator[list[torch.Tensor]]:
    """Endless global micro-batches: documents (at most ``max_len`` tokens after the overlong
    policy) until the next one would overflow ``tokens_per_batch``. The same seed gives the
    same batches on every rank."""
    if len(source) == 0:
        raise ValueError("the document source is empty")
    if tokens_per_batch <= 0:
        raise ValueError(f"tokens per micro-batch {tokens_per_batch} is invalid: expected > 0")
    stream = _documents(source, seed, max_len or tokens_per_batch, overlong,
                        stats if stats is not None else DocumentStats())
    pending = next(stream)
    while True:
        batch, total = [], 0
        while not batch or total + pending.numel() <= tokens_per_batch:
            batch.append(pending)
            total += pending.numel()
            pending = next(stream)
        yield batch


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
               device: torch.device | str = "cpu") -> MicroBatch:
    """Cut ``rank``'s linear-layout tokens, labels, mask and positions out of the documents."""
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
    params = packed_seq_params_for_rank(plan, rank, device=device)
    return MicroBatch(
        tokens=torch.cat(tokens).unsqueeze(0).to(device),
        labels=torch.cat(labels).unsqueeze(0).to(device),
        loss_mask=torch.cat(mask).unsqueeze(0).to(device),
        position_ids=params.position_ids(device), packed_seq_params=params, plan=plan)


class ZeppelinDataIterator:
    """Wraps a stream of global micro-batches (lists of documents) into this rank's
    ``MicroBatch``es; the plan of micro-batch i+1 is computed while micro-batch i trains.

    ``planner``: a ``planner.service.PlannerService`` (planning in its own process, never
    holding this process's GIL; its failures raise ``PlannerServiceError`` here), or a
    ``lengths -> Plan`` callable run on a worker thread of this process. Either must be
    deterministic so that every rank of the pool computes the same plan.
    """

    def __init__(self, batches: Iterator[list[torch.Tensor]],
                 planner: PlannerService | Callable[[list[int]], Plan], rank: int,
                 device: torch.device | str = "cpu", prefetch: bool = True) -> None:
        self.batches, self.planner, self.rank, self.device = batches, planner, rank, device
        self.service = planner if isinstance(planner, PlannerService) else None
        self.pool = ThreadPoolExecutor(max_workers=1) if prefetch and not self.service else None
        self.ahead: tuple[list[torch.Tensor], Future | Plan | int] | None = None

    def _submit(self) -> tuple[list[torch.Tensor], Future | Plan | int]:
        docs = next(self.batches)
        lengths = [d.numel() for d in docs]
        if self.service is not None:  # a ticket: the planner process plans it meanwhile
            return docs, self.service.submit(lengths)
        work = self.pool.submit(self.planner, lengths) if self.pool else self.planner(lengths)
        return docs, work

    def __iter__(self) -> "ZeppelinDataIterator":
        return self

    def __next__(self) -> MicroBatch:
        docs, work = self.ahead or self._submit()
        plan = self.service.result(work) if self.service is not None else \
            work.result() if isinstance(work, Future) else work
        self.ahead = self._submit()  # plan the next micro-batch while this one trains
        return slice_rank(plan, self.rank, docs, self.device)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.service is not None:
            self.service.close()
