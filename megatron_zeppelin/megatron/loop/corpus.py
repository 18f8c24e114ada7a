"""Training documents: where they come from and a data position that survives a restart.

Sources (``DocumentSource``): the built-in long-tail corpus (``--mock-data``) and Megatron's
indexed datasets (``--data-path PREFIX``). Each tells its documents' lengths without reading
them, and reads the tokens of one piece of a document on demand.

``DocumentStream`` walks the corpus in a per-epoch shuffled order (``--seed``) and applies the
overlong policy to each document (``planner/overlong.py``, the planner's own: ``split`` cuts a
document longer than ``--seq-length`` into equal pieces, ``drop`` counts and skips it). Its
position is a
cursor (epoch, index in the epoch's order, piece of that document): a checkpoint stores it and
a restart continues at the same piece, with no replay.

``MicroBatchSampler`` packs the stream greedily into *global* micro-batches of at most
micro-batch x seq-length tokens and deals them to the pools round-robin (micro-batch
``r * pools + i`` goes to pool ``i``); every rank walks the same stream (lengths only) and reads
the tokens of its own pool's micro-batches. The position is global, Megatron's
``consumed_samples`` for documents: a checkpoint taken with D pools resumes with any other
number of pools at the same document.
"""
from __future__ import annotations

import bisect
import os
import random
import statistics
import struct
from dataclasses import asdict
from functools import cached_property
from typing import Protocol, Sequence

import numpy
import torch

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.planner.overlong import OverlongTally


class DocumentSource(Protocol):
    """Random access to documents. ``lengths()``: tokens of every document (no token read);
    ``tokens(i, start, end)``: tokens ``[start, end)`` of document ``i``, 1-D int64."""

    name: str

    def __len__(self) -> int: ...

    def lengths(self) -> Sequence[int]: ...

    def tokens(self, index: int, start: int, end: int) -> torch.Tensor: ...


class _StdlibText:
    """The Python standard library's ``.py`` files as one byte string (never fully loaded):
    ``read(offset, n)`` returns ``n`` bytes from ``offset``, wrapping around at the end."""

    def __init__(self) -> None:
        from megatron_zeppelin.sim.workloads import stdlib_files

        self.paths = stdlib_files()
        self.starts = [0]
        for path in self.paths:
            self.starts.append(self.starts[-1] + os.path.getsize(path))
        if self.starts[-1] == 0:
            raise RuntimeError("the standard library's .py files are empty on this machine")

    @property
    def size(self) -> int:
        return self.starts[-1]

    def read(self, offset: int, n: int) -> bytes:
        out = bytearray()
        offset %= self.size
        while len(out) < n:
            i = bisect.bisect_right(self.starts, offset) - 1
            with open(self.paths[i], "rb") as f:
                f.seek(offset - self.starts[i])
                out += f.read(min(n - len(out), self.starts[i + 1] - offset))
            offset = self.starts[i + 1] % self.size
        return bytes(out)


