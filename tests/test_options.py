"""One typed config tree: the planner options reach every command line and YAML from one
declaration, errors name the flag the user typed, and ``PoolLayout`` derives every rank."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.config import ConfigError, ZeppelinConfig
from megatron_zeppelin.megatron.loop import args as train_args
from megatron_zeppelin.options import integer, settings
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.sim import cli as sim_cli

PLAN = ["plan", "--model", "llama-7b", "--cluster", "h200-8nic"]
TRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "256", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
         "--vocab-size", "256", "--device", "cpu"]


def _dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_planner_option_is_a_flag_of_every_command_with_the_declared_default():
    megatron_lm = argparse.ArgumentParser()
    train_args.add_zeppelin_args(megatron_lm)  # what the patch adds to Megatron-LM
    parsers = {"zeppelin plan": (_subparser("plan"), ""),
               "pretrain_gpt.py": (train_args.build_parser(), "zeppelin_"),
               "Megatron-LM": (megatron_lm, "zeppelin_")}
    for field in settings(ZeppelinConfig):
        for where, (parser, prefix) in parsers.items():
            if prefix and field.name == "max_seqlen":  # training: Megatron's --seq-length
                continue
            action = _dests(parser).get(prefix + field.name)
            assert action is not None, f"{where} has no flag for ZeppelinConfig.{field.name}"
            assert action.default == field.default, (where, field.name)
    simulate = _subparser("simulate")
    assert {"capacity_factor", "overlong", "balance_slack"} <= set(_dests(simulate))


def test_the_plan_command_and_training_build_the_same_config():
    plan_args = _subparser("plan").parse_args(PLAN[1:] + ["--capacity-factor", "3",
                                                          "--no-remap", "--balance-slack", "0.1"])
    train = train_args.parse_args(TRAIN + ["--zeppelin-capacity-factor", "3",
                                           "--no-zeppelin-remap", "--zeppelin-balance-slack",
                                           "0.1"])
    ours = dataclasses.replace(cli.zeppelin_config(plan_args), max_seqlen=256)
    assert ours == train_args.zeppelin_config(train)
    assert ours.capacity_factor == 3.0 and ours.remap is False and ours.balance_slack == 0.1


def test_a_validation_error_names_the_flag_of_the_command_it_came_from(capsys):
    assert cli.main(PLAN + ["--capacity-factor", "0.5"]) == 2
    assert "--capacity-factor=0.5 is invalid: expected a finite number >= 1.0" in \
        capsys.readouterr().err
    train = train_args.parse_args(TRAIN + ["--zeppelin-capacity-factor", "0.5"])
    with pytest.raises(ConfigError, match=r"^--zeppelin-capacity-factor=0.5 is invalid"):
        train_args.validate_args(train, 1, None)


def test_a_bad_flag_value_is_one_line_not_a_usage_dump(capsys):
    assert cli.main(PLAN + ["--capacity-factor", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fast' is invalid: expected a finite number" in err
    with pytest.raises(ConfigError, match="invalid integer value: 'x'"):
        train_args.parse_args(TRAIN + ["--num-layers", "x"])


def test_a_flag_given_twice_with_two_values_is_refused_but_pretrain_gpt_keeps_the_last(capsys):
    """argparse keeps the last value silently; the zeppelin commands refuse the conflict in
    one line. pretrain_gpt.py keeps Megatron-LM's last-one-wins (launch scripts append
    overrides to a shared flag list)."""
    assert cli.main(PLAN + ["--capacity-factor", "1.5", "--capacity-factor", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--capacity-factor given twice (1.5, then 2.0): expected it once" in err
    assert cli.main(["simulate", "--strategies", "zeppelin", "--strategies", "static-cp"]) == 2
    assert "--strategies given twice (['zeppelin'], then ['static-cp'])" in \
        capsys.readouterr().err
    repeated = train_args.parse_args(TRAIN + ["--lr", "0.1", "--lr", "0.2"])
    assert repeated.lr == 0.2


@pytest.mark.parametrize("flags,match", [
    (["--tensor-model-parallel-size", "0"], r"^--tensor-model-parallel-size=0 is invalid"),
    (["--micro-batch-size", "0"], r"^--micro-batch-size=0 is invalid: expected >= 1"),
    (["--lr=-1"], r"^--lr=-1.0 is invalid: expected >= 0.0"),
    (["--seq-length", "0"], r"^--seq-length=0 is invalid: expected >= 2"),
    (["--adam-beta2", "1.5"], r"^--adam-beta2=1.5 is invalid: expected a number in \[0, 1\)"),
    (["--zeppelin-gpus-per-node", "0"], r"^--zeppelin-gpus-per-node=0 is invalid"),
    (["--global-batch-size", "0"], r"^--global-batch-size=0 is invalid: expected >= 1"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     r"^--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler cannot be "
     r"used together"),
])
def test_out_of_range_training_flags_are_refused_by_name(flags, match):
    with pytest.raises(ConfigError, match=match):
        train_args.validate_args(train_args.parse_args(TRAIN + flags), 1, None)


@pytest.mark.parametrize("text,match", [
    ("lr: fast\n", r"c\.yaml: lr='fast' is invalid: expected a finite number"),
    ("num-layers: 2.5\n", r"c\.yaml: num-layers=2\.5 is invalid: expected an integer"),
    ("mock_data: yes please\n", r"c\.yaml: mock_data='yes please' is invalid: expected true"),
    ("zeppelin_overlong: trim\n", r"c\.yaml: zeppelin_overlong='trim' is invalid: expected one "
                                  r"of \['error', 'split', 'drop'\]"),
    ("- a list\n", r"c\.yaml: expected a mapping of flag names to values, got list"),
    ("yaml_cfg: other.yaml\n", r"unknown key 'yaml_cfg'"),
    ("hidden_size: 64\nhidden-size: 32\n", r"c\.yaml: keys 'hidden_size' and 'hidden-size' both "
                                          r"set --hidden-size: keep one"),
    ("lr: .inf\n", r"c\.yaml: lr=inf is invalid: expected a finite number"),
    ("lr: 1e400\n", r"c\.yaml: lr=inf is invalid: expected a finite number"),
])
def test_yaml_values_are_type_checked_naming_the_file_and_key(tmp_path, text, match):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        train_args.parse_args(["--yaml-cfg", str(cfg)])


def test_yaml_reads_exponent_floats_as_numbers(tmp_path):
    """``3e-3`` is a float in YAML 1.2 and to every user; PyYAML (YAML 1.1) reads it as a
    string, which the training flags then refused as "not a number"."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 3e-3\nmin_lr: 1E-5\nweight_decay: .5e-1\nadam_beta2: '9.5e-1'\n")
    with pytest.raises(ConfigError, match=r"adam_beta2='9.5e-1' is invalid: expected a finite "):
        train_args.parse_args(TRAIN + ["--yaml-cfg", str(cfg)])  # quoted: a string, as written
    cfg.write_text("lr: 3e-3\nmin_lr: 1E-5\nweight_decay: .5e-1\nseed: 12\n")
    args = train_args.parse_args(TRAIN + ["--yaml-cfg", str(cfg)])
    assert (args.lr, args.min_lr, args.weight_decay, args.seed) == (3e-3, 1e-5, 0.05, 12)


