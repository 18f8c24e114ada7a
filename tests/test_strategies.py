"""The strategy registry, the peers (FlexSP, Hydraulis, static CP at its best size), zeppelin's
portfolio, and the two planner backends giving the same plans bit for bit."""
from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_step
from megatron_zeppelin.plan import Topology
from megatron_zeppelin.planner import STRATEGIES, Strategy, get_strategy, make_plan, native
from megatron_zeppelin.planner.common import CapacityError
from megatron_zeppelin.planner.overlong import OverlongTally, piece_bounds
from megatron_zeppelin.sim.simulator import SimOptions, simulate
from megatron_zeppelin.sim.sweep import VARIANTS, Setting, resolve_variants, run_setting
from megatron_zeppelin.sim.workloads import WORKLOADS, sample_batch

from conftest import make_cost

SMALL = [9000, 3000, 1200, 700, 300, 80, 64, 20000]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_runs_through_the_cli_the_simulator_and_the_fidelity_planning(
        name, capsys, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, SMALL)))
    assert cli.main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
                     "--lengths", str(lengths), "--strategy", name, "--validate",
                     "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["plans"][0]
    assert shown["tokens"] == sum(SMALL) and shown["est_step_s"] > 0
    assert shown["strategy"] == name  # the column is the strategy asked for
    result = run_setting(Setting("llama-7b", "h200-8nic", 2, "github", tokens=1 << 18),
                         resolve_variants([name]))
    assert result.get(name).iteration_s > 0 and not result.skipped
    from megatron_zeppelin.bench.fidelity import FidelityOptions, fidelity_cost, fidelity_plans

    opts = FidelityOptions(batches=1, tokens=8192)
    plans = [p for p in fidelity_plans(opts, fidelity_cost(opts)) if p[0] == name]
    assert len(plans) == 1
    plans[0][3].validate()
    assert plans[0][3].attention_kind == STRATEGIES[name].attention
    assert STRATEGIES[name]().runs_on_engine


def test_registry_rejects_bad_names_options_and_registrations():
    with pytest.raises(ValueError, match=r"unknown strategy 'nope': expected one of \["):
        get_strategy("nope")
    with pytest.raises(ValueError, match=r"strategy 'static-cp' has no option\(s\) \['bogus'\]"):
        get_strategy("static-cp", bogus=1)
    with pytest.raises(ValueError, match="cp_size=0 is invalid"):
        get_strategy("static-cp", cp_size=0)
    with pytest.raises(TypeError, match="no metadata help"):
        from megatron_zeppelin.planner.registry import register

        @register
        @dataclasses.dataclass(frozen=True)
        class Undocumented(Strategy):
            name = "undocumented"
            knob: int = 1
    assert "undocumented" not in STRATEGIES


def test_plan_plot_draws_every_strategy_side_by_side(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert cli.main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
                     "--global-batch-tokens", "256K", "--strategy", "zeppelin", "static-cp",
                     "hydraulis", "--plot", str(png)]) == 0
    assert png.stat().st_size > 10000 and f"wrote {png}" in capsys.readouterr().err


def test_cli_refuses_an_option_of_a_strategy_not_asked_for(capsys):
    assert cli.main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--strategy",
                     "zeppelin", "--cp-size", "8"]) == 2
    assert "--cp-size is an option of ['static-cp']" in capsys.readouterr().err


def test_cli_strategy_options_are_typed_settings_whose_errors_name_the_flag(capsys):
    base = ["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
            "--global-batch-tokens", "64K", "--json"]
    assert cli.main(base + ["--strategy", "static-cp", "--cp-size", "0"]) == 2
    assert "zeppelin: error: --cp-size=0 is invalid: expected an integer >= 1" in \
        capsys.readouterr().err
    assert cli.main(base + ["--strategy", "flexsp", "--buckets", "two"]) == 2
    assert "--buckets: invalid integer value: 'two'" in capsys.readouterr().err
    # a boolean option is --x/--no-x; an option two strategies share is one flag for both;
    # an option not given keeps the strategy's default
    args = cli.build_parser().parse_args(
        base + ["--strategy", "zeppelin", "hybrid-dp", "megatron-hybrid-cp", "flexsp",
                "--no-portfolio", "--max-seqlen-per-dp-cp-rank", "20000"])
    assert [s.label() for s in cli.selected_strategies(args, Topology(2, 8))] == [
        "zeppelin(portfolio=False)", "hybrid-dp(max_seqlen_per_rank=20000)",
        "megatron-hybrid-cp(max_seqlen_per_rank=20000)", "flexsp"]


