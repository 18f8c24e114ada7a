"""Simulator invariants, the sweep and its reports, and bad input on ``zeppelin simulate``."""
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin import cli
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.plan import AttentionTask, Plan, Segment, Topology
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.sim import report
from megatron_zeppelin.sim.network import inter_step_time
from megatron_zeppelin.sim.profile import profile_of
from megatron_zeppelin.sim.step_model import linear_seconds
from megatron_zeppelin.sim.rounds import local_parts
from megatron_zeppelin.sim.simulator import SimOptions, attention_time, lower_bound, simulate
from megatron_zeppelin.planner.common import CapacityError
from megatron_zeppelin.sim.sweep import (Setting, VARIANTS, best_cap, resolve_variants,
                                         run_setting, settings_from_args)
from megatron_zeppelin.sim.workloads import sample_batch

from conftest import make_cost


def long_tailed(rng: random.Random, n: int) -> list[int]:
    out = [max(16, int(rng.lognormvariate(7.0, 1.3))) for _ in range(n)]
    out[rng.randrange(n)] = rng.randint(1 << 15, 1 << 17)
    return out


def manual_plan(topology: Topology, seqlens: list[int], rings: list[tuple[int, ...]],
                waves: list[int]) -> Plan:
    """A plan from explicit rings and waves; the linear layout is the attention layout."""
    tasks = tuple(AttentionTask(i, ring, topology.tier_of(ring), wave)
                  for i, (ring, wave) in enumerate(zip(rings, waves)))
    sources = tuple(Segment(i, 0, n) for i, n in enumerate(seqlens))
    draft = Plan("manual", topology, tuple(seqlens), sources, tasks, (), 1 << 30)
    return Plan("manual", topology, tuple(seqlens), sources, tasks, draft.attention, 1 << 30)


def test_time_grows_with_work():
    cost = make_cost(nodes=2)
    lengths = long_tailed(random.Random(3), 60)
    for strategy in ("zeppelin", "static-cp", "hybrid-dp"):
        options = SimOptions(inter_mode="routed" if strategy == "zeppelin" else "ring")
        small = simulate(make_plan(strategy, lengths, cost), cost, options).iteration_s
        more = simulate(make_plan(strategy, lengths + [20000, 9000], cost), cost,
                        options).iteration_s
        longer = simulate(make_plan(strategy, [2 * n for n in lengths], cost), cost,
                          options).iteration_s
        assert small < more and small < longer, strategy


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["a800-4nic", "h200-8nic"]),
       st.sampled_from(["auto", "analytic"]))
def test_routing_is_never_slower_than_direct(seed, cluster, router):
    cost = make_cost(cluster=cluster, nodes=3)
    lengths = long_tailed(random.Random(seed), 30)
    for plan in (make_plan("zeppelin", lengths, cost),
                 make_plan("static-cp", lengths, cost, cp_size=24)):
        direct = simulate(plan, cost, SimOptions(inter_mode="direct", router=router))
        routed = simulate(plan, cost, SimOptions(inter_mode="routed", router=router))
        assert routed.iteration_s <= direct.iteration_s * (1 + 1e-12)


def test_cross_node_rings_are_slower_without_routing_on_shared_nics():
    cost = make_cost(cluster="a800-4nic", nodes=2)
    plan = make_plan("static-cp", [65536] * 4, cost, cp_size=16)
    direct = simulate(plan, cost, SimOptions(inter_mode="ring"))
    routed = simulate(plan, cost, SimOptions(inter_mode="routed"))
    assert direct.ring_exposed_s > 0 and routed.iteration_s < direct.iteration_s


def test_analytic_direct_matches_the_router_model():
    cost = make_cost(cluster="a800-4nic", nodes=2)
    flows = {(0, 8): 3e6, (1, 9): 1e6, (7, 15): 5e6, (9, 2): 2e6}
    router = inter_step_time(cost.cluster, flows, routed=False, backend="auto")
    analytic = inter_step_time(cost.cluster, flows, routed=False, backend="analytic")
    assert analytic == pytest.approx(router, rel=1e-3)
    assert inter_step_time(cost.cluster, {}, routed=True) == 0.0