def test_yaml_sets_planner_options_by_their_training_flag_names(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("zeppelin_balance_slack: 0.2\nzeppelin-routing: false\n")
    args = train_args.parse_args(TRAIN + ["--yaml-cfg", str(cfg)])
    config = train_args.zeppelin_config(args)
    assert config.balance_slack == 0.2 and config.routing is False and config.max_seqlen == 256


def test_pool_layout_derives_ranks_topology_and_micro_batches():
    layout = PoolLayout(world_size=16, tp=2, cp=4, gpus_per_node=4)
    assert (layout.dp, layout.nodes, layout.ranks_per_node) == (2, 2, 2)
    assert layout.topology.world_size == layout.cp
    assert layout.pool_ranks(1, 1) == [9, 11, 13, 15]
    every = sorted(r for _, _, ranks in layout.pools() for r in ranks)
    assert every == list(range(16))
    for replica, tp_rank, ranks in layout.pools():
        for position, rank in enumerate(ranks):
            assert layout.position(rank) == (replica, position, tp_rank)
    assert layout.micro_batches(global_batch_size=8, micro_batch_size=2) == 2
    with pytest.raises(ConfigError, match="must be a multiple of --micro-batch-size x "
                                          "data-parallel size = 2 x 2"):
        layout.micro_batches(global_batch_size=6, micro_batch_size=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=8, tp=3, cp=1, gpus_per_node=3), "--tensor-model-parallel-size=3"),
    (dict(world_size=8, tp=1, cp=3, gpus_per_node=1), "--context-parallel-size=3"),
    (dict(world_size=8, tp=1, cp=2, gpus_per_node=4), r"CP x TP = 2 GPUs must be whole nodes"),
    (dict(world_size=8, tp=2, cp=2, gpus_per_node=3), r"a multiple of TP=2"),
    (dict(world_size=8, tp=1, cp=0, gpus_per_node=1), r"--context-parallel-size=0 is invalid"),
])
def test_pool_layout_refuses_what_does_not_tile_the_world(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PoolLayout(**kwargs)


def test_gpus_per_node_defaults_to_torchruns_local_world_size():
    assert PoolLayout.resolve(16, 1, 16, None, local_world_size=8).gpus_per_node == 8
    assert PoolLayout.resolve(16, 1, 4, None, local_world_size=8).gpus_per_node == 4
    assert PoolLayout.resolve(4, 1, 4, None, local_world_size=None).gpus_per_node == 4


# the integer flags of `zeppelin plan` / `zeppelin simulate` that take any integer or 0
ANY_INTEGER = {"--seed"}
ZERO_ALLOWED = {"--max-megatron-sequences"}  # 0: skip megatron-hybrid-cp at every batch size


def _integer_flags(command: str) -> list[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a.option_strings[0] for a in sub.choices[command]._actions if a.option_strings
            and (a.type in (int, integer) or getattr(a.type, "__name__", "").startswith("int_at_least"))]


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_every_integer_flag_refuses_zero_and_negatives_in_one_line(command, capsys):
    """An integer flag at 0 or below is one line naming it, exit status 2 (``--tp 0`` was a
    ZeroDivisionError traceback); every strategy is asked for, so each strategy option is
    read."""
    from megatron_zeppelin.planner.registry import STRATEGIES

    flags = _integer_flags(command)
    assert {"--tp", "--nodes", "--seed"} <= set(flags) and len(flags) >= 7
    chosen = ["--strategy", *STRATEGIES] if command == "plan" else []
    for flag in sorted(set(flags) - ANY_INTEGER):
        for value in ["-1"] if flag in ZERO_ALLOWED else ["0", "-1"]:
            code = cli.main([command, "--model", "gpt-tiny", "--cluster", "cpu-2x2", *chosen,
                             flag, value])
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, (flag, value, err)
            assert flag in err and f"{value} is invalid" in err, err


@pytest.mark.parametrize("flag,dest", [
    ("--override-opt_param-scheduler", "override_opt_param_scheduler"),
    ("--override-opt-param-scheduler", "override_opt_param_scheduler"),
    ("--use-checkpoint-opt_param-scheduler", "use_checkpoint_opt_param_scheduler"),
    ("--use-checkpoint-opt-param-scheduler", "use_checkpoint_opt_param_scheduler"),
])
def test_megatrons_scheduler_flags_take_both_of_megatrons_spellings(flag, dest):
    args = train_args.parse_args(TRAIN + [flag, "--load", "/nonexistent/checkpoints"])
    train_args.validate_args(args, 1, None)  # with --load only: it says how to resume
    assert getattr(args, dest) is True
    assert not getattr(train_args.parse_args(TRAIN), dest)


def test_numpy_integers_are_taken_as_ints_where_an_integer_belongs():
    """A config built from numpy values (lengths, capacities from arrays): its integers are
    Python ints (YAML, JSON and the C++ twin take them); a numpy float or bool for an integer
    is still refused by name."""
    import numpy as np

    from megatron_zeppelin.config import ConfigError, ModelSpec, PipelineSpec, ZeppelinConfig
    from megatron_zeppelin.planner import get_strategy

    config = ZeppelinConfig(capacity_tokens_per_gpu=np.int64(4096), max_seqlen=np.int32(8192))
    assert (config.capacity_tokens_per_gpu, config.max_seqlen) == (4096, 8192)
    assert {type(config.capacity_tokens_per_gpu), type(config.max_seqlen)} == {int}
    model = ModelSpec(name="m", num_layers=np.int16(2), hidden_size=np.uint32(64),
                      num_attention_heads=4, window_size=np.int64(128))
    assert {type(model.num_layers), type(model.hidden_size), type(model.window_size)} == {int}
    assert type(PipelineSpec(pp=np.int64(2)).pp) is int
    assert type(get_strategy("hybrid-dp", max_seqlen_per_rank=np.int64(512))
                .max_seqlen_per_rank) is int
    for bad in (np.float64(4096.0), np.True_):
        with pytest.raises(ConfigError, match=r"zeppelin.capacity_tokens_per_gpu=.* is invalid: "
                                              r"expected a positive integer"):
            ZeppelinConfig(capacity_tokens_per_gpu=bad)
