"""Routed and direct exchanges over gloo deliver the exact bytes; a silent peer times out.

Two pools of gloo ranks (2 nodes x 2 ranks, 2 nodes x 4 ranks) started by ``run_world``.
Routed exchanges run one chunk, the schedule's own chunk count (> 1: small ``min_chunk_bytes``)
and forced odd and deep pipelines (3 and 16 chunks: uneven and empty chunks). Each rank returns
a report; the test asserts on the reports, so a failure names the rank and the flow.
"""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.router import Flow, RouterTopology, route
from megatron_zeppelin.runtime.routed_p2p import (_Leg, describe, direct_exchange,
                                                  make_batches, routed_exchange)

from distributed import run_world

pytestmark = pytest.mark.distributed

DTYPES = (torch.float32, torch.bfloat16, torch.int16, torch.float64)
TIMEOUT_S = 1.0
SMALL_CHUNK = 1024  # min_chunk_bytes that lets the test's small flows pipeline
FORCED_CHUNKS = (3, 16)


def make_topology(nodes: int, gpus: int, gpu_to_nic: tuple[int, ...]) -> RouterTopology:
    """Latency-free links so that the router splits even the test's small flows."""
    return RouterTopology(nodes=nodes, gpus_per_node=gpus, nics_per_node=max(gpu_to_nic) + 1,
                          gpu_to_nic=gpu_to_nic, nvlink_byte_per_s=200e9, nvlink_latency_s=0.0,
                          nic_byte_per_s=25e9, nic_latency_s=0.0)


def make_flows(topology: RouterTopology, seed: int, count: int) -> list[Flow]:
    """Random inter-node flows whose sizes are multiples of 8 bytes (every dtype used); the
    first two are 2 and 3 units long, so deep pipelines leave some of their chunks empty."""
    rng = random.Random(seed)
    last = topology.world_size - 1
    flows = [Flow(0, last, 16), Flow(last, 0, 24)]
    while len(flows) < count:
        src, dst = rng.randrange(topology.world_size), rng.randrange(topology.world_size)
        if topology.node_of(src) != topology.node_of(dst):
            flows.append(Flow(src, dst, 8 * rng.randint(1, 4096)))
    return flows


