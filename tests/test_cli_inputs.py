"""Bad input to the ``zeppelin`` command line and the planner's configs: one line on stderr
naming the flag, key or file and the value, exit status 2, no traceback (found by fuzzing)."""
import dataclasses

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.planner import get_strategy

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
])
def test_bad_command_lines_are_one_line_naming_the_flag(argv, message, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
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
