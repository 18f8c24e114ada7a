"""Cost model formulas, tier crossovers and plan estimates."""
import dataclasses

import numpy as np
import pytest

from megatron_zeppelin.config import ConfigError, ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_plan, estimate_step, shared_peak
from megatron_zeppelin.plan import Tier
from megatron_zeppelin.planner import make_plan

from conftest import make_cost


def test_attention_flops_are_causal_and_quadratic(cost_7b):
    # 2 * a * d * s^2 for LLaMA-7B: a = 32, d = 128
    assert cost_7b.attention_flops(1000) == 2 * 32 * 128 * 1000 ** 2
    assert cost_7b.attention_flops(2000) == 4 * cost_7b.attention_flops(1000)


def test_a_sliding_window_prices_the_pairs_it_keeps(cost_7b):
    """Window W on a share of the layers: a windowed layer keeps s (W + 1) - W (W + 1) / 2
    of the s^2 / 2 causal pairs once s > W + 1; the planner's kernel, the estimate and the
    simulator's FLOP count (array or number) agree; short sequences cost as without it."""
    windowed = dataclasses.replace(cost_7b.model, window_size=512, window_layers=24)
    cost = CostModel(windowed, cost_7b.cluster, cost_7b.hardware)
    share, kept = 24 / 32, (2 * 8192 * 513 - 512 * 513) / 8192 ** 2
    assert cost.attention_flops(8192) == pytest.approx(
        cost_7b.attention_flops(8192) * ((1 - share) + share * kept), rel=1e-12)
    assert cost.attention_flops(500) == cost_7b.attention_flops(500)
    lengths = np.asarray([1.0, 500.0, 8192.0])
    assert cost.attention_flops(lengths).tolist() == [cost.attention_flops(x) for x in lengths]
    assert cost.kernel.compute(8192, 4) / cost_7b.kernel.compute(8192, 4) == pytest.approx(
        (1 - share) + share * kept, rel=1e-12)
    assert cost.kernel.compute(513, 1) == cost_7b.kernel.compute(513, 1)


def test_a_sliding_window_keeps_long_documents_local_where_dense_attention_rings_them():
    """Priced as its dense twin, a windowed model's long documents went to rings across nodes
    (attention ~ s^2 outweighs the traffic); with the window's O(s W) work they stay local."""
    import random

    from megatron_zeppelin.sim.workloads import sample_batch

    dense = make_cost("llama-7b", "h200-8nic", nodes=4)
    lengths = sample_batch("prolong64k", 16 * 1024 * 32, random.Random(1))
    tiers = {}
    for window in (None, 512):
        model = dataclasses.replace(dense.model, window_size=window)
        plan = make_plan("zeppelin", lengths, CostModel(model, dense.cluster, dense.hardware))
        tiers[window] = [t.tier for t in plan.tasks]
    assert tiers[None].count(Tier.INTER) > tiers[512].count(Tier.INTER)
    assert tiers[512].count(Tier.LOCAL) > tiers[None].count(Tier.LOCAL)


