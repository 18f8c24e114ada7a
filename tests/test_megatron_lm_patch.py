"""The Megatron-LM patch, its apply script and the glue's checks (``megatron/lm/glue.py``).

Tests that need a Megatron-LM checkout (tag core_v0.16.1, core_v0.17.1, core_v0.18.2 or
core_v0.19.0) read MEGATRON_LM_PATH (through ``megatron_zeppelin.env``) and are skipped without
it; the checkout itself is never modified.
"""
from __future__ import annotations

import argparse
import py_compile
import re
import subprocess
from pathlib import Path

import pytest

from megatron_zeppelin import env
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.loop import args as train_args
from megatron_zeppelin.megatron.lm import glue as lm
from megatron_zeppelin.megatron.common import compat
from megatron_zeppelin.megatron.common.compat import (MEGATRON_CORE_BELOW, MEGATRON_CORE_MIN,
                                               check_cpu_bridge, check_megatron_core,
                                               megatron_core_version, parse_version)
from megatron_zeppelin.megatron.lm.features import RULES, refusals

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "apply_megatron_patch.sh"
PATCHED = ("pretrain_gpt.py", "gpt_builders.py", "megatron/training/arguments.py",
           "megatron/training/yaml_arguments.py", "megatron/training/training.py")
needs_megatron_lm = pytest.mark.skipif(env.megatron_lm_path() is None,
                                       reason="MEGATRON_LM_PATH is not set")


def megatron_lm_args(**overrides) -> argparse.Namespace:
    """Megatron-LM's parsed args as the glue reads them: Megatron's defaults for the fields
    the rules read, plus the zeppelin flags' defaults."""
    parser = argparse.ArgumentParser()
    train_args.add_zeppelin_args(parser)
    base = {rule.name: rule.default for rule in RULES}
    base.update(vars(parser.parse_args([])))
    base.update(context_parallel_mode="zeppelin", context_parallel_size=16, world_size=64,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                calculate_per_token_loss=True, attention_dropout=0.0, rank=0)
    return argparse.Namespace(**{**base, **overrides})


def test_zeppelin_mode_keeps_megatron_cp_and_takes_gpus_per_node_from_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = megatron_lm_args()
    lm.check_megatron_lm_args(args)
    assert args.context_parallel_size == 16 and args.zeppelin_gpus_per_node == 8
    assert lm.pool_layout(args).nodes == 4 and lm.pool_layout(args).dp == 2
    assert all(isinstance(v, (int, float, str, bool, list, tuple, type(None)))
               for v in vars(args).values())  # Megatron pickles args into checkpoints


def test_gpus_per_node_without_torchrun_is_one_pool(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = megatron_lm_args(context_parallel_size=4, world_size=8)
    lm.check_megatron_lm_args(args)
    assert args.zeppelin_gpus_per_node == 8  # CP x TP: no device count, no division by zero


def test_explicit_gpus_per_node_must_tile_the_pool(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"CP x TP = 8 GPUs must be whole nodes of "
                                          r"--zeppelin-gpus-per-node=16"):
        lm.check_megatron_lm_args(megatron_lm_args(context_parallel_size=4,
                                                   zeppelin_gpus_per_node=16))


def trigger(rule) -> dict:
    """Settings under which ``rule`` refuses."""
    values = {"overlap_p2p_comm": False, "calculate_per_token_loss": False,
              "attention_dropout": 0.1, "position_embedding_type": "mrope",
              "cp_comm_type": ["a2a"], "softmax_type": "off-by-one",
              "transformer_impl": "inference_optimized", "attention_backend": "flash",
              "fp8": "hybrid", "fp4": "e2m1", "cuda_graph_impl": "local",
              "moe_token_dispatcher_type": "allgather",
              "moe_router_load_balancing_type": "seq_aux_loss",
              "zeppelin_overlong": "split", "zeppelin_planner_process": False,
              "hierarchical_context_parallel_sizes": [2, 8], "window_size": (128, 4),
              "experimental_attention_variant": "dsa", "data_parallel_sharding_strategy":
              "no_shard", "tensor_model_parallel_size": 2}
    extra = {"moe_token_dispatcher_type": {"expert_model_parallel_size": 2},
             "moe_router_load_balancing_type": {"micro_batch_size": 2},
             "data_parallel_sharding_strategy": {"use_megatron_fsdp": True,
                                                 "use_distributed_optimizer": True},
             "tensor_model_parallel_size": {"use_megatron_fsdp": True,
                                            "use_distributed_optimizer": True,
                                            "data_parallel_sharding_strategy": "optim_grads",
                                            "transformer_impl": "local"},
             "overlap_grad_reduce": {"use_megatron_fsdp": True, "use_distributed_optimizer": True,
                                     "data_parallel_sharding_strategy": "optim"},
             "save": {"use_megatron_fsdp": True, "use_distributed_optimizer": True,
                      "data_parallel_sharding_strategy": "optim_grads"},
             "overlap_p2p_comm": {"pipeline_model_parallel_size": 2,
                                  "num_layers_per_virtual_pipeline_stage": 1}}
    return {rule.name: values.get(rule.name, True), **extra.get(rule.name, {})}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.flag)