def make_payload(flow_index: int, flow: Flow, seed: int) -> torch.Tensor:
    """The deterministic payload of a flow: random bytes viewed as one of DTYPES."""
    gen = torch.Generator().manual_seed(seed * 1000 + flow_index)
    raw = torch.randint(0, 256, (flow.nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(DTYPES[flow_index % len(DTYPES)])


def exchange_all(me: int, flows: list[Flow], seed: int, group, schedule=None,
                 chunks: int | None = None) -> dict[int, bool]:
    """Run one exchange; map each flow this rank receives to "bytes identical"."""
    sends = {f: make_payload(f, flow, seed) for f, flow in enumerate(flows) if flow.src == me}
    recv_like = {f: (flow.nbytes // DTYPES[f % len(DTYPES)].itemsize, DTYPES[f % len(DTYPES)])
                 for f, flow in enumerate(flows) if flow.dst == me}
    if schedule is None:
        out = direct_exchange(sends, recv_like, flows, group, step=seed)
    else:
        out = routed_exchange(sends, recv_like, flows, schedule, group, step=seed, chunks=chunks)
    return {f: out[f].dtype == DTYPES[f % len(DTYPES)] and torch.equal(
        out[f].view(torch.uint8), make_payload(f, flows[f], seed).view(torch.uint8)) for f in out}


def check_integrity(me: int, topology: RouterTopology, report: dict) -> None:
    group = dist.group.WORLD
    for seed in range(3):
        flows = make_flows(topology, seed, count=3 * topology.world_size)
        schedule = route(topology, flows, align=8)
        report[f"routed{seed}"] = exchange_all(me, flows, seed, group, schedule)
        piped = route(topology, flows, align=8, min_chunk_bytes=SMALL_CHUNK)
        report[f"pipelined{seed}"] = exchange_all(me, flows, seed, group, piped)
        for chunks in FORCED_CHUNKS:
            report[f"chunks{chunks}_{seed}"] = exchange_all(me, flows, seed, group, piped,
                                                            chunks)
        report[f"direct{seed}"] = exchange_all(me, flows, seed, group)


def collect_input_errors(me: int, topology: RouterTopology, report: dict) -> None:
    """Malformed arguments raise ValueError on the calling rank before any communication."""
    flows = [Flow(0, topology.world_size - 1, 64), Flow(topology.world_size - 1, 0, 64)]
    schedule = route(topology, flows, align=8)
    sends = {f: torch.zeros(16, dtype=torch.float32) for f, fl in enumerate(flows) if fl.src == me}
    recv = {f: (16, torch.float32) for f, fl in enumerate(flows) if fl.dst == me}
    world = dist.group.WORLD
    calls = {
        "wrong_schedule": lambda: routed_exchange(sends, recv, flows[:1], schedule, world),
        "missing_send": lambda: direct_exchange({}, recv, flows, world),
        "short_recv": lambda: direct_exchange(sends, {f: (8, torch.float32) for f in recv},
                                              flows, world),
        "bad_timeout": lambda: routed_exchange(sends, recv, flows, schedule, world,
                                               timeout_s=0),
        "bad_chunks": lambda: routed_exchange(sends, recv, flows, schedule, world, chunks=0),
    }
    for name, call in calls.items():
        try:
            call()
            report[name] = None
        except ValueError as exc:
            report[name] = str(exc)


def time_out_silent_peer(me: int, world: int, out_dir: Path, report: dict) -> None:
    """The last rank is the source of flows 0 and 1 but never calls the exchange: the world-4
    pool runs the routed exchange, the world-8 pool the direct one (gloo closes a pair after a
    timeout, so one pool can time out only once)."""
    silent = world - 1
    topology = make_topology(2, world // 2, (0, 1) if world == 4 else (0, 0, 0, 1))
    flows = [Flow(silent, 0, 1 << 16), Flow(silent, 1, 1 << 16)]
    schedule = (route(topology, flows, align=8, min_chunk_bytes=SMALL_CHUNK) if world == 4
                else None)
    if schedule is not None:
        report["relayed_via_rank2"] = any(s.src_proxy == 2 for s in schedule.slices)
        report["chunks"] = schedule.chunks
    if me == silent:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(out_dir.glob("done*"))) < silent:
            time.sleep(0.05)
        return
    recv_like = {f: (flow.nbytes, torch.uint8) for f, flow in enumerate(flows) if flow.dst == me}
    start = time.monotonic()
    try:
        if schedule is not None:
            routed_exchange({}, recv_like, flows, schedule, dist.group.WORLD, step=7,
                            timeout_s=TIMEOUT_S)
        else:
            direct_exchange({}, recv_like, flows, dist.group.WORLD, step=8, timeout_s=TIMEOUT_S)
        report["error"] = None
    except RuntimeError as exc:
        report["error"] = str(exc)
    report["seconds"] = time.monotonic() - start


def worker(rank: int, world: int, gpus: int, gpu_to_nic: tuple[int, ...], out_dir: str) -> dict:
    report: dict = {}
    topology = make_topology(world // gpus, gpus, gpu_to_nic)
    collect_input_errors(rank, topology, report)
    check_integrity(rank, topology, report)
    dist.barrier()
    time_out_silent_peer(rank, world, Path(out_dir), report)
    (Path(out_dir) / f"done{rank}").touch()  # lets the silent peer leave
    return report


def run_pool(tmp_path: Path, world: int, gpus: int, gpu_to_nic: tuple[int, ...],
             transport: str = "direct") -> list[dict]:
    """Start ``world`` gloo ranks (``ZEPPELIN_TRANSPORT=transport``) and return their reports."""
    return run_world(worker, world, gpus, gpu_to_nic, str(tmp_path), timeout_s=120,
                     env={"ZEPPELIN_TRANSPORT": transport})


def expected_receivers(topology: RouterTopology, seed: int) -> dict[int, list[int]]:
    flows = make_flows(topology, seed, count=3 * topology.world_size)
    mine: dict[int, list[int]] = {r: [] for r in range(topology.world_size)}
    for f, flow in enumerate(flows):
        mine[flow.dst].append(f)
    return mine


def assert_integrity(reports: list[dict], topology: RouterTopology) -> None:
    for seed in range(3):
        flows = make_flows(topology, seed, count=3 * topology.world_size)
        schedule = route(topology, flows, align=8)
        assert schedule.chunks == 1  # 1 MiB chunks: the test's flows are far smaller
        piped = route(topology, flows, align=8, min_chunk_bytes=SMALL_CHUNK)
        assert piped.chunks > 1
        for sched in (schedule, piped):
            assert any(s.src_proxy != flows[s.flow].src for s in sched.slices)
            assert any(s.dst_proxy != flows[s.flow].dst for s in sched.slices)
        receivers = expected_receivers(topology, seed)
        kinds = ["routed", "pipelined", *(f"chunks{c}_" for c in FORCED_CHUNKS), "direct"]
        for rank, report in enumerate(reports):
            for kind in kinds:
                got = report[f"{kind}{seed}"]
                assert sorted(got) == receivers[rank], (kind, seed, rank)
                assert all(got.values()), (kind, seed, rank, got)


def assert_input_errors(reports: list[dict], topology: RouterTopology) -> None:
    last = len(reports) - 1
    schedule = route(topology, [Flow(0, last, 64), Flow(last, 0, 64)], align=8)
    first_of_flow1 = [sl.flow for sl in schedule.slices].index(1)
    for rank, report in enumerate(reports):
        assert report["wrong_schedule"] == (f"schedule slice {first_of_flow1} (flow 1, offset 0)"
                                            " does not match the 1 flows passed: route these "
                                            "flows again")
        assert report["bad_timeout"] == ("timeout_s=0 is invalid: expected a positive number of "
                                         "seconds (or None for ZEPPELIN_P2P_TIMEOUT_S)")
        assert report["bad_chunks"] == ("chunks=0 is invalid: expected an integer in [1, 16] "
                                        f"(or None for the schedule's {schedule.chunks})")
        sources = {0: [0], last: [1]}.get(rank, [])
        if sources:
            assert report["missing_send"] == (
                f"rank {rank}: sends has flows [], expected exactly the flows this rank is the "
                f"source of: {sources}")
            assert report["short_recv"] == (
                f"rank {rank}: recv_like[{1 - sources[0]}] = (8, torch.float32) holds 32 bytes, "
                f"expected 64 (Flow(src={last if rank == 0 else 0}, dst={rank}, nbytes=64))")
        else:
            assert report["missing_send"] is None and report["short_recv"] is None


@pytest.mark.parametrize("transport", ["direct", "ordered"])
def test_two_nodes_of_two_ranks_deliver_and_routed_times_out(tmp_path: Path,
                                                             transport: str) -> None:
    """``ordered``: the routed batches also hold under NCCL's matching by order."""
    reports = run_pool(tmp_path, world=4, gpus=2, gpu_to_nic=(0, 1), transport=transport)
    assert_input_errors(reports, make_topology(2, 2, (0, 1)))
    assert_integrity(reports, make_topology(2, 2, (0, 1)))
    assert reports[0]["relayed_via_rank2"] is True
    chunks = reports[0]["chunks"]
    assert chunks > 1
    for rank in (0, 1, 2):  # rank 2 proxies for rank 3, ranks 0 and 1 receive from 2 and 3
        error = reports[rank]["error"]
        # rank 2 stalls in batch 0 (dispatch), ranks 0 and 1 in batch 1 (NIC of chunk 0)
        batch, leg = (0, "dispatch") if rank == 2 else (1, "NIC")
        assert re.search(rf"routed P2P step 7, batch {batch} of {chunks + 2} \(chunks {chunks}\), "
                         rf"rank {rank}: {leg} receive of slice \d+ \(flow [01], bytes \d+:\d+\) "
                         rf"from rank [23], chunk 0 of {chunks} \(slice bytes 0:\d+\) did not "
                         rf"complete within {TIMEOUT_S:g} s", error), error
        assert TIMEOUT_S - 0.1 < reports[rank]["seconds"] < TIMEOUT_S + 2.0


def test_two_nodes_of_four_skewed_nics_deliver_and_direct_times_out(tmp_path: Path) -> None:
    reports = run_pool(tmp_path, world=8, gpus=4, gpu_to_nic=(0, 0, 0, 1))
    assert_input_errors(reports, make_topology(2, 4, (0, 0, 0, 1)))
    assert_integrity(reports, make_topology(2, 4, (0, 0, 0, 1)))
    for rank in (0, 1):
        error = reports[rank]["error"]
        assert re.search(rf"routed P2P step 8, direct phase, rank {rank}: receive of flow {rank} "
                         rf"from rank 7 did not complete within {TIMEOUT_S:g} s", error), error
        assert TIMEOUT_S - 0.1 < reports[rank]["seconds"] < TIMEOUT_S + 2.0
    for rank in range(2, 7):  # nothing to receive from the silent rank: they return at once
        assert reports[rank]["error"] is None and reports[rank]["seconds"] < 1.0


def test_batches_pipeline_chunks_by_phase() -> None:
    """Chunk c of a leg of phase i lands in batch c + i, in leg order, tagged slice * C + c;
    empty chunks (a slice shorter than C units) are skipped."""
    payload = torch.arange(40, dtype=torch.uint8)
    legs = [_Leg(0, True, payload[:24], 1, 0, "dispatch send of slice 0"),
            _Leg(1, True, payload[24:40], 2, 1, "NIC send of slice 1"),
            _Leg(2, False, payload[:8], 3, 2, "combine receive of slice 2")]
    batches = make_batches(legs, chunks=3, align=8)
    placed = [[(op.tag, op.peer, op.tensor.tolist()) for op in batch] for batch in batches]
    assert placed == [
        [(0, 1, list(range(0, 8)))],
        [(1, 1, list(range(8, 16)))],  # slice 1 has 2 units: its chunk 0 is empty
        [(2, 1, list(range(16, 24))), (4, 2, list(range(24, 32)))],
        [(5, 2, list(range(32, 40)))],
        [(8, 3, list(range(0, 8)))],  # slice 2's one unit is its chunk 2
    ]
    assert describe(batches[2][0]) == "dispatch send of slice 0, chunk 2 of 3 (slice bytes 16:24)"
    assert [len(b) for b in make_batches(legs, chunks=1, align=8)] == [1, 1, 1]


def test_collectives_and_receive_only_staging_use_the_groups_device(monkeypatch):
    """NCCL refuses host tensors: a collective's tensors, and a rank's received or relayed
    bytes when it sends nothing, go on this thread's GPU for NCCL groups, the host for gloo
    (a pipeline stage before the last logs its loss from zeros made there)."""
    import torch.distributed as dist

    from megatron_zeppelin.runtime import routed_p2p, transport

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert transport.collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert transport.collective_device("group") == torch.device("cuda", 3)
    assert routed_p2p._staging_device(None, {}, "group") == torch.device("cuda", 3)
    assert routed_p2p._staging_device("cpu", {}, "group") == torch.device("cpu")
