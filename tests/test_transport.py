"""Transports on gloo with CPU tensors: the staged path (host buffers, as for several ranks
sharing one GPU) delivers the same bytes as the direct one, for ring steps and all-to-alls,
and is chosen only explicitly."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from megatron_zeppelin.runtime import transport as transport_module
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.runtime.transport import get_transport
from megatron_zeppelin.schedule import Phase

pytestmark = pytest.mark.distributed

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def payload(rank: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + index)
    return (torch.randn(5 + index, 3, generator=gen) * 100).to(dtype)


def _worker(rank: int, world: int) -> dict:
    staged_calls = []
    original = transport_module._staged

    def spy(tensor):
        staged_calls.append(tuple(tensor.shape))
        return original(tensor)

    transport_module._staged = spy
    report = {"default": RingComm(range(world), rank, dist.group.WORLD).transport.name}
    for name in ("direct", "staged"):
        comm = RingComm(range(world), rank, dist.group.WORLD, tag=7, timeout_s=30,
                        transport=name)
        sends = [payload(rank, i, dtype) for i, dtype in enumerate(DTYPES)]
        prev = (rank - 1) % world
        like = [(tuple(payload(prev, i, d).shape), d) for i, d in enumerate(DTYPES)]
        request = comm.exchange(sends, like, 3, phase=Phase.BACKWARD)
        got = request.wait()
        report[f"ring/{name}"] = all(torch.equal(g, payload(prev, i, d))
                                     for i, (g, d) in enumerate(zip(got, DTYPES)))
        send_splits = [(rank + peer) % 3 for peer in range(world)]
        recv_splits = [(peer + rank) % 3 for peer in range(world)]
        sent = torch.arange(sum(send_splits) * 2, dtype=torch.float64).reshape(-1, 2) + rank * 1000
        received = torch.empty(sum(recv_splits), 2, dtype=torch.float64)
        get_transport(name).all_to_all(received, sent, recv_splits, send_splits,
                                       dist.group.WORLD, "test all-to-all", 30).wait()
        expected = []
        for peer in range(world):  # peer sends me the rows of its block for my rank
            peer_send = [(peer + p) % 3 for p in range(world)]
            start = sum(peer_send[:rank])
            rows = torch.arange(sum(peer_send) * 2, dtype=torch.float64).reshape(-1, 2)
            expected.append(rows[start:start + peer_send[rank]] + peer * 1000)
        report[f"all_to_all/{name}"] = torch.equal(received, torch.cat(expected))
        report[f"staged_copies/{name}"] = len(staged_calls)
        staged_calls.clear()
    return report


def test_staged_and_direct_transports_deliver_the_same_bytes():
    results = run_world(_worker, 3, env={"ZEPPELIN_TRANSPORT": "staged"})
    for rank, report in enumerate(results):
        assert report["default"] == "staged", "ZEPPELIN_TRANSPORT selects the transport"
        for key in ("ring/direct", "ring/staged", "all_to_all/direct", "all_to_all/staged"):
            assert report[key] is True, (rank, key, report)
        assert report["staged_copies/direct"] == 0
        assert report["staged_copies/staged"] == len(DTYPES) + 1  # ring sends + the all-to-all


def test_transport_choice_is_explicit(monkeypatch):
    monkeypatch.delenv("ZEPPELIN_TRANSPORT", raising=False)
    assert get_transport().name == "direct"
    with pytest.raises(ValueError, match="transport='pinned' is invalid"):
        get_transport("pinned")
    monkeypatch.setenv("ZEPPELIN_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match="ZEPPELIN_TRANSPORT='nccl' is invalid"):
        get_transport()