def test_windowed_ring_hops_are_priced_as_the_engine_trims_them(cost_7b):
    """``CostKernel.relayed``: a windowed layer's hop carries on average min(s/G, L) KV rows
    and min(s/G, 2L(G-1)/G) dK/dV rows, as the engine's layouts send (``held_rows``,
    ``dkv_rows``): exactly once the window fits in a zigzag chunk (L <= s/2G), never less
    than they send below; the ring's comm and task time follow, dense layers unchanged."""
    from megatron_zeppelin.runtime.zigzag import ZigzagLayout

    for s, g, window in ((4096, 4, 64), (4096, 8, 256), (1001, 3, 100), (4096, 4, 1024),
                         (1000, 4, 300), (8192, 8, 4096), (4096, 4, 5000), (100, 2, 10)):
        model = dataclasses.replace(cost_7b.model, window_size=window, window_layers=32)
        kernel = CostModel(model, cost_7b.cluster, cost_7b.hardware).kernel
        layouts = [ZigzagLayout([s], g, p, window) for p in range(g)]
        sent_kv = sum(x.relay_tokens(t) for x in layouts for t in range(1, g)) / (g * (g - 1))
        sent_dkv = sum(layouts[0].dkv_tokens(p) for p in range(g)) / g
        kv, dkv = kernel.relayed(s, g)
        if window <= s / (2 * g):
            assert (kv, dkv) == pytest.approx((sent_kv, sent_dkv), rel=1e-12), (s, g, window)
        assert kv >= sent_kv - 1e-9 and dkv >= sent_dkv - 1e-9, (s, g, window)
    half = CostModel(dataclasses.replace(cost_7b.model, window_size=64, window_layers=16),
                     cost_7b.cluster, cost_7b.hardware)
    kv, dkv = half.kernel.relayed(8192, 4)  # half the layers dense: 2048 rows, half 64 / 96
    assert (kv, dkv) == (0.5 * 2048 + 0.5 * 64, 0.5 * 2048 + 0.5 * 96)
    assert cost_7b.kernel.relayed(8192, 4) == (2048.0, None)
    assert half.ring_step_comm_time(8192, 4, Tier.INTER, False) < \
        cost_7b.ring_step_comm_time(8192, 4, Tier.INTER, False)
    assert half.ring_step_bytes(8192, 4) == pytest.approx(
        half.kv_bytes(kv) * 2 + half.kv_bytes(dkv) * 4 / 2)


def test_a_ring_whose_window_fits_its_chunks_is_priced_as_the_halo_exchange(cost_7b):
    """The sequences whose window fits in their chunks (``zigzag_window.halo_fits``) go by
    halo exchange on every tier (an INTER ring's hops across nodes both ways in the global
    steps, routed or not): the estimate prices one exchange of their rows each way (KV
    forward and again backward) behind step 0's work and the dK/dV of those rows home; the
    other sequences' hops round the ring as before."""
    from megatron_zeppelin.cost_model import RingWindow
    from megatron_zeppelin.zigzag_window import halo_fits

    model = dataclasses.replace(cost_7b.model, window_size=512, window_layers=32)
    kernel = CostModel(model, cost_7b.cluster, cost_7b.hardware).kernel
    for s, g in ((65536, 8), (8192, 8), (8191, 8), (4096, 2), (20000, 3)):
        assert kernel.window_parts(s, g).halo == halo_fits([s], g, 512), (s, g)
    window = RingWindow(8).add(kernel.window_parts(65536, 8))
    dense, share = 0.0, 65536 / 8
    even = window.even / 8 + kernel.ring_step_s
    for tier, routed in ((Tier.INTRA, True), (Tier.INTER, True), (Tier.INTER, False)):
        assert kernel.ring_exposed(dense, window, share, tier, routed) == pytest.approx(
            max(0.0, kernel.comm(512, tier, routed, 0.0) - window.first - even))
    assert kernel.accumulator_rows(share, window) == window.halo_kv == 512
    short = RingWindow(8).add(kernel.window_parts(8191, 8))  # 8191 // 16 < 512: the relay
    assert (short.rest, short.halo_kv) == (1, 0.0) and short.rest_dkv > 512
    assert kernel.accumulator_rows(share, short) == short.rest_dkv
    mixed = RingWindow(8).add(kernel.window_parts(65536, 8)).add(kernel.window_parts(8191, 8))
    assert (mixed.rest, mixed.halo_kv, mixed.rest_kv) == (1, 512, short.rest_kv)
    for tier, routed in ((Tier.INTRA, True), (Tier.INTER, True)):
        assert kernel.ring_exposed(dense, window, share, tier, routed) <= \
            kernel.ring_exposed(dense, mixed, share, tier, routed)