def test_flexsp_solves_a_milp_over_ulysses_groups():
    cost = make_cost(nodes=2)
    plan = make_plan("flexsp", sample_batch("github", 1 << 20, random.Random(2)), cost)
    plan.validate()
    assert plan.attention_kind == "ulysses" and plan.candidate.startswith("milp ")
    sizes = {len(t.ring) for t in plan.tasks}
    gpn = cost.cluster.gpus_per_node
    assert all(size <= cost.heads and (size <= gpn or size % gpn == 0) for size in sizes)
    ranks = sorted(r for ring in {t.ring for t in plan.tasks} for r in ring)
    assert len(ranks) == len(set(ranks))  # groups are disjoint
    result = simulate(plan, cost)
    assert result.iteration_s >= result.lower_bound_s


def test_hydraulis_runs_replicas_of_one_cp_size_each():
    cost = make_cost(nodes=2)
    plan = make_plan("hydraulis", sample_batch("arxiv", 1 << 20, random.Random(3)), cost)
    plan.validate()
    assert plan.candidate.startswith("replicas ")
    rings = {t.ring for t in plan.tasks}
    for a in rings:
        for b in rings:
            assert a == b or not set(a) & set(b) or len(a) != len(b) or a[0] // len(a) != \
                b[0] // len(b)


def test_static_cp_best_keeps_the_size_with_the_lowest_estimate():
    cost = make_cost(nodes=2)
    lengths = sample_batch("prolong64k", 1 << 20, random.Random(4))
    best = make_plan("static-cp-best", lengths, cost, ZeppelinConfig(routing=False))
    sizes = dict(best.estimates)
    assert best.estimates[0][0] == best.strategy and len(sizes) >= 3
    for label, seconds in sizes.items():
        cp = int(label.split("=")[1].rstrip(")"))
        plan = make_plan("static-cp", lengths, cost, ZeppelinConfig(routing=False), cp_size=cp)
        assert estimate_step(plan, cost, routed=False).step_s == pytest.approx(seconds)


@pytest.mark.usefixtures("planner_backend")
def test_portfolio_returns_its_fastest_candidate_and_records_the_others():
    cost = make_cost(nodes=2)
    for seed, workload in enumerate(("github", "uniform-short", "prolong64k")):
        plan = make_plan("zeppelin", sample_batch(workload, 1 << 20, random.Random(seed)), cost)
        names = [n for n, _ in plan.estimates]
        assert {"hierarchical+remap", "hierarchical", "hybrid-dp"} <= set(names)
        assert plan.candidate == names[0] and plan.margin >= 1.0
        assert [t for _, t in plan.estimates] == sorted(t for _, t in plan.estimates)
        assert plan.estimates[0][1] == pytest.approx(estimate_step(plan, cost).step_s)
        assert (plan.linear != plan.attention) == plan.candidate.endswith("+remap")
    alone = make_plan("zeppelin", SMALL, cost, portfolio=False)
    assert alone.candidate == "" and alone.estimates == ()