def test_single_gpu_plan_has_no_communication():
    cost = make_cost(nodes=1, gpus_per_node=1)
    lengths = [5000, 700, 12000, 64]
    result = simulate(make_plan("zeppelin", lengths, cost), cost, SimOptions(inter_mode="routed"))
    assert result.ring_exposed_s == result.remap_s == result.grad_sync_s == 0.0
    assert result.rank_wait_s == (0.0,)
    # every document at its own length's rate and backward ratio, one fused LOCAL call
    # forward and one backward per layer, the linear modules on every token, the optimizer
    profile, layers = profile_of(cost), cost.model.num_layers
    s = np.asarray(lengths, dtype=np.float64)
    flops = np.asarray([cost.attention_flops(x) for x in s])
    attention = layers * float(np.sum(profile.attention_forward_s(flops, s)
                                      * (1 + profile.backward_ratio(s))))
    launches = profile.attention_call_us * 1e-6 * 2 * layers
    linear = float(linear_seconds(np.asarray([s.sum()]), cost, profile)[0])
    assert result.iteration_s == pytest.approx(attention + launches + linear
                                               + result.optimizer_s, rel=1e-9)
    assert result.iteration_s >= result.lower_bound_s


def test_remap_off_means_no_remap_time():
    cost = make_cost(nodes=2)
    lengths = long_tailed(random.Random(5), 80)
    on = simulate(make_plan("zeppelin", lengths, cost, ZeppelinConfig(remap=True)), cost)
    off = simulate(make_plan("zeppelin", lengths, cost, ZeppelinConfig(remap=False)), cost)
    assert on.remap_s > 0 and off.remap_s == 0.0


def test_waves_add_up():
    cost = make_cost(nodes=2)
    topo = cost.cluster.topology()
    lengths = [30000, 4000, 16000, 900]
    rings = [tuple(range(8)), (8,), (9, 10, 11, 12), (13,)]
    options = SimOptions(overlap_grad_reduce=False)
    both = simulate(manual_plan(topo, lengths, rings, [0, 0, 1, 1]), cost, options)
    first = simulate(manual_plan(topo, lengths[:2], rings[:2], [0, 0]), cost, options)
    second = simulate(manual_plan(topo, lengths[2:], rings[2:], [0, 0]), cost, options)
    grad = both.grad_sync_s + both.optimizer_s  # once per iteration
    assert both.waves == 2 and both.grad_sync_s > 0
    assert first.grad_sync_s + first.optimizer_s == pytest.approx(grad)
    assert both.iteration_s - grad == pytest.approx(first.iteration_s + second.iteration_s
                                                    - 2 * grad, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["zeppelin", "static-cp", "hybrid-dp"]),
       st.sampled_from([{}, {"model": "gpt-tiny", "cluster": "cpu-2x2"}]))
