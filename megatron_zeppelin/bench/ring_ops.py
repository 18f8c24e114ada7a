"""What a ring step costs besides its kernels: device ops per block and host time per step.

``python -m megatron_zeppelin.bench.ring_ops [--reps N] [--heads H] [--kv-heads G]
[--head-dim D] [--tokens T]`` runs every step of a zigzag ring group (``RingGroupRun``, ring
of 4 at position 1: a diagonal step, a step from an earlier and one from a later position) on
CPU, with one sequence and with three, forward and backward, and prints per step:

* ``ops/block``: the ATen ops that would each be one kernel launch on a GPU (views and bare
  allocations excluded; counted with a ``TorchDispatchMode``) outside the attention kernel
  itself: the gathers of the block's rows, the LSE merge, the gradient scatters, the
  accumulator set-up, averaged over the step's blocks;
* ``us/step null``: host microseconds of the step with a kernel that only allocates its
  outputs (so the figure is the merge/index work and Python overhead alone), median of
  ``--reps``;
* ``us/step torch``: the same with the torch math kernel (the CPU stand-in).

It also prints, for a Zeppelin plan on 2 x 4 ranks, the P2P batches a rank posts per round:
one per ring with traffic when each ring posted its own, one since the engine batches a
round's rings (``ring_comm.RingBatch``). Figures on CPU are stand-ins: the op counts carry
over to the GPU (one launch each), the timings only in their ratios.
"""
from __future__ import annotations

import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.attention import RingGroupRun
from megatron_zeppelin.runtime.zigzag import ZigzagLayout
from megatron_zeppelin.runtime.kernels import accum_dtype
from megatron_zeppelin.schedule import Phase
from megatron_zeppelin.bench.flags import ExitParser, check_shape
from megatron_zeppelin.options import int_at_least

FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
        "lift_fresh", "_to_copy_noop"}


