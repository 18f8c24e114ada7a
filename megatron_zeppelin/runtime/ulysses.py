"""Ulysses attention (DeepSpeed-Ulysses style all-to-all head parallelism) of one rank, for plans
whose ``attention_kind`` is ``ulysses`` (FlexSP's plans); ``AttentionEngine`` hands them here.

Layout. Every task's ranks form a Ulysses group of ``g`` ranks. The rank at group position
``p`` holds, of each of the group's sequences, the rows the plan's attention layout gives it
(``Plan.attention[rank]``: the zigzag chunks ``p`` and ``2g-1-p``), q ``[tokens, heads,
head_dim]``, k/v ``[tokens, kv_heads, head_dim]``. A group of one rank holds its sequences
whole: plain local calls, no traffic.

Forward: one ``all_to_all_single`` (uneven splits) moves q, k and v at once so that position
``p`` holds every sequence of the group in full, in token order, over its share of the heads;
one causal varlen call per group (the kernel backend's block call, so every backend runs it:
``kernels.select``), its sequences the call's pieces; one all-to-all moves the output back.
Backward: dout in (one all-to-all), the backend's block backward on the saved head-sharded
q, k, v, output and lse, dq/dk/dv back (one all-to-all), replicated KV gradients summed at
the row's owner. Local work (groups of one rank) runs while the all-to-alls fly.

Heads. Query heads are cut into contiguous ranges over the group's positions, sizes differing
by at most one (the first ``heads % g`` positions take one more): any ``g <= heads`` works.
Position ``p`` with query heads ``[a, b)`` needs KV heads ``i // (heads / kv_heads)`` for
``i`` in ``[a, b)``; it receives the fewest KV heads ``c_p`` (a divisor of ``b - a``) for which
the kernel's own GQA grouping (query head ``t`` of the call uses KV head ``t // ((b - a) /
c_p)``) gives every query head its KV head, replicating a KV head where positions share it.
Extra traffic: k and v move ``sum_p c_p`` heads per group instead of ``kv_heads``, i.e.
``max(g, kv_heads) / kv_heads`` times as much when the split is even (MQA on 8 ranks: 8x; no
extra when ``g`` divides ``kv_heads``), so a token's forward bytes go from ``2 heads + 2
kv_heads`` to ``2 heads + 2 max(g, kv_heads)`` heads (what ``CostKernel.ulysses_comm`` and
``sim/ulysses.py`` count); the backward sends the replicated dK/dV back the same way.

Concurrency. All groups of the plan, of every size, share each all-to-all over the pool's
process group (a rank's split to a rank outside its groups is 0), so they run at once, and
every rank of the pool, ranks without tokens included, makes the same collective calls in the
same order: no ordering between groups, no deadlock. A plan with no group of two or more
ranks makes no collective call at all. Waves (a plan property of ring strategies) do not
order anything here: a rank's attention buffer holds every wave's rows anyway, and the
head-sharded buffers hold as many elements (up to the uneven split and KV replication). The
routing layer (``inter_mode``) routes ring P2P only; Ulysses traffic is this all-to-all.

Hot path. Every index (element offsets into ``[rows * heads]`` views, the split sizes, the
groups' varlen offsets) is built on the host once per plan, device and head counts
(``_Index``; ``prepare``, ahead of the step, builds them for the head counts already seen in
the process, so only a process's first plan builds them at its first call),
then each call only gathers (``index_select``), posts the all-to-all (split sizes from the
host: no host sync), scatters (``index_copy_``/``index_add_``) and calls kernels. On gloo a
wait is bounded by ``timeout_s``; on NCCL it is a stream join (``transport``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_zeppelin.plan import Plan, RingGroup, zigzag_segments
from megatron_zeppelin.runtime.device_index import to_device
from megatron_zeppelin.runtime.kernels import KernelBackend, Pieces, make_pieces
from megatron_zeppelin.runtime.transport import Transport


# (heads, kv_heads) this process has built Ulysses indices for, oldest first: ``prepare``
# builds a new plan's indices for them ahead of its step (the planning thread's work)
_HEADS_SEEN: dict[tuple[int, int], None] = {}


def head_range(heads: int, size: int, position: int) -> tuple[int, int]:
    """Query heads ``[a, b)`` of group position ``position`` of ``size`` (contiguous ranges,
    sizes differing by at most one, the first ``heads % size`` positions one more)."""
    base, extra = divmod(heads, size)
    start = position * base + min(position, extra)
    return start, start + base + (position < extra)


def kv_heads_for(heads: int, kv_heads: int, first: int, last: int) -> tuple[int, ...]:
    """The KV heads a call over query heads ``[first, last)`` receives, in call order: the
    fewest (a divisor ``c`` of ``last - first``) such that the call's query head ``t`` uses
    KV head ``t // ((last - first) / c)`` of the list, as query head ``first + t`` uses KV head
    ``(first + t) // (heads / kv_heads)`` in the full model."""
    count, per_kv = last - first, heads // kv_heads
    need = [(first + t) // per_kv for t in range(count)]
    for c in (c for c in range(1, count + 1) if count % c == 0):
        width = count // c
        kept = tuple(need[u * width] for u in range(c))
        if all(need[t] == kept[t // width] for t in range(count)):
            return kept
    raise AssertionError("unreachable: one KV head per query head always fits")


def _elements(rows: torch.Tensor, heads: torch.Tensor, width: int, base: int) -> torch.Tensor:
    """Offsets ``base + row * width + head`` of every (row, head), row-major, int64."""
    return (base + rows[:, None] * width + heads[None, :]).reshape(-1)


def _token_positions(plan: Plan, group: RingGroup, position: int) -> torch.Tensor:
    """Where the rows of ``group`` that ``position`` holds (its buffer order) sit in the
    group's call: sequences one after another, each in token order."""
    parts, first = [], 0
    for seq in group.seqs:
        length = plan.seqlens[seq]
        for _, start, end in zigzag_segments(seq, length, len(group.ring), position):
            parts.append(torch.arange(first + start, first + end))
        first += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class _Call:
    """One varlen call of this rank: a Ulysses group (``base``: where its q/k/v block begins
    in the received buffer, ``out_base`` its output in the output buffer) or a local group
    (``rows``: its slice of the rank's buffer; ``base`` -1)."""

    pieces: Pieces
    tokens: int
    heads: int
    kv_heads: int
    base: int = -1
    out_base: int = -1
    rows: slice | None = None


class _Index:
    """One rank's all-to-all indices for given head counts (module doc), host tensors until
    ``to``. Element units are ``head_dim`` vectors of the flattened buffers.

    send: offsets into ``cat(q, k, v)`` flattened, grouped by destination rank; send_splits /
    recv_splits: elements per peer; recv: where each received element lands in the received
    buffer ``[per group: q (tokens x h_p), k, v (tokens x c_p)]``; q_send / q_send_splits: the
    query part of ``send`` alone (where the output comes back to, where dout leaves from);
    out_recv / q_recv_splits: where each output element sent back to its owner is taken from
    in the output buffer ``[per group: tokens x h_p]``, in the order the owner sent q.
    """

    def __init__(self, plan: Plan, rank: int, heads: int, kv_heads: int,
                 pieces: dict[int, Pieces]) -> None:
        world = plan.topology.world_size
        tokens = plan.attention_tokens()[rank]
        self.q_elems, self.kv_elems = tokens * heads, tokens * kv_heads
        send = [[] for _ in range(world)]
        q_send = [[] for _ in range(world)]
        recv = [[] for _ in range(world)]
        out_recv = [[] for _ in range(world)]
        self.calls: list[_Call] = []
        base = out_base = offset = 0
        for group in plan.rank_groups[rank]:
            size, position = len(group.ring), group.ring.index(rank)
            mine = _token_positions(plan, group, position)
            rows = torch.arange(offset, offset + mine.numel())
            offset += mine.numel()
            if size == 1:
                continue
            total = sum(plan.seqlens[s] for s in group.seqs)
            a, b = head_range(heads, size, position)
            kv = len(kv_heads_for(heads, kv_heads, a, b))
            h_mine, c_mine = torch.arange(b - a), torch.arange(kv)
            for peer_position, peer in enumerate(group.ring):
                pa, pb = head_range(heads, size, peer_position)
                q_part = _elements(rows, torch.arange(pa, pb), heads, 0)
                kv_part = torch.tensor(kv_heads_for(heads, kv_heads, pa, pb), dtype=torch.long)
                send[peer] += [q_part, _elements(rows, kv_part, kv_heads, self.q_elems),
                               _elements(rows, kv_part, kv_heads, self.q_elems + self.kv_elems)]
                q_send[peer].append(q_part)
                theirs = _token_positions(plan, group, peer_position)
                recv[peer] += [_elements(theirs, h_mine, b - a, base),
                               _elements(theirs, c_mine, kv, base + total * (b - a)),
                               _elements(theirs, c_mine, kv, base + total * (b - a + kv))]
                out_recv[peer].append(_elements(theirs, h_mine, b - a, out_base))
            self.calls.append(_Call(pieces[group.key[2]], total, b - a, kv, base, out_base))
            base += total * (b - a + 2 * kv)
            out_base += total * (b - a)
        self.received, self.out_elems = base, out_base
        self.send, self.send_splits = _flatten(send)
        self.recv, self.recv_splits = _flatten(recv)
        self.q_send, self.q_send_splits = _flatten(q_send)
        self.out_recv, self.q_recv_splits = _flatten(out_recv)

    def to(self, device: torch.device) -> "_Index":
        names = ("send", "recv", "q_send", "out_recv")
        for name, moved in zip(names, to_device([getattr(self, n) for n in names], device)):
            setattr(self, name, moved)
        return self


def _flatten(per_peer: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    """One index of every peer's parts in rank order, and the elements per peer."""
    parts = [torch.cat(p) if p else torch.zeros(0, dtype=torch.long) for p in per_peer]
    return torch.cat(parts), [p.numel() for p in parts]


class UlyssesAttention:
    """Ulysses attention of ``plan`` on ``rank`` of the pool's ``group`` (module doc).

    kernel: ``q`` -> the kernel backend for its device and dtype (the engine's, resolved once);
    scale: softmax scale (None: head_dim ** -0.5); transport / timeout_s: how the all-to-alls
    travel and the most a gloo wait may take (the engine resolved both).
    """

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup, *,
                 kernel: Callable[[torch.Tensor], KernelBackend], scale: float | None,
                 transport: Transport, timeout_s: float) -> None:
        if plan.attention_kind != "ulysses":
            raise ValueError(f"UlyssesAttention runs 'ulysses' plans, got "
                             f"{plan.attention_kind!r} attention (strategy {plan.strategy!r})")
        self.plan, self.rank, self.group = plan, rank, group
        self.kernel, self.scale = kernel, scale
        self.transport, self.timeout_s = transport, timeout_s
        self.tokens = plan.attention_tokens()[rank]
        self.traffic = any(len(g.ring) > 1 for g in plan.ring_groups)
        self._pieces: dict[tuple, dict[int, Pieces]] = {}
        self._local: dict[torch.device, list[_Call]] = {}
        self._indices: dict[tuple, _Index] = {}

    # ------------------------------------------------------------------ preparation
    def prepare(self, device: torch.device) -> None:
        """Build the plan's varlen offsets on ``device`` and its indices for every head count
        this process has already called Ulysses attention with (``_HEADS_SEEN``: a training
        run has one, so from its second plan on nothing is built in the step); other head
        counts are built at their first call. Idempotent."""
        if device in self._local:
            return
        groups = self.plan.rank_groups[self.rank]
        cus = [tuple(itertools.accumulate((self.plan.seqlens[s] for s in g.seqs), initial=0))
               for g in groups]
        host = [make_pieces(cu, cu) for cu in cus]
        moved = iter(to_device([p.cu_q_dev for p in host], device))
        pieces = {}
        for g, p in zip(groups, host):
            cu = next(moved)
            pieces[g.key[2]] = p._replace(cu_q_dev=cu, cu_k_dev=cu)
        self._pieces[device] = pieces
        local, offset = [], 0
        for g, cu in zip(groups, cus):
            share = sum(s.end - s.start for s in self._segments(g))
            if len(g.ring) == 1 and share:
                local.append(_Call(pieces[g.key[2]], share, 0, 0,
                                   rows=slice(offset, offset + share)))
            offset += share
        self._local[device] = local
        largest = max((len(g.ring) for g in groups), default=1)
        for heads, kv_heads in list(_HEADS_SEEN) if self.traffic else ():
            if largest <= heads:
                self.index(device, heads, kv_heads)

    def _segments(self, group: RingGroup):
        position = group.ring.index(self.rank)
        return [s for seq in group.seqs for s in zigzag_segments(
            seq, self.plan.seqlens[seq], len(group.ring), position)]

    def index(self, device: torch.device, heads: int, kv_heads: int) -> _Index:
        """The rank's indices for ``heads``/``kv_heads`` on ``device``, built once."""
        key = (device, heads, kv_heads)
        if key not in self._indices:
            for g in self.plan.rank_groups[self.rank]:
                if len(g.ring) > heads:
                    raise ValueError(
                        f"a Ulysses group of {len(g.ring)} ranks {g.ring} (plan of strategy "
                        f"{self.plan.strategy!r}) splits the query heads over its ranks, but "
                        f"this rank has {heads} query heads: groups may have at most that "
                        "many ranks")
            self.prepare(device)
            self._indices[key] = _Index(self.plan, self.rank, heads, kv_heads,
                                        self._pieces[device]).to(device)
            _HEADS_SEEN.setdefault((heads, kv_heads))
        return self._indices[key]

    # ------------------------------------------------------------------ calls
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
        """Attention output ``[tokens, heads, head_dim]`` of the rank's buffer, with autograd
        (shapes checked by the engine); scale: this call's (None: the engine's)."""
        scale = next((s for s in (scale, self.scale) if s is not None), q.shape[-1] ** -0.5)
        return _UlyssesFunction.apply(q, k, v, self, scale)

    def exchange(self, sent: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 what: str):
        """Post one all-to-all of ``sent`` ``[elements, head_dim]``: (received, pending)."""
        received = sent.new_empty((sum(recv_splits), sent.shape[1]))
        where = f"Ulysses all-to-all ({what}) on rank {self.rank}"
        return received, self.transport.all_to_all(received, sent, recv_splits, send_splits,
                                                    self.group, where, self.timeout_s)

    def wait(self, pending, splits: list[int], what: str) -> None:
        try:
            pending.wait()
        except RuntimeError as exc:
            peers = [r for r, n in enumerate(splits) if n]
            raise RuntimeError(f"Ulysses all-to-all ({what}) on rank {self.rank} failed: a "
                               f"peer of the pool stopped or stalled (timeout "
                               f"{self.timeout_s:g} s, ZEPPELIN_P2P_TIMEOUT_S); data was "
                               f"expected from ranks {peers}: {exc}") from exc


def _views(buffer: torch.Tensor, call: _Call, head_dim: int):
    """q, k, v ``[tokens, h_p | c_p, head_dim]`` of a Ulysses call in the received buffer."""
    t, h, c = call.tokens, call.heads, call.kv_heads
    q = buffer[call.base:call.base + t * h].view(t, h, head_dim)
    k = buffer[call.base + t * h:call.base + t * (h + c)].view(t, c, head_dim)
    v = buffer[call.base + t * (h + c):call.base + t * (h + 2 * c)].view(t, c, head_dim)
    return q, k, v


def _out_view(buffer: torch.Tensor, call: _Call, head_dim: int) -> torch.Tensor:
    return buffer[call.out_base:call.out_base + call.tokens * call.heads].view(
        call.tokens, call.heads, head_dim)


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    """``[rows * heads, head_dim]`` of each tensor, concatenated."""
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in tensors])


class _UlyssesFunction(torch.autograd.Function):
    """Autograd of ``UlyssesAttention.forward`` (module doc): saves the head-sharded q, k, v,
    output and lse of every Ulysses call, and the rank's q, k, v and output only where it has
    local calls (their backward reads them)."""

    @staticmethod
    def forward(ctx, q, k, v, attn: UlyssesAttention, scale: float):
        q, k, v = q.detach().contiguous(), k.detach().contiguous(), v.detach().contiguous()
        d, kernel, device = q.shape[-1], attn.kernel(q), q.device
        attn.prepare(device)
        idx = attn.index(device, q.shape[1], k.shape[1]) if attn.traffic else None
        if idx is not None:
            sent = _flat(q, k, v).index_select(0, idx.send)
            received, pending = attn.exchange(sent, idx.send_splits, idx.recv_splits, "q/k/v")
        out = torch.empty_like(q)
        local_lse = []
        for call in attn._local[device]:  # while the all-to-all flies
            part, lse = kernel.forward(q[call.rows], k[call.rows], v[call.rows], call.pieces,
                                       True, scale)
            out[call.rows] = part
            local_lse.append(lse)
        calls, lses, heads_out = [], [], None
        if idx is not None:
            attn.wait(pending, idx.recv_splits, "q/k/v")
            heads_in = received.new_empty((idx.received, d))
            heads_in.index_copy_(0, idx.recv, received)
            heads_out = q.new_empty((idx.out_elems, d))
            for call in idx.calls:
                part, lse = kernel.forward(*_views(heads_in, call, d), call.pieces, True, scale)
                _out_view(heads_out, call, d).copy_(part)
                lses.append(lse)
            back, pending = attn.exchange(heads_out.index_select(0, idx.out_recv),
                                          idx.q_recv_splits, idx.q_send_splits, "output")
            attn.wait(pending, idx.q_send_splits, "output")
            out.view(-1, d).index_copy_(0, idx.q_send, back)
            calls = [heads_in, heads_out]
        ctx.save_for_backward(*((q, k, v, out) if local_lse else ()), *calls, *local_lse, *lses)
        ctx.attn, ctx.scale, ctx.locals, ctx.traffic = attn, scale, len(local_lse), bool(calls)
        ctx.shapes = (q.shape, k.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        attn, scale, (q_shape, k_shape) = ctx.attn, ctx.scale, ctx.shapes
        rest = list(ctx.saved_tensors)
        q, k, v, out = rest[:4] if ctx.locals else (None,) * 4
        rest = rest[4:] if ctx.locals else rest
        heads_in, heads_out = rest[:2] if ctx.traffic else (None, None)
        rest = rest[2:] if ctx.traffic else rest
        local_lse, lses = rest[:ctx.locals], rest[ctx.locals:]
        dout = dout.contiguous()
        d, kernel, device = q_shape[-1], attn.kernel(dout), dout.device
        idx = attn.index(device, q_shape[1], k_shape[1]) if ctx.traffic else None
        if idx is not None:
            received, pending = attn.exchange(dout.view(-1, d).index_select(0, idx.q_send),
                                              idx.q_send_splits, idx.q_recv_splits, "dout")
        flat = dout.new_zeros((q_shape.numel() + 2 * k_shape.numel()) // d, d)  # set or added
        dq, dk, dv = _split(flat, q_shape, k_shape)
        for call, lse in zip(attn._local[device], local_lse):
            r = call.rows
            dq[r], dk[r], dv[r] = kernel.backward(dout[r], q[r], k[r], v[r], out[r], lse,
                                                  call.pieces, True, scale)
        if idx is not None:
            attn.wait(pending, idx.q_recv_splits, "dout")
            dout_heads = received.new_empty((idx.out_elems, d))
            dout_heads.index_copy_(0, idx.out_recv, received)
            grads = heads_in.new_empty(heads_in.shape)
            for call, lse in zip(idx.calls, lses):
                parts = kernel.backward(_out_view(dout_heads, call, d), *_views(heads_in, call, d),
                                        _out_view(heads_out, call, d), lse, call.pieces, True,
                                        scale)
                for target, part in zip(_views(grads, call, d), parts):
                    target.copy_(part)
            back, pending = attn.exchange(grads.index_select(0, idx.recv), idx.recv_splits,
                                          idx.send_splits, "dq/dk/dv")
            attn.wait(pending, idx.send_splits, "dq/dk/dv")
            flat.index_add_(0, idx.send, back)  # replicated KV heads' gradients add up
        return dq, dk, dv, None, None


def _split(flat: torch.Tensor, q_shape: torch.Size, kv_shape: torch.Size):
    """``_flat(q, k, v)``'s inverse: q, k, v shaped views of ``flat``."""
    nq, nk = q_shape.numel() // q_shape[-1], kv_shape.numel() // kv_shape[-1]
    return (flat[:nq].view(q_shape), flat[nq:nq + nk].view(kv_shape),
            flat[nq + nk:].view(kv_shape))
