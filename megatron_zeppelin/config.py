"""Configuration a user edits: model dims, cluster topology, planner and pipeline options, and
the loaders of the shipped YAML files (model, cluster, hardware profile, all three together).

Every dataclass here is frozen and validated on construction; YAML files are loaded strictly
(``config_yaml.py``): an unknown key, a wrong type or an out-of-range value raises
``ConfigError`` naming the file, the key, the value and what is allowed. Bare names
(``llama-7b``) resolve to the YAML files shipped under ``configs/``. The hardware profile is
``hardware_profile.py``.
"""
from __future__ import annotations

import math

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_zeppelin.config_yaml import from_dict, read_yaml, resolve_config_path
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.hardware_profile import ATTENTION_KERNELS, HardwareProfile
from megatron_zeppelin.options import (only_with, plain_integers, require, require_at_least,
                                       require_positive, require_positive_int, reword, setting)
from megatron_zeppelin.plan import Topology

OVERLONG_POLICIES = ("error", "split", "drop")
# multi-latent attention's dims, defaults as Megatron-LM's flags (--q-lora-rank ... --v-head-dim)
MLA_DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
                "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
MLA_FIELDS = ("multi_latent_attention", *MLA_DEFAULTS)  # ModelSpec's, named as Megatron's flags


MAX_WINDOW = 2 ** 31 - 1  # the kernels' window sizes are 32-bit integers