@pytest.mark.parametrize("seed", range(3))
def test_backends_give_the_same_plans_bit_for_bit(seed, monkeypatch):
    rng = random.Random(seed)
    cases = 0
    for nodes, gpn in ((1, 1), (1, 8), (2, 4), (3, 3), (4, 8), (16, 8)):
        cost = make_cost(cluster=rng.choice(["h200-8nic", "a800-4nic"]), nodes=nodes,
                         gpus_per_node=gpn)
        shared = dataclasses.replace(cost.hardware, shared_by=rng.choice([1.0, 2.0, 3.0]))
        window = rng.choice([None, None, 511, 4096])  # sliding windows on some layers
        model = dataclasses.replace(cost.model, window_size=window, window_layers=None if
                                    window is None else rng.randint(1, cost.model.num_layers))
        if rng.random() < 0.3:  # multi-latent attention: its own head dims and projections
            model = dataclasses.replace(model, num_query_groups=None, multi_latent_attention=True,
                                        q_lora_rank=rng.choice([None, 1536]), kv_lora_rank=512,
                                        qk_pos_emb_head_dim=64, v_head_dim=rng.choice([64, 128]))
        cost = CostModel(model, cost.cluster, shared, cost.tp)
        lengths = sample_batch(rng.choice(sorted(WORKLOADS)), 16 * 1024 * nodes * gpn, rng)
        config = ZeppelinConfig(remap=rng.random() < 0.8, routing=rng.random() < 0.8,
                                capacity_factor=rng.choice([1.0, 2.0]))
        for name in ("zeppelin", "hybrid-dp", "static-cp", "static-cp-best", "hydraulis"):
            outcomes = []
            for backend in native.BACKENDS:
                monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
                try:
                    p = make_plan(name, lengths, cost, config)
                    outcomes.append((p.tasks, p.linear, p.capacity, p.candidate, p.estimates))
                except CapacityError as exc:  # e.g. hydraulis: no power-of-two CP size fits
                    outcomes.append(("CapacityError", str(exc)))
            assert outcomes[0] == outcomes[1], (name, nodes, gpn)
            cases += 1
    assert cases == 30


def test_backends_refuse_a_configured_capacity_alike(monkeypatch):
    cost = make_cost(nodes=2, gpus_per_node=4)
    config = ZeppelinConfig(capacity_tokens_per_gpu=1500, overlong="drop")
    errors = []
    for backend in native.BACKENDS:
        monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
        with pytest.raises(CapacityError) as caught:
            make_plan("zeppelin", [1400] * 8 + [1000] * 3, cost, config)
        errors.append(type(caught.value))
    assert errors[0] is errors[1]


def test_switch_point_follows_the_environment(monkeypatch):
    monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", "python")
    assert native.backend_name() == "python" and native.cpp_module(None) is None
    monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", "cpp")
    assert native.backend_name() == "cpp"
    monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", "fast")
    with pytest.raises(ValueError, match="ZEPPELIN_PLANNER_BACKEND='fast' is invalid"):
        native.backend_name()
    monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", "cpp")
    monkeypatch.setattr(native, "load_cpp", lambda: None)
    with pytest.raises(ImportError, match="pip install -e"):
        native.backend_name()


def test_one_overlong_policy_equal_pieces_counted():
    assert piece_bounds(10, 4) == [(0, 3), (3, 6), (6, 10)]
    tally = OverlongTally()
    assert tally.admit(0, 5, 8, "error") == [(0, 5)]
    assert tally.admit(1, 9, 4, "split") == [(0, 3), (3, 6), (6, 9)]
    assert tally.admit(2, 9, 4, "drop") == []
    with pytest.raises(ValueError, match="document 3 has 9 tokens, more than --seq-length "
                       r"allows \(4 tokens\); raise it, or set --zeppelin-overlong"):
        tally.admit(3, 9, 4, "error", what="document", why="--seq-length",
                    setting="--zeppelin-overlong")
    report = tally.report("split")
    assert (report.documents, report.split_sequences, report.split_pieces,
            report.dropped_sequences, report.dropped_tokens) == (4, 1, 3, 1, 9)


def test_every_variant_of_the_sweep_is_a_registered_strategy_object():
    for variant in VARIANTS.values():
        assert isinstance(variant.strategy, Strategy)
        assert variant.strategy.name in STRATEGIES


