"""Zigzag variable-length ring attention for one ring group (all its sequences fused).

Layout and blocks: ``zigzag.py`` (``ZigzagLayout``: each sequence in ``2G`` zigzag chunks,
ring position ``p`` holds chunks ``p`` and ``2G-1-p``; which (q chunk, kv chunk) pairs each step
computes, trimmed to a sliding window where one is set; the rows each hop forwards). q
``[tokens, heads, head_dim]``, k ``[tokens, kv_heads, head_dim]``, v ``[tokens, kv_heads,
v_head_dim]`` (``v_head_dim`` may differ: multi-latent attention); KV travels p -> p+1 as one
``[tokens_j, kv_heads, head_dim + v_head_dim]`` tensor, k and v side by side.

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

from typing import Sequence

import torch

from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.kernels import KernelBackend, accum_dtype
from megatron_zeppelin.runtime.merge import merge_into_
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.runtime.zigzag import StepBlocks, ZigzagLayout, device_blocks
from megatron_zeppelin.schedule import Phase, compute_steps, phase_steps, sends_dkv, sends_kv

Like = list[tuple[tuple[int, ...], torch.dtype]]


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
    also the dKV accumulator of the block held at ``step`` (its ``dkv_rows``) in the
    accumulator dtype (``schedule.sends_dkv``). ``tail`` is ``(kv_heads, head_dim +
    v_head_dim)`` (k and v side by side), dtype the KV dtype. What position p+1 receives is
    exactly what position p sends.
    """
    phase, size, like = Phase(phase), layout.ring_size, []
    if sends_kv(size, step):
        like.append(((layout.relay_tokens(step + 1), *tail), dtype))
    if phase is Phase.BACKWARD and sends_dkv(size, step):
        like.append(((layout.dkv_tokens(layout.source(step)), *tail), accum_dtype(dtype)))
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
        self._forward_blocks(self.blocks[step], self.kv)

    def _forward_blocks(self, blocks, held: torch.Tensor) -> None:
        """Merge the calls of ``blocks`` against the KV block ``held`` into the output."""
        for block in blocks:
            kv = take(held, block.k_rows)
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
        fresh = self._backward_blocks(self.blocks[step], self.kv)
        index = self.blocks.dkv_index[step]
        if index is not None:  # the held rows' places in the travelling accumulator
            rows = (self.layout.dkv_tokens(self.layout.source(step)), *fresh.shape[1:])
            fresh = fresh.new_zeros(rows).index_copy_(0, index, fresh)
        self.fresh_dkv = fresh

    def _backward_blocks(self, blocks, held: torch.Tensor,
                         fresh: torch.Tensor | None = None) -> torch.Tensor:
        """The calls of ``blocks`` against the KV block ``held``: dq accumulated, the block's
        dK/dV added into ``fresh`` (default: a new zero accumulator shaped like ``held``),
        returned."""
        if fresh is None:
            fresh = torch.zeros(held.shape, dtype=self.dq.dtype, device=self.dq.device)
        for block in blocks:
            rows = block.q_rows
            kv = take(held, block.k_rows)
            dq, dk, dv = self._kernel.backward(
                take(self.dout, rows), take(self.q, rows), self._k(kv), self._v(kv),
                take(self.out, rows), take(self.lse, rows, 1), block.pieces, block.causal,
                self.scale, block.window)
            _add_rows(self.dq, rows, dq)
            _add_rows(fresh, block.k_rows, torch.cat((dk, dv), dim=-1))
        return fresh

    def _backward_receive(self, step: int, received: Sequence[torch.Tensor]) -> None:
        size = self.layout.ring_size
        received = list(received)
        kv_next = received.pop(0) if sends_kv(size, step) else None
        dkv_in = received.pop(0) if sends_dkv(size, step) else None
        own = self.blocks.own_dkv
        if step == 0 and own is not None:  # the rows nobody else reads stay home
            self.own_dkv, self.dkv = self.fresh_dkv, self.fresh_dkv.index_select(0, own)
        elif step < compute_steps(size):
            self.dkv = self.fresh_dkv if dkv_in is None else self.fresh_dkv.add_(dkv_in)
        elif own is not None:  # the final accumulator of this rank's own KV, into its rows
            self.dkv = self.own_dkv.index_copy_(0, own, dkv_in)
        else:
            self.dkv = dkv_in
        if kv_next is not None:
            self.kv = kv_next

    def end_backward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq [n, h, d], dk [n, g, d], dv [n, g, dv])`` in q's dtype; frees the state."""
        dtype = self.q.dtype
        grads = (self.dq.to(dtype), self._k(self.dkv).to(dtype),
                 self._v(self.dkv).to(dtype))
        del self.dout, self.q, self.out, self.lse, self.kv, self.dq, self.dkv
        self.__dict__.pop("fresh_dkv", None)
        self.__dict__.pop("own_dkv", None)
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
