"""Zigzag variable-length ring attention for one ring group (all its sequences fused).

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
keeps every row of its source (the rows a step read are scattered into it, ``held``).

All sequences of the group go into one varlen call per block (``kernels``), and the partial
outputs merge with the LSE merge (``merge.merge_into_``) in float32 (float64 for float64).
The blocks of every step (row indices, ``kernels.Pieces``) are built once per layout and moved
to the device once (``device_blocks``); a step only indexes, calls the kernel and merges.

Backward ring. The KV travels again; ``dq`` accumulates locally and the ``dK/dV``
accumulator of a source travels with it, one step behind the KV, and after ``G`` hops arrives
back at its owner. Exchange ``t`` (posted at the start of step ``t``) carries the KV held at
``t`` (for ``t < G-1``) and the dKV accumulated at step ``t-1`` (for ``t >= 1``); exchange
``G`` returns the last accumulator to its owner. Block gradients use the FINAL out and lse.
Which round sends what is ``schedule`` (``sends_kv``, ``sends_dkv``, ``phase_steps``), the
facts the simulator prices too.

``RingGroupRun`` exposes the steps so that a scheduler (``engine``) can interleave many groups;
``ZigzagRingAttention``/``ring_attention`` run one group alone.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Sequence

import torch

from megatron_zeppelin.plan import zigzag_bounds
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.device_index import to_device
from megatron_zeppelin.runtime.kernels import KernelBackend, Pieces, accum_dtype, make_pieces
from megatron_zeppelin.runtime.merge import merge_into_
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.runtime.window import add_pair, chunk_rows, window_pair
from megatron_zeppelin.schedule import Phase, compute_steps, phase_steps, sends_dkv, sends_kv

Like = list[tuple[tuple[int, ...], torch.dtype]]


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
    """Per ring step, its blocks (a tuple of tuples); ``held[step]``: int64 rows of the source's
    buffer held at ``step`` (None: all) and ``relay[step]``: rows of the held block to forward
    for ``step + 1`` (None: all), built once per layout and device (``device_blocks``)."""

    held: tuple = ()
    relay: tuple = ()


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
        self._held: dict[tuple[int, int], tuple[int, ...] | None] = {}

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
        if self.window is None or step == 0:
            return None
        key = (source, step)
        if key not in self._held:
            rows: set[int] = set()
            for later in range(step, self.ring_size):
                for _, (_, _, k, n) in self._window_pairs((source + later) % self.ring_size,
                                                          source):
                    rows.update(range(k, k + n))
            full = rows == set(range(self.tokens(source)))
            self._held[key] = None if full else tuple(sorted(rows))
        return self._held[key]

    def _window_blocks(self, step: int) -> tuple[Block, ...]:
        """The calls of ``step`` with a sliding window: trimmed pairs grouped by band, key
        rows in the held block (``held_rows``)."""
        source = self.source(step)
        held = self.held_rows(source, step)
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
        held, nxt = self.held_rows(source, step), self.held_rows(source, step + 1)
        if nxt is None:
            return None
        return nxt if held is None else tuple(bisect.bisect_left(held, r) for r in nxt)

    def relay_tokens(self, step: int) -> int:
        """Tokens of the KV block that arrives for ``step`` (step >= 1)."""
        held = self.held_rows(self.source(step), step)
        return self.tokens(self.source(step)) if held is None else len(held)


def device_blocks(layout: ZigzagLayout, device: torch.device | str) -> StepBlocks:
    """Every step's blocks with their indices and offsets on ``device`` (one move; rows that
    form one range stay slices), and each step's held and relayed rows."""
    size = layout.ring_size
    host = [layout.blocks(step) for step in range(size)]
    flat = [b._replace(q_rows=_as_slice(b.q_rows), k_rows=_as_slice(b.k_rows))
            for step in host for b in step]
    rows = [_rows_tensor(layout.held_rows(layout.source(t), t)) for t in range(size)] + \
        [_rows_tensor(layout.relay_rows(t)) if t + 1 < size else None for t in range(size)]
    moved = to_device([_index(t) for b in flat for t in (b.q_rows, b.k_rows, b.pieces.cu_q_dev,
                                                         b.pieces.cu_k_dev)] + rows, device)
    n = 4 * len(flat)
    placed = iter([Block(b.q_rows if q is None else q, b.k_rows if k is None else k,
                         b.pieces._replace(cu_q_dev=cq, cu_k_dev=ck), b.causal, b.window)
                   for b, (q, k, cq, ck) in zip(flat, zip(*[iter(moved[:n])] * 4))])
    steps = StepBlocks(tuple(next(placed) for _ in step) for step in host)
    steps.held, steps.relay = tuple(moved[n:n + size]), tuple(moved[n + size:])
    return steps


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


def take(x: torch.Tensor, rows: torch.Tensor | slice | None, dim: int = 0) -> torch.Tensor:
    """Rows ``rows`` of ``x`` along ``dim``: None (all), a slice or int64 indices."""
    if rows is None:
        return x
    if isinstance(rows, slice):
        return x[rows] if dim == 0 else x[:, rows]
    return x.index_select(dim, rows)