@dataclass(frozen=True)
class ModelSpec:
    """Transformer dimensions (Megatron names). ``num_query_groups`` < heads means GQA/MQA.

    ``multi_latent_attention`` (DeepSeek-V2/V3): queries and keys have ``qk_head_dim +
    qk_pos_emb_head_dim`` per head, values ``v_head_dim``, one key/value head per query head
    (``num_query_groups`` must then be unset or equal the heads), from low-rank projections
    (``q_lora_rank``: None is a full query projection; ``kv_lora_rank``); the dims default to
    Megatron-LM's flags (``MLA_DEFAULTS``) and are refused without it.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    vocab_size: int = 32000
    swiglu: bool = True
    bytes_per_element: int = 2
    num_experts: int | None = None
    moe_router_topk: int = 1
    window_size: int | None = None  # sliding window: a token sees itself and this many before
    window_layers: int | None = None  # layers with the window (default: all of them)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        plain_integers(self)  # numpy's integers as ints
        require(isinstance(self.name, str) and self.name.strip() != "", "model.name", self.name,
                "a non-empty name")
        require(isinstance(self.swiglu, bool), "model.swiglu", self.swiglu, "true or false")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                    "bytes_per_element", "moe_router_topk"):
            require_positive_int(f"model.{key}", getattr(self, key))
        require(self.bytes_per_element in (1, 2, 4), "model.bytes_per_element",
                self.bytes_per_element, "1 (fp8), 2 (bf16/fp16) or 4 (fp32)")
        if self.window_size is not None:
            require(isinstance(self.window_size, int) and not isinstance(self.window_size, bool)
                    and 0 <= self.window_size < MAX_WINDOW,
                    "model.window_size", self.window_size, f"an integer in [0, {MAX_WINDOW})")
        if self.window_layers is not None:
            require(self.window_size is not None and isinstance(self.window_layers, int) and
                    0 <= self.window_layers <= self.num_layers, "model.window_layers",
                    self.window_layers, f"an integer in [0, num_layers={self.num_layers}], "
                    "with window_size")
        for key in ("num_query_groups", "ffn_hidden_size", "kv_channels", "num_experts"):
            if getattr(self, key) is not None:
                require_positive_int(f"model.{key}", getattr(self, key))
        if self.num_experts is not None:
            require(self.moe_router_topk <= self.num_experts, "model.moe_router_topk",
                    self.moe_router_topk, f"at most num_experts={self.num_experts} (experts "
                    "per token)")
        else:
            require(self.moe_router_topk == 1, "model.moe_router_topk", self.moe_router_topk,
                    "unset (1) without num_experts: experts per token needs a MoE model")
        heads = self.num_attention_heads
        require(heads % self.kv_heads == 0, "model.num_query_groups", self.num_query_groups,
                f"a divisor of num_attention_heads={heads}")
        if self.kv_channels is None and not self.multi_latent_attention:
            require(self.hidden_size % heads == 0, "model.hidden_size", self.hidden_size,
                    f"a multiple of num_attention_heads={heads} (or set kv_channels)")
        self._check_mla()

    def _check_mla(self) -> None:
        require(isinstance(self.multi_latent_attention, bool), "model.multi_latent_attention",
                self.multi_latent_attention, "true or false")
        for key in MLA_DEFAULTS:
            value = getattr(self, key)
            if value is None:
                continue
            require(self.multi_latent_attention, f"model.{key}", value,
                    "unset without multi_latent_attention: true")
            require_positive_int(f"model.{key}", value)
        if self.multi_latent_attention:
            heads = self.num_attention_heads
            require(self.num_query_groups in (None, heads), "model.num_query_groups",
                    self.num_query_groups, f"unset or num_attention_heads={heads}: multi-latent "
                    "attention has one key/value head per query head")

    def mla(self, key: str) -> int | None:
        """An MLA dim (``MLA_DEFAULTS``'s keys): the field, else Megatron-LM's default."""
        value = getattr(self, key)
        return MLA_DEFAULTS[key] if value is None else value

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def qk_dim(self) -> int:
        """Width of one query (and key) head: ``head_dim``, or MLA's ``qk_head_dim +
        qk_pos_emb_head_dim``."""
        if not self.multi_latent_attention:
            return self.head_dim
        return self.mla("qk_head_dim") + self.mla("qk_pos_emb_head_dim")

    @property
    def v_dim(self) -> int:
        """Width of one value (and attention output) head: ``head_dim``, or MLA's
        ``v_head_dim``."""
        return self.mla("v_head_dim") if self.multi_latent_attention else self.head_dim

    @property
    def pair_dim(self) -> int:
        """``qk_dim + v_dim``: a query/key pair's FLOPs per head are twice it (QK^T and PV),
        a token's K and V per KV head, or q and out per query head, this many elements."""
        return self.qk_dim + self.v_dim

    def attention_linears(self, heads: int, kv_heads: int) -> list[tuple[int, int]]:
        """(in, out) features of one layer's attention projections with ``heads`` query and
        ``kv_heads`` KV heads (one tensor-parallel rank's: the heads // tp): fused QKV and
        output, or MLA's query (full, or down and up), key/value down (with the RoPE key)
        and up, and output (its down-projections whole on every rank, as Megatron duplicates
        them)."""
        h = self.hidden_size
        if not self.multi_latent_attention:
            d = self.head_dim
            return [(h, (heads + 2 * kv_heads) * d), (heads * d, h)]
        q_lora, kv_lora = self.mla("q_lora_rank"), self.mla("kv_lora_rank")
        query = [(h, heads * self.qk_dim)] if q_lora is None else \
            [(h, q_lora), (q_lora, heads * self.qk_dim)]
        key_value = [(h, kv_lora + self.mla("qk_pos_emb_head_dim")),
                     (kv_lora, heads * (self.mla("qk_head_dim") + self.v_dim))]
        return query + key_value + [(heads * self.v_dim, h)]

    def attention_weights(self, heads: int, kv_heads: int) -> int:
        """Weights of ``attention_linears``."""
        return sum(n * m for n, m in self.attention_linears(heads, kv_heads))

    def parameter_count(self) -> int:
        """Parameters of the GPT (untied embeddings, RMSNorm weights, all experts)."""
        h, f = self.hidden_size, self.ffn
        experts = self.num_experts or 1
        mlp = (3 if self.swiglu else 2) * h * f * experts + (h * experts if self.num_experts else 0)
        layer = self.attention_weights(self.num_attention_heads, self.kv_heads) + mlp + 2 * h
        return self.num_layers * layer + 2 * self.vocab_size * h + h

    @property
    def window_share(self) -> float:
        """The fraction of layers that attend a sliding window (0.0 without one)."""
        if self.window_size is None:
            return 0.0
        layers = self.num_layers if self.window_layers is None else self.window_layers
        return layers / self.num_layers

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        return ffn_width(self.hidden_size, self.ffn_hidden_size)


def ffn_width(hidden_size: int, ffn_hidden_size: int | None) -> int:
    """The FFN width: ``ffn_hidden_size``, else Megatron's default of 4 x the hidden size."""
    return ffn_hidden_size or 4 * hidden_size


MAX_GPUS = 1 << 20  # a cluster's GPUs: far beyond any built (and the router's 1M nodes' range)


@dataclass(frozen=True)
class ClusterSpec:
    """Node type and count. Bandwidths are per direction: NVLink per GPU, NIC per NIC.

    ``gpu_to_nic[i]`` is the NIC GPU ``i`` of a node sends inter-node traffic through
    (its static affinity); by default GPUs are spread evenly over the NICs.
    """

    name: str
    gpus_per_node: int
    nics_per_node: int
    nvlink_gbyte_per_s: float
    nic_gbit_per_s: float
    nvlink_latency_us: float = 3.0
    nic_latency_us: float = 8.0
    nodes: int = 1
    gpu_to_nic: tuple[int, ...] | None = None
    gpu_memory_gib: float = 80.0
    hardware: str = "h100"

    def __post_init__(self) -> None:
        plain_integers(self)  # numpy's integers as ints
        for key in ("name", "hardware"):
            require(isinstance(getattr(self, key), str) and getattr(self, key).strip() != "",
                    f"cluster.{key}", getattr(self, key), "a non-empty name")
        for key in ("gpus_per_node", "nics_per_node", "nodes"):
            require_positive_int(f"cluster.{key}", getattr(self, key))
        require(self.gpus_per_node <= MAX_GPUS, "cluster.gpus_per_node", self.gpus_per_node,
                f"at most {MAX_GPUS} GPUs")
        require(self.nodes * self.gpus_per_node <= MAX_GPUS, "cluster.nodes", self.nodes,
                f"at most {MAX_GPUS // self.gpus_per_node} nodes of {self.gpus_per_node} GPUs "
                f"({MAX_GPUS} GPUs)")
        for key in ("nvlink_gbyte_per_s", "nic_gbit_per_s", "gpu_memory_gib"):
            require_positive(f"cluster.{key}", getattr(self, key))
        require(self.nics_per_node <= self.gpus_per_node, "cluster.nics_per_node",
                self.nics_per_node, f"at most gpus_per_node={self.gpus_per_node} (each NIC "
                "carries the inter-node traffic of the GPUs attached to it)")
        for key in ("nvlink_latency_us", "nic_latency_us"):
            require_at_least(f"cluster.{key}", getattr(self, key))
        if self.gpu_to_nic is None:
            spread = tuple(i * self.nics_per_node // self.gpus_per_node
                           for i in range(self.gpus_per_node))
            object.__setattr__(self, "gpu_to_nic", spread)
        else:
            object.__setattr__(self, "gpu_to_nic", tuple(self.gpu_to_nic))
        require(len(self.gpu_to_nic) == self.gpus_per_node, "cluster.gpu_to_nic",
                list(self.gpu_to_nic), f"a list of {self.gpus_per_node} NIC indices")
        bad = [n for n in self.gpu_to_nic if isinstance(n, bool) or
               not (isinstance(n, int) and 0 <= n < self.nics_per_node)]
        require(not bad, "cluster.gpu_to_nic", list(self.gpu_to_nic),
                f"NIC indices in [0, {self.nics_per_node})")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nic_byte_per_s(self) -> float:
        return self.nic_gbit_per_s * 1e9 / 8

    @property
    def nvlink_byte_per_s(self) -> float:
        return self.nvlink_gbyte_per_s * 1e9

    def with_nodes(self, nodes: int) -> "ClusterSpec":
        return dataclasses.replace(self, nodes=nodes)

    def with_topology(self, nodes: int, gpus_per_node: int) -> "ClusterSpec":
        """The same node type with ``gpus_per_node`` GPUs (NICs capped to GPUs, affinity
        spread evenly again unless the GPU count is unchanged)."""
        if gpus_per_node == self.gpus_per_node:
            return self.with_nodes(nodes)
        return dataclasses.replace(self, nodes=nodes, gpus_per_node=gpus_per_node,
                                   nics_per_node=min(self.nics_per_node, gpus_per_node),
                                   gpu_to_nic=None)

    def topology(self, tp: int = 1) -> Topology:
        """Planner ranks: one per tensor-parallel group (``tp`` GPUs) of each node."""
        require(isinstance(tp, int) and tp >= 1 and self.gpus_per_node % tp == 0,
                "tensor_model_parallel_size", tp,
                f"a positive divisor of gpus_per_node={self.gpus_per_node}")
        return Topology(nodes=self.nodes, gpus_per_node=self.gpus_per_node // tp)


@dataclass(frozen=True)
class ZeppelinConfig:
    """Planner options: one declaration for every place they are set.

    The ``zeppelin plan`` / ``zeppelin simulate`` flags (``--capacity-factor``...), the
    training flags (``--zeppelin-capacity-factor``... on ``scripts/pretrain_gpt.py`` and on
    Megatron-LM's parser through the patch) and the training YAML keys
    (``zeppelin_capacity_factor: 2.0``) are generated from these fields (``options.py``).
    In training, ``max_seqlen`` is Megatron's ``--seq-length``. What ``split`` and ``drop`` did
    is counted in the plan's ``OverlongReport``.
    """

    SECTION = "zeppelin"  # validation errors say zeppelin.<field>=...; flags reword them

    max_seqlen: int | None = setting(
        None, "longest document accepted (Megatron's --seq-length); longer ones follow "
        "--overlong; default: what the pool holds")
    capacity_tokens_per_gpu: int | None = setting(
        None, "attention-layout tokens a rank may hold (default: capacity factor x the mean "
        "tokens per rank, at least the longest document's smallest share)")
    capacity_factor: float = setting(2.0, "capacity = factor x mean tokens per rank when no "
                                     "capacity is given (>= 1)")
    overlong: str = setting("error", "a document longer than the limit: refuse it (error), "
                            "split it into pieces of at most the limit, or drop it (counted)",
                            choices=OVERLONG_POLICIES)
    routing: bool = setting(True, "route inter-node ring steps over every NIC of a node "
                            "through proxy GPUs (routing layer)")
    remap: bool = setting(True, "run linear modules on a token-balanced layout (remapping "
                          "layer)")
    balance_slack: float = setting(0.05, "relative overload of a rank accepted before a "
                                   "sequence is sharded over more ranks, in [0, 1]")

    def __post_init__(self) -> None:
        plain_integers(self)  # numpy's integers as ints
        for key in ("max_seqlen", "capacity_tokens_per_gpu"):
            if getattr(self, key) is not None:
                require_positive_int(f"zeppelin.{key}", getattr(self, key))
        require(isinstance(self.capacity_factor, (int, float)) and
                not isinstance(self.capacity_factor, bool) and
                math.isfinite(self.capacity_factor) and self.capacity_factor >= 1.0,
                "zeppelin.capacity_factor", self.capacity_factor, "a finite number >= 1.0")
        only_with(self, ("capacity_factor",), self.capacity_tokens_per_gpu is None,
                  "without zeppelin.capacity_tokens_per_gpu (a given capacity replaces the "
                  "factor)")
        require(self.overlong in OVERLONG_POLICIES, "zeppelin.overlong", self.overlong,
                f"one of {list(OVERLONG_POLICIES)}")
        require(isinstance(self.balance_slack, (int, float)) and
                not isinstance(self.balance_slack, bool) and
                0.0 <= self.balance_slack <= 1.0, "zeppelin.balance_slack", self.balance_slack,
                "a number in [0, 1]")
        for key in ("routing", "remap"):
            require(isinstance(getattr(self, key), bool), f"zeppelin.{key}",
                    getattr(self, key), "true or false")


MICROBATCH_ORDERS = ("balanced", "arrival")


@dataclass(frozen=True)
class PipelineSpec:
    """Pipeline parallelism as the planner and simulator price it (``planner/pipeline.py``):
    ``pp`` stages of ``num_layers / pp`` layers each (Megatron's rank order: a stage is a
    contiguous block of GPUs / pp), ``vpp`` model chunks per stage (interleaved schedule),
    ``microbatches`` per global batch, formed by ``balance_microbatches`` (``balanced``) or in
    arrival order (``arrival``). ``pp == 1``: no pipeline (the other fields are unused)."""

    SECTION = "pipeline"

    pp: int = setting(1, "pipeline-parallel stages (Megatron's --pipeline-model-parallel-size);"
                      " layers split evenly over them")
    vpp: int = setting(1, "model chunks per stage: Megatron's interleaved schedule (layers / "
                       "(pp x vpp) = --num-layers-per-virtual-pipeline-stage); needs pp >= 2")
    microbatches: int | None = setting(None, "micro-batches per global batch (default: 4 x pp;"
                                       " a multiple of pp when vpp > 1)")
    microbatch_order: str = setting("balanced", "how documents are grouped into micro-batches:"
                                    " balanced for the pipeline, or in arrival order (equal "
                                    "tokens)", choices=MICROBATCH_ORDERS)

    def __post_init__(self) -> None:
        plain_integers(self)  # numpy's integers as ints
        require_positive_int("pipeline.pp", self.pp)
        require_positive_int("pipeline.vpp", self.vpp)
        require(self.vpp == 1 or self.pp >= 2, "pipeline.vpp", self.vpp,
                "1 when pipeline.pp is 1 (the interleaved schedule needs pipeline.pp >= 2)")
        if self.microbatches is not None:
            require_positive_int("pipeline.microbatches", self.microbatches)
            require(self.vpp == 1 or self.microbatches % self.pp == 0, "pipeline.microbatches",
                    self.microbatches, f"a multiple of pipeline.pp={self.pp} with "
                    f"pipeline.vpp={self.vpp} "
                    "(megatron-core's interleaved schedule)")
        require(self.microbatch_order in MICROBATCH_ORDERS, "pipeline.microbatch_order",
                self.microbatch_order, f"one of {list(MICROBATCH_ORDERS)}")

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or 4 * self.pp

    def check(self, model: ModelSpec, ranks: int) -> None:
        """Raise ``ConfigError`` unless ``model``'s layers and ``ranks`` (GPUs / TP) split
        evenly over the stages and chunks (the error names the flag: ``--pp=3 is invalid``)."""
        try:
            self._check(model, ranks)
        except ConfigError as exc:
            raise ConfigError(reword(str(exc), PipelineSpec)) from None

    def _check(self, model: ModelSpec, ranks: int) -> None:
        require(model.num_layers % self.pp == 0, "pipeline.pp", self.pp,
                f"a divisor of num_layers={model.num_layers} ({model.name})")
        require(model.num_layers % (self.pp * self.vpp) == 0, "pipeline.vpp", self.vpp,
                f"pp x vpp dividing num_layers={model.num_layers} ({model.name}), pp={self.pp}")
        require(ranks % self.pp == 0, "pipeline.pp", self.pp,
                f"a divisor of the {ranks} ranks (GPUs / TP)")


def load_model(name_or_path: str | os.PathLike) -> ModelSpec:
    """The model YAML's ``ModelSpec``; ConfigError naming the file for a bad field, and for
    ``window_layers: 0`` with a window (no layer would have it: the simulator builds such a
    spec for a model's dense layers, a user file means a mistake)."""
    path = resolve_config_path(name_or_path, "models")
    spec = from_dict(ModelSpec, read_yaml(path), where=str(path))
    if spec.window_size is not None and spec.window_layers == 0:
        raise ConfigError(f"{path}: window_layers=0 is invalid with window_size "
                          f"{spec.window_size}: expected 1 to num_layers={spec.num_layers} "
                          "layers with the window (or no window_size)")
    return spec


def load_hardware(name_or_path: str | os.PathLike) -> HardwareProfile:
    path = resolve_config_path(name_or_path, "hardware")
    return from_dict(HardwareProfile, read_yaml(path), where=str(path))


def hardware_for(cluster: ClusterSpec, kernel: str | None = None) -> HardwareProfile:
    """The hardware profile of ``cluster`` for the attention ``kernel`` that will run.

    The cluster's ``hardware:`` names the profile of its default kernel (the native backend's
    ``fa2`` on GPUs); the profile of another kernel for the same GPU is ``<hardware>-<kernel>``
    (``h100-fa3``). None: the cluster's own. ConfigError when no profile describes ``kernel``,
    naming what to measure (``zeppelin calibrate --backend ... --output ...``).
    """
    default = load_hardware(cluster.hardware)
    if kernel is None or default.kernel == kernel:
        return default
    require(kernel in ATTENTION_KERNELS, "attention kernel", kernel,
            f"one of {list(ATTENTION_KERNELS)}")
    name = f"{cluster.hardware}-{kernel}"
    try:
        profile = load_hardware(name)
    except ConfigError:
        raise ConfigError(f"cluster {cluster.name!r}: no hardware profile describes attention "
                          f"kernel {kernel!r} ({cluster.hardware!r} describes "
                          f"{default.kernel!r}); measure one with `zeppelin calibrate --device "
                          f"cuda --backend ... --output {name}.yaml` and pass it as the hardware "
                          "profile") from None
    require(profile.kernel == kernel, f"hardware profile {name!r} kernel", profile.kernel,
            f"{kernel!r} (its file name says so)")
    return profile


def load_cluster(name_or_path: str | os.PathLike, nodes: int | None = None) -> ClusterSpec:
    """The cluster of a YAML file or shipped name; its ``hardware:`` is a shipped profile's
    name or a YAML path, a relative one read from the cluster file's folder where it is there
    (else from the working folder); checked here, an error naming the cluster file and key."""
    path = resolve_config_path(name_or_path, "clusters")
    try:
        cluster = from_dict(ClusterSpec, read_yaml(path), where=str(path))
    except ConfigError as exc:  # the file's key as the file spells it (not a flag's setting)
        raise ConfigError(str(exc).replace(f"{path}: cluster.", f"{path}: ", 1)) from None
    hardware = Path(cluster.hardware)
    beside = path.parent / hardware
    if hardware.suffix in (".yaml", ".yml") and not hardware.is_absolute() and beside.exists():
        cluster = dataclasses.replace(cluster, hardware=str(beside))
    try:
        profile = resolve_config_path(cluster.hardware, "hardware")
    except ConfigError as exc:
        raise ConfigError(f"{path}: hardware={hardware!s}: {exc}") from None
    if not profile.is_file():
        raise ConfigError(f"{path}: hardware={hardware!s} is invalid: expected a hardware "
                          "profile YAML file or a shipped name, not a folder")
    return cluster.with_nodes(nodes) if nodes is not None else cluster


@dataclass(frozen=True)
class Setup:
    """What the planner, cost model and simulator need, loaded together."""

    model: ModelSpec
    cluster: ClusterSpec
    hardware: HardwareProfile
    zeppelin: ZeppelinConfig = field(default_factory=ZeppelinConfig)
    tp: int = 1


def load_setup(model: str, cluster: str, nodes: int | None = None, hardware: str | None = None,
               zeppelin: ZeppelinConfig | None = None, tp: int = 1) -> Setup:
    """Load model + cluster (+ the cluster's hardware profile unless ``hardware`` is given)."""
    cluster_spec = load_cluster(cluster, nodes)
    cluster_spec.topology(tp)  # validates tp against gpus_per_node
    return Setup(model=load_model(model), cluster=cluster_spec,
                 hardware=load_hardware(hardware or cluster_spec.hardware),
                 zeppelin=zeppelin or ZeppelinConfig(), tp=tp)
