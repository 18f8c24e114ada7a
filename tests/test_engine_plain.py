"""The engine's ops skip ``__torch_function__`` handlers (``runtime/plain.py``): on CPU the
training step runs under megatron/common/cpu.py's ``CudaToCpuMode``, which would otherwise see
every op of every ring step. The results are the same bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import make_cost
from distributed import run_world
from megatron_zeppelin.planner import make_plan

pytestmark = pytest.mark.distributed


class Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _forward_backward(engine, q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = engine.forward(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _rank(rank: int, world: int) -> tuple[int, bool]:
    import torch.distributed as dist

    from megatron_zeppelin.runtime.engine import AttentionEngine

    cost = make_cost("gpt-tiny", "h200-8nic", nodes=1, gpus_per_node=2)
    plan = make_plan("static-cp", [61, 13, 1, 30], cost, cp_size=2)  # rings over both ranks
    engine = AttentionEngine(plan, rank, dist.group.WORLD, backend="torch")
    tokens = engine.tokens
    gen = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(tokens, 4, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(tokens, 2, 8, generator=gen) for _ in range(2))
    plain = _forward_backward(engine, q, k, v, dout)
    with Counting() as mode:
        moded = _forward_backward(engine, q, k, v, dout)
    return mode.calls, all(torch.equal(a, b) for a, b in zip(plain, moded))


def test_engine_ops_bypass_an_active_torch_function_mode_with_the_same_results():
    for calls, same in run_world(_rank, 2):
        assert same
        # what the caller's own lines make (clone, requires_grad_, backward, .grad, ...);
        # the engine's rounds, which make hundreds of ops here, are not seen
        assert calls < 30, calls