class OpCounter(TorchDispatchMode):
    """Counts the ops that launch a kernel (views and bare allocations excluded), except
    while ``paused`` (inside the attention kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in FREE:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class _Counted:
    """A kernel backend whose calls are not counted (``null``: outputs allocated only)."""

    def __init__(self, inner, counter: OpCounter | None, null: bool) -> None:
        self.inner, self.counter, self.null = inner, counter, null
        self.name = inner.name

    def _call(self, method, *args):
        if self.counter is not None:
            self.counter.paused = True
        try:
            return getattr(self.inner, method)(*args)
        finally:
            if self.counter is not None:
                self.counter.paused = False

    def forward(self, q, k, v, pieces, causal, scale, window=None):
        if self.null:
            return (q.new_empty((*q.shape[:2], v.shape[-1])),
                    torch.empty((q.shape[1], q.shape[0]), dtype=accum_dtype(q.dtype)))
        return self._call("forward", q, k, v, pieces, causal, scale, window)

    def backward(self, dout, q, k, v, out, lse, pieces, causal, scale, window=None):
        if self.null:
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        return self._call("backward", dout, q, k, v, out, lse, pieces, causal, scale, window)


def _inputs(layout: ZigzagLayout, heads: int, kv_heads: int, dim: int):
    n = layout.tokens()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    return q, k, v


def _run_steps(layout, backend, q, k, v, on_step) -> None:
    """Forward then backward of every compute step, on the rank's own KV (the counts and
    timings do not depend on which KV a step holds); ``on_step(phase, step, run)``."""
    run = RingGroupRun(layout, q.shape[-1] ** -0.5, backend)
    run.begin_forward(q, k, v)
    for step in range(layout.ring_size):
        on_step(Phase.FORWARD, step, run)
    out, lse = run.end_forward()
    run.begin_backward(torch.ones_like(q), q, k, v, out, lse)
    for step in range(layout.ring_size):
        on_step(Phase.BACKWARD, step, run)
        run.receive(Phase.BACKWARD, step, [t for t in run.sends(Phase.BACKWARD, step)])


def count_ops(layout: ZigzagLayout, q, k, v) -> dict:
    """(phase, step) -> (blocks, ops per block)."""
    counter = OpCounter()
    backend = _Counted(kernels.get("torch"), counter, null=False)
    result = {}

    def on_step(phase, step, run):
        counter.counts.clear()
        with counter:
            run.compute(phase, step)
        blocks = len(run.blocks[step])
        result[(phase.value, step)] = (blocks, sum(counter.counts.values()) / blocks)
    _run_steps(layout, backend, q, k, v, on_step)
    return result


def time_steps(layout: ZigzagLayout, q, k, v, null: bool, reps: int) -> dict:
    """(phase, step) -> median host microseconds of ``compute``."""
    backend = _Counted(kernels.get("torch"), None, null=null)
    samples = collections.defaultdict(list)

    def on_step(phase, step, run):
        start = time.perf_counter()
        run.compute(phase, step)
        samples[(phase.value, step)].append((time.perf_counter() - start) * 1e6)
    for _ in range(reps):
        _run_steps(layout, backend, q, k, v, on_step)
    return {key: statistics.median(values) for key, values in samples.items()}


def batches_per_round(seeds: int = 8) -> str:
    """P2P batches a rank posts per round on 2 x 4 Zeppelin plans of long-tailed batches:
    one per ring of the (rank, wave) before, one now."""
    import random

    from megatron_zeppelin.config import ZeppelinConfig, load_setup
    from megatron_zeppelin.cost_model import CostModel
    from megatron_zeppelin.plan import Tier
    from megatron_zeppelin.planner import make_plan

    setup = load_setup("gpt-tiny", "h200-8nic", nodes=2)
    cost = CostModel(setup.model, setup.cluster.with_topology(2, 4), setup.hardware, 1)
    rings = []
    for seed in range(seeds):
        rng = random.Random(seed)
        lengths = [max(1, min(8000, int(40 * rng.paretovariate(0.8)))) for _ in range(64)]
        plan = make_plan("zeppelin", lengths, cost, ZeppelinConfig(
            capacity_tokens_per_gpu=int(sum(lengths) / 8 * 1.15) + 1))
        per = collections.Counter((rank, g.wave) for rank, groups in enumerate(plan.rank_groups)
                                  for g in groups if g.tier != Tier.LOCAL)
        rings += list(per.values())
    return (f"P2P batches per round (2x4 zeppelin plans, {seeds} long-tailed batches, every "
            f"(rank, wave) with rings): one per ring before, mean "
            f"{statistics.mean(rings or [0]):.2f}, max {max(rings or [0])}; now 1 (RingBatch)")


def main(argv=None) -> None:
    parser = ExitParser(prog="python -m megatron_zeppelin.bench.ring_ops",
                        description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int_at_least(1), default=20)
    parser.add_argument("--heads", type=int_at_least(1), default=8)
    parser.add_argument("--kv-heads", type=int_at_least(1), default=2)
    parser.add_argument("--head-dim", type=int_at_least(1), default=64)
    parser.add_argument("--tokens", type=int_at_least(8), default=512,
                        help="tokens per sequence (a 4-position ring: 8 zigzag chunks)")
    args = parser.parse_args(argv)
    check_shape(parser, args, ("tokens",))
    torch.set_num_threads(1)
    print(f"{'case':<14}{'phase':<10}{'step':>5}{'blocks':>7}{'ops/block':>10}"
          f"{'us/step null':>14}{'us/step torch':>15}")
    for seqs in (1, 3):
        layout = ZigzagLayout([args.tokens] * seqs, 4, 1)
        q, k, v = _inputs(layout, args.heads, args.kv_heads, args.head_dim)
        ops = count_ops(layout, q, k, v)
        null = time_steps(layout, q, k, v, True, args.reps)
        full = time_steps(layout, q, k, v, False, max(1, args.reps // 4))
        for key, (blocks, per_block) in ops.items():
            print(f"{f'{seqs} seq':<14}{key[0]:<10}{key[1]:>5}{blocks:>7}{per_block:>10.1f}"
                  f"{null[key]:>14.1f}{full[key]:>15.1f}")
    print(batches_per_round())


if __name__ == "__main__":
    main()
