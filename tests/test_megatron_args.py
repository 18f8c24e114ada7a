"""pretrain_gpt.py's command line and YAML: shipped recipes validate, bad input is refused
before any process group or model exists."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.loop import args as train_args

ROOT = Path(__file__).resolve().parent.parent
TRAIN = sorted((ROOT / "configs" / "train").glob("*.yaml"))
ZEPPELIN_FLEXSP = ["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "flexsp"]
BASE = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "256", "--global-batch-size", "2",
        "--train-iters", "1", "--mock-data", "--vocab-size", "256"]


@pytest.mark.parametrize("path", TRAIN, ids=lambda p: p.stem)
def test_every_shipped_training_recipe_validates_for_its_world(path):
    args = train_args.parse_args(["--yaml-cfg", str(path), "--data-path", "corpus_text_document"])
    gpus = args.context_parallel_size * args.tensor_model_parallel_size
    train_args.validate_args(args, world_size=gpus, local_world_size=min(gpus, 8))
    assert args.context_parallel_mode in train_args.MODES


def test_flags_override_the_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_layers: 2\ncontext-parallel-mode: zeppelin\nlr: 0.5\n")
    args = train_args.parse_args(["--yaml-cfg", str(cfg), "--lr", "0.25"])
    assert args.num_layers == 2 and args.context_parallel_mode == "zeppelin" and args.lr == 0.25


@pytest.mark.parametrize("text,match", [
    ("num_layer: 2\n", r"unknown key 'num_layer'; valid keys: \[.*'num_layers'"),
    ("context_parallel_mode: ring\n", r"context_parallel_mode='ring' is invalid: expected one of "
                                      r"\['static', 'zeppelin'\]"),
])
def test_bad_yaml_is_refused_with_the_key(tmp_path, text, match):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        train_args.parse_args(["--yaml-cfg", str(cfg)])


@pytest.mark.parametrize("extra,world,match", [
    (["--context-parallel-size", "3"], 4, r"--context-parallel-size=3 is invalid: expected a "
                                          r"divisor of world size / \(TP x PP\) = 4"),
    (["--context-parallel-size", "4", "--zeppelin-gpus-per-node", "3"], 4,
     r"CP x TP = 4 GPUs must be whole nodes of --zeppelin-gpus-per-node=3"),
    (["--tensor-model-parallel-size", "3"], 6, r"--tensor-model-parallel-size=3 is invalid"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"], 1,
     r"--use-torch-fsdp2 with --use-distributed-optimizer: torch FSDP2 shards"),
    (["--global-batch-size", "3", "--context-parallel-size", "2"], 4,
     r"--global-batch-size=3 must be a multiple of --micro-batch-size x data-parallel size"),
    (["--zeppelin-strategy", "hybrid-dp"], 1, r"--zeppelin-strategy hybrid-dp: only with "
                                              r"--context-parallel-mode zeppelin"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "ring"], 1,
     r"--zeppelin-strategy='ring' is invalid: expected one of \['static-cp'"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "megatron-dynamic-cp"], 1,
     r"megatron-dynamic-cp needs megatron-core's DefaultDynamicCPScheduler"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "hybrid-dp",
      "--zeppelin-cp-size", "2"], 1, r"--zeppelin-cp-size is an option of \['static-cp'\], "
                                     r"none of which is --zeppelin-strategy hybrid-dp"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "hybrid-dp",
      "--max-seqlen-per-dp-cp-rank", "0"], 1, r"--max-seqlen-per-dp-cp-rank=0 is invalid: "
                                              r"expected an integer >= 1"),
    (["--context-parallel-mode", "static", "--zeppelin-balance-slack", "0.1"], 1,
     r"--zeppelin-balance-slack=0.1 is ignored by --context-parallel-mode static \(static CP\): "
     r"only zeppelin reads it"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "hybrid-dp",
      "--no-zeppelin-remap"], 1, r"--zeppelin-remap=False is ignored by --zeppelin-strategy "
                                 r"hybrid-dp: only zeppelin reads it"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-capacity-tokens-per-gpu", "100",
      "--zeppelin-capacity-factor", "3"], 1, r"--zeppelin-capacity-factor=3.0 is invalid: "
                                             r"expected given only without "
                                             r"--zeppelin-capacity-tokens-per-gpu"),
])
def test_bad_parallel_settings_are_refused(extra, world, match):
    args = train_args.parse_args(BASE + extra)
    with pytest.raises(ConfigError, match=match):
        train_args.validate_args(args, world_size=world, local_world_size=None)


def test_the_strategy_and_its_options_plan_each_micro_batch(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("context_parallel_mode: zeppelin\nzeppelin_strategy: megatron-hybrid-cp\n"
                   "max_seqlen_per_dp_cp_rank: 96\n")
    args = train_args.parse_args(BASE + ["--yaml-cfg", str(cfg)])
    train_args.validate_args(args, world_size=1, local_world_size=None)
    assert train_args.planner_strategy(args, 4) == ("megatron-hybrid-cp",
                                                    {"max_seqlen_per_rank": 96})
    static = train_args.parse_args(BASE)
    assert train_args.planner_strategy(static, 4) == ("static-cp", {"cp_size": 4})
    default = train_args.parse_args(BASE + ["--context-parallel-mode", "zeppelin"])
    assert train_args.planner_strategy(default, 4) == ("zeppelin", {})


@pytest.mark.parametrize("extra,match", [
    (["--window-size", "10,3"],
     r"--window-size='10,3' is invalid: expected 'L,0' with 0 <= L < 2147483647"),
    (["--window-size", "99999999999999999999,0"], r"--window-size='9+,0' is invalid"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "[0,0]"],
     r"--window-attn-skip-freq='\[0,0\]' is invalid: expected a pattern with at least one "
     r"windowed layer"),
    (["--window-attn-skip-freq", "[1,2]"], r"'\[1,2\]' is invalid: expected .* per layer "
     r"\(1: sliding window\)"),
    (["--q-lora-rank", "16"],
     r"--q-lora-rank=16 is invalid: expected given only with --multi-latent-attention"),
    (["--v-head-dim", "64"], r"--v-head-dim=64 is invalid: expected given only with --multi"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "3"],
     r"--qk-pos-emb-head-dim=3 is invalid: expected an even number \(RoPE"),
    (["--hidden-size", "12"], r"--hidden-size=12 is invalid with --num-attention-heads 4: "
     r"expected an even head dim"),
    (["--window-size", "abc"], r"--window-size='abc' is invalid"),
    (["--window-size=-2,0"], r"--window-size='-2,0' is invalid"),
    (["--window-attn-skip-freq", "2"], r"--window-attn-skip-freq=2 without --window-size"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "[1,0,1]"],
     r"--window-attn-skip-freq='\[1,0,1\]' is invalid: expected .* per layer \(2 layers"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "0"],
     r"--window-attn-skip-freq='0' is invalid: expected an integer >= 1"),
    (["--multi-latent-attention", "--v-head-dim", "0"], r"--v-head-dim=0 is invalid"),
    (["--multi-latent-attention", "--num-query-groups", "2"],
     r"--num-query-groups=2 \(flag or --yaml-cfg key\) is invalid with "
     r"--multi-latent-attention: expected unset or --num-attention-heads 4"),
    (["--softmax-type", "sigmoid"], r"--softmax-type: invalid choice: 'sigmoid'"),
] + [([*ZEPPELIN_FLEXSP, *extra], rf"--zeppelin-strategy flexsp with {flag}: its Ulysses "
      r"attention runs full causal attention with one head dim and the vanilla softmax")
     for extra, flag in ((["--window-size", "8,0"], "--window-size 8,0"),
                         (["--softmax-type", "learnable"], "--softmax-type learnable"),
                         (["--multi-latent-attention"], r"--multi-latent-attention with "
                          r"--v-head-dim 128 \(q/k 192\)"))])
def test_bad_attention_settings_are_refused(extra, match):
    """Including what the Ulysses attention of FlexSP's plans does not run."""
    with pytest.raises(ConfigError, match=match):
        train_args.validate_args(train_args.parse_args(BASE + extra), world_size=1,
                                 local_world_size=None)