def test_flexsp_group_sizes_are_any_size_up_to_the_heads_inside_a_node_or_whole_nodes():
    from megatron_zeppelin.planner.flexsp import group_sizes, place_groups

    assert group_sizes(128, 20, 8) == [1, 2, 3, 4, 5, 6, 7, 8, 16]  # 13B at TP 2: 20 heads
    assert group_sizes(4, 32, 2) == [1, 2, 4]
    placed = place_groups({16: 1, 8: 1, 3: 2, 2: 1, 1: 4}, 8, 32)
    assert placed[16] == [tuple(range(16))] and placed[8] == [tuple(range(16, 24))]
    assert placed[3] == [(24, 25, 26), (27, 28, 29)] and placed[2] == [(30, 31)]
    assert sorted(r for rings in placed.values() for ring in rings for r in ring) == \
        list(range(32))
    spanning = place_groups({3: 2, 2: 1}, 4, 8)  # 3 + 3 + 2 on nodes of 4: the 2 spans
    assert spanning[3] == [(0, 1, 2), (4, 5, 6)] and spanning[2] == [(3, 7)]


def test_flexsp_refuses_an_unplaceable_batch_with_a_capacity_error():
    from megatron_zeppelin.planner.common import CapacityError

    cost = make_cost("llama-13b", nodes=8, tp=2)  # 32 ranks, 20 heads: groups of <= 20
    config = ZeppelinConfig(capacity_tokens_per_gpu=1000)
    with pytest.raises(CapacityError, match=r"flexsp: no Ulysses group size \[1, .*20\] "
                                            r"holds the sequences of 30000-30000 tokens"):
        make_plan("flexsp", [30000, 100], cost, config)


def test_the_solvers_c_output_goes_to_stderr(capfd):
    from megatron_zeppelin.planner.flexsp import solver_output_to_stderr

    print("before", flush=True)
    with solver_output_to_stderr():
        os.write(1, b"solver log\n")
    print("after", flush=True)
    out, err = capfd.readouterr()
    assert out == "before\nafter\n" and err == "solver log\n"


@pytest.mark.parametrize("model, workload, seed", [("llama-7b-swa", "prolong64k", 0),
                                                   ("llama-7b", "github", 1)])
def test_the_portfolio_holds_hybrid_dp_at_every_cap_its_users_sweep(model, workload, seed,
                                                                    monkeypatch):
    """Zeppelin's candidates include hybrid DP at each cap of ``baselines.swept_caps`` within
    the capacity (the tuned peer's sweep), estimated as that peer's plan, each placement once
    (a cap placing the batch as an earlier cap does is not built again); both planner backends
    give the same plans and estimates bit for bit."""
    from megatron_zeppelin.planner.baselines import swept_caps

    cost = make_cost(model=model, nodes=2)
    lengths = sample_batch(workload, 1 << 20, random.Random(seed))
    plans = []
    for backend in native.BACKENDS:
        monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", backend)
        plans.append(make_plan("zeppelin", lengths, cost, ZeppelinConfig()))
    assert [(p.tasks, p.linear, p.candidate, p.estimates) for p in plans[:1]] == \
        [(p.tasks, p.linear, p.candidate, p.estimates) for p in plans[1:]]
    from megatron_zeppelin.planner import portfolio
    from megatron_zeppelin.planner.common import prepare

    estimates, capacity = dict(plans[0].estimates), plans[0].capacity
    batch = prepare(lengths, cost.cluster.topology(cost.tp), ZeppelinConfig())
    hybrid = {c.name: tuple(c.tasks) for c in portfolio.candidates(batch, cost, ZeppelinConfig())
              if c.name.startswith("hybrid-dp")}
    assert set(hybrid) == {n for n in estimates if n.startswith("hybrid-dp")}
    assert len(set(hybrid.values())) == len(hybrid)  # each placement once
    caps = [cap for cap in swept_caps(max(lengths), cost.cluster.world_size)
            if cap <= capacity]
    assert len(caps) >= 3
    for cap in caps:
        peer = make_plan("hybrid-dp", lengths, cost, ZeppelinConfig(), max_seqlen_per_rank=cap)
        names = [n for n, tasks in hybrid.items() if tasks == tuple(peer.tasks)]
        assert len(names) == 1, (cap, sorted(hybrid))
        assert estimates[names[0]] == pytest.approx(estimate_step(peer, cost).step_s)
    assert min(estimates.values()) == plans[0].estimates[0][1]