def test_on_cpu_a_partly_fitting_windowed_group_is_priced_round_the_ring(cost_7b, monkeypatch):
    """The engine splits a windowed group whose sequences only partly fit their chunks on
    CUDA (the fitting ones by halo exchange) but keeps it whole round the ring on CPU
    (``schedule.HALO_SPLIT``): the estimate prices what runs, in both planner backends, bit
    for bit. static-cp(cp=16) rings all three sequences (131072 fits a window of 512 in its
    chunks of 4096, 16000 and 8191 do not): dearer on CPU; the all-local and node-sized
    candidates (no mixed group) cost the same."""
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.planner.registry import make_plan

    model = dataclasses.replace(cost_7b.model, window_size=512, window_layers=32)
    gpu = CostModel(model, cost_7b.cluster, cost_7b.hardware)
    cpu = CostModel(model, cost_7b.cluster, dataclasses.replace(cost_7b.hardware, kernel="cpu"))
    assert gpu.kernel.halo_split and not cpu.kernel.halo_split
    priced = {}
    for backend in ("python", "cpp"):
        monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
        for device, cost in (("cuda", gpu), ("cpu", cpu)):
            plan = make_plan("zeppelin", [131072, 16000, 8191], cost,
                             ZeppelinConfig(max_seqlen=131072))
            priced[backend, device] = dict(plan.estimates)
    assert priced["python", "cuda"] == priced["cpp", "cuda"]
    assert priced["python", "cpu"] == priced["cpp", "cpu"]
    cuda, host = priced["python", "cuda"], priced["python", "cpu"]
    assert host["static-cp(cp=16)"] > cuda["static-cp(cp=16)"] * 1.05
    assert host["static-cp(cp=8)"] == cuda["static-cp(cp=8)"]
    assert host["hybrid-dp"] == cuda["hybrid-dp"]


def test_windowed_ring_steps_are_priced_where_the_zigzag_geometry_puts_their_work(cost_7b):
    """``CostKernel.window_parts``: a windowed layer computes each zigzag chunk's band with
    itself (and the two middle chunks' band) at step 0, the rest at the ``reach`` steps on
    either side, as ``zigzag_window.step_pairs`` counts the engine's blocks: step 0's share
    exact while the window fits in a chunk, the reach always."""
    from megatron_zeppelin.zigzag_window import step_pairs

    for s, g, window in ((4096, 4, 64), (4096, 8, 256), (65536, 16, 512), (4096, 8, 512),
                         (8192, 4, 3000), (1000, 4, 50)):
        model = dataclasses.replace(cost_7b.model, window_size=window, window_layers=32)
        kernel = CostModel(model, cost_7b.cluster, cost_7b.hardware).kernel
        parts = kernel.window_parts(s, g)
        pairs = step_pairs(s, g, window)
        busy = [t for t in range(1, g) if pairs[t] > 0]
        assert parts.reach == max(min(t, g - t) for t in busy), (s, g, window)
        assert parts.first + parts.rest == pytest.approx(kernel.compute(s, g), rel=1e-12)
        if window <= s / (2 * g) and s % (2 * g) == 0:
            assert parts.first / (parts.first + parts.rest) == \
                pytest.approx(pairs[0] / sum(pairs), rel=1e-12), (s, g, window)
    short = CostModel(dataclasses.replace(cost_7b.model, window_size=512, window_layers=32),
                      cost_7b.cluster, cost_7b.hardware).kernel.window_parts(400, 4)
    assert (short.first, short.rest, short.reach) == (0.0, 0.0, 2) and short.even > 0