def _add_rows(acc: torch.Tensor, rows: torch.Tensor | slice | None, value: torch.Tensor) -> None:
    """``acc[rows] += value`` (one op: in place on a view, or ``index_add_``)."""
    if rows is None:
        acc.add_(value)
    elif isinstance(rows, slice):
        acc[rows].add_(value)
    else:
        acc.index_add_(0, rows, value.to(acc.dtype))


def recv_like(layout: ZigzagLayout, step: int, phase: Phase, tail: tuple[int, ...],
              dtype: torch.dtype) -> Like:
    """(shape, dtype) of what ring position ``layout.position`` receives at ``step``.

    Both phases: the next KV block ``[tokens, *tail]`` (``schedule.sends_kv``); backward
    also the dKV accumulator of the block held at ``step`` in the accumulator dtype
    (``schedule.sends_dkv``). ``tail`` is ``(kv_heads, head_dim + v_head_dim)`` (k and v side
    by side), dtype the KV dtype. What position p+1 receives is exactly what position p sends.
    """
    phase, size, like = Phase(phase), layout.ring_size, []
    if sends_kv(size, step):
        like.append(((layout.relay_tokens(step + 1), *tail), dtype))
    if phase is Phase.BACKWARD and sends_dkv(size, step):
        like.append(((layout.tokens(layout.source(step)), *tail), accum_dtype(dtype)))
    return like


class RingGroupRun:
    """One ring group on this rank, driven one round at a time.

    Per phase: ``begin_forward`` (or ``begin_backward``), then for each round
    ``r < steps(phase)``: post ``sends(phase, r)`` / ``recv_like(phase, r)``,
    ``compute(phase, r)``, ``receive(phase, r, received)``; ``end_forward`` returns
    ``(out, lse)``, ``end_backward`` ``(dq, dk, dv)``. Sends go to the next ring position,
    receives come from the previous one. backend: a kernel backend object, name or None
    (resolved once per phase); blocks: ``device_blocks`` of the layout on the tensors' device
    (None: built at ``begin_*``).
    """

    def __init__(self, layout: ZigzagLayout, scale: float,
                 backend: KernelBackend | str | None = None,
                 blocks: StepBlocks | None = None) -> None:
        self.layout, self.scale, self.backend, self.blocks = layout, scale, backend, blocks

    def steps(self, phase: Phase) -> int:
        return phase_steps(self.layout.ring_size, Phase(phase))

    def _begin(self, q: torch.Tensor) -> None:
        self._kernel = kernels.select(self.backend, q)
        if self.blocks is None:
            self.blocks = device_blocks(self.layout, q.device)

    # ------------------------------------------------------------------ both phases
    def sends(self, phase: Phase, step: int) -> list[torch.Tensor]:
        size = self.layout.ring_size
        relay = self.blocks.relay[step] if sends_kv(size, step) else None
        kv = [self.kv if relay is None else self.kv.index_select(0, relay)] \
            if sends_kv(size, step) else []
        return kv + ([self.dkv] if phase is Phase.BACKWARD and sends_dkv(size, step) else [])

    def recv_like(self, phase: Phase, step: int) -> Like:
        return recv_like(self.layout, step, phase, tuple(self.kv.shape[1:]), self.kv.dtype)

    def _k(self, kv: torch.Tensor) -> torch.Tensor:
        return kv[..., :self.head_dim]

    def _v(self, kv: torch.Tensor) -> torch.Tensor:
        return kv[..., self.head_dim:]

    def compute(self, phase: Phase, step: int) -> None:
        if phase is Phase.FORWARD:
            self._forward_compute(step)
        else:
            self._backward_compute(step)

    def receive(self, phase: Phase, step: int, received: Sequence[torch.Tensor]) -> None:
        if phase is Phase.FORWARD:
            if received:
                self.kv = received[0]
        else:
            self._backward_receive(step, received)

    # ------------------------------------------------------------------ forward
    def begin_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q ``[n, h, d]``, k ``[n, g, d]``, v ``[n, g, dv]``: this rank's group buffer (n =
        layout.tokens())."""
        n = self.layout.tokens()
        if q.shape[0] != n or k.shape[0] != n or v.shape[0] != n:
            raise ValueError(f"group buffers have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens "
                             f"(q/k/v): expected {n} for ring position {self.layout.position}")
        self._begin(q)
        acc = accum_dtype(q.dtype)
        self.q, self.kv, self.head_dim = q, torch.cat((k, v), dim=-1), k.shape[-1]
        self.out_acc = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=acc, device=q.device)
        self.lse_acc = torch.full((q.shape[1], n), float("-inf"), dtype=acc, device=q.device)

    def _forward_compute(self, step: int) -> None:
        for block in self.blocks[step]:
            kv = take(self.kv, block.k_rows)
            out, lse = self._kernel.forward(take(self.q, block.q_rows), self._k(kv), self._v(kv),
                                            block.pieces, block.causal, self.scale,
                                            block.window)
            merge_into_(self.out_acc, self.lse_acc, out, lse, block.q_rows)

    def end_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [n, h, dv] in q's dtype, lse [h, n] accumulator dtype)``; frees the state."""
        out, lse = self.out_acc.to(self.q.dtype), self.lse_acc
        del self.q, self.kv, self.out_acc, self.lse_acc
        return out, lse

    # ------------------------------------------------------------------ backward
    def begin_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """q ``[n, h, d]``, dout/out ``[n, h, dv]``, k ``[n, g, d]``, v ``[n, g, dv]``, lse
        ``[h, n]`` (the forward's)."""
        self._begin(q)
        acc = accum_dtype(q.dtype)
        self.dout, self.q, self.out, self.lse = dout.contiguous(), q, out, lse
        self.kv, self.head_dim = torch.cat((k, v), dim=-1), k.shape[-1]
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.dkv = torch.zeros(self.kv.shape, dtype=acc, device=q.device)

    def _backward_compute(self, step: int) -> None:
        if step >= compute_steps(self.layout.ring_size):
            return
        held = self.blocks.held[step]
        fresh = torch.zeros(self.kv.shape, dtype=self.dq.dtype, device=self.dq.device)
        for block in self.blocks[step]:
            rows = block.q_rows
            kv = take(self.kv, block.k_rows)
            dq, dk, dv = self._kernel.backward(
                take(self.dout, rows), take(self.q, rows), self._k(kv), self._v(kv),
                take(self.out, rows), take(self.lse, rows, 1), block.pieces, block.causal,
                self.scale, block.window)
            _add_rows(self.dq, rows, dq)
            _add_rows(fresh, block.k_rows, torch.cat((dk, dv), dim=-1))
        if held is not None:  # the accumulator keeps every row of the source
            whole = (self.layout.tokens(self.layout.source(step)), *fresh.shape[1:])
            fresh = fresh.new_zeros(whole).index_copy_(0, held, fresh)
        self.fresh_dkv = fresh

    def _backward_receive(self, step: int, received: Sequence[torch.Tensor]) -> None:
        size = self.layout.ring_size
        received = list(received)
        kv_next = received.pop(0) if sends_kv(size, step) else None
        dkv_in = received.pop(0) if sends_dkv(size, step) else None
        if step < compute_steps(size):
            self.dkv = self.fresh_dkv if dkv_in is None else self.fresh_dkv.add_(dkv_in)
        else:
            self.dkv = dkv_in  # the final accumulator of this rank's own KV
        if kv_next is not None:
            self.kv = kv_next

    def end_backward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq [n, h, d], dk [n, g, d], dv [n, g, dv])`` in q's dtype; frees the state."""
        dtype = self.q.dtype
        grads = (self.dq.to(dtype), self._k(self.dkv).to(dtype),
                 self._v(self.dkv).to(dtype))
        del self.dout, self.q, self.out, self.lse, self.kv, self.dq, self.dkv
        self.__dict__.pop("fresh_dkv", None)
        return grads