def test_every_refused_feature_is_named_with_its_alternative(rule, monkeypatch):
    if rule.fixed_in is not None:  # refused with the megatron-core versions before the fix
        monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 16, 1))
    with pytest.raises(ConfigError) as info:
        lm.check_megatron_lm_args(megatron_lm_args(**trigger(rule)))
    message = str(info.value)
    assert message.startswith(rule.given or f"{rule.flag}=") and rule.alternative in message


@pytest.mark.parametrize("rule", [r for r in RULES if r.fixed_in is not None],
                         ids=lambda r: r.flag)
def test_a_rule_fixed_in_a_version_refuses_only_before_it(rule):
    args = megatron_lm_args(**trigger(rule))
    before = (rule.fixed_in[0], rule.fixed_in[1] - 1, 9)
    assert any(m.startswith(rule.given or rule.flag) for m in refusals(args, before))
    assert any(m.startswith(rule.given or rule.flag) for m in refusals(args))  # unknown
    assert not any(m.startswith(rule.given or rule.flag) for m in refusals(args, rule.fixed_in))


def test_optim_sharding_with_overlap_is_refused_with_megatron_core_0_16_only(monkeypatch):
    """megatron-core 0.17 fixed the overlapped reduce: our script and the patch take it from
    there (exact through Megatron-LM core_v0.17.1 to core_v0.19.0:
    tests/test_megatron_lm_train.py); the glue asks the checkout's own megatron-core."""
    args = megatron_lm_args(use_megatron_fsdp=True, use_distributed_optimizer=True,
                            data_parallel_sharding_strategy="optim", overlap_grad_reduce=True)

    def refused(version):
        return [m for m in refusals(args, version) if m.startswith("--overlap-grad-reduce")]

    assert "megatron-core 0.17 fixed it" in refused((0, 16, 1))[0] and refused(None)
    assert not refused((0, 17, 1)) and not refused((0, 19, 2))
    for version, ok in (((0, 16, 1), False), ((0, 17, 1), True), ((0, 19, 1), True)):
        monkeypatch.setattr(compat, "megatron_core_version", lambda v=version: v)
        if ok:
            lm.check_megatron_lm_args(args)
        else:
            with pytest.raises(ConfigError, match="--overlap-grad-reduce with"):
                lm.check_megatron_lm_args(args)


def test_rules_on_zeppelin_flags_know_their_defaults():
    parser = argparse.ArgumentParser()
    train_args.add_zeppelin_args(parser)
    defaults = vars(parser.parse_args([]))
    ours = [rule for rule in RULES if rule.name in defaults]
    assert len(ours) >= 2 and all(rule.default == defaults[rule.name] for rule in ours)
    assert not refusals(megatron_lm_args())  # the defaults pass


@pytest.mark.parametrize("overrides,match", [
    ({"zeppelin_profile_out": "p.yaml"},
     r"--zeppelin-profile-out='p.yaml' is invalid: expected given only with"),
    ({"zeppelin_fit_interval": -1}, r"--zeppelin-fit-interval=-1 is invalid"),
    ({"zeppelin_fit_interval": 2, "zeppelin_profile_out": "/nonexistent/p.yaml"},
     r"--zeppelin-profile-out='/nonexistent/p.yaml' is invalid: expected a file in an "
     r"existing"),
    ({"zeppelin_capacity_factor": 0.0}, r"--zeppelin-capacity-factor=0.0 is invalid"),
    ({"zeppelin_cluster": "nope"}, r"^--zeppelin-cluster 'nope': unknown clusters config"),
    ({"zeppelin_hardware": "nope.yaml"}, r"^--zeppelin-hardware 'nope.yaml': hardware config "
                                         r"file 'nope.yaml' does not exist"),
    ({"zeppelin_watchdog_timeout": 400.0}, r"--zeppelin-watchdog-timeout=400 is invalid: "
                                           r"expected fewer seconds than "
                                           r"ZEPPELIN_P2P_TIMEOUT_S=300"),
])
def test_the_zeppelin_flags_are_checked_at_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        lm.check_megatron_lm_args(megatron_lm_args(seq_length=256, **overrides))
    lm.check_megatron_lm_args(megatron_lm_args(seq_length=256, zeppelin_fit_interval=2))