class BuiltinCorpus:
    """The built-in corpus of ``--mock-data``: 16,384 documents of real text (windows of this
    machine's Python standard library sources, as bytes: vocab 256) whose lengths follow
    MagiAttention's representative training dataset (13.5M documents; ``sim/published.py``
    ``MAGI_DOCS``: 8% under 100 tokens, 1.3% over 16K, up to 196K) divided by 8 to fit a CPU:
    a mean of ~215 tokens, most documents a few dozen to a few hundred tokens, a few thousand
    of up to 24K tokens. The lengths are fixed (drawn with seed 0) on every machine; the text
    depends on the Python version."""

    DOCUMENTS = 16384
    SCALE = 8
    name = "builtin long-tail corpus (MagiAttention lengths / 8 over Python stdlib text)"

    def __init__(self) -> None:
        from megatron_zeppelin.sim.workloads import get_workload

        draw, rng = get_workload("magi").draw, random.Random(0)
        self._lengths = tuple(max(1, draw(rng) // self.SCALE) for _ in range(self.DOCUMENTS))
        self._starts = [0]
        for length in self._lengths:
            self._starts.append(self._starts[-1] + length)

    @cached_property
    def _text(self) -> _StdlibText:
        return _StdlibText()

    def __len__(self) -> int:
        return self.DOCUMENTS

    def lengths(self) -> Sequence[int]:
        return self._lengths

    def tokens(self, index: int, start: int, end: int) -> torch.Tensor:
        data = self._text.read(self._starts[index] + start, end - start)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class IndexedDocuments:
    """Megatron's indexed dataset (``--data-path PREFIX`` for ``PREFIX.bin``/``PREFIX.idx``):
    each stored sequence is one document. A missing, garbage or truncated pair is refused with
    a ``ConfigError`` naming the file; so is a token id outside ``[0, vocab_size)``, found when
    its piece is read (every piece read is checked unless the file's dtype cannot hold one)."""

    def __init__(self, prefix: str, vocab_size: int | None = None) -> None:
        for suffix in (".idx", ".bin"):
            if not os.path.isfile(prefix + suffix):
                raise ConfigError(f"--data-path {prefix!r}: {prefix + suffix} does not exist "
                                  "(expected Megatron's indexed dataset PREFIX.bin/PREFIX.idx)")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        _check_index(prefix)
        if os.path.getsize(prefix + ".bin") == 0:
            raise ConfigError(f"--data-path {prefix!r}: {prefix}.bin is empty: the dataset holds "
                              "no tokens")
        try:
            self.dataset = IndexedDataset(prefix)
            sizes = self.dataset.sequence_lengths
        except Exception as exc:  # an index that passed _check_index but still fails
            raise ConfigError(f"--data-path {prefix!r}: {prefix}.idx is not a readable Megatron "
                              f"index ({type(exc).__name__}: {exc})") from None
        if len(sizes) == 0:
            raise ConfigError(f"--data-path {prefix!r}: the dataset holds no documents")
        _check_extents(prefix, sizes, self.dataset.index.sequence_pointers,
                       self.dataset.index.dtype_size)
        self.name, self.prefix = f"indexed dataset {prefix}", prefix
        self._lengths = [int(n) for n in sizes]
        info = numpy.iinfo(self.dataset.index.dtype)
        self.vocab_size = vocab_size if vocab_size is not None and (
            info.max >= vocab_size or info.min < 0) else None

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> Sequence[int]:
        return self._lengths

    def tokens(self, index: int, start: int, end: int) -> torch.Tensor:
        array = self.dataset.get(index, offset=start, length=end - start)
        if self.vocab_size is not None and len(array):
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                where = int(numpy.flatnonzero(array == bad)[0]) + start
                raise ConfigError(f"--data-path {self.prefix!r}: document {index} holds token "
                                  f"id {bad} at position {where}, outside [0, --vocab-size "
                                  f"{self.vocab_size}): was it tokenized with another "
                                  "tokenizer? (set --vocab-size to the tokenizer's)")
        return torch.from_numpy(array.astype("int64"))


def _check_index(prefix: str) -> None:
    """The layout of Megatron's ``.idx`` (megatron-core's ``_IndexReader``): magic, version 1,
    dtype code, sequence count S, document count D (34 bytes), then S int32 sizes, S int64
    pointers and D int64 document indices; checked before megatron-core reads it (its reader
    asserts, then fails again in ``__del__``)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    path = prefix + ".idx"
    with open(path, "rb") as f:
        head = f.read(34)
    if head[:9] != _INDEX_HEADER:
        raise ConfigError(f"--data-path {prefix!r}: {path} is not a Megatron index (it starts "
                          f"with {head[:9]!r}, not {_INDEX_HEADER!r})")
    if len(head) < 34:
        raise ConfigError(f"--data-path {prefix!r}: {path} is truncated ({len(head)} bytes)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    expected = 34 + 12 * sequences + 8 * documents
    kinds = {kind.value: kind.name for kind in DType if numpy.issubdtype(
        DType.dtype_from_code(kind.value), numpy.integer)}  # token ids: integer dtypes only
    if version == 1 and code not in kinds:
        raise ConfigError(f"--data-path {prefix!r}: {path} stores tokens as dtype code {code}: "
                          f"expected an integer dtype ({', '.join(sorted(kinds.values()))})")
    if version != 1 or os.path.getsize(path) != expected:
        raise ConfigError(f"--data-path {prefix!r}: {path} is not a readable Megatron index "
                          f"(version {version}, {os.path.getsize(path)} bytes where "
                          f"{sequences} sequences and {documents} documents take {expected})")


def _check_extents(prefix: str, sizes, pointers, itemsize: int) -> None:
    """Every sequence's bytes (its pointer and size, in the index) lie inside ``.bin``. A
    negative size or pointer is a corrupt index; a sequence past the end is a truncated
    ``.bin`` when the index is laid out as Megatron writes it (each sequence right after the
    one before), else a corrupt index. Checked once, over the whole index, with numpy."""
    sizes, pointers = numpy.asarray(sizes, numpy.int64), numpy.asarray(pointers, numpy.int64)
    actual = os.path.getsize(prefix + ".bin")
    ends = pointers + sizes * itemsize
    packed = pointers[0] == 0 and bool(numpy.all(pointers[1:] == ends[:-1]))
    bad = numpy.flatnonzero((sizes < 0) | (pointers < 0) | (~packed & (ends > actual)))
    if len(bad):
        i = int(bad[0])
        raise ConfigError(f"--data-path {prefix!r}: {prefix}.idx is corrupt: sequence {i} has "
                          f"size {int(sizes[i])} at byte {int(pointers[i])} of a {actual}-byte "
                          ".bin (expected sizes >= 0 at offsets inside it)")
    needed = int(ends.max())
    if actual < needed:
        raise ConfigError(f"--data-path {prefix!r}: {prefix}.bin has {actual} bytes, its "
                          f"index needs {needed}: the file is truncated")


def open_source(mock_data: bool, data_path: str | None,
                vocab_size: int | None = None) -> DocumentSource:
    """The source of ``--mock-data`` / ``--data-path`` (validated: exactly one is set);
    ``vocab_size``: token ids read from ``--data-path`` are checked against it."""
    return BuiltinCorpus() if mock_data else IndexedDocuments(data_path, vocab_size)


def describe_lengths(lengths: Sequence[int], max_len: int) -> str:
    """One line of length statistics (tokens per document) for the startup banner."""
    ordered = sorted(lengths)
    total = sum(ordered)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    longer = len(ordered) - bisect.bisect_right(ordered, max_len)
    empty = bisect.bisect_right(ordered, 0)
    skipped = f"; {empty:,} empty (0 tokens), skipped" if empty else ""
    return (f"{len(ordered):,} documents, {total:,} tokens; tokens per document: mean "
            f"{total / len(ordered):,.0f}, median {statistics.median(ordered):,.0f}, p99 "
            f"{p99:,}, max {ordered[-1]:,}; {longer:,} longer than --seq-length "
            f"{max_len:,}{skipped}")


def trained_documents(lengths: Sequence[int], max_len: int, policy: str) -> tuple[int, int]:
    """(documents, tokens) one pass over the corpus trains on: empty documents are skipped,
    and with ``--zeppelin-overlong drop`` those longer than ``max_len`` (unused otherwise)."""
    sizes = numpy.asarray(lengths, dtype=numpy.int64)
    kept = sizes[(sizes > 0) & ((sizes <= max_len) if policy == "drop" else True)]
    return int(kept.size), int(kept.sum())


def documents_per_pass(lengths: Sequence[int]) -> int:
    """Documents one pass over the corpus reads: the non-empty ones (dropped ones are read
    and counted as dropped)."""
    return trained_documents(lengths, 0, "split")[0]


def repeat_note(lengths: Sequence[int], max_len: int, policy: str, iteration_tokens: int
                ) -> str:
    """The banner's notice when one iteration reads more tokens than a pass over the corpus
    trains on (``trained_documents``): then documents repeat within an iteration, or within
    a micro-batch."""
    documents, tokens = trained_documents(lengths, max_len, policy)
    if tokens >= iteration_tokens:
        return ""
    return (f"; a pass trains on {tokens:,} tokens ({documents:,} documents), fewer than one "
            f"iteration's {iteration_tokens:,} (--global-batch-size x --seq-length): documents "
            "repeat within an iteration")


def check_overlong(lengths: Sequence[int], max_len: int, policy: str, what: str) -> None:
    """Refuse up front what the stream would refuse later: with ``--zeppelin-overlong error``
    any document longer than ``max_len``; with ``drop``, a corpus with nothing shorter; a
    corpus whose documents are all empty."""
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] == 0:
        raise ConfigError(f"{what}: all {len(lengths):,} documents are empty (0 tokens)")
    if policy == "error" and lengths[longest] > max_len:
        raise ConfigError(f"{what}: document {longest} has {lengths[longest]:,} tokens, more "
                          f"than --seq-length {max_len:,}; pass --zeppelin-overlong split (equal "
                          "pieces) or drop (counted)")
    if policy == "drop" and not any(0 < n <= max_len for n in lengths):
        raise ConfigError(f"{what}: every document is longer than --seq-length {max_len:,} and "
                          "--zeppelin-overlong drop would drop them all")


# What the stream read and what the overlong policy did (nothing is dropped silently): the one
# tally of the policy (``planner/overlong.py``), also the planner's.
DocumentStats = OverlongTally


Piece = tuple[int, int, int]  # (document, start, end): tokens [start, end) of a document


class DocumentStream:
    """Pieces of the documents in a per-epoch shuffled order; position = (epoch, index in the
    epoch's order, piece of that document), the next piece to hand out."""

    def __init__(self, lengths: Sequence[int], seed: int, max_len: int, overlong: str) -> None:
        self.lengths, self.seed, self.max_len, self.overlong = lengths, seed, max_len, overlong
        self.stats = DocumentStats()
        self._seek(0, 0, 0)

    def _seek(self, epoch: int, index: int, piece: int) -> None:
        self.epoch, self.index, self.piece = epoch, index, piece
        self._order = list(range(len(self.lengths)))
        random.Random(self.seed * 1000003 + epoch).shuffle(self._order)
        self._pieces: list[Piece] | None = None

    def _current(self) -> list[Piece]:
        """The pieces of the document under the cursor (moving past dropped documents, and
        past empty ones: they hold nothing to train on, and the banner counts them)."""
        skipped = 0
        while self._pieces is None:
            doc = self._order[self.index]
            if self.lengths[doc]:
                pieces = self._admit(doc, OverlongTally())  # counted when the cursor takes it
                if pieces:
                    self._pieces = [(doc, start, end) for start, end in pieces]
                    break
                self._admit(doc, self.stats)  # dropped: counted as the cursor passes it
            skipped += 1
            if skipped > len(self.lengths):
                raise ConfigError("no document can be trained on: each is empty or, with "
                                  "--zeppelin-overlong drop, longer than --seq-length "
                                  f"{self.max_len:,}")
            self._next_document()
        return self._pieces

    def _admit(self, doc: int, tally: OverlongTally) -> list[tuple[int, int]]:
        """The overlong policy on document ``doc`` (``OverlongTally.admit``), counted in
        ``tally``; ``error`` is a ConfigError naming the document."""
        try:
            return tally.admit(doc, self.lengths[doc], self.max_len, self.overlong,
                               what="document", why="--seq-length",
                               setting="--zeppelin-overlong")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _next_document(self) -> None:
        self.index, self.piece, self._pieces = self.index + 1, 0, None
        if self.index == len(self._order):
            self._seek(self.epoch + 1, 0, 0)

    def peek(self) -> Piece:
        return self._current()[self.piece]

    def advance(self) -> None:
        pieces = self._current()
        if self.piece == 0:
            self._admit(pieces[0][0], self.stats)
        self.piece += 1
        if self.piece == len(pieces):
            self._next_document()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "piece": self.piece,
                "stats": asdict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self._seek(int(state["epoch"]), int(state["index"]), int(state["piece"]))
        self.stats = DocumentStats(**state["stats"])


class MicroBatchSampler:
    """This pool's micro-batches (lists of 1-D token tensors) from one global stream: global
    micro-batches of at most ``tokens`` tokens, dealt round-robin to ``pools`` pools."""

    def __init__(self, source: DocumentSource, tokens: int, seed: int, max_len: int,
                 overlong: str, pools: int = 1, pool: int = 0) -> None:
        if tokens < max_len:
            raise ValueError(f"a micro-batch of {tokens} tokens cannot hold a document piece of "
                             f"{max_len} tokens")
        if not 0 <= pool < pools:
            raise ValueError(f"pool {pool} is invalid: expected in [0, {pools})")
        self.source, self.tokens, self.pools, self.pool = source, tokens, pools, pool
        self.stream = DocumentStream(source.lengths(), seed, max_len, overlong)
        self.fingerprint = {"corpus": source.name, "documents": len(source), "seed": seed,
                            "max_len": max_len, "overlong": overlong}

    def _pack(self) -> list[Piece]:
        batch, total = [], 0
        while True:
            doc, start, end = self.stream.peek()
            if batch and total + end - start > self.tokens:
                return batch
            batch.append((doc, start, end))
            total += end - start
            self.stream.advance()

    def __iter__(self) -> "MicroBatchSampler":
        return self

    def __next__(self) -> list[torch.Tensor]:
        mine: list[Piece] = []
        for i in range(self.pools):
            pieces = self._pack()
            if i == self.pool:
                mine = pieces
        return [self.source.tokens(doc, start, end) for doc, start, end in mine]

    @property
    def stats(self) -> DocumentStats:
        return self.stream.stats

    def state_dict(self) -> dict:
        """The position before the next round of micro-batches (the same on every rank)."""
        return {**self.fingerprint, "stream": self.stream.state_dict()}

    def close(self) -> None:
        """Nothing to release here (``microbatch_order.BalancedSampler`` stops its worker)."""

    def load_state_dict(self, state: dict) -> str | None:
        """Continue at a saved position; returns why it cannot (another corpus, seed,
        --seq-length or overlong policy: the stream's order differs), or None."""
        changed = [f"{key} {state.get(key)!r} -> {value!r}" for key, value in
                   self.fingerprint.items() if state.get(key) != value]
        if changed:
            return "the stream changed: " + ", ".join(changed)
        self.stream.load_state_dict(state["stream"])
        return None