def run_phase(run: RingGroupRun, comm: RingComm | None, phase: Phase,
              device: torch.device) -> None:
    """One group's rounds alone (after ``begin_*``): each round's exchange overlaps that
    round's compute."""
    for step in range(run.steps(phase)):
        sends, like = run.sends(phase, step), run.recv_like(phase, step)
        request = (comm.exchange(sends, like, step, phase=phase, device=device)
                   if sends or like else None)
        run.compute(phase, step)
        run.receive(phase, step, request.wait() if request else [])


class ZigzagRingAttention(torch.autograd.Function):
    """Autograd of one ring group: forward and backward rings (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, layout, comm, scale, backend):
        run = RingGroupRun(layout, scale, backend)
        run.begin_forward(q.detach(), k.detach(), v.detach())
        run_phase(run, comm, Phase.FORWARD, q.device)
        out, lse = run.end_forward()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run, ctx.comm = run, comm
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ctx.run.begin_backward(dout, q, k, v, out, lse)
        run_phase(ctx.run, ctx.comm, Phase.BACKWARD, q.device)
        dq, dk, dv = ctx.run.end_backward()
        # one entry per forward input: q, k, v, layout, comm, scale, backend
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ZigzagLayout,
                   comm: RingComm | None = None, scale: float | None = None,
                   backend: KernelBackend | str | None = None) -> torch.Tensor:
    """Causal attention of one ring group's sequences: ``out [n, heads, head_dim]``.

    q ``[n, heads, head_dim]``, k/v ``[n, kv_heads, head_dim]`` in the group layout of
    ``layout`` (this rank's position); ``comm`` the group's ring (None only for a ring of one);
    scale defaults to ``head_dim ** -0.5``; backend as in ``kernels.select``.
    """
    if comm is None and layout.ring_size > 1:
        raise ValueError(f"a ring of {layout.ring_size} ranks needs a RingComm (comm=None)")
    if comm is not None and (len(comm.ring) != layout.ring_size
                             or comm.position != layout.position):
        raise ValueError(f"comm ring {comm.ring} (position {comm.position}) does not match the "
                         f"layout (ring size {layout.ring_size}, position {layout.position})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ZigzagRingAttention.apply(q, k, v, layout, comm, scale, backend)