def test_upstream_defaults_that_zeppelin_supports_pass():
    args = megatron_lm_args(position_embedding_type="learned_absolute", num_experts=8,
                            sequence_parallel=True, reset_position_ids=True,
                            reset_attention_mask=True, eod_mask_loss=True,
                            moe_token_dispatcher_type="alltoall",
                            expert_model_parallel_size=4, use_rope_scaling=True)
    lm.check_megatron_lm_args(args)


def test_pipeline_stages_each_have_pools_of_megatron_cp_groups(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = megatron_lm_args(pipeline_model_parallel_size=2,
                            num_layers_per_virtual_pipeline_stage=1)
    lm.check_megatron_lm_args(args)  # PP and virtual stages (overlapped P2P, the default)
    lm.check_megatron_lm_args(megatron_lm_args(pipeline_model_parallel_size=2,
                                               mtp_num_layers=1))  # MTP on the last stage
    layout = lm.pool_layout(args)
    assert layout.pp == 2 and layout.dp == 1 and layout.pool_ranks(0, 1, 1) == list(
        range(33, 64, 2))  # stage 1, TP rank 1: Megatron's CP group (order tp-cp-dp-pp)


def test_multi_latent_attention_and_causal_sliding_windows_pass():
    lm.check_megatron_lm_args(megatron_lm_args(
        multi_latent_attention=True, apply_rope_fusion=False, window_size=(128, 0),
        window_attn_skip_freq=[1, 1, 0]))
    megatron = argparse.Namespace(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32,
                                  qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                                  window_size=(128, 0), window_attn_skip_freq=[1, 1, 0],
                                  softmax_type="vanilla")
    attention = train_args.AttentionArgs.from_namespace(megatron)  # Megatron-LM's values
    assert attention.windows(3) == (None, 128)
    assert attention.config_fields(3)["window_size"] == (128, 0)
    with pytest.raises(ConfigError, match=r"--multi-latent-attention=True .* --no-rope-fusion"):
        lm.check_megatron_lm_args(megatron_lm_args(multi_latent_attention=True,
                                                   apply_rope_fusion=True))


def test_the_glue_plans_megatron_lms_mla_and_windowed_layers_as_they_run():
    """``glue._model_spec`` (no Megatron-LM needed): MLA's head dims and one KV head per
    query head (megatron-core's MLA ignores --num-query-groups), the windowed layers."""
    from megatron_zeppelin.megatron.lm.glue import _model_spec

    megatron = argparse.Namespace(
        num_layers=3, hidden_size=64, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, ffn_hidden_size=128, kv_channels=None, padded_vocab_size=256,
        swiglu=True, bf16=True, fp16=False, num_experts=None, moe_router_topk=2,
        window_size=(128, 0), window_attn_skip_freq=[1, 1, 0], multi_latent_attention=True,
        q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=12)
    spec = _model_spec(megatron)
    assert (spec.kv_heads, spec.qk_dim, spec.v_dim, spec.bytes_per_element) == (4, 24, 12, 2)
    assert (spec.window_size, spec.window_layers) == (128, 2)
    plain = _model_spec(argparse.Namespace(**{**vars(megatron), "multi_latent_attention": False,
                                              "window_size": None}))
    assert (plain.kv_heads, plain.qk_dim, plain.v_dim, plain.window_size) == (2, 16, 16, None)


def test_the_upstream_attention_dropout_default_is_refused_once_with_exit_2(capsys,
                                                                          monkeypatch):
    from megatron_zeppelin.megatron.loop import fatal

    with pytest.raises(SystemExit) as info:
        lm.validate_megatron_lm_args(megatron_lm_args(attention_dropout=0.1))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    message = ("--attention-dropout=0.1 is not supported with --context-parallel-mode "
               "zeppelin: zeppelin attention has no dropout (Megatron-LM's default is 0.1); "
               "pass --attention-dropout 0.0")
    assert err == ["megatron-zeppelin: " + message]
    # another rank waits for torchrun to stop it (had it left first, torchrun would have
    # stopped rank 0 before it printed); still running after the grace, it prints, naming itself
    slept: list[float] = []
    monkeypatch.setattr(fatal.time, "sleep", slept.append)
    with pytest.raises(SystemExit) as info:
        lm.validate_megatron_lm_args(megatron_lm_args(attention_dropout=0.1, rank=3))
    assert info.value.code == 2 and slept == [fatal.PEER_GRACE_S]
    assert capsys.readouterr().err.strip() == "megatron-zeppelin: rank 3: " + message


def test_static_mode_refuses_zeppelin_flags_that_would_do_nothing():
    lm.check_megatron_lm_args(megatron_lm_args(context_parallel_mode="static"))
    with pytest.raises(ConfigError, match=r"--zeppelin-routing, --zeppelin-gpus-per-node only "
                                          r"apply to --context-parallel-mode zeppelin"):
        lm.check_megatron_lm_args(megatron_lm_args(context_parallel_mode="static",
                                                   zeppelin_routing=False,
                                                   zeppelin_gpus_per_node=8))


def test_the_strategy_flags_reach_megatron_lms_parser_and_are_checked():
    args = megatron_lm_args(zeppelin_strategy="hybrid-dp", max_seqlen_per_dp_cp_rank=2048)
    lm.check_megatron_lm_args(args)
    assert train_args.planner_strategy(args, 16) == ("hybrid-dp", {"max_seqlen_per_rank": 2048})
    with pytest.raises(ConfigError, match=r"--zeppelin-cp-size is an option of \['static-cp'\]"):
        lm.check_megatron_lm_args(megatron_lm_args(zeppelin_strategy="hybrid-dp",
                                                   zeppelin_cp_size=2))
    with pytest.raises(ConfigError, match=r"--max-seqlen-per-dp-cp-rank only applies to "
                                          r"--context-parallel-mode zeppelin"):
        lm.check_megatron_lm_args(megatron_lm_args(context_parallel_mode="static",
                                                   max_seqlen_per_dp_cp_rank=2048))


def test_docs_name_every_refused_flag():
    text = (ROOT / "docs" / "megatron-lm.md").read_text()
    missing = [rule.flag for rule in RULES if f"`{rule.flag}" not in text]
    assert not missing, missing


def test_supported_megatron_core_range(monkeypatch):
    assert parse_version("0.16.0rc0.dev100085") == (0, 16, 0)
    assert MEGATRON_CORE_MIN <= megatron_core_version() < MEGATRON_CORE_BELOW
    check_megatron_core((0, 19, 2))
    with pytest.raises(ConfigError, match=r"megatron-core 0.15.3 is installed; megatron-zeppelin"
                                          r" supports >= 0.16.1, < 0.20.0"):
        check_megatron_core((0, 15, 3))
    for version in ((0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 2)):
        check_cpu_bridge(version)
    monkeypatch.setattr(compat, "CPU_BRIDGE_SERIES", ((0, 16), (0, 17)))
    with pytest.raises(RuntimeError, match=r"the CPU bridge \(--device cpu\) targets 0.16.x "
                                           r"and 0.17.x"):
        check_cpu_bridge((0, 18, 2))
    setup = (ROOT / "setup.py").read_text()
    low, high = re.search(r'"megatron-core>=([\d.]+),<([\d.]+)"', setup).groups()
    assert parse_version(low) == MEGATRON_CORE_MIN and parse_version(high) == MEGATRON_CORE_BELOW


def test_apply_script_refuses_a_folder_that_is_not_megatron_lm(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "is not a Megatron-LM checkout" in result.stderr


def test_apply_script_without_git_trusts_the_marker_or_says_git_is_missing(tmp_path):
    """Where git is not installed (a GPU image) a tree whose patched files all carry the
    marker counts as applied; any other is refused naming git, not called 'partly patched'."""
    import shutil

    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "python3", "grep", "wc", "dirname", "ls", "sed", "tr", "cat"):
        (tools / tool).symlink_to(shutil.which(tool))
    tree = tmp_path / "Megatron-LM"
    for name in PATCHED:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("# megatron-zeppelin\n")
    (tree / "megatron/core").mkdir()
    (tree / "megatron/core/package_info.py").write_text("MAJOR, MINOR, PATCH = 0, 16, 1\n")
    no_git = {"PATH": str(tools), "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), str(tree)], capture_output=True, text=True,
                            env=no_git)
    assert result.returncode == 0 and "already applied" in result.stdout and \
        "git not found: judged by the megatron-zeppelin marker" in result.stdout, result.stderr
    (tree / PATCHED[0]).write_text("# unpatched\n")
    result = subprocess.run(["bash", str(SCRIPT), str(tree)], capture_output=True, text=True,
                            env=no_git)
    assert result.returncode == 1 and "git not found: it applies" in result.stderr, \
        result.stderr


def copy_checkout(src: Path, dst: Path) -> None:
    """The files the patch touches (and the version file) as plain copies."""
    for name in PATCHED + ("megatron/core/package_info.py",):
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_bytes((src / name).read_bytes())


@needs_megatron_lm
@pytest.mark.parametrize("where", ["own-repository", "inside-another-repository", "plain"])
def test_patch_applies_once_wherever_the_checkout_lives(tmp_path, where):
    target = tmp_path / "outer" / "Megatron-LM" if where == "inside-another-repository" \
        else tmp_path / "Megatron-LM"
    copy_checkout(Path(env.megatron_lm_path()), target)
    if where != "plain":
        repo = tmp_path / "outer" if where == "inside-another-repository" else target
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    first = subprocess.run(["bash", str(SCRIPT), str(target)], capture_output=True, text=True)
    assert first.returncode == 0 and "patched" in first.stdout, first.stderr
    again = subprocess.run(["bash", str(SCRIPT), str(target)], capture_output=True, text=True)
    assert again.returncode == 0 and "already applied" in again.stdout
    for name in PATCHED:
        assert "megatron-zeppelin" in (target / name).read_text(), name
        py_compile.compile(str(target / name), doraise=True)
    pretrain = (target / "pretrain_gpt.py").read_text()
    assert "import megatron_zeppelin" not in pretrain.split("def get_batch")[0]  # lazy only


# ----------------------------------------------------------------------------- missing modules
def _fake_checkout(tmp_path: Path, pretrain: str) -> tuple[Path, Path]:
    """A tree whose ``pretrain_gpt.py`` is ``pretrain``, and a driver importing it."""
    (tmp_path / "pretrain_gpt.py").write_text(pretrain)
    driver = tmp_path / "driver.py"
    driver.write_text("import os, sys\nsys.path.insert(0, os.getcwd())\nimport pretrain_gpt\n"
                      "if __name__ == '__main__':\n    raise SystemExit('main ran')\n")
    return tmp_path, driver


def test_a_module_megatron_lm_imports_and_we_lack_is_named_for_a_skip(tmp_path):
    from megatron_lm_imports import missing_in_log, missing_module

    tree, driver = _fake_checkout(tmp_path, "import colorsys\nimport json\n")
    assert missing_module(tree, driver) is None
    assert missing_module(tree, driver, hide=("colorsys",)) == "colorsys"  # as six would be
    (tmp_path / "pretrain_gpt.py").write_text("from megatron.training.tokenizer import x\n")
    with pytest.raises(AssertionError, match="Megatron-LM's modules do not import"):
        missing_module(tree, driver)  # the checkout's own module: a failure, not a skip
    log = "Traceback ...\nModuleNotFoundError: No module named 'regex'\n"
    assert missing_in_log(log) == "regex"
    assert missing_in_log(log.replace("'regex'", "'megatron.legacy'")) is None
    assert missing_in_log("AssertionError: losses differ") is None


def test_every_patch_is_a_known_version_and_carries_the_same_hooks():
    """Each ``patches/megatron-lm-core_v<version>.patch`` is a version the code names
    (``MEGATRON_LM_PATCHED``, used in messages), and every patch adds the same
    megatron-zeppelin lines: the hooks are placed per version, never dropped."""
    from megatron_zeppelin.megatron.common.compat import MEGATRON_LM_PATCHED

    patches = sorted((ROOT / "patches").glob("megatron-lm-core_v*.patch"))
    versions = [p.name.removeprefix("megatron-lm-core_v").removesuffix(".patch")
                for p in patches]
    assert sorted(versions) == sorted(MEGATRON_LM_PATCHED) and len(versions) >= 2
    hooks = [patch_hooks(p.read_text()) for p in patches]
    assert all(found == hooks[0] for found in hooks), \
        {v: found ^ hooks[0] for v, found in zip(versions, hooks)}
    assert len(hooks[0]) >= 20  # the glue's entry points, the patch's helpers, their uses


def patch_hooks(patch: str) -> set[str]:
    """What a patch hooks in: each megatron_zeppelin import it adds, each function it defines
    and which of those its added lines use (the lines around them follow each tag's code:
    core_v0.18 moved the batch into ``forward_step``)."""
    added = [line[1:].strip() for line in patch.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    defined = {line[4:].split("(")[0] for line in added if line.startswith("def ")}
    used = {f"uses {name}" for name in defined
            if any(name in line and not line.startswith("def ") for line in added)}
    return {line for line in added if line.startswith("from megatron_zeppelin")} | \
        {f"def {name}" for name in defined} | used