def test_attention_settings_become_megatron_config_fields():
    args = train_args.parse_args(BASE + ["--multi-latent-attention", "--v-head-dim", "8",
                                         "--window-size", "8,0",
                                         "--window-attn-skip-freq", "[1,0]"])
    train_args.validate_args(args, 1, None)
    attention = train_args.AttentionArgs.from_namespace(args)
    fields = attention.config_fields(2)
    assert fields["window_size"] == (8, 0) and fields["window_attn_skip_freq"] == [1, 0]
    assert fields["multi_latent_attention"] and fields["v_head_dim"] == 8
    assert attention.windows(2) == (None, 8)
    assert train_args.AttentionArgs().windows(2) == (None,)
    assert "softmax_type" not in fields  # vanilla: megatron-core's default
    sinks = train_args.parse_args(BASE + ["--softmax-type", "learnable"])
    assert train_args.AttentionArgs.from_namespace(sinks).config_fields(2) == {
        "softmax_type": "learnable"}


def test_the_planner_sees_mla_head_dims_and_the_windowed_layers():
    """``train.model_spec``: the planner prices MLA's q/k (qk + RoPE dims) and v heads, a
    key/value head per query head, and the layers the window applies to."""
    from megatron_zeppelin.megatron.loop import train

    args = train_args.parse_args(BASE + ["--multi-latent-attention", "--q-lora-rank", "16",
                                         "--kv-lora-rank", "8", "--qk-head-dim", "8",
                                         "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
                                         "--window-size", "8,0",
                                         "--window-attn-skip-freq", "[1,0]"])
    train_args.validate_args(args, 1, None)
    spec = train.model_spec(args)
    assert (spec.qk_dim, spec.v_dim, spec.kv_heads) == (12, 6, 4)
    assert (spec.mla("q_lora_rank"), spec.mla("kv_lora_rank")) == (16, 8)
    assert (spec.window_size, spec.window_layers) == (8, 1)
    plain = train.model_spec(train_args.parse_args(BASE))
    assert not plain.multi_latent_attention and plain.qk_dim == plain.v_dim == plain.head_dim


