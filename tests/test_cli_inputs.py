"""Bad input to the ``zeppelin`` command line and the planner's configs: one line on stderr
naming the flag, key or file and the value, exit status 2, no traceback (found by fuzzing)."""
import dataclasses

from pathlib import Path

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.config import ConfigError, ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.planner import get_strategy, make_plan

from conftest import make_cost

PLAN = ["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2"]


@pytest.mark.parametrize("argv,message", [
    (PLAN + ["--strategy", "zeppelin", "--pp", "2", "--plot", "{tmp}/p.png"],
     "--plot: only without --pp"),
    (PLAN + ["--strategy", "zeppelin", "zeppelin"],
     "--strategy lists zeppelin more than once"),
    (["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "4", "--strategy",
      "static-cp", "--cp-nodes", "3"], "--cp-nodes=3 is invalid: expected a divisor of the "
                                       "pool's 4 node(s)"),
    (PLAN + ["--strategy", "static-cp", "--cp-nodes", "1", "--cp-size", "8"],
     "--cp-nodes=1 is invalid: expected unset when the CP size is given too (8)"),
    (PLAN + ["--strategy", "zeppelin", "--capacity-factor", "inf"],
     "argument --capacity-factor: 'inf' is invalid: expected a finite number"),
    (["simulate", "--cluster", "cpu-2x2"], "--model: required"),
    (["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2", "2"],
     "--nodes lists 2 more than once"),
    (["calibrate", "--output", "{tmp}/afile/x.yaml"], "afile' is a file, not a folder"),
    (PLAN + ["--capacity-tokens-per-gpu", "200000", "--capacity-factor", "3"],
     "--capacity-factor=3.0 is invalid: expected given only without --capacity-tokens-per-gpu"),
    (PLAN + ["--capacity-tokens-per-gpu", "10"],
     "more than the pool limit (16 ranks x --capacity-tokens-per-gpu 10) allows"),
    (PLAN + ["--strategy", "static-cp", "hybrid-dp", "--balance-slack", "0.2"],
     "--balance-slack=0.2 is ignored by --strategy static-cp hybrid-dp: only zeppelin reads"),
    (PLAN + ["--strategy", "static-cp", "--no-routing"],
     "--routing=False is ignored by --strategy static-cp"),
    (PLAN + ["--lengths", "{tmp}/fullwidth"], "fullwidth:2: '２００' is not an integer length"),
    (PLAN + ["--lengths", "{tmp}/underscore"], "underscore:1: '1_000' is not an integer length"),
    (["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2", "--lengths",
      "{tmp}/huge"], "huge: document 1 has 1,000,000,000,000 tokens; 2 x h200-8nic"),
    (PLAN + ["--nodes", "x"], "argument --nodes: 'x' is invalid: expected an integer >= 1"),
    (PLAN + ["--tp", "１"], "argument --tp: '１' is invalid: expected an integer >= 1"),
    (["calibrate", "--backend", "native", "--output", "{tmp}/c.yaml"],
     "--backend='native' is invalid here: needs fp16/bf16 tensors"),
    # an empty name or path was read as "not given": a sampled batch, the cluster's profile,
    # square GEMMs
    (PLAN + ["--lengths", ""], "argument --lengths: '' is invalid: expected a non-empty value"),
    (PLAN + ["--hardware", " "], "argument --hardware: ' ' is invalid: expected a non-empty"),
    (["calibrate", "--model", "", "--output", "{tmp}/c.yaml"],
     "argument --model: '' is invalid: expected a non-empty value"),
    (PLAN + ["--strategy", "static-cp", "--plot", "{tmp}/dangling.png"],
     "nodir' does not exist"),  # a link is judged by where it leads, before any planning
    # refused before the progress bar starts (it used to end the bar's line after a while)
    (["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--tp", "3"],
     "--tp=3 is invalid: expected a positive divisor of gpus_per_node=8"),
    (["simulate", "--model", "llama-7b", "--cluster", "h200-8nic", "--strategies", "zeppelin"],
     "--baseline 'static-cp' (what the others are compared with; default static-cp) is not "
     "among --strategies ['zeppelin']"),
])
def test_bad_command_lines_are_one_line_naming_the_flag(argv, message, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "fullwidth").write_text("100\n２００\n")
    (tmp_path / "underscore").write_text("1_000\n")
    (tmp_path / "huge").write_text("1000\n1000000000000\n")
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nodir" / "y.png")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("zeppelin")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_planner_configs_refuse_what_megatron_refuses():
    """MoE top-k above the experts, TP not dividing the KV heads, a TP of 0: a ValueError
    naming the value, never a silent price or a ZeroDivisionError."""
    cost = make_cost()
    model = cost.model
    with pytest.raises(ConfigError, match=r"model.moe_router_topk=16 is invalid: expected at "
                                          r"most num_experts=8"):
        dataclasses.replace(model, num_experts=8, moe_router_topk=16)
    gqa = dataclasses.replace(model, num_query_groups=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 must divide the "
                                         r"model's 2 key/value heads"):
        CostModel(gqa, cost.cluster, cost.hardware, 4)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=0 is invalid"):
        CostModel(model, cost.cluster, cost.hardware, 0)
    with pytest.raises(ConfigError, match=r"static-cp.cp_nodes=1 is invalid: expected unset"):
        get_strategy("static-cp", cp_size=8, cp_nodes=1)


