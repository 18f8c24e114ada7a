"""Where a ring group's tokens sit and which blocks each ring step computes (host geometry,
built once per layout; ``attention`` runs the steps).

Layout. A group of sequences ``s_1..s_n`` is attended on a ring of ``G`` ranks. Each sequence
is cut into ``2G`` zigzag chunks (``plan.zigzag_bounds``: sizes differ by at most one, so
lengths need not divide by 2G); ring position ``p`` holds chunks ``p`` and ``2G-1-p``. The
rank's group buffer is, sequence after sequence, ``[chunk p, chunk 2G-1-p]`` (Plan.attention
order); q ``[tokens, heads, head_dim]``, k ``[tokens, kv_heads, head_dim]``, v ``[tokens,
kv_heads, v_head_dim]`` (``v_head_dim`` may differ: multi-latent attention). A ring of one
(LOCAL) holds whole sequences and runs one causal varlen call.

Forward ring. At step ``t`` position ``p`` holds the KV block of source ``j = (p - t) mod G``
(KV travels p -> p+1 as one ``[tokens_j, kv_heads, head_dim + v_head_dim]`` tensor, k and v
side by side). Causal structure of
zigzag chunks, per sequence (``m = 2G-1-p``):

* ``t = 0`` (``j = p``): q chunk p vs kv chunk p and q chunk m vs kv chunk m, each causal on the
  diagonal (one fused call), plus q chunk m vs kv chunk p, full;
* ``j < p``: both q chunks vs kv chunk j, full (kv chunk 2G-1-j lies after both);
* ``j > p``: q chunk m vs both kv chunks, full (q chunk p lies before both).

Sliding window (``window=L``, Megatron's ``window_size=(L, 0)``: a query at document position
``i`` sees keys ``i-L .. i``). Each (q chunk, kv chunk) pair of a step is trimmed to the rows
that see some key and the keys some row sees (``window.window_pair``); a pair with nothing left is
skipped, so a step whose chunks all lie outside the window computes nothing. A trimmed pair
whose every key is visible to every row is a full block; the others are bands: with ``s`` the
distance from the pair's last key to its last query, the END-aligned band ``(L - s, s)``
(``kernels.base.band``), and pairs of one band share a call. A KV block still makes every hop
of the ring (in the zigzag layout position ``p - 1`` holds the chunk right after position
``p``'s mirror chunk, so the last hop is needed whenever both chunks hold tokens), but each hop
forwards only the rows some later position of its journey still reads (``held_rows``; blocks
index the held rows, ``relay`` picks the rows to forward). In backward the dK/dV accumulator
that travels carries the rows some position after the owner reads (``dkv_rows``: the rows held
at step 1, a superset of every later step's); the owner keeps its own step's gradient of the
other rows at home and writes the returned accumulator into its rows (``StepBlocks.own_dkv``).
The sums are the same, in the same order, as with whole accumulators.

``ZigzagLayout`` holds that geometry for one ring position; ``device_blocks`` moves every step's
blocks (row indices, ``kernels.Pieces``) to the device once.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Sequence

import torch

from megatron_zeppelin.plan import zigzag_bounds
from megatron_zeppelin.runtime.device_index import to_device
from megatron_zeppelin.runtime.kernels import Pieces, make_pieces
from megatron_zeppelin.zigzag_window import add_pair, chunk_rows, window_pair


class Block(NamedTuple):
    """One fused varlen call of a ring step.

    q_rows: rows of the group's q buffer, in call order: None (every row, in order), int64
    indices, or (``device_blocks``) a slice where they form one range (views, no gather);
    k_rows: rows of the KV block held at this step, likewise; pieces: the call's
    ``kernels.Pieces`` (``kernels`` pair convention); causal: diagonal blocks (END-aligned,
    tq == tk); window: the call's ``(left, right)`` band with a sliding window, else None.
    """

    q_rows: torch.Tensor | slice | None
    k_rows: torch.Tensor | slice | None
    pieces: Pieces
    causal: bool
    window: tuple[int, int] | None = None


class StepBlocks(tuple):
    """Per ring step, its blocks (a tuple of tuples); ``relay[step]``: int64 rows of the held
    block to forward for ``step + 1`` (None: all) and ``dkv_index[step]``: where the held rows go in the
    travelling dK/dV accumulator (None: they are its rows); ``own_dkv``: the rows of this
    position's own dK/dV that travel (None: all). Built once per layout and device
    (``device_blocks``)."""

    relay: tuple = ()
    dkv_index: tuple = ()
    own_dkv: torch.Tensor | None = None


class ZigzagLayout:
    """Chunk sizes and per-step blocks of one ring group at one ring position.

    lengths: tokens of each sequence of the group, in group order; ring_size: G >= 1;
    position: this rank's ring position in ``[0, G)``; window: sliding window ``L >= 0`` (a
    query sees itself and the ``L`` keys before it) or None (full causal).
    """

    def __init__(self, lengths: Sequence[int], ring_size: int, position: int,
                 window: int | None = None) -> None:
        if not (isinstance(ring_size, int) and ring_size >= 1):
            raise ValueError(f"ring_size={ring_size!r} is invalid: expected an integer >= 1")
        if not (isinstance(position, int) and 0 <= position < ring_size):
            raise ValueError(f"position={position!r} is invalid: expected in [0, {ring_size})")
        bad = [n for n in lengths if not (isinstance(n, int) and n >= 0)]
        if bad:
            raise ValueError(f"sequence lengths {bad} are invalid: expected integers >= 0")
        if window is not None and not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window={window!r} is invalid: expected an integer >= 0 or None")
        self.lengths, self.ring_size, self.position = tuple(lengths), ring_size, position
        self.window = window
        self._bounds = [zigzag_bounds(n, ring_size) for n in self.lengths]
        self._blocks: dict[int, tuple[Block, ...]] = {}
        self._held: dict[tuple[int, int], list[tuple[int, int]] | None] = {}  # ranges
        self._held_rows: dict[tuple[int, int], tuple[int, ...]] = {}

    def held(self, source: int) -> list[tuple[int, int]]:
        """Per sequence, the sizes of (chunk source, chunk 2G-1-source) position ``source``
        holds (a ring of one holds the whole sequence as the first chunk)."""
        if self.ring_size == 1:
            return [(n, 0) for n in self.lengths]
        mirror = 2 * self.ring_size - 1 - source
        return [(b[source + 1] - b[source], b[mirror + 1] - b[mirror]) for b in self._bounds]

    def tokens(self, source: int | None = None) -> int:
        """Tokens position ``source`` (default: this rank's) holds."""
        return sum(a + b for a, b in self.held(self.position if source is None else source))

    def source(self, step: int) -> int:
        """Ring position whose KV block this rank holds at ``step``."""
        return (self.position - step) % self.ring_size

    def blocks(self, step: int) -> tuple[Block, ...]:
        """The fused calls of ``step`` (see the module docstring), indices on the host."""
        if not 0 <= step < self.ring_size:
            raise ValueError(f"step={step} is invalid: expected in [0, {self.ring_size})")
        if step not in self._blocks:
            self._blocks[step] = self._build_blocks(step)
        return self._blocks[step]

    def chunk_spans(self, source: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per sequence, the document positions ``[start, end)`` of the two chunks position
        ``source`` holds, in buffer order (a ring of one: the whole sequence, then nothing)."""
        if self.ring_size == 1:
            return [((0, n), (n, n)) for n in self.lengths]
        mirror = 2 * self.ring_size - 1 - source
        return [((b[source], b[source + 1]), (b[mirror], b[mirror + 1])) for b in self._bounds]

    def _build_blocks(self, step: int) -> tuple[Block, ...]:
        if self.window is not None:
            return self._window_blocks(step)
        p, j = self.position, self.source(step)
        mine, theirs = self.held(p), self.held(j)
        q_off, k_off = _offsets(mine), _offsets(theirs)
        q_total, k_total = q_off[-1], k_off[-1]
        if step == 0:
            diag = [pair for o, (a, m) in zip(q_off, mine)
                    for pair in ((o, a, o, a), (o + a, m, o + a, m))]
            full = [(o + a, m, o, a) for o, (a, m) in zip(q_off, mine)]
            blocks = [_block(diag, True, q_total, k_total), _block(full, False, q_total, k_total)]
        elif j < p:
            pairs = [(qo, a + m, ko, ka) for qo, (a, m), ko, (ka, _) in
                     zip(q_off, mine, k_off, theirs)]
            blocks = [_block(pairs, False, q_total, k_total)]
        else:
            pairs = [(qo + a, m, ko, ka + km) for qo, (a, m), ko, (ka, km) in
                     zip(q_off, mine, k_off, theirs)]
            blocks = [_block(pairs, False, q_total, k_total)]
        return tuple(b for b in blocks if b is not None)

    def _window_pairs(self, position: int, source: int) -> list:
        """``(band, (q row, q len, k row, k len))`` of ``position``'s query chunks vs the KV
        block of ``source`` under the window (rows of the two full buffers)."""
        mine, theirs = self.chunk_spans(position), self.chunk_spans(source)
        q_off, k_off = _offsets(self.held(position)), _offsets(self.held(source))
        out = []
        for qo, ko, q_chunks, k_chunks in zip(q_off, k_off, mine, theirs):
            q_rows, k_rows = chunk_rows(qo, q_chunks), chunk_rows(ko, k_chunks)
            for (qa, qb), q_row in zip(q_chunks, q_rows):
                for (ka, kb), k_row in zip(k_chunks, k_rows):
                    pair = window_pair(qa, qb, ka, kb, self.window)
                    if pair is not None:
                        (qa2, qb2, ka2, kb2), key = pair
                        out.append((key, (q_row + qa2 - qa, qb2 - qa2, k_row + ka2 - ka,
                                          kb2 - ka2)))
        return out

    def held_rows(self, source: int, step: int) -> tuple[int, ...] | None:
        """Rows of ``source``'s KV buffer the position holding it at ``step`` receives (every
        row a position reads at ``step`` or later on its journey), None for all of them (no
        window, or the owner at step 0). The same on every position of the ring."""
        spans = self._held_spans(source, step)
        if spans is None:
            return None
        if (source, step) not in self._held_rows:
            self._held_rows[(source, step)] = _span_rows(spans)
        return self._held_rows[(source, step)]

    def _held_spans(self, source: int, step: int) -> list[tuple[int, int]] | None:
        """``held_rows`` as merged row ranges ``[a, b)`` (cached)."""
        if self.window is None or step == 0:
            return None
        key = (source, step)
        if key not in self._held:
            spans = _merge([span for later in range(step, self.ring_size)
                            for span in self._read_spans((source + later) % self.ring_size,
                                                         source)])
            full = sum(b - a for a, b in spans) == self.tokens(source)  # spans in [0, n)
            self._held[key] = None if full else spans
        return self._held[key]

    def read_rows(self, position: int, source: int) -> tuple[int, ...]:
        """Rows of ``source``'s KV buffer that ``position``'s queries read under the window,
        sorted (what a halo exchange sends from ``source`` to ``position``)."""
        return _span_rows(self._read_spans(position, source))

    def _read_spans(self, position: int, source: int) -> list[tuple[int, int]]:
        """``read_rows`` as merged row ranges ``[a, b)``."""
        return _merge([(k, k + n) for _, (_, _, k, n) in self._window_pairs(position, source)
                       if n])

    def _window_blocks(self, step: int) -> tuple[Block, ...]:
        """The calls of ``step`` with a sliding window: trimmed pairs grouped by band, key
        rows in the held block (``held_rows``)."""
        source = self.source(step)
        return self.window_blocks(source, self.held_rows(source, step))

    def window_blocks(self, source: int, held: tuple[int, ...] | None) -> tuple[Block, ...]:
        """This position's calls against ``source``'s KV under the window: trimmed pairs
        grouped by band, key rows in a block of ``source``'s rows ``held`` (sorted; None: its
        whole buffer)."""
        calls: list[tuple[tuple[int, int] | None, list]] = []
        for key, (q_row, qn, k_row, kn) in self._window_pairs(self.position, source):
            if held is not None:  # a needed range is contiguous in the sorted held rows
                k_row = bisect.bisect_left(held, k_row)
            add_pair(calls, key, (q_row, qn, k_row, kn))
        q_total = self.tokens()
        k_total = self.tokens(source) if held is None else len(held)
        return tuple(_block(pairs, key[1] == 0, q_total, k_total,
                            None if key == (-1, -1) else key) for key, pairs in calls)

    def relay_rows(self, step: int) -> tuple[int, ...] | None:
        """Rows of the block held at ``step`` to forward for ``step + 1`` (None: all)."""
        source = self.source(step)
        held, nxt = self._held_spans(source, step), self._held_spans(source, step + 1)
        if nxt is None:
            return None
        return _span_rows(nxt) if held is None else _positions(nxt, held)

    def relay_tokens(self, step: int) -> int:
        """Tokens of the KV block that arrives for ``step`` (step >= 1)."""
        held = self.held_rows(self.source(step), step)
        return self.tokens(self.source(step)) if held is None else len(held)

    def dkv_rows(self, source: int) -> tuple[int, ...] | None:
        """Rows of ``source``'s dK/dV the travelling accumulator carries: those some position
        after the owner reads (the rows held at step 1), None for all of them."""
        return None if self.ring_size == 1 else self.held_rows(source, 1)

    def dkv_tokens(self, source: int) -> int:
        """Rows of ``source``'s travelling dK/dV accumulator."""
        rows = self.dkv_rows(source)
        return self.tokens(source) if rows is None else len(rows)

    def dkv_index(self, step: int) -> tuple[int, ...] | None:
        """Positions of the rows held at ``step`` in the travelling accumulator's rows (None:
        the same rows, or step 0, whose gradient is the owner's whole own)."""
        if step == 0:
            return None
        source = self.source(step)
        held = self._held_spans(source, step)
        rows = None if self.ring_size == 1 else self._held_spans(source, 1)
        if held is None or held == rows:
            return None
        return _span_rows(held) if rows is None else _positions(held, rows)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` sorted and merged where they overlap or touch."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _span_rows(spans: list[tuple[int, int]]) -> tuple[int, ...]:
    """The rows of merged ranges, ascending."""
    return tuple(r for a, b in spans for r in range(a, b))


def _positions(sub: list[tuple[int, int]], spans: list[tuple[int, int]]) -> tuple[int, ...]:
    """Where the rows of ``sub`` (merged ranges, a subset of ``spans``'s rows) sit among the
    rows of ``spans`` in order: each range of ``sub`` lies inside one range of ``spans``."""
    starts = [a for a, _ in spans]
    before = [0]
    for a, b in spans:
        before.append(before[-1] + b - a)
    out: list[int] = []
    for a, b in sub:
        i = bisect.bisect_right(starts, a) - 1
        first = before[i] + a - spans[i][0]
        out.extend(range(first, first + b - a))
    return tuple(out)


def device_blocks(layout: ZigzagLayout, device: torch.device | str) -> StepBlocks:
    """Every step's blocks with their indices and offsets on ``device`` (one move; rows that
    form one range stay slices), each step's relayed rows and dK/dV accumulator rows."""
    size = layout.ring_size
    rows = [layout.relay_rows(t) if t + 1 < size else None for t in range(size)] + \
        [layout.dkv_index(t) for t in range(size)] + [layout.dkv_rows(layout.position)]
    placed, moved = place_blocks([layout.blocks(step) for step in range(size)], rows, device)
    steps = StepBlocks(placed)
    steps.relay, steps.dkv_index = tuple(moved[:size]), tuple(moved[size:2 * size])
    steps.own_dkv = moved[-1]
    return steps


def place_blocks(calls: list[tuple[Block, ...]], rows: list[tuple[int, ...] | None],
                 device: torch.device | str) -> tuple[tuple, list]:
    """``calls`` (groups of blocks) with their indices and offsets on ``device``, and host
    ``rows`` (tuples, None stays None) as int64 tensors there, in one move; rows of a block
    that form one range become slices (views, no gather)."""
    flat = [b._replace(q_rows=_as_slice(b.q_rows), k_rows=_as_slice(b.k_rows))
            for group in calls for b in group]
    moved = to_device([_index(t) for b in flat for t in (b.q_rows, b.k_rows, b.pieces.cu_q_dev,
                                                         b.pieces.cu_k_dev)] +
                      [_rows_tensor(r) for r in rows], device)
    n = 4 * len(flat)
    placed = iter([Block(b.q_rows if q is None else q, b.k_rows if k is None else k,
                         b.pieces._replace(cu_q_dev=cq, cu_k_dev=ck), b.causal, b.window)
                   for b, (q, k, cq, ck) in zip(flat, zip(*[iter(moved[:n])] * 4))])
    return tuple(tuple(next(placed) for _ in group) for group in calls), moved[n:]


def _rows_tensor(rows: tuple[int, ...] | None) -> torch.Tensor | None:
    """Host row indices as an int64 tensor (None stays None)."""
    return None if rows is None else torch.tensor(rows, dtype=torch.int64)


def _index(rows: torch.Tensor | slice | None) -> torch.Tensor | None:
    """``rows`` when they are an index tensor, else None (nothing to move)."""
    return rows if isinstance(rows, torch.Tensor) else None


def _as_slice(rows: torch.Tensor | None) -> torch.Tensor | slice | None:
    """Host row indices that form one range as a slice (views, no gather), else as given."""
    if rows is None or not rows.numel():
        return rows
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + rows.numel(), dtype=rows.dtype)):
        return slice(first, first + rows.numel())
    return rows


def _offsets(held: list[tuple[int, int]]) -> list[int]:
    out = [0]
    for a, b in held:
        out.append(out[-1] + a + b)
    return out


def _block(pairs: list[tuple[int, int, int, int]], causal: bool, q_total: int,
           k_total: int, window: tuple[int, int] | None = None) -> Block | None:
    """A block from (q start, q len, k start, k len) pairs; empty pairs dropped."""
    pairs = [pr for pr in pairs if pr[1] > 0 and pr[3] > 0]
    if not pairs:
        return None
    cu_q, cu_k = [0], [0]
    for _, tq, _, tk in pairs:
        cu_q.append(cu_q[-1] + tq)
        cu_k.append(cu_k[-1] + tk)
    return Block(_rows([(s, n) for s, n, _, _ in pairs], q_total),
                 _rows([(s, n) for _, _, s, n in pairs], k_total), make_pieces(cu_q, cu_k),
                 causal, window)


def _rows(ranges: list[tuple[int, int]], total: int) -> torch.Tensor | None:
    """Row indices of consecutive ``(start, length)`` ranges; None when they are 0..total-1."""
    position = 0
    for start, length in ranges:
        if start != position:
            break
        position += length
    else:
        if position == total:
            return None
    return torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in ranges])
