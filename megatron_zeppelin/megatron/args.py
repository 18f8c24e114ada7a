"""Command line and YAML for ``scripts/pretrain_gpt.py``, with Megatron-LM's flag names.

``--yaml-cfg FILE`` supplies values for any flag (keys are flag names with ``_`` or ``-``;
unknown keys are refused with the list of valid ones); flags given on the command line win.
``validate_args`` rejects bad settings before any process group or model is built.
"""
from __future__ import annotations

import argparse
from typing import Sequence

import yaml

from megatron_zeppelin.config import OVERLONG_POLICIES, ConfigError
from megatron_zeppelin.runtime.kernels import choices as attention_backends

MODES = ("static", "zeppelin")
DEVICES = ("cpu", "cuda")


def add_megatron_args(p: argparse.ArgumentParser) -> None:
    """The Megatron-LM flags the script understands (same names and meanings)."""
    g = p.add_argument_group("megatron")
    for name in ("num-layers", "hidden-size", "num-attention-heads"):
        g.add_argument(f"--{name}", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None, help="KV heads (GQA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size (the built-in byte corpus needs >= 256)")
    g.add_argument("--normalization", default="RMSNorm", choices=("RMSNorm", "LayerNorm"))
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seq-length", type=int, default=None,
                   help="longest document (tokens); longer ones follow --zeppelin-overlong")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--mock-data", action="store_true",
                   help="train on the built-in corpus (Python stdlib sources as bytes)")
    g.add_argument("--data-path", default=None, help="Megatron indexed dataset prefix")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-json", default=None,
                   help="rank 0 appends one JSON object per iteration to this file")
    g.add_argument("--device", default="cuda", choices=DEVICES)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU only)")
    g.add_argument("--yaml-cfg", default=None, help="YAML file with values for these flags")


def add_zeppelin_args(p: argparse.ArgumentParser) -> None:
    """``--context-parallel-mode`` and the zeppelin options."""
    g = p.add_argument_group("zeppelin")
    g.add_argument("--context-parallel-mode", default="static", choices=MODES,
                   help="static: every document zigzag over the CP group (TE/Megatron CP); "
                   "zeppelin: hierarchical partitioning, routing and remapping")
    g.add_argument("--zeppelin-cluster", default=None,
                   help="cluster YAML (path or shipped name) for the planner's cost model")
    g.add_argument("--zeppelin-hardware", default=None, help="hardware profile YAML")
    g.add_argument("--zeppelin-gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: torchrun's local world size); on CPU this "
                   "groups ranks into emulated nodes; CP x TP must be whole nodes")
    g.add_argument("--zeppelin-capacity-tokens-per-gpu", type=int, default=None)
    g.add_argument("--zeppelin-capacity-factor", type=float, default=2.0)
    g.add_argument("--zeppelin-overlong", default="error", choices=OVERLONG_POLICIES)
    g.add_argument("--zeppelin-routing", action=argparse.BooleanOptionalAction, default=True,
                   help="route inter-node ring steps over every NIC (proxy GPUs)")
    g.add_argument("--zeppelin-remap", action=argparse.BooleanOptionalAction, default=True,
                   help="run linear modules on a token-balanced layout")
    g.add_argument("--zeppelin-attention-backend", default="auto", choices=attention_backends(),
                   help="attention kernel (auto: native on CUDA fp16/bf16, torch otherwise)")
    g.add_argument("--zeppelin-validate-plan", action="store_true",
                   help="check every plan's contract (Plan.validate) before using it")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py",
                                description="GPT pretraining on megatron-core with zeppelin CP")
    add_megatron_args(p)
    add_zeppelin_args(p)
    return p


def apply_yaml(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the YAML file's values the parser's defaults (command-line flags still win)."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"--yaml-cfg {path!r} does not exist") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values")
    valid = {a.dest: a for a in parser._actions if a.dest not in ("help", "yaml_cfg")}
    values = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in valid:
            raise ConfigError(f"{path}: unknown key {key!r}; valid keys: {sorted(valid)}")
        choices = valid[dest].choices
        if choices is not None and value not in choices:
            raise ConfigError(f"{path}: {key}={value!r} is invalid: expected one of "
                              f"{list(choices)}")
        values[dest] = value
    parser.set_defaults(**values)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.yaml_cfg:
        apply_yaml(parser, first.yaml_cfg)
    return parser.parse_args(argv)


def validate_args(args: argparse.Namespace, world_size: int, local_world_size: int | None
                  ) -> None:
    """Refuse bad settings with the flag, the value and what is allowed (before training)."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "global_batch_size", "train_iters"):
        if getattr(args, flag) is None:
            raise ConfigError(f"--{flag.replace('_', '-')} is required (flag or --yaml-cfg key)")
    if not args.mock_data and not args.data_path:
        raise ConfigError("no data: pass --mock-data (built-in corpus) or --data-path PREFIX")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if tp < 1 or world_size % tp or args.num_attention_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size={tp} is invalid: expected a divisor of "
                          f"the world size {world_size} and of --num-attention-heads "
                          f"{args.num_attention_heads}")
    if cp < 1 or world_size % (tp * cp):
        raise ConfigError(f"--context-parallel-size={cp} is invalid: expected a divisor of "
                          f"world size / TP = {world_size // tp}")
    gpn = args.zeppelin_gpus_per_node or min(cp * tp, local_world_size or cp * tp)
    if gpn % tp or (cp * tp) % gpn:
        raise ConfigError(f"--context-parallel-size={cp} does not match the topology: CP x TP "
                          f"= {cp * tp} GPUs must be whole nodes of --zeppelin-gpus-per-node="
                          f"{gpn} GPUs (a multiple of TP={tp})")
    args.zeppelin_gpus_per_node = gpn
    dp = world_size // (tp * cp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size={args.global_batch_size} must be a multiple of "
                          f"--micro-batch-size x data-parallel size = "
                          f"{args.micro_batch_size} x {dp}")
    if args.bf16 and args.device == "cpu":
        raise ConfigError("--bf16 with --device cpu: megatron-core's bf16 optimizer needs CUDA; "
                          "train in fp32 on CPU")
    if args.mock_data and (args.vocab_size or 0) < 256:
        raise ConfigError(f"--vocab-size={args.vocab_size}: the built-in byte corpus needs "
                          ">= 256")


def pool_size(args: argparse.Namespace) -> int:
    """Ranks of a zeppelin pool: the CP size the user asked for (Megatron-LM's argument hook
    moves it to ``zeppelin_pool_size`` and runs Megatron's own CP at 1)."""
    return getattr(args, "zeppelin_pool_size", None) or args.context_parallel_size