@pytest.mark.parametrize("seqlens,cost,config,match", [
    (None, "cost", "config", r"seqlens=None is invalid: expected a sequence of positive"),
    ("abc", "cost", "config", r"seqlens='abc' is invalid"),
    ([100], None, "config", r"cost=None is invalid: expected a CostModel"),
    ([100], "cost", None, r"config=None is invalid: expected a ZeppelinConfig"),
])
def test_the_planner_api_names_a_bad_argument(seqlens, cost, config, match):
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.planner import make_plan

    real = {"cost": make_cost(), "config": ZeppelinConfig()}
    with pytest.raises(ValueError, match=match):
        make_plan("zeppelin", seqlens, real.get(cost, cost), real.get(config, config))


def test_config_fields_are_type_checked():
    """A string where a bool belongs (truthy: it switched routing on), a bool as a number or a
    window: refused naming the field."""
    from megatron_zeppelin.config import ZeppelinConfig

    for fields, match in (({"routing": "no"}, r"zeppelin.routing='no' is invalid: expected "
                                               r"true or false"),
                          ({"balance_slack": True}, r"zeppelin.balance_slack=True is invalid")):
        with pytest.raises(ConfigError, match=match):
            ZeppelinConfig(**fields)
    with pytest.raises(ConfigError, match=r"model.window_size=True is invalid"):
        dataclasses.replace(make_cost().model, window_size=True)
    with pytest.raises(ConfigError, match=r"model.bytes_per_element=3 is invalid: expected 1 "
                                          r"\(fp8\), 2 \(bf16/fp16\) or 4"):
        dataclasses.replace(make_cost().model, bytes_per_element=3)
    cluster = make_cost().cluster
    with pytest.raises(ConfigError, match=rf"cluster.nics_per_node={cluster.gpus_per_node + 1} "
                                          rf"is invalid: expected at most gpus_per_node="):
        dataclasses.replace(cluster, nics_per_node=cluster.gpus_per_node + 1, gpu_to_nic=None)


