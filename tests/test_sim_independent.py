"""The simulator judges the planner's estimate independently: ``sim/`` imports nothing of
``estimate.py`` and calls no time function of ``cost_model.py`` (only its counts), and its own
profile drives what it predicts."""
import ast
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import megatron_zeppelin.sim as sim_package
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.sim.profile import load_sim_profile, profile_of
from megatron_zeppelin.sim.simulator import SimOptions, simulate
from megatron_zeppelin.sim.step_model import StepOptions, linear_seconds, step_time

from conftest import make_cost

# CostModel / CostKernel / cost_model.py time functions (the estimate's formulas)
TIME_FUNCTIONS = {"attention_time", "attention_times", "linear_time", "routed_seconds",
                  "remap_seconds_per_token", "ring_step_comm_time", "task_time", "task_times",
                  "crossover_chunk", "kernel", "pipelined_seconds", "pipeline_time",
                  "routed_message_seconds", "RoutedLoad", "CostKernel", "FWD_BWD_LINEAR",
                  "ulysses_compute", "ulysses_comm", "attention_flops_per_s", "window_parts",
                  "ring_exposed"}


def sim_sources() -> dict[str, ast.Module]:
    folder = Path(sim_package.__file__).parent
    return {p.name: ast.parse(p.read_text()) for p in sorted(folder.glob("*.py"))}


def test_sim_imports_nothing_of_the_estimate_nor_cost_model_time_functions():
    for name, tree in sim_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert "estimate" not in node.module, (name, node.module)
                if node.module.endswith(("cost_model", "routed_cost")):
                    assert not {a.name for a in node.names} & TIME_FUNCTIONS, name
            if isinstance(node, ast.Import):
                assert not any("estimate" in a.name for a in node.names), name
            if isinstance(node, ast.Attribute):
                assert node.attr not in TIME_FUNCTIONS - {"kernel"} or \
                    not isinstance(node.value, ast.Name) or node.value.id != "cost", \
                    (name, node.attr)
                if node.attr == "kernel":  # cost.kernel.* is the estimate's formulas
                    assert not (isinstance(node.value, ast.Name) and node.value.id == "cost"), \
                        name


def test_the_profile_not_the_planners_hardware_drives_the_simulation():
    cost = make_cost(nodes=2)
    lengths = [30000, 9000, 4000] + [500] * 40
    plan = make_plan("zeppelin", lengths, cost)
    profile = profile_of(cost)
    base = simulate(plan, cost, SimOptions(inter_mode="routed"), profile=profile)
    # the planner's profile 2x faster at attention: the simulation does not move
    faster = replace(cost.hardware, attention_tflops=tuple(
        (n, 2 * t) for n, t in cost.hardware.attention_tflops))
    other = replace(cost, hardware=faster)
    assert simulate(plan, other, SimOptions(inter_mode="routed"), profile=profile).iteration_s \
        == pytest.approx(base.iteration_s, rel=1e-12)
    # the simulator's profile 2x slower at attention: the simulation does
    slow = replace(profile, attention_tflops=tuple((n, t / 2) for n, t in
                                                   profile.attention_tflops))
    assert simulate(plan, cost, SimOptions(inter_mode="routed"), profile=slow).attention_s > \
        1.5 * base.attention_s


def test_host_work_per_ring_step_and_the_backward_ratio_by_length_count():
    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    profile = load_sim_profile("cpu-2x2")
    ring = make_plan("static-cp", [4096, 2048], cost, cp_size=4)
    local = make_plan("static-cp", [4096, 2048], cost, cp_size=1)
    no_host = replace(profile, ring_step_us=0.0)
    gap = step_time([ring], cost, profile).seconds - step_time([ring], cost, no_host).seconds
    assert gap >= 2 * 4 * profile.ring_step_us * 1e-6 * cost.model.num_layers * 0.99
    assert step_time([local], cost, profile).seconds == \
        pytest.approx(step_time([local], cost, no_host).seconds)
    flat = replace(profile, attention_bwd_ratio=((1, 1.0),))
    assert step_time([local], cost, flat).seconds < step_time([local], cost, profile).seconds


def test_optimizer_grad_sync_and_micro_batches_add_up():
    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    profile = load_sim_profile("cpu-2x2")
    lengths = [max(16, int(random.Random(i).lognormvariate(6, 1.5))) for i in range(40)]
    plans = [make_plan("zeppelin", lengths, cost), make_plan("hybrid-dp", lengths, cost)]
    step = step_time(plans, cost, profile)
    assert step.seconds == pytest.approx(sum(m.seconds for m in step.micro_batches)
                                         + step.grad_sync_s + step.optimizer_s)
    assert step.grad_sync_s > 0 and step.optimizer_s > 0
    overlapped = step_time(plans, cost, profile, StepOptions(overlap_grad_reduce=True))
    assert overlapped.grad_sync_s <= step.grad_sync_s
    assert np.all(np.diff(linear_seconds(np.asarray([0.0, 10.0, 1000.0]), cost, profile)) > 0)


def test_a_bad_profile_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    text = Path(sim_package.__file__).parents[2].joinpath("configs/sim/h200-8nic.yaml").read_text()
    path.write_text(text.replace("gemm_tflops: 780.0", "gemm_tflops: -1"))
    with pytest.raises(ConfigError, match="gemm_tflops"):
        load_sim_profile(path)
    with pytest.raises(ConfigError, match="unknown sim config"):
        load_sim_profile("no-such-cluster")


def test_per_batch_wins_ties_losses_geomean_and_median():
    from megatron_zeppelin.sim import report
    from megatron_zeppelin.sim.sweep import Setting, SettingResult, VariantResult

    def variant(label, batch_s):
        return VariantResult(label, sum(batch_s) / len(batch_s), 1.0, 0.0, None,
                             batch_s=tuple(batch_s))

    setting = Setting("llama-7b", "h200-8nic", 2, "github")
    results = [SettingResult(setting, 16, 10, 1e6, 1.0, (
        variant("zeppelin", [1.0, 2.0, 1.0]), variant("static-cp", [2.0, 1.0, 1.005])), ()),
        SettingResult(setting, 16, 10, 1e6, 1.0, (
            variant("zeppelin", [1.0]), variant("static-cp", [4.0])), ())]
    assert report.batch_speedups(results, "static-cp") == pytest.approx([2.0, 0.5, 1.005, 4.0])
    assert report.win_loss(results, "static-cp") == (2, 1, 1)
    table = report.format_win_loss(results)
    assert "2 / 1 / 1" in table and "1.42x" in table  # geomean of 2, 0.5, 1.005, 4
    assert "1.50x" in table  # median of the four



def test_host_work_per_token_adds_to_every_ranks_linear_time(tmp_path):
    cost = make_cost(model="gpt-tiny", cluster="cpu-2x2", nodes=2)
    base = replace(load_sim_profile("cpu-2x2"), token_host_ns=0.0)
    hosted = replace(base, token_host_ns=1000.0)
    tokens = np.asarray([100.0, 3000.0])
    assert (linear_seconds(tokens, cost, hosted) - linear_seconds(tokens, cost, base)) == \
        pytest.approx(tokens * 1e-6)
    hosted.to_yaml(tmp_path / "p.yaml", "test")
    assert load_sim_profile(tmp_path / "p.yaml").token_host_ns == 1000.0
    (tmp_path / "bad.yaml").write_text((tmp_path / "p.yaml").read_text().replace(
        "token_host_ns: 1000.0", "token_host_ns: -1"))
    with pytest.raises(ConfigError, match="token_host_ns"):
        load_sim_profile(tmp_path / "bad.yaml")
