"""The router: both backends agree bit for bit, schedules are sound, bad input is named."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zeppelin import router
from megatron_zeppelin.config import load_cluster
from megatron_zeppelin.router import (Flow, RouterTopology, Slice, backend_name, direct,
                                      evaluate, route, get_route_raw)
from megatron_zeppelin.bench import router as bench
from megatron_zeppelin.router.model import MAX_CHUNKS_LIMIT, chunk_cap, chunk_span
from megatron_zeppelin.router.reference import make_raw_arguments
from megatron_zeppelin.router.schedule import TICKS_PER_S

BACKENDS = ("python", "cpp")
MIB = 1 << 20


def load_paper_topology(cluster: str, nodes: int = 2) -> RouterTopology:
    return RouterTopology.from_cluster(load_cluster(cluster, nodes=nodes))


def make_random_flows(topology: RouterTopology, rng: random.Random, align: int) -> list[Flow]:
    """One of three shapes: random pairs, a few senders per node, every GPU sends."""
    g, world = topology.gpus_per_node, topology.world_size
    shape = rng.choice(("pairs", "some", "all"))
    if shape == "pairs":
        sources = [rng.randrange(world) for _ in range(rng.randint(1, min(3 * world, 300)))]
    elif shape == "some":
        sources = [n * g + l for n in range(topology.nodes) for l in rng.sample(range(g), 2)]
    else:
        sources = list(range(world))
    flows = []
    for src in sources[:400]:
        other = (src // g + rng.randrange(1, topology.nodes)) % topology.nodes
        units = rng.choice((1, 3, 1000, rng.randint(1, 1 << 16), rng.randint(1, 1 << 24)))
        flows.append(Flow(src, other * g + rng.randrange(g), align * units))
    return flows


@st.composite
def cases(draw) -> tuple[RouterTopology, list[Flow], int, dict]:
    nodes = draw(st.sampled_from((2, 3, 4, 8, 16, 32, 64, 128)))
    gpus = draw(st.sampled_from((4, 8)))
    nics = draw(st.sampled_from((1, 2, 4, 8)))
    if draw(st.booleans()):  # skewed affinity: any NIC per GPU, some NICs may idle
        gpu_to_nic = tuple(draw(st.lists(st.integers(0, nics - 1), min_size=gpus,
                                         max_size=gpus)))
    else:
        gpu_to_nic = tuple(i * nics // gpus for i in range(gpus))
    topology = RouterTopology(
        nodes=nodes, gpus_per_node=gpus, nics_per_node=nics, gpu_to_nic=gpu_to_nic,
        nvlink_byte_per_s=draw(st.sampled_from((200e9, 450e9, 50e9))),
        nvlink_latency_s=draw(st.sampled_from((0.0, 3e-6))),
        nic_byte_per_s=draw(st.sampled_from((25e9, 50e9, 12.5e9))),
        nic_latency_s=draw(st.sampled_from((0.0, 6e-6, 8e-6))))
    align = draw(st.sampled_from((1, 2, 4, 16)))
    flows = make_random_flows(topology, random.Random(draw(st.integers(0, 2**32 - 1))), align)
    chunking = {"max_chunks": draw(st.sampled_from((1, 2, 3, 8, MAX_CHUNKS_LIMIT))),
                "min_chunk_bytes": draw(st.sampled_from((1, 4096, MIB)))}
    return topology, flows, align, chunking


def assert_sound(topology: RouterTopology, flows: list[Flow], align: int, schedule,
                 chunking: dict | None = None) -> None:
    """Slices tile every flow in order, on rails, and the model agrees with ``evaluate``."""
    chunking = chunking or {}
    next_offset = [0] * len(flows)
    for sl in schedule.slices:
        flow = flows[sl.flow]
        assert sl.offset == next_offset[sl.flow] and sl.nbytes > 0
        assert sl.offset % align == 0 and sl.nbytes % align == 0
        next_offset[sl.flow] += sl.nbytes
        assert topology.node_of(sl.src_proxy) == topology.node_of(flow.src)
        assert topology.node_of(sl.dst_proxy) == topology.node_of(flow.dst)
        if (sl.src_proxy, sl.dst_proxy) != (flow.src, flow.dst):  # relayed: rail aligned
            assert topology.nic_of(sl.src_proxy) == topology.nic_of(sl.dst_proxy)
    assert next_offset == [flow.nbytes for flow in flows]
    largest = max((sl.nbytes for sl in schedule.slices), default=0)
    assert 1 <= schedule.chunks <= chunk_cap(largest, chunking.get("max_chunks", 8),
                                             chunking.get("min_chunk_bytes", MIB))
    cost = evaluate(topology, flows, schedule.slices, schedule.chunks)
    assert cost.total_time_s == schedule.estimated_time_s
    assert evaluate(topology, flows, schedule.slices, **chunking) == cost  # the best chunks
    assert (cost.dispatch_time_s, cost.nic_time_s, cost.combine_time_s) == (
        schedule.dispatch_time_s, schedule.nic_time_s, schedule.combine_time_s)
    sequential = evaluate(topology, flows, schedule.slices, chunks=1).total_time_s
    assert schedule.sequential_time_s == sequential
    assert cost.nic_egress_bytes == schedule.nic_egress_bytes
    assert cost.nic_ingress_bytes == schedule.nic_ingress_bytes
    assert sum(schedule.nic_egress_bytes) == sum(f.nbytes for f in flows)
    assert sum(schedule.nic_ingress_bytes) == sum(f.nbytes for f in flows)
    assert schedule.estimated_time_s <= min(schedule.direct_time_s, sequential)
    assert schedule.direct_time_s == direct(topology, flows, align).estimated_time_s


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_backends_agree_bit_for_bit_and_schedules_are_sound(case) -> None:
    topology, flows, align, chunking = case
    args = make_raw_arguments(topology, flows, align, **chunking)
    raws = [get_route_raw(b)(*args) for b in BACKENDS]
    assert [list(part) for part in raws[0][:3]] == [list(part) for part in raws[1][:3]]
    assert tuple(raws[0][3]) == tuple(raws[1][3]) and raws[0][4:] == raws[1][4:]
    schedules = [route(topology, flows, align, backend=b, **chunking) for b in BACKENDS]
    assert schedules[0] == schedules[1]
    assert_sound(topology, flows, align, schedules[0], chunking)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_random_cases_agree_with_the_other_backend(backend: str) -> None:
    rng = random.Random(20250921)
    other = "python" if backend == "cpp" else "cpp"
    for _ in range(60):
        gpus = rng.choice((4, 8))
        nics = rng.choice((1, 2, 4, 8))
        topology = RouterTopology(rng.choice((2, 3, 5, 16)), gpus, nics,
                                  tuple(rng.randrange(nics) for _ in range(gpus)),
                                  200e9, 3e-6, rng.choice((25e9, 50e9)), 8e-6)
        flows = make_random_flows(topology, rng, 2)
        chunking = {"max_chunks": rng.choice((1, 4, 8)), "min_chunk_bytes": rng.choice((1, MIB))}
        schedule = route(topology, flows, 2, backend=backend, **chunking)
        assert schedule == route(topology, flows, 2, backend=other, **chunking)
        assert_sound(topology, flows, 2, schedule, chunking)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_chunk_is_the_sequential_model_over_all_rails(backend: str) -> None:
    topology = load_paper_topology("h800-8nic")
    cv, lv, cn, ln = topology.cost_ticks()
    assert (cv, lv, cn, ln) == (5000, 3 * 10**9, 20000, 6 * 10**9)
    schedule = route(topology, [Flow(7, 8, 64 * MIB)], align=2, backend=backend, max_chunks=1)
    part = 8 * MIB
    proxies = [(0, 8)] + [(k, 8 + k) for k in range(1, 7)] + [(7, 15)]
    assert schedule.slices == tuple(Slice(0, p, q, k * part, part)
                                    for k, (p, q) in enumerate(proxies))
    leg = part * cv + lv
    assert schedule.chunks == 1
    assert schedule.dispatch_time_s == 7 * leg / TICKS_PER_S
    assert schedule.nic_time_s == (part * cn + ln) / TICKS_PER_S
    assert schedule.combine_time_s == 7 * leg / TICKS_PER_S
    assert schedule.estimated_time_s == (14 * leg + part * cn + ln) / TICKS_PER_S
    assert schedule.sequential_time_s == schedule.estimated_time_s
    assert schedule.direct_time_s == (64 * MIB * cn + ln) / TICKS_PER_S
    assert schedule.nic_egress_bytes == (part,) * 8 + (0,) * 8
    assert schedule.nic_ingress_bytes == (0,) * 8 + (part,) * 8
    assert schedule.nic_load_ratio == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipelined_split_has_the_exact_pipeline_time(backend: str) -> None:
    # 2 GPUs and 2 NICs per node, no latency: flow 0 -> 2 goes half direct (rail 0), half
    # relayed 1 -> 3 (rail 1); NIC-bound, so T = 2 d + C n (scaled) with d = m = 4 MiB cv.
    topology = RouterTopology(2, 2, 2, (0, 1), 200e9, 0.0, 25e9, 0.0)
    cv, _, cn, _ = topology.cost_ticks()
    half = 4 * MIB
    schedule = route(topology, [Flow(0, 2, 2 * half)], backend=backend)
    assert schedule.slices == (Slice(0, 0, 2, 0, half), Slice(0, 1, 3, half, half))
    assert schedule.chunks == 4  # chunk_cap(4 MiB) with 1 MiB chunks
    assert schedule.estimated_time_s == (half * cn + -(-2 * half * cv // 4)) / TICKS_PER_S
    assert schedule.sequential_time_s == (2 * half * cv + half * cn) / TICKS_PER_S
    assert schedule.direct_time_s == 2 * half * cn / TICKS_PER_S
    flows = [Flow(0, 2, 2 * half)]
    for chunks in (1, 2, 3, 4, 16):
        scaled = 2 * half * cv + chunks * half * cn if chunks > 1 else 2 * half * cv + half * cn
        want = -(-scaled // chunks) if chunks > 1 else scaled
        assert evaluate(topology, flows, schedule.slices, chunks).total_time_s == \
            want / TICKS_PER_S, chunks


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipelining_makes_splitting_pay(backend: str) -> None:
    # NVLink only twice the NIC: split in one chunk ties with direct (kept direct); pipelined,
    # the NVLink legs hide behind the NIC transfer and the split wins.
    topology = RouterTopology(2, 2, 2, (0, 1), 50e9, 0.0, 25e9, 0.0)
    flows = [Flow(0, 2, 8 * MIB)]
    sequential = route(topology, flows, backend=backend, max_chunks=1)
    assert sequential.slices == (Slice(0, 0, 2, 0, 8 * MIB),)
    assert sequential.estimated_time_s == sequential.direct_time_s
    pipelined = route(topology, flows, backend=backend)
    assert pipelined.num_slices == 2 and pipelined.chunks == 4
    assert pipelined.estimated_time_s < 0.7 * pipelined.direct_time_s


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_large_flow_pipelined_balances_nvlink_and_nics(backend: str) -> None:
    # H800: the source's NVLink (200 GB/s) limits the spread; pipelined, the router relays
    # over fewer rails than the sequential model and beats its modelled time.
    topology = load_paper_topology("h800-8nic")
    flows = [Flow(7, 8, 64 * MIB)]
    sequential = route(topology, flows, align=2, backend=backend, max_chunks=1)
    pipelined = route(topology, flows, align=2, backend=backend)
    assert pipelined.chunks > 1 and pipelined.num_slices < sequential.num_slices
    assert pipelined.estimated_time_s < 0.7 * sequential.estimated_time_s
    assert pipelined.sequential_time_s >= sequential.estimated_time_s


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_flow_stays_direct(backend: str) -> None:
    topology = load_paper_topology("a800-4nic")
    schedule = route(topology, [Flow(3, 12, 4096), Flow(9, 6, 64)], align=2, backend=backend)
    assert schedule.slice_table == (0, 3, 12, 0, 4096, 1, 9, 6, 0, 64)
    assert schedule.estimated_time_s == schedule.direct_time_s


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_senders_on_one_nic_balance_all_nics(backend: str) -> None:
    topology = load_paper_topology("a800-4nic")  # GPUs 0 and 1 share NIC 0
    flows = [Flow(0, 8, 64 * MIB), Flow(1, 9, 64 * MIB)]
    plain = direct(topology, flows, align=2)
    assert plain.nic_egress_bytes == (128 * MIB, 0, 0, 0, 0, 0, 0, 0)
    assert plain.nic_load_ratio == 4.0
    schedule = route(topology, flows, align=2, backend=backend)
    # Equal NIC times: NIC 0 carries one message (flow 1's own rail), NICs 1-3 two messages
    # (one per flow), so NIC 0 gets one message latency's worth of bytes more; the search
    # levels NICs at 8 chunks (16 MiB per NIC, 1 MiB chunks), where a message pays 8 latencies.
    _, _, cn, ln = topology.cost_ticks()
    extra = 8 * ln // cn
    rest = (128 * MIB - extra) // 4
    assert schedule.nic_egress_bytes == (rest + extra, rest, rest, rest, 0, 0, 0, 0)
    assert schedule.nic_ingress_bytes == (0, 0, 0, 0, rest + extra, rest, rest, rest)
    assert schedule.nic_load_ratio == (rest + extra) * 8 / (128 * MIB * 2)
    assert schedule.chunks == 8
    assert schedule.estimated_time_s < plain.estimated_time_s / 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_rail_aligned_all_to_all_stays_direct(backend: str) -> None:
    topology = load_paper_topology("h800-8nic", nodes=3)
    flows = [Flow(n * 8 + l, (n + 1) % 3 * 8 + l, 16 * MIB) for n in range(3) for l in range(8)]
    schedule = route(topology, flows, align=2, backend=backend)
    assert schedule.slices == direct(topology, flows, align=2).slices
    assert schedule.estimated_time_s == schedule.direct_time_s


@pytest.mark.parametrize("backend", BACKENDS)
def test_slices_are_multiples_of_align(backend: str) -> None:
    topology = RouterTopology(2, 4, 4, (0, 1, 2, 3), 200e9, 0.0, 25e9, 0.0)
    schedule = route(topology, [Flow(0, 4, 3 * 7)], align=3, backend=backend)
    assert [sl.nbytes for sl in schedule.slices] == [6, 6, 6, 3]
    assert [sl.offset for sl in schedule.slices] == [0, 6, 12, 18]


def test_no_flows_gives_an_empty_schedule() -> None:
    schedule = route(load_paper_topology("h200-8nic"), [])
    assert schedule.slices == () and schedule.estimated_time_s == 0.0 and schedule.chunks == 1
    assert schedule.nic_load_ratio == 1.0 and schedule.speedup == 1.0


def test_from_cluster_converts_units() -> None:
    topology = load_paper_topology("a800-4nic", nodes=3)
    assert topology == RouterTopology(3, 8, 4, (0, 0, 1, 1, 2, 2, 3, 3), 200e9, 3e-6, 25e9, 8e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": 0}, r"nodes=0 is invalid: expected an integer in \[1, 1000000\]"),
    ({"gpus_per_node": 300}, r"gpus_per_node=300 is invalid: expected an integer in \[1, 256\]"),
    ({"nics_per_node": True}, r"nics_per_node=True is invalid"),
    ({"gpu_to_nic": (0, 1, 1)}, r"gpu_to_nic=\[0, 1, 1\] is invalid: expected 4 NIC indices"),
    ({"gpu_to_nic": (0, 1, 2, 2)}, r"entry 2 is not a NIC index in \[0, 2\)"),
    ({"nic_byte_per_s": 0.0}, r"nic_byte_per_s=0.0 is invalid: expected a number in \[1e\+06, "),
    ({"nvlink_latency_s": -1e-6}, r"nvlink_latency_s=-1e-06 is invalid: expected a number in "
                                  r"\[0, 1\]"),
])
def test_invalid_topology_names_value_and_range(kwargs: dict, message: str) -> None:
    base = dict(nodes=2, gpus_per_node=4, nics_per_node=2, gpu_to_nic=(0, 0, 1, 1),
                nvlink_byte_per_s=200e9, nvlink_latency_s=3e-6, nic_byte_per_s=25e9,
                nic_latency_s=8e-6)
    with pytest.raises(ValueError, match=message):
        RouterTopology(**{**base, **kwargs})


@pytest.mark.parametrize("flows, align, message", [
    ([Flow(0, 16, 8)], 1, r"flow 0 Flow\(src=0, dst=16, nbytes=8\): dst=16 is out of range: "
                          r"expected a rank in \[0, 16\)"),
    ([Flow(0, 8, 8), Flow(1, 2, 8)], 1, r"flow 1 .*both on node 0; routed flows must cross"),
    ([Flow(0, 8, 0)], 1, r"flow 0 .*nbytes=0 is invalid: expected a positive multiple of "
                         r"align=1"),
    ([Flow(0, 8, 6)], 4, r"nbytes=6 is invalid: expected a positive multiple of align=4"),
    ([Flow(0, 8, 8)], 0, r"align=0 is invalid: expected an integer >= 1"),
    ([(0, 8, 8)], 1, r"flow 0 = \(0, 8, 8\) is invalid: expected a Flow"),
    ([Flow(0, 8, 10**15)], 1, r"exceeds the router's range"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_flows_name_the_flow(flows: list, align: int, message: str,
                                     backend: str) -> None:
    with pytest.raises(ValueError, match=message):
        route(load_paper_topology("h200-8nic"), flows, align, backend=backend)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_chunks": 0}, r"max_chunks=0 is invalid: expected an integer in \[1, 16\]"),
    ({"max_chunks": 17}, r"max_chunks=17 is invalid"),
    ({"max_chunks": 2.0}, r"max_chunks=2.0 is invalid"),
    ({"min_chunk_bytes": 0}, r"min_chunk_bytes=0 is invalid: expected an integer >= 1 \(bytes\)"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_chunk_rule_names_the_value(kwargs: dict, message: str, backend: str) -> None:
    with pytest.raises(ValueError, match=message):
        route(load_paper_topology("h200-8nic"), [Flow(0, 8, 8)], backend=backend, **kwargs)


def test_evaluate_rejects_a_bad_chunk_count() -> None:
    topology = load_paper_topology("h200-8nic")
    flows = [Flow(0, 8, 8)]
    with pytest.raises(ValueError, match=r"chunks=0 is invalid: expected an integer in \[1, 16\]"):
        evaluate(topology, flows, direct(topology, flows).slices, chunks=0)


@pytest.mark.parametrize("nbytes, align, chunks", [(96, 8, 3), (40, 8, 8), (7, 1, 16), (8, 8, 2)])
def test_chunk_spans_tile_a_slice_in_aligned_pieces(nbytes: int, align: int,
                                                     chunks: int) -> None:
    spans = [chunk_span(nbytes, align, chunks, c) for c in range(chunks)]
    assert spans[0][0] == 0 and spans[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [hi - lo for lo, hi in spans]
    assert all(lo % align == 0 for lo, _ in spans)
    assert max(sizes) - min(sizes) <= align  # as even as whole units allow
    assert sum(size == 0 for size in sizes) == max(0, chunks - nbytes // align)


def test_chunk_cap_keeps_chunks_above_the_minimum() -> None:
    assert chunk_cap(8 * MIB, 8, MIB) == 8 and chunk_cap(64 * MIB, 8, MIB) == 8
    assert chunk_cap(3 * MIB - 1, 8, MIB) == 2 and chunk_cap(100, 8, MIB) == 1
    assert chunk_cap(0, 8, MIB) == 1


@pytest.mark.parametrize("index, value, message", [
    (6, [1], "flow 0: src and dst on the same node"),
    (7, [10**15], "flows exceed the router's range of 2\\^53 ticks per resource"),
    (3, [0] * 7, "gpu_to_nic needs gpus_per_node entries"),
    (8, 0, "align must be >= 1"),
    (9, 17, "max_chunks must be in \\[1, 16\\]"),
    (10, 0, "min_chunk_bytes must be >= 1"),
])
def test_cpp_rejects_inconsistent_raw_input(index: int, value, message: str) -> None:
    args = list(make_raw_arguments(load_paper_topology("h200-8nic"), [Flow(0, 8, 8)], 1))
    args[index] = value
    with pytest.raises(ValueError, match=message):
        get_route_raw("cpp")(*args)


def test_backend_switch_follows_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPPELIN_ROUTER_BACKEND", "python")
    assert backend_name() == "python"
    monkeypatch.setenv("ZEPPELIN_ROUTER_BACKEND", "cpp")
    assert backend_name() == "cpp"
    monkeypatch.setenv("ZEPPELIN_ROUTER_BACKEND", "auto")
    assert backend_name() == "cpp"
    monkeypatch.setenv("ZEPPELIN_ROUTER_BACKEND", "fortran")
    with pytest.raises(ValueError, match="ZEPPELIN_ROUTER_BACKEND='fortran' is invalid"):
        backend_name()


def test_missing_cpp_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router, "load_cpp", lambda: None)
    monkeypatch.setenv("ZEPPELIN_ROUTER_BACKEND", "auto")
    assert backend_name() == "python"
    monkeypatch.setenv("ZEPPELIN_ROUTER_BACKEND", "cpp")
    with pytest.raises(ImportError, match=r"reinstall with `pip install -e \.`"):
        route(load_paper_topology("h200-8nic"), [Flow(0, 8, 8)])


def test_bench_prints_modelled_paper_step(capsys: pytest.CaptureFixture) -> None:
    bench.run(["--repeats", "1", "--nodes", "2"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.endswith("2.18   0.41")}
    assert sorted(rows) == ["a800-4nic", "h200-8nic", "h800-8nic"]
    # MiB, direct ms, routed (pipelined) ms, chunks, the same slices in one chunk ms
    assert rows["a800-4nic"][1:6] == ["64.0", "2.692", "0.816", "8", "1.200"]
    assert rows["h800-8nic"][1:6] == ["64.0", "1.348", "0.509", "5", "0.835"]
    assert rows["h200-8nic"][1:6] == ["64.0", "1.348", "0.331", "6", "0.508"]
    assert sum(line.startswith(("a800-4nic", "h800-8nic")) for line in lines) == 4 + 2