def test_the_report_header_counts_what_the_overlong_policy_did(tmp_path, capsys):
    lengths = tmp_path / "lengths"
    lengths.write_text("1000\n9000000\n")
    for policy, said in (("drop", "; --overlong drop left out 1 of them (9000000 tokens)"),
                         ("split", "; --overlong split cut 1 of them into 90 pieces")):
        assert cli.main(PLAN + ["--lengths", str(lengths), "--max-seqlen", "100000",
                                "--overlong", policy, "--strategy", "static-cp"]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert header.endswith("2 documents, 9001000 tokens, longest 9000000" + said), header


def test_the_planner_api_refuses_a_document_no_pool_can_hold():
    cost = make_cost()
    with pytest.raises(ConfigError, match=r"seqlens: document 1 has [0-9,]+ tokens; .* holds at "
                                          r"most"):
        make_plan("zeppelin", [100, 10 ** 15], cost)


@pytest.mark.parametrize("strategy,options,match", [
    ("hybrid-dp", {"max_seqlen_per_rank": 10 ** 30}, r"hybrid-dp.max_seqlen_per_rank=1000+ is "
                                                      r"invalid: expected an integer <= 2147483647"),
    ("static-cp-best", {"max_cp_size": 10 ** 30}, r"static-cp-best.max_cp_size=1000+ is invalid"),
    ("flexsp", {"node_limit": 10 ** 30}, r"flexsp.node_limit=1000+ is invalid"),
    ("zeppelin", {"portfolio": "yes"}, r"zeppelin.portfolio='yes' is invalid: expected true or "
                                       r"false"),
    ("static-cp", {"cp_size": True}, r"static-cp.cp_size=True is invalid"),
    (["zeppelin"], {}, r"strategy \['zeppelin'\] is invalid: expected a name"),
])
def test_strategy_options_of_the_planner_api_are_type_checked(strategy, options, match):
    """Values no flag parser typed: a pybind cast error, a solver TypeError or a bool taken
    as 1 before."""
    with pytest.raises(ValueError, match=match):
        make_plan(strategy, [100, 200], make_cost(), **options)


def test_capacities_beyond_the_batch_plan_as_the_whole_batch():
    """A capacity (or a factor) larger than the batch means the batch (no rank holds more);
    the C++ twin's 64-bit capacity overflowed before."""
    cost = make_cost()
    for config in (ZeppelinConfig(capacity_tokens_per_gpu=10 ** 30),
                   ZeppelinConfig(capacity_factor=1e300)):
        assert make_plan("zeppelin", [100, 200], cost, config).capacity == 300
    plan = make_plan("flexsp", [100, 150, 200], cost, buckets=10 ** 9)  # a bucket per length
    assert sorted(plan.seqlens) == [100, 150, 200]


def test_a_cluster_files_keys_are_named_as_the_file_spells_them(tmp_path, capsys):
    """Not as the --nodes flag, which the user did not give; an oversized node is blamed on
    gpus_per_node, not on the node count."""
    shipped = (Path(cli.__file__).parent.parent / "configs" / "clusters" / "h200-8nic.yaml")
    for key, value, words in (("nodes", 0, "nodes=0 is invalid: expected a positive integer"),
                              ("gpus_per_node", 10 ** 8, "gpus_per_node=100000000 is invalid: "
                                                         "expected at most 1048576 GPUs")):
        path = tmp_path / f"{key}.yaml"
        path.write_text(shipped.read_text() + f"\n{key}: {value}\n" if key == "nodes" else
                        shipped.read_text().replace("gpus_per_node: 8", f"{key}: {value}"))
        assert cli.main(["plan", "--model", "llama-7b", "--cluster", str(path),
                         "--global-batch-tokens", "256K"]) == 2
        assert capsys.readouterr().err.strip() == f"zeppelin: error: {path}: {words}"


def test_a_static_cp_best_that_cannot_place_the_batch_names_the_flags_to_change(capsys):
    """2M tokens over 800,000 GPUs: 27 tokens per rank hold no CP size's share of the longest
    document; the line names the capacity and CP-size flags, not only the strategy."""
    assert cli.main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes",
                     "100000", "--strategy", "static-cp-best"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zeppelin: error: static-cp-best: no CP size up to 64 holds the "
                          "longest document (") and err.endswith(
        "within --capacity-tokens-per-gpu=27: raise it or --max-cp-size (or give each GPU "
        "more tokens per batch)"), err


@pytest.mark.parametrize("value", [None, 3, ""])
def test_a_config_name_that_is_not_a_string_or_path_is_refused_naming_it(value):
    from megatron_zeppelin.config import load_model

    with pytest.raises(ConfigError, match=rf"^models config {value!r} is invalid: expected a "
                                          r"shipped name \(\["):
        load_model(value)