def test_missing_data_and_required_flags():
    with pytest.raises(ConfigError, match="no data: pass --mock-data"):
        no_data = train_args.parse_args([x for x in BASE if x != "--mock-data"])
        train_args.validate_args(no_data, 1, None)
    without_iters = BASE[:BASE.index("--train-iters")] + BASE[BASE.index("--mock-data"):]
    with pytest.raises(ConfigError, match="--train-iters is required"):
        train_args.validate_args(train_args.parse_args(without_iters), 1, None)


def test_unknown_mode_is_refused_by_the_script():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_gpt.py"),
                             "--context-parallel-mode", "ring"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "invalid choice: 'ring' (choose from 'static', 'zeppelin')" in result.stderr


def test_the_script_asks_for_torchrun():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_gpt.py")] + BASE,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "launch with torchrun" in result.stderr


def test_transformer_engine_missing_names_the_extra():
    from megatron_zeppelin.megatron.common.core_attention import te_core_attention_class

    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'megatron-zeppelin\[te\]'"):
            te_core_attention_class()
    else:
        assert te_core_attention_class().__name__ == "ZeppelinTEDotProductAttention"


def test_the_te_subclass_runs_zeppelin_with_the_scale_window_and_sink_it_was_built_with(
        monkeypatch):
    """The TE subclass over a stand-in base with megatron-core's ``TEDotProductAttention``
    signature that, as TE's ``DotProductAttention``, keeps no ``softmax_scale`` attribute: its
    arguments are read by name, positional or keyword, and a zeppelin-packed batch runs zeppelin
    attention with them (other batches go to the base)."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_zeppelin.megatron.common import core_attention
    from megatron_zeppelin.megatron.common.packing import ZeppelinPackedSeqParams

    class TEStandIn(torch.nn.Module):  # megatron-core 0.16.1's signature, TE's attributes
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, k_channels=None,
                     v_channels=None, cp_comm_type="p2p", pg_collection=None):
            super().__init__()
            self.config = config
            if config.softmax_type == "learnable":  # TE's sink parameter, [heads / TP]
                self.softmax_offset = torch.nn.Parameter(torch.arange(4.0))

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            return "base"

    calls = []
    monkeypatch.setattr(core_attention, "zeppelin_attention",
                        lambda state, q, k, v, params, scale, window, sink:
                        calls.append((state, scale, window, sink)) or "zeppelin")
    cls = core_attention.zeppelin_te_attention(TEStandIn)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                               attention_dropout=0.0, window_size=(8, 0),
                               window_attn_skip_freq=2)
    sink = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                             attention_dropout=0.0, softmax_type="learnable")
    keyword = cls(config=config, layer_number=2, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", softmax_scale=0.125, zeppelin_state="state")
    positional = cls(config, 1, AttnMaskType.causal, "self", 0.0, 0.25, zeppelin_state="state")
    learnable = cls(sink, 1, AttnMaskType.causal, "self", zeppelin_state="state")
    query = torch.zeros(3, 1, 4, 8)
    packed = ZeppelinPackedSeqParams(qkv_format="sbhd")
    for layer in (keyword, positional, learnable):
        assert layer(query, query, query, None, packed_seq_params=packed) == "zeppelin"
    assert calls[:2] == [("state", 0.125, None, None), ("state", 0.25, 8, None)]  # 2: global
    assert calls[2][:3] == ("state", None, None)
    assert torch.equal(calls[2][3], torch.arange(4.0))
    assert keyword(query, query, query, None) == "base"
    with pytest.raises(ValueError, match="attention_dropout=0.1 is not supported"):
        cls(config, 1, AttnMaskType.causal, "self", 0.1, zeppelin_state="state")


def test_a_strategy_that_cannot_place_a_document_names_the_training_flag():
    """The preflight plan of one ``--seq-length`` document: the planner's setting names become
    the training flags that set them."""
    from types import SimpleNamespace

    from conftest import make_cost
    from megatron_zeppelin.megatron.loop.train import check_strategy
    from megatron_zeppelin.planner.service import PlanFunction

    args = train_args.parse_args(BASE + ["--context-parallel-mode", "zeppelin",
                                         "--zeppelin-capacity-tokens-per-gpu", "10"])
    cost = make_cost(nodes=1, gpus_per_node=2)
    planner = PlanFunction("zeppelin", cost, train_args.zeppelin_config(args))
    with pytest.raises(ConfigError, match=r"--zeppelin-strategy zeppelin cannot run here: .*"
                                          r"x --zeppelin-capacity-tokens-per-gpu 10\) allows .*"
                                          r"set --zeppelin-overlong to 'split' or 'drop'"):
        check_strategy(args, planner, SimpleNamespace(prepare=lambda plan: None))