def test_no_plan_beats_the_lower_bound(seed, strategy, setup):
    """On GPUs and on the emulated CPU cluster, whose ranks share cores and whose per-token
    host work takes none (its bound once exceeded zeppelin's simulated step by 6%)."""
    cost = make_cost(nodes=2, **setup)
    lengths = long_tailed(random.Random(seed), 40)
    result = simulate(make_plan(strategy, lengths, cost), cost)
    assert result.iteration_s >= result.lower_bound_s
    assert result.lower_bound_s == lower_bound(lengths, cost, cost.cluster.world_size // cost.tp)
    if setup:  # shared cores: the parts are priced at one core per rank, the step is not
        return
    parts = result.linear_s + result.attention_s + result.remap_s + result.grad_sync_s + \
        result.optimizer_s
    assert parts == pytest.approx(result.iteration_s, rel=1e-12)


@pytest.mark.parametrize("strategy", ["zeppelin", "static-cp", "hybrid-dp"])
def test_short_documents_on_shared_cores_do_not_beat_the_lower_bound(strategy):
    """Short documents on the emulated CPU cluster: the per-token host work (no core taken)
    dominates; the bound once multiplied it by the cores' fair share and exceeded zeppelin's
    simulated step (1.323 s against 1.243 s on this batch)."""
    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    lengths = sample_batch("github", 32 * 1024, random.Random(0))
    result = simulate(make_plan(strategy, lengths, cost), cost)
    assert result.iteration_s >= result.lower_bound_s


def test_tensor_parallel_ranks_simulate():
    cost = make_cost(model="llama-13b", cluster="a800-4nic", nodes=2, tp=2)
    lengths = long_tailed(random.Random(9), 40)
    result = simulate(make_plan("zeppelin", lengths, cost), cost, SimOptions(inter_mode="routed"))
    assert len(result.rank_linear_s) == 8 and result.iteration_s > result.lower_bound_s


def test_plan_of_another_cluster_is_rejected():
    plan = make_plan("zeppelin", [1000, 2000], make_cost(nodes=2))
    with pytest.raises(ValueError, match="does not match the cluster"):
        simulate(plan, make_cost(nodes=4))


def test_a_1024_gpu_plan_simulates_without_blowing_up():
    """A guard against super-linear work, not a speed claim (those live in benchmarks): the
    process's CPU time, which other load on the machine barely moves (0.7 s on the 2-core CI
    machine; the bound leaves 4x for slower hosts)."""
    cost = make_cost(cluster="h200-8nic", nodes=128)
    lengths = sample_batch("github", 16 << 20, random.Random(0))
    plan = make_plan("zeppelin", lengths, cost)
    _ = plan.transfers  # built once per plan (the runtime needs it too); not the simulator's
    start = time.process_time()
    simulate(plan, cost, SimOptions(inter_mode="routed"))
    assert time.process_time() - start < 3.0


def test_sweep_runs_every_variant_and_skips_megatron_on_request(tmp_path):
    setting = Setting("llama-7b", "h200-8nic", 2, "github", tokens=1 << 19)
    variants = resolve_variants(["zeppelin", "static-cp", "static-cp-best",
                                 "megatron-hybrid-cp"])
    ticks = []
    result = run_setting(setting, variants, max_megatron_sequences=1,
                         tick=lambda: ticks.append(1))
    assert [r.label for r in result.results] == ["zeppelin", "static-cp", "static-cp-best"]
    assert result.skipped[0][0] == "megatron-hybrid-cp" and len(ticks) == 4
    assert result.get("static-cp-best").iteration_s <= result.get("static-cp").iteration_s
    table = report.format_setting(result)
    assert "zeppelin" in table and "skipped" in table
    assert "| setting |" in report.format_summary([result], markdown=True)
    png = report.plot_speedups([result], tmp_path / "s.png")
    loads = report.plot_rank_loads(result, tmp_path / "l.png")
    assert png.stat().st_size > 1000 and loads.stat().st_size > 1000


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        Setting("llama-7b", "h200-8nic", 2, "nope")
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        resolve_variants(["fast"])
    with pytest.raises(ValueError, match="--nodes 0 is invalid"):
        settings_from_args("llama-7b", "h200-8nic", [0], ["github"], 1, 0, 1024, 1, 0, None)
    with pytest.raises(ValueError, match="router='x' is invalid"):
        SimOptions(router="x")
    assert set(VARIANTS) >= {"zeppelin", "static-cp", "hybrid-dp", "megatron-hybrid-cp"}


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
    (["--global-batch-tokens", "0"], "expected a positive number of tokens"),
    (["--global-batch-tokens", "999G"], "'999G' is invalid: expected at most 1G tokens"),
    (["--global-batch-tokens", "1M", "--tokens-per-gpu", "8K"],
     "--global-batch-tokens 1048576 with --tokens-per-gpu 8192: pass one"),
    (["--lengths", __file__, "--batches", "5"], "with --batches: the file is the batch"),
    (["--seed", "-1"], "argument --seed: -1 is invalid: expected an integer >= 0"),
    (["--compare-orders"], "--compare-orders applies only with --pp >= 2"),
    (["--strategies", "zeppelin", "static-cp", "--max-megatron-sequences", "5"],
     "--max-megatron-sequences=5 is invalid here: it applies only to megatron-hybrid-cp"),
    (["--pp", "2", "--compare-orders", "--microbatch-order", "arrival"],
     "--microbatch-order=arrival is invalid with --compare-orders"),
    (["--plot", __file__ + "/sub"],  # a file above the folder
     f"argument --plot: '{__file__}/sub' is invalid: expected a folder ('{__file__}' is a file)"),
    (["--global-batch-tokens", "-5"], "is invalid"),
    (["--strategies", "zeppelin", "warp"], "unknown strategy 'warp'"),
    (["--nodes", "0"], "argument --nodes: 0 is invalid"),
    (["--batches", "0"], "argument --batches: 0 is invalid"),
])
def test_simulate_cli_rejects_bad_input(argv, message, capsys):
    base = ["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--no-progress"]
    assert cli.main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_simulate_cli_prints_a_table(capsys):
    argv = ["simulate", "--model", "llama-3b", "--cluster", "h200-8nic", "--nodes", "2",
            "--workload", "arxiv", "--global-batch-tokens", "256K", "--batches", "1",
            "--strategies", "zeppelin", "static-cp", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "llama-3b h200-8nic x2 arxiv" in out and "vs static-cp" in out


def test_local_queue_is_cut_into_at_most_one_run_per_round():
    work = [(float(n * n), n * 1e-3) for n in (100, 3000, 50, 700, 700, 9000)]
    for rounds in (1, 2, 3, 6, 20):
        parts = local_parts(work, rounds, 1e-4)
        assert 1 <= len(parts) <= rounds
        assert sum(parts) == pytest.approx(sum(t for _, t in work) + 1e-4 * len(parts))
    assert local_parts([], 4, 1e-4) == []


def test_attention_only_time_of_one_gpu_is_its_compute():
    cost = make_cost(nodes=1, gpus_per_node=1)
    plan = make_plan("zeppelin", [3000, 5000], cost)
    result = simulate(plan, cost)
    assert result.rank_wait_s == (0.0,) and result.rank_attention_s[0] > 0
    assert attention_time(plan, cost) == pytest.approx(result.rank_attention_s[0])


def test_idealised_local_filling_removes_the_engines_round_stalls():
    cost = make_cost(cluster="h200-8nic", nodes=2)
    lengths = [40000] * 2 + [9000] * 6 + [300] * 200
    plan = make_plan("zeppelin", lengths, cost)
    engine = simulate(plan, cost, SimOptions(inter_mode="routed"))
    fill = simulate(plan, cost, SimOptions(inter_mode="routed", local_policy="fill"))
    assert fill.iteration_s <= engine.iteration_s
    # same work; the engine launches one kernel per LOCAL run, fill one per rank
    assert sum(fill.rank_attention_s) == pytest.approx(sum(engine.rank_attention_s), rel=2e-2)


def test_simulate_cli_takes_a_lengths_file(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# my corpus\n30000\n1200\n800\n\n5000\n")
    argv = ["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "1",
            "--lengths", str(lengths), "--strategies", "zeppelin", "static-cp", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "lengths.txt" in out and "4 documents" in out
    lengths.write_text("12\n-3\n")
    assert cli.main(argv) == 2
    assert "length -3 is invalid" in capsys.readouterr().err


def test_te_cp_sends_dkv_in_the_kv_dtype_and_the_peers_are_charged_their_own():
    cost = make_cost(nodes=2)  # bf16: dK/dV accumulators are fp32, TE sends them in bf16
    lengths = sample_batch("github", 256 * 1024, random.Random(4))
    plan = make_plan("static-cp", lengths, cost, ZeppelinConfig(), cp_nodes=2)
    accumulator = simulate(plan, cost, SimOptions(dkv_dtype="accumulator"))
    kv = simulate(plan, cost, SimOptions(dkv_dtype="kv"))
    assert kv.iteration_s < accumulator.iteration_s  # inter-node rings move half the dK/dV
    with pytest.raises(ValueError, match="dkv_dtype='fp8' is invalid"):
        SimOptions(dkv_dtype="fp8")
    assert VARIANTS["static-cp-2node"].strategy.te_attention
    assert not VARIANTS["zeppelin"].strategy.te_attention
    assert "paper's baseline" in VARIANTS["static-cp-2node"].description


@pytest.mark.parametrize("seconds,best,tried", [
    ({64: 9.0, 32: 5.0, 16: 6.0, 8: 7.0, 4: 1.0}, 32, [64, 32, 16, 8]),  # two slower: stop
    ({64: 9.0, 32: 9.0, 16: 9.0, 8: 4.0, 4: 5.0}, 8, [64, 32, 16, 8, 4]),  # a plateau goes on
    ({64: None, 32: 5.0, 16: 6.0, 8: 4.0, 4: 5.0}, 8, [64, 32, 16, 8, 4]),  # no fit is passed
])
def test_the_cap_sweep_keeps_the_fastest_and_stops_after_two_slower(seconds, best, tried):
    calls = []

    def evaluate(variant):
        cap = variant.strategy.max_seqlen_per_rank
        calls.append(cap)
        if seconds[cap] is None:
            raise CapacityError("too long")
        return f"runs at {cap}", seconds[cap]

    got, note = best_cap(VARIANTS["hybrid-dp-tuned"], list(seconds), evaluate)
    assert got == f"runs at {best}" and calls == tried and note.startswith(f"cap {best} (swept ")
    assert ("64: no fit" in note) == (seconds[64] is None)
    with pytest.raises(CapacityError, match="no --max-seqlen-per-dp-cp-rank of \\[4, 8\\]"):
        best_cap(VARIANTS["hybrid-dp-tuned"], [8, 4], lambda v: _no_fit())


def _no_fit():
    raise CapacityError("too long")


def test_hybrid_peers_are_tuned_per_batch_set_and_state_their_cap():
    setting = Setting("llama-7b", "h200-8nic", 2, "github", tokens=512 * 1024, batches=2)
    result = run_setting(setting, resolve_variants(["hybrid-dp", "hybrid-dp-tuned"]))
    plain, tuned = result.get("hybrid-dp"), result.get("hybrid-dp-tuned")
    assert tuned.note.startswith("cap ") and "swept" in tuned.note
    assert tuned.iteration_s <= plain.iteration_s * (1 + 1e-9)  # the default is among those swept
    assert report.geomean_speedup([result], "hybrid-dp", "hybrid-dp-tuned") == \
        pytest.approx(plain.iteration_s / tuned.iteration_s)
    assert report.median_speedup([result], "hybrid-dp", "hybrid-dp-tuned") == \
        pytest.approx(plain.iteration_s / tuned.iteration_s)


def test_windowed_rings_are_simulated_with_the_rows_the_engine_sends():
    """Under a sliding window the simulator's ring hops carry the KV and dK/dV rows the engine
    sends (``zigzag_window.relay_rows``, counted on the zigzag geometry, equal to the
    engine's layouts), on the windowed share of layers; whole chunks without a window. Fewer
    bytes: cross-node static CP on long documents simulates faster, and its exposed traffic
    falls."""
    import dataclasses

    from megatron_zeppelin.cost_model import CostModel
    from megatron_zeppelin.runtime.zigzag import ZigzagLayout
    from megatron_zeppelin.sim.profile import profile_of as sim_profile
    from megatron_zeppelin.sim.step_model import build_work
    from megatron_zeppelin.zigzag_window import relay_rows

    for s, g, window in ((4096, 4, 64), (1000, 4, 300), (4096, 8, 1000), (37, 3, 5)):
        layouts = [ZigzagLayout([s], g, p, window) for p in range(g)]
        kv = sum(x.relay_tokens(t) for x in layouts for t in range(1, g)) / (g * (g - 1))
        dkv = sum(layouts[0].dkv_tokens(p) for p in range(g)) / g
        assert relay_rows(s, g, window) == pytest.approx((kv, dkv), rel=1e-12)
    dense = make_cost(cluster="a800-4nic", nodes=2)
    model = dataclasses.replace(dense.model, window_size=512, window_layers=16)
    windowed = CostModel(model, dense.cluster, dense.hardware)
    plan = make_plan("static-cp", [65536] * 4, dense, cp_size=16)
    rings = {name: build_work(plan, cost, sim_profile(cost))[0][1].rings
             for name, cost in (("dense", dense), ("windowed", windowed))}
    kv, dkv = relay_rows(65536, 16, 512)
    for full, trimmed in zip(rings["dense"], rings["windowed"]):
        assert full.accumulator_bytes == full.kv_bytes
        chunk = full.kv_bytes / 4
        assert trimmed.kv_bytes == pytest.approx(4 * (0.5 * chunk + 0.5 * kv * dense.kv_bytes(1)))
        assert trimmed.accumulator_bytes == pytest.approx(
            4 * (0.5 * chunk + 0.5 * dkv * dense.kv_bytes(1)))
    slow, fast = (simulate(plan, cost, SimOptions(inter_mode="ring")) for cost in (dense, windowed))
    assert fast.ring_exposed_s < slow.ring_exposed_s and fast.iteration_s < slow.iteration_s


def test_windowed_ring_steps_are_simulated_where_their_work_falls():
    """``zigzag_window.step_pairs`` counts each step's windowed (query, key) pairs on the
    zigzag chunks (brute force agrees); the simulator's windowed ring computes them in those
    steps (step 0 the most, steps beyond the window's reach only the per-step host work and
    launch), and a model with the window on half its layers simulates as the mean of its
    dense and all-windowed twins (the two kinds of layers run apart)."""
    import dataclasses

    from megatron_zeppelin.cost_model import CostModel
    from megatron_zeppelin.plan import zigzag_bounds
    from megatron_zeppelin.sim.profile import profile_of as sim_profile
    from megatron_zeppelin.sim.step_model import StepOptions, attention_ends, build_work
    from megatron_zeppelin.zigzag_window import step_pairs

    for s, g, window in ((100, 4, 10), (97, 3, 40), (64, 4, 0), (50, 2, 100)):
        b = zigzag_bounds(s, g)
        spans = [[(b[p], b[p + 1]), (b[2 * g - 1 - p], b[2 * g - p])] for p in range(g)]
        brute = [sum(1 for p in range(g) for qa, qb in spans[p]
                     for ka, kb in spans[(p - t) % g] for i in range(qa, qb)
                     for k in range(ka, kb) if i - window <= k <= i) / g for t in range(g)]
        assert step_pairs(s, g, window) == pytest.approx(brute, abs=1e-12), (s, g, window)
    dense = make_cost(cluster="a800-4nic", nodes=2)
    windowed = CostModel(dataclasses.replace(dense.model, window_size=512), dense.cluster,
                         dense.hardware)
    plan = make_plan("static-cp", [65536] * 4, dense, cp_size=16)
    profile = sim_profile(windowed)
    extra = profile.attention_call_us * 1e-6 * profile.compute_scale + \
        profile.ring_step_us * 1e-6
    relay = build_work(plan, windowed, profile, halo=False)[0]  # as AttentionEngine(halo=False)
    for work in relay:
        for ring in work.rings:
            steps = np.asarray(ring.step_s)
            assert steps.shape == (16,) and steps.argmax() == 0 and not ring.halo
            assert steps[2:15] == pytest.approx(np.full(13, extra))
    # by halo exchange (across nodes too): step 0, then the two neighbours' blocks, the same
    # work; each way to a neighbour carries half of what a position sends (halo_rows)
    from megatron_zeppelin.zigzag_window import halo_rows

    for ring_work, halo_work in zip(relay, build_work(plan, windowed, profile)[0]):
        for ring, halo in zip(ring_work.rings, halo_work.rings):
            assert halo.halo and halo.rounds_size == 2 and halo.steps == 2
            assert halo.step_s[0] == ring.step_s[0]
            assert halo.step_s[1] == pytest.approx(sum(ring.step_s[1:]) - 13 * extra)
            sent = 4 * halo_rows(65536, 16, 512)[0] / 2 * windowed.kv_bytes(1)
            assert halo.kv_bytes == pytest.approx(sent) and halo.kv_bytes < ring.kv_bytes
    # a short sequence in the group (1000 // 32 < 512) runs round the ring beside the halo
    mixed = make_plan("static-cp", [65536] * 3 + [1000], dense, cp_size=16)
    for work in build_work(mixed, windowed, profile)[0]:
        assert [(r.halo, r.steps, r.index) for r in work.rings] == [(True, 2, 0), (False, 16, 0)]
    for work in build_work(mixed, windowed, profile, split=False)[0]:  # as the engine on CPU
        assert [(r.halo, r.steps, r.index) for r in work.rings] == [(False, 16, 0)]
    half = CostModel(dataclasses.replace(dense.model, window_size=512, window_layers=16),
                     dense.cluster, dense.hardware)
    ends = {name: attention_ends(plan, cost, sim_profile(half), StepOptions())[0]
            for name, cost in (("dense", dense), ("windowed", windowed), ("half", half))}
    for field in ("fwd", "bwd", "compute"):
        assert getattr(ends["half"], field) == pytest.approx(
            0.5 * getattr(ends["dense"], field) + 0.5 * getattr(ends["windowed"], field))


def test_a_halo_ring_is_simulated_as_one_exchange_with_both_neighbours():
    """``sim.rounds``: a halo group (4 ranks of one node) sends to both neighbours in round 0
    (and its dK/dV home in round 2 of the backward), so each pass waits for one latency
    forward and two backward where the relayed ring waits for G - 1 and G + 1."""
    from megatron_zeppelin.config import load_cluster
    from megatron_zeppelin.plan import Tier
    from megatron_zeppelin.sim.network import GpuMap
    from megatron_zeppelin.sim.rounds import Links, PassSpec, RingCosts, simulate_pass

    cluster = load_cluster("h200-8nic", nodes=1)
    links = Links(GpuMap(cluster, 1), "ring", "python")
    latency = cluster.nvlink_latency_us * 1e-6
    members, cross = np.arange(4), np.zeros(4, dtype=bool)
    for backward, hops in ((False, (1, 3)), (True, (2, 5))):
        spec = PassSpec(backward, 1.0, 1.0, 0.0)
        halo = RingCosts(0, members, Tier.INTRA, np.zeros(2), 1.0, cross, 1.0, halo=True)
        ring = RingCosts(0, members, Tier.INTRA, np.zeros(4), 1.0, cross, 1.0)
        ends = [simulate_pass([r], [[] for _ in range(8)], 8, spec, links)[0]
                for r in (halo, ring)]
        for end, count in zip(ends, hops):  # a byte per hop: latency-bound
            assert end[:4] == pytest.approx(count * (latency + 1 / cluster.nvlink_byte_per_s))
            assert not end[4:].any()


def test_a_halo_ring_across_nodes_sends_both_ways_in_the_global_steps():
    """An INTER halo group in the global steps (``direct``/``routed``): its hops across
    nodes travel both ways in one global step forward (three backward: KV out, nothing,
    dK/dV home, ``schedule.wave_global_steps``), where the relayed ring takes G - 1 global
    steps forward; the hops inside a node stay ring P2P."""
    from megatron_zeppelin.config import load_cluster
    from megatron_zeppelin.plan import Tier
    from megatron_zeppelin.sim.network import GpuMap, inter_step_time
    from megatron_zeppelin.sim.rounds import Links, PassSpec, RingCosts, simulate_pass

    cluster = load_cluster("h200-8nic", nodes=2)
    members = np.asarray([0, 1, 8, 9])
    cross = np.asarray([False, True, False, True])
    nbytes, spec, world = 64e6, PassSpec(False, 1.0, 1.0, 0.0), 16
    for mode in ("direct", "routed"):
        links = Links(GpuMap(cluster, 1), mode, "auto")
        halo = RingCosts(0, members, Tier.INTER, np.zeros(2), nbytes, cross, nbytes, halo=True)
        ring = RingCosts(0, members, Tier.INTER, np.zeros(4), nbytes, cross, nbytes)
        both = {(1, 8): nbytes, (8, 1): nbytes, (9, 0): nbytes, (0, 9): nbytes}
        one = {(1, 8): nbytes, (9, 0): nbytes}
        step = inter_step_time(cluster, both, mode == "routed", "auto")
        relay_step = inter_step_time(cluster, one, mode == "routed", "auto")
        halo_end = simulate_pass([halo], [[] for _ in range(world)], world, spec, links)[0]
        ring_end = simulate_pass([ring], [[] for _ in range(world)], world, spec, links)[0]
        intra = nbytes / cluster.nvlink_byte_per_s + cluster.nvlink_latency_us * 1e-6
        assert halo_end[members] == pytest.approx(max(step, intra)), mode
        assert ring_end[members] == pytest.approx(3 * max(relay_step, intra)), mode
        assert halo_end[members].max() < ring_end[members].min()