def test_a_windowed_ring_exposes_the_hops_of_steps_with_nothing_to_compute(cost_7b):
    """A 64K document with a 5000-token window over 8 ranks across nodes (chunks of 4096
    tokens: no halo exchange, the relay): the windowed layers compute at steps 0, 1, 2, 6 and
    7 only, so 3 of the 7 hops hide behind nothing but the host work, where an even spread
    of the compute hid every hop behind 1/8 of it. Dense layers (a window on 16 of 32) keep
    the even spread; a model without a window is unchanged."""
    s, g, tier, w = 65536, 8, Tier.INTER, 5000
    model = dataclasses.replace(cost_7b.model, window_size=w, window_layers=32)
    kernel = CostModel(model, cost_7b.cluster, cost_7b.hardware).kernel
    parts = kernel.window_parts(s, g)
    hop = kernel.comm(parts.kv, tier, True, parts.dkv)
    host = kernel.ring_step_s
    assert parts.reach == 2 and not parts.halo and parts.first > parts.rest / 4
    compute = kernel.compute(s, g) + g * host
    exposed = kernel.task_time(s, g, tier) - compute
    assert exposed == pytest.approx(  # steps 1 and 2, 6 (2 away from 0): rest / 4 each
        max(0.0, hop - parts.first - host) + 3 * max(0.0, hop - parts.rest / 4 - host)
        + 3 * max(0.0, hop - host), rel=1e-12)
    even = (g - 1) * max(0.0, hop - compute / g)
    assert exposed >= 3 * (hop - host) > 0.0 and exposed > 1.2 * even  # 3 wholly exposed
    half = CostModel(dataclasses.replace(cost_7b.model, window_size=w, window_layers=16),
                     cost_7b.cluster, cost_7b.hardware).kernel
    dense_part = half.comm(s / g, tier, True) * 0.5 - \
        half.attn_coef * s * s / g / half.flops(s / g) * 0.5 / g - 0.5 * host
    windowed = half.window_parts(s, g)
    hop = half.comm(windowed.kv, tier, True, windowed.dkv) * 0.5
    assert half.task_time(s, g, tier) - half.compute(s, g) - g * host == pytest.approx(
        (g - 1) * max(0.0, dense_part) + max(0.0, hop - windowed.first - 0.5 * host)
        + 3 * max(0.0, hop - windowed.rest / 4 - 0.5 * host) + 3 * max(0.0, hop - 0.5 * host),
        rel=1e-12)
    plain = cost_7b.kernel
    c = plain.compute(s, g) + g * host
    assert plain.task_time(s, g, tier) == c + (g - 1) * max(0.0, plain.comm(s / g, tier, True)
                                                            - c / g)