def test_yaml_keys_must_be_scalars_merge_keys_merge_and_unknown_keys_of_any_type_are_named(
        tmp_path, capsys):
    shipped = (Path(cli.__file__).parent.parent / "configs" / "clusters" / "h200-8nic.yaml")
    cases = {"listkey": ("? [a, b]\n: 3\n", "a key must be a scalar, got ['a', 'b']"),
             "mixed": ("1: 2\nfoo: 3\n", "unknown key(s) [1, 'foo']"),
             "gpu_to_nic": ("gpu_to_nic: [true, false, false, false, false, false, false, "
                            "false]\n", "gpu_to_nic=[True, False"),
             "hardware": ("hardware: {tmp}\n", "hardware={tmp} is invalid: expected a hardware "
                          "profile YAML file or a shipped name, not a folder")}
    for name, (extra, words) in cases.items():
        text = shipped.read_text()
        if name in ("gpu_to_nic", "hardware"):
            text = "\n".join(line for line in text.splitlines()
                             if not line.startswith(f"{name}:"))
        path = tmp_path / f"{name}.yaml"
        path.write_text(text + "\n" + extra.replace("{tmp}", str(tmp_path)))
        assert cli.main(PLAN[:3] + ["--cluster", str(path), "--global-batch-tokens", "256K"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words.replace("{tmp}", str(tmp_path)) in err, err
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b {nodes: 3, nics_per_node: 8}\n" + "\n".join(
        line for line in shipped.read_text().splitlines()
        if not line.startswith(("nodes:", "nics_per_node:"))) +
        "\n<<: *b\nnics_per_node: 4\n")
    from megatron_zeppelin.config_yaml import read_yaml

    data = read_yaml(merged)  # YAML 1.1's merge: the mapping's own keys override the merged
    assert data["nodes"] == 3 and data["nics_per_node"] == 4


def test_sim_profile_tables_are_checked_as_the_hardware_profiles_are(tmp_path, capsys):
    from megatron_zeppelin.sim.profile import load_sim_profile

    shipped = (Path(cli.__file__).parent.parent / "configs" / "sim" / "cpu-2x2.yaml").read_text()
    for old, new, words in (
            ("attention_tflops:", "attention_tflops:\n  7: [1, 2]",
             "attention_tflops={7: [1, 2]}"),
            ("attention_tflops:", "attention_tflops:\n  abc: 0.5", "{'abc': 0.5}"),
            ("attention_tflops:", "attention_tflops:\n  9: fast", "{9: 'fast'}"),
            ("measured_hidden:", "measured_hidden: -64\nx_measured_hidden:",
             "unknown key(s) ['x_measured_hidden']")):
        path = tmp_path / "sim.yaml"
        path.write_text(shipped.replace(old, new, 1))
        with pytest.raises(ConfigError, match=None) as info:
            load_sim_profile(str(path))
        assert str(path) in str(info.value) and words in str(info.value), info.value


def test_the_config_dataclasses_check_types_and_finiteness_from_the_api_too(monkeypatch):
    from megatron_zeppelin.config import ClusterSpec, ModelSpec, load_cluster, load_hardware

    model = dict(name="x", num_layers=2, hidden_size=64, num_attention_heads=4)
    for bad, match in ((dict(swiglu="no"), "model.swiglu='no' is invalid: expected true or "
                                           "false"),
                       (dict(name=3), "model.name=3 is invalid"),
                       (dict(moe_router_topk=2), "model.moe_router_topk=2 is invalid: expected "
                                                 "unset \\(1\\) without num_experts")):
        with pytest.raises(ConfigError, match=match):
            ModelSpec(**{**model, **bad})
    cluster = dataclasses.asdict(load_cluster("h200-8nic"))
    for key in ("nvlink_gbyte_per_s", "nvlink_latency_us", "gpu_memory_gib"):
        with pytest.raises(ConfigError, match=rf"cluster.{key}=inf is invalid: expected a "
                                              "finite"):
            ClusterSpec(**{**cluster, key: float("inf")})
    hardware = load_hardware("h200")
    for key, value, match in (("gemm_tflops", float("inf"), "a finite positive number"),
                              ("shared_by", "2", "a finite number >= 1")):
        with pytest.raises(ConfigError, match=rf"hardware.{key}=.* is invalid: expected {match}"):
            dataclasses.replace(hardware, **{key: value})
    with pytest.raises(ValueError, match=r"^model=None is invalid: expected a ModelSpec"):
        CostModel(None, load_cluster("h200-8nic"), hardware)
    monkeypatch.setenv("ZEPPELIN_CONFIGS", "/nonexistent/configs")
    with pytest.raises(ConfigError, match=r"^ZEPPELIN_CONFIGS='/nonexistent/configs' is "
                                          "invalid: expected a folder"):
        load_cluster("h200-8nic")