@pytest.mark.parametrize("fields,match", [
    ({"window_layers": 2}, r"model.window_layers=2 is invalid: expected an integer in "
                           r"\[0, num_layers=32\], with window_size"),
    ({"window_size": 512, "window_layers": 33}, r"model.window_layers=33 is invalid"),
    ({"window_size": -1}, r"model.window_size=-1 is invalid: expected an integer in "
                          r"\[0, 2147483647\)"),
    ({"window_size": 2 ** 31}, r"model.window_size=2147483648 is invalid"),
])
def test_bad_window_settings_are_refused(cost_7b, fields, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(cost_7b.model, **fields)


def test_a_model_file_giving_no_layer_its_window_is_refused_naming_the_file(tmp_path):
    from megatron_zeppelin.config import load_model

    path = tmp_path / "m.yaml"
    path.write_text("name: m\nnum_layers: 4\nhidden_size: 64\nnum_attention_heads: 4\n"
                    "window_size: 128\nwindow_layers: 0\n")
    with pytest.raises(ConfigError, match=rf"^{path}: window_layers=0 is invalid with "
                                          r"window_size 128: expected 1 to num_layers=4"):
        load_model(path)
    path.write_text(path.read_text().replace("window_layers: 0", "window_layers: 2"))
    assert load_model(path).window_share == 0.5


def test_multi_latent_attention_prices_its_own_head_dims_and_projections():
    """MLA (DeepSeek-V2-Lite): q/k heads of 128 + 64 dims, v heads of 128, one KV head per
    query head; attention FLOPs, KV and q/k/v/out bytes follow those widths, the linear FLOPs
    MLA's low-rank projections. Its dense twin, as it was planned before (head dim hidden /
    heads = 128 here), is 1.25x low on both (with DeepSeek-V3's hidden 7,168 over 128 heads,
    head dim 56, 2.9x)."""
    cost = make_cost("deepseek-v2-lite", "h200-8nic")
    h, a, qk, v, kv_lora, rope, f = 2048, 16, 192, 128, 512, 64, 1408
    assert cost.kv_heads == a and cost.model.pair_dim == qk + v
    assert cost.attention_flops(1000) == a * (qk + v) * 1000 ** 2  # 2 a qk s^2/2 + 2 a v s^2/2
    assert cost.kv_bytes(10) == 10 * a * (qk + v) * 2
    assert cost.qkvo_bytes(10) == 10 * (a * qk + a * qk + a * v + a * v) * 2
    attention = h * a * qk + h * (kv_lora + rope) + kv_lora * a * (128 + v) + a * v * h
    assert cost.linear_flops_per_token() == 2 * (attention + 3 * h * f * 6)
    twin = dataclasses.replace(cost.model, multi_latent_attention=False, kv_lora_rank=None,
                               qk_head_dim=None, qk_pos_emb_head_dim=None, v_head_dim=None)
    gqa = CostModel(twin, cost.cluster, cost.hardware)
    assert cost.attention_flops(4096) / gqa.attention_flops(4096) == pytest.approx(320 / 256)
    assert cost.kv_bytes(1) / gqa.kv_bytes(1) == pytest.approx(320 / 256)
    assert cost.kernel.attn_coef / gqa.kernel.attn_coef == pytest.approx(320 / 256)
    with_q_lora = dataclasses.replace(cost.model, q_lora_rank=1536)
    assert with_q_lora.attention_weights(a, a) == attention - h * a * qk + h * 1536 + 1536 * a * qk
    tp2 = make_cost("deepseek-v2-lite", "h200-8nic", tp=2)  # down-projections on every rank
    assert tp2.model.attention_weights(8, 8) == h * 8 * qk + h * (kv_lora + rope) + \
        kv_lora * 8 * (128 + v) + 8 * v * h


@pytest.mark.parametrize("fields,match", [
    ({"kv_lora_rank": 512}, r"model.kv_lora_rank=512 is invalid: expected unset without "
                            r"multi_latent_attention: true"),
    ({"multi_latent_attention": True, "num_query_groups": 8},
     r"model.num_query_groups=8 is invalid: expected unset or num_attention_heads=32"),
    ({"multi_latent_attention": True, "v_head_dim": 0}, r"model.v_head_dim=0 is invalid"),
    ({"multi_latent_attention": "yes"}, r"model.multi_latent_attention='yes' is invalid"),
])
def test_bad_multi_latent_attention_settings_are_refused(cost_7b, fields, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(cost_7b.model, **{"num_query_groups": None, **fields})


def test_linear_flops_per_token_matches_the_formula(cost_7b):
    h, d, a, f = 4096, 128, 32, 11008
    assert cost_7b.linear_flops_per_token() == 2 * (h * 3 * a * d + a * d * h + 3 * h * f)


def test_gqa_shrinks_kv_bytes_not_query_flops():
    tiny = make_cost("gpt-tiny", "h200-8nic")  # 4 heads, 2 KV heads, head dim 16, fp32
    assert tiny.kv_bytes(10) == 10 * 2 * 2 * 16 * 4
    assert tiny.attention_flops(10) == 2 * 4 * 16 * 100


def test_tensor_parallel_splits_heads():
    full, half = make_cost(tp=1), make_cost(tp=2)
    assert half.attention_flops(4096) == full.attention_flops(4096) / 2
    assert half.kv_bytes(4096) == full.kv_bytes(4096) / 2


def test_vectorised_attention_times_match_scalar(cost_7b):
    lengths = [1, 100, 1000, 5000, 70000]
    for length, t in zip(lengths, cost_7b.attention_times(lengths)):
        assert t == pytest.approx(cost_7b.attention_time(length), rel=1e-12)


def test_vectorised_task_times_match_scalar(cost_7b):
    for tier in (Tier.INTRA, Tier.INTER):
        for routed in (False, True):
            rings = [1, 2, 3, 8, 16, 64]
            got = cost_7b.task_times(50_000, rings, tier, routed)
            for g, t in zip(rings, got):
                assert t == pytest.approx(cost_7b.task_time(50_000, g, tier, routed), rel=1e-12)


def test_crossovers_order_nvlink_below_routed_below_direct_nic(cost_7b):
    intra = cost_7b.crossover_chunk(Tier.INTRA)
    routed = cost_7b.crossover_chunk(Tier.INTER, routed=True)
    direct = cost_7b.crossover_chunk(Tier.INTER, routed=False)
    assert 0 < intra < routed < direct
    assert cost_7b.crossover_chunk(Tier.LOCAL) == 0
    # the analytic estimate c ~ (2B + 4) / (1 + bwd ratio) * g * F / (a * bw) holds there
    f = cost_7b.hardware.attention_flops_per_s(direct)
    fwd_bwd = 1 + cost_7b.hardware.attention_bwd_ratio
    analytic = (2 * 2 + 4) / fwd_bwd * f / cost_7b.cluster.nic_byte_per_s
    assert direct == pytest.approx(analytic, rel=0.05)


def test_step_is_hidden_exactly_above_the_crossover(cost_7b):
    c = cost_7b.crossover_chunk(Tier.INTER)
    assert cost_7b._step_hidden(c, Tier.INTER, False)
    assert not cost_7b._step_hidden(c - 1, Tier.INTER, False)


def test_task_time_counts_exposed_traffic_only(cost_7b):
    short, long = 1024, 1 << 18
    assert cost_7b.task_time(short, 8, Tier.INTER, routed=False) > cost_7b.attention_time(short, 8)
    assert cost_7b.task_time(long, 8, Tier.INTRA) == pytest.approx(cost_7b.attention_time(long, 8))
    assert cost_7b.task_time(short, 8, Tier.INTER, routed=True) <= \
        cost_7b.task_time(short, 8, Tier.INTER, routed=False)


def test_ring_bytes(cost_7b):
    assert cost_7b.ring_bytes(4096, 1) == 0
    # bf16 KV forward and backward (2 + 2 bytes) plus the fp32 dKV (4 bytes): 8 per element
    expected = cost_7b.kv_bytes(1024) / 2 * 8 * 3 * 32
    assert cost_7b.ring_bytes(4096, 4) == pytest.approx(expected)


def test_estimate_counts_cross_node_ring_hops():
    cost = make_cost(nodes=2, gpus_per_node=2)
    plan = make_plan("static-cp", [4096, 4096], cost, cp_size=4)
    est = estimate_plan(plan, cost)
    # one ring of 4 ranks over 2 nodes: 2 node-crossing hops per step, for each document
    assert est.ring_cross_node_bytes == pytest.approx(2 * 2 * cost.ring_bytes(4096, 4))
    assert est.remap_cross_node_bytes == 0
    assert len(est.attention_s) == 4 and est.step_s > 0


@pytest.mark.parametrize("cluster", ["a800-4nic", "h800-8nic", "h200-8nic"])
def test_routed_messages_follow_the_router_and_never_lose_to_direct(cluster):
    from megatron_zeppelin.config import load_cluster
    from megatron_zeppelin.routed_cost import routed_message_seconds
    from megatron_zeppelin.router import Flow, RouterTopology, route

    spec = load_cluster(cluster, nodes=2)
    topology = RouterTopology.from_cluster(spec)
    for mib in (1, 8, 64, 256):
        nbytes = mib << 20
        model = routed_message_seconds(spec, nbytes)
        assert model <= nbytes / spec.nic_byte_per_s + spec.nic_latency_us * 1e-6
        router = route(topology, [Flow(0, spec.gpus_per_node, nbytes)], align=2)
        assert model == pytest.approx(router.estimated_time_s, rel=0.15), (cluster, mib)
    cost = make_cost(cluster=cluster)
    sizes = np.array([1e4, 1e6, 1e8])
    assert np.allclose(cost.routed_seconds(sizes), [routed_message_seconds(spec, b) for b in sizes],
                       rtol=0.02)


@pytest.mark.parametrize("cluster", ["a800-4nic", "h800-8nic", "h200-8nic"])
@pytest.mark.parametrize("mib", [1, 8, 64, 256])
def test_routed_transfer_cost_is_the_routers_model_of_an_even_split(cluster, mib):
    """One definition: the cost model's routed message time is the router's own model
    (``router.evaluate``, the integer twin of the C++ router) of the flow split evenly over
    r rails, at the best r and chunk count; ticks round link costs by up to 5e-4."""
    from megatron_zeppelin.config import load_cluster
    from megatron_zeppelin.routed_cost import routed_message_seconds
    from megatron_zeppelin.router import Flow, RouterTopology, Slice, evaluate

    spec = load_cluster(cluster, nodes=2)
    topology = RouterTopology.from_cluster(spec)
    gpn, nbytes = spec.gpus_per_node, mib << 20
    flows = [Flow(0, gpn, nbytes)]
    best = float("inf")
    for rails in range(1, len(set(spec.gpu_to_nic)) + 1):
        proxies = [spec.gpu_to_nic.index(k) for k in range(rails)]  # rail-aligned, GPU 0 first
        cuts = [i * nbytes // rails for i in range(rails + 1)]
        slices = [Slice(0, p, gpn + p, lo, hi - lo) for p, lo, hi in zip(proxies, cuts, cuts[1:])]
        best = min(best, evaluate(topology, flows, slices).total_time_s)
    assert routed_message_seconds(spec, nbytes) == pytest.approx(best, rel=1e-3)


def test_ranks_sharing_a_device_run_faster_while_their_peers_wait():
    assert shared_peak([4.0, 4.0, 1.0, 1.0], 1.0) == 4.0
    assert shared_peak([4.0, 4.0, 1.0, 1.0], 2.0) == 2.5  # the mean: 10 s of work on 2 devices
    assert shared_peak([4.0, 0.0, 0.0, 0.0], 2.0) == 2.0  # alone on its device
    assert shared_peak([3.0, 3.0, 3.0, 3.0], 2.0) == 3.0  # all busy: as timed
    # fair sharing, not the best schedule (max(peak / 2, mean) = 2): the long rank shares a
    # core until the short ones finish (1 s at half speed for all four), then runs at full
    # speed beside the 2-unit rank (1 s more of it: 0.5 s) and alone (its last 2 s: 1 s)
    assert shared_peak([4.0, 2.0, 1.0, 1.0], 2.0) == 2.5
    assert shared_peak([1.0, 4.0, 1.0, 2.0], 2.0) == 2.5  # the order of ranks is irrelevant
    # 4 CPU ranks on 2 cores: one long document over a ring of 2 (the other pair idle) is
    # estimated faster with shared cores; over all 4 ranks (every rank busy) it is not
    cpu = make_cost("gpt-tiny", "cpu-2x2", nodes=2)
    assert cpu.hardware.shared_by == 2.0  # configs/hardware/cpu.yaml: 4 ranks on 2 cores
    plain, shared = (CostModel(cpu.model, cpu.cluster,
                               dataclasses.replace(cpu.hardware, shared_by=by), cpu.tp)
                     for by in (1.0, 2.0))
    lengths, config = [8000], ZeppelinConfig(routing=False, remap=False)
    steps = {}
    for cp in (2, 4):
        plan = make_plan("static-cp", lengths, plain, config, cp_size=cp)
        steps[cp] = [estimate_step(plan, c, routed=False).step_s for c in (plain, shared)]
    assert steps[2][1] < 0.8 * steps[2][0]
    assert steps[4][1] == pytest.approx(steps[4][0], rel=0.05)
    with pytest.raises(ConfigError, match="hardware.shared_by"):
        dataclasses.replace(plain.hardware, shared_by=0.5)
