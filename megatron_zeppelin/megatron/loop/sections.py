"""The sections of ``TrainConfig`` (``args.py``): frozen dataclasses whose fields are declared
once with ``options.setting`` (flag, YAML key, default, check). Megatron-LM's names; each section
validates itself in ``__post_init__`` and names the flag, the value and what is allowed."""
from __future__ import annotations

import argparse
import ast
import os
from dataclasses import dataclass

from megatron_zeppelin.config import MAX_WINDOW
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.options import from_flags, integer, only_with, require, setting
from megatron_zeppelin.output_paths import writable_file
from megatron_zeppelin.planner import STRATEGIES, dynamic_cp
from megatron_zeppelin.runtime.kernels import choices as attention_backends

MODES = ("static", "zeppelin")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
DEVICES = ("cpu", "cuda")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ZEPPELIN_PREFIX = "zeppelin-"
MICROBATCH_ORDERS = ("auto", "balanced", "arrival")  # megatron/loop/microbatch_order.py
LOAD_ONLY = ("exit_on_missing_checkpoint", "load_optim", "load_rng",
             "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


FLOAT32_MAX = 3.4028234663852886e38
SEED_BELOW = 2 ** 31


def _at_least(section, minimum, *names: str) -> None:
    """Each set field of ``names`` is >= ``minimum`` (errors say ``<section>.<field>=``)."""
    for name in names:
        value = getattr(section, name)
        if value is not None:
            require(value >= minimum, f"{section.SECTION}.{name}", value, f">= {minimum}")


@dataclass(frozen=True)
class ModelArgs:
    SECTION = "model"
    num_layers: int | None = setting(None, "transformer layers (required)")
    hidden_size: int | None = setting(None, "hidden size (required)")
    num_attention_heads: int | None = setting(None, "attention heads (required)")
    num_query_groups: int | None = setting(None, "KV heads (GQA); default: one per head")
    ffn_hidden_size: int | None = setting(None, "FFN hidden size; default: 4 x hidden")
    vocab_size: int | None = setting(None, "vocabulary size (the built-in byte corpus needs "
                                     ">= 256)")
    normalization: str = setting("RMSNorm", "normalization layer", choices=NORMALIZATIONS)
    swiglu: bool = setting(True, "SwiGLU MLP (else GELU)")
    seq_length: int | None = setting(None, "tokens of a sample (Megatron's meaning: a CP group "
                                     "runs micro-batch x seq-length tokens); also the longest "
                                     "document, longer ones follow --zeppelin-overlong")
    mtp_num_layers: int | None = setting(None, "multi-token prediction: MTP layers, each "
                                         "predicting one token further (DeepSeek-V3; default: "
                                         "none)")
    mtp_loss_scaling_factor: float = setting(0.1, "multi-token prediction: weight of the mean "
                                             "of the MTP losses in the training loss")

    def __post_init__(self) -> None:
        _at_least(self, 1, "num_layers", "hidden_size", "num_attention_heads",
                  "num_query_groups", "ffn_hidden_size", "vocab_size", "mtp_num_layers")
        _at_least(self, 2, "seq_length")  # a sample of one token has no label
        _at_least(self, 0, "mtp_loss_scaling_factor")
        only_with(self, ("mtp_loss_scaling_factor",), self.mtp_num_layers is not None,
                  "with --mtp-num-layers (it weighs the multi-token prediction losses)")
        heads = self.num_attention_heads
        if heads is not None and self.num_query_groups is not None:
            require(heads % self.num_query_groups == 0, "model.num_query_groups",
                    self.num_query_groups, f"a divisor of --num-attention-heads={heads}")
        if heads is not None and self.hidden_size is not None:
            require(self.hidden_size % heads == 0, "model.hidden_size", self.hidden_size,
                    f"a multiple of --num-attention-heads={heads}")

    def mtp_fields(self) -> dict:
        """The ``TransformerConfig`` fields of multi-token prediction (none without it)."""
        if self.mtp_num_layers is None:
            return {}
        return {"mtp_num_layers": self.mtp_num_layers,
                "mtp_loss_scaling_factor": self.mtp_loss_scaling_factor}


def _window_pair(text: str | None) -> tuple[int, int] | None:
    """``--window-size`` as Megatron-LM parses it (``"L,0"`` or ``"(L,0)"``), or None."""
    if text is None:
        return None
    try:
        pair = tuple(integer(x) for x in str(text).strip("()").split(","))
    except ValueError:
        pair = ()
    require(len(pair) == 2 and 0 <= pair[0] < MAX_WINDOW and pair[1] == 0,
            "attention.window_size", text, f"'L,0' with 0 <= L < {MAX_WINDOW}: each token sees "
            "itself and the L tokens before it (zeppelin and static modes run causal "
            "attention)")
    return pair


def skip_freq(text: str | None, num_layers: int | None,
               what: str = "attention.window_attn_skip_freq") -> int | list[int] | None:
    """``--window-attn-skip-freq``: an integer N (every N-th layer full attention) or a list
    of 0/1 per layer (1: sliding window), as megatron-core's ``window_attn_skip_freq``."""
    if text is None:
        return None
    try:
        value = ast.literal_eval(str(text).strip())
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, int) and not isinstance(value, bool):
        require(value >= 1, what, text, "an integer >= 1")
        return value
    ok = isinstance(value, (list, tuple)) and all(v in (0, 1) for v in value) and (
        num_layers is None or len(value) == num_layers)
    layers = "" if num_layers is None else f"{num_layers} layers; "
    require(ok, what, text, "an integer N >= 1 or a list of 0/1 "
            f"per layer ({layers}1: sliding window), e.g. [1,1,0]")
    require(any(value), what, text, "a pattern with at least one windowed layer (1): this one "
            "gives no layer the window; drop --window-size for full attention")
    return list(value)


# megatron-core's TransformerConfig.softmax_type (megatron/common/sink.py runs the other two)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


@dataclass(frozen=True)
class AttentionArgs:
    """Multi-latent attention, sliding windows and attention sinks, with Megatron-LM's flags
    and defaults
    (MLA's RoPE is YaRN with scaling factor 1.0, as Megatron-LM builds it by default)."""

    SECTION = "attention"
    multi_latent_attention: bool = setting(False, "multi-latent attention (DeepSeek-V2/V3)")
    q_lora_rank: int | None = setting(None, "MLA: rank of the query's low-rank projection "
                                      "(default: a full query projection)")
    kv_lora_rank: int = setting(32, "MLA: rank of the key/value low-rank projection")
    qk_head_dim: int = setting(128, "MLA: query/key head dim without the RoPE part")
    qk_pos_emb_head_dim: int = setting(64, "MLA: query/key head dim of the RoPE part")
    v_head_dim: int = setting(128, "MLA: value head dim")
    window_size: str | None = setting(None, "sliding-window attention 'L,0': each token sees "
                                      "itself and the L tokens before it in its document")
    window_attn_skip_freq: str | None = setting(
        None, "with --window-size: every N-th layer is full attention (N), or a list of 0/1 "
        "per layer, 1 = sliding window (e.g. [1,1,1,0])")
    softmax_type: str = setting(
        "vanilla", "attention softmax: vanilla, off-by-one (a sink logit 0 per head) or "
        "learnable (a trained sink logit per head, GPT-OSS style)", choices=SOFTMAX_TYPES)

    def __post_init__(self) -> None:
        _at_least(self, 1, "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim")
        require(self.qk_pos_emb_head_dim % 2 == 0, "attention.qk_pos_emb_head_dim",
                self.qk_pos_emb_head_dim, "an even number (RoPE rotates pairs of dims)")
        only_with(self, MLA_DIMS, self.multi_latent_attention,
                  "with --multi-latent-attention (a dim of its projections)")
        _window_pair(self.window_size)
        skip_freq(self.window_attn_skip_freq, None)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "AttentionArgs":
        """The section from parsed flags (ours; Megatron-LM's namespace has the same names)."""
        return from_flags(cls, args)

    def config_fields(self, num_layers: int) -> dict:
        """The ``TransformerConfig``/``MLATransformerConfig`` fields these flags set."""
        fields = {}
        if self.window_size is not None:
            fields.update(window_size=_window_pair(self.window_size),
                          window_attn_skip_freq=skip_freq(self.window_attn_skip_freq,
                                                           num_layers))
        if self.softmax_type != "vanilla":
            fields.update(softmax_type=self.softmax_type)
        if self.multi_latent_attention:
            fields.update(multi_latent_attention=True, q_lora_rank=self.q_lora_rank,
                          kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_head_dim,
                          qk_pos_emb_head_dim=self.qk_pos_emb_head_dim,
                          v_head_dim=self.v_head_dim, rotary_scaling_factor=1.0)
        return fields

    def windows(self, num_layers: int) -> tuple[int | None, ...]:
        """The distinct per-layer sliding windows (None: full causal), for the engine."""
        if self.window_size is None:
            return (None,)
        pattern = skip_freq(self.window_attn_skip_freq, num_layers)
        if pattern is None:
            return (_window_pair(self.window_size)[0],)
        layers = [i % pattern != 0 if isinstance(pattern, int) else bool(pattern[i - 1])
                  for i in range(1, num_layers + 1)]
        window = _window_pair(self.window_size)[0]
        return tuple(sorted({window if w else None for w in layers}, key=lambda w: w or -1))


@dataclass(frozen=True)
class ParallelArgs:
    SECTION = "parallel"
    tensor_model_parallel_size: int = setting(1, "tensor-parallel size")
    context_parallel_size: int = setting(1, "context-parallel size: the ranks of a pool")
    pipeline_model_parallel_size: int = setting(
        1, "pipeline stages (Megatron's 1F1B schedule; every stage plans each micro-batch from "
        "the same document lengths, so all run the same plan)")
    num_layers_per_virtual_pipeline_stage: int | None = setting(
        None, "layers per virtual pipeline stage: each stage holds (layers / PP) / N model "
        "chunks and runs Megatron's interleaved schedule (needs PP > 1)")
    context_parallel_mode: str = setting(
        "static", "static: every document zigzag over the CP group (TE/Megatron CP); zeppelin: "
        "hierarchical partitioning, routing and remapping", choices=MODES)
    overlap_grad_reduce: bool = setting(
        True, "reduce each gradient bucket (DP x CP) as soon as its backward is done, "
        "overlapping the last micro-batch's backward (Megatron DDP; --no-overlap-grad-reduce: "
        "one exposed reduction after the backward, Megatron-LM's default)")
    use_distributed_optimizer: bool = setting(
        False, "shard the Adam state and fp32 main parameters over the data-parallel group "
        "(DP x CP: Megatron's DistributedOptimizer; gradients are reduce-scattered, parameters "
        "all-gathered after the step)")
    use_megatron_fsdp: bool = setting(
        False, "Megatron-FSDP (megatron-core's fully sharded data parallel over DP x CP, with "
        "its distributed optimizer); what it shards: --data-parallel-sharding-strategy")
    data_parallel_sharding_strategy: str = setting(
        "no_shard", "with --use-megatron-fsdp, what is sharded over DP x CP (Megatron-LM's "
        "flag): no_shard, optim (Adam state), optim_grads (+ gradients), optim_grads_params "
        "(+ parameters, gathered per layer: full FSDP)", choices=SHARDING_STRATEGIES)
    use_torch_fsdp2: bool = setting(
        False, "torch FSDP2 (fully_shard) over DP x CP through megatron-core's "
        "TorchFullyShardedDataParallel: parameters, gradients and Adam state sharded per "
        "layer, with the plain optimizer (Megatron-LM's flag)")

    def __post_init__(self) -> None:
        _at_least(self, 1, "tensor_model_parallel_size", "context_parallel_size",
                  "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")


@dataclass(frozen=True)
class OptimArgs:
    """Adam and Megatron's learning-rate schedule (megatron-core's ``OptimizerParamScheduler``:
    linear warmup from 0 over ``lr_warmup_iters``, then decay to ``min_lr`` at
    ``lr_decay_iters``, ``min_lr`` after)."""

    SECTION = "optim"
    lr: float = setting(1e-3, "peak learning rate (after warmup)")
    min_lr: float = setting(0.0, "learning rate at the end of the decay (<= --lr)")
    lr_warmup_iters: int = setting(0, "iterations of linear warmup from 0 to --lr")
    lr_decay_style: str = setting("linear", "decay from --lr to --min-lr after warmup",
                                  choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = setting(None, "iteration at which the decay reaches --min-lr "
                                         "(default: --train-iters)")
    weight_decay: float = setting(0.01, "weight decay")
    clip_grad: float = setting(1.0, "gradient clipping norm (0: off)")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.95, "Adam beta2")

    def __post_init__(self) -> None:
        _at_least(self, 0.0, "lr", "min_lr", "weight_decay", "clip_grad")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad"):  # the optimizer's fp32 steps
            require(getattr(self, name) <= FLOAT32_MAX, f"optim.{name}", getattr(self, name),
                    f"a number <= {FLOAT32_MAX:.4g} (float32's largest)")
        _at_least(self, 0, "lr_warmup_iters")
        _at_least(self, 1, "lr_decay_iters")
        require(self.min_lr <= self.lr, "optim.min_lr", self.min_lr,
                f"a rate <= --lr {self.lr!r} (the schedule decays from --lr to --min-lr)")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"optim.{name}", value, "a number in [0, 1)")


def schedule(args: argparse.Namespace) -> dict:
    """The values of megatron-core's ``OptimizerParamScheduler`` these flags give, in samples
    (iterations x --global-batch-size), as Megatron-LM computes them: LR warmup and decay,
    and a constant weight decay whose increment spans --train-iters (``wd_incr_steps``).
    The keys are those of the scheduler's ``state_dict`` (what a checkpoint holds)."""
    samples = args.global_batch_size
    return dict(max_lr=args.lr, min_lr=args.min_lr,
                lr_warmup_steps=args.lr_warmup_iters * samples,
                lr_decay_steps=(args.lr_decay_iters or args.train_iters) * samples,
                lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
                end_wd=args.weight_decay, wd_incr_steps=args.train_iters * samples,
                wd_incr_style="constant")


@dataclass(frozen=True)
class TrainingArgs:
    SECTION = "training"
    micro_batch_size: int = setting(1, "samples of --seq-length tokens per micro-batch and pool")
    global_batch_size: int | None = setting(None, "samples per iteration (required)")
    train_iters: int | None = setting(None, "iterations to train (required)")
    exit_interval: int | None = setting(None, "stop after an iteration divisible by this "
                                        "(saving a checkpoint first when --save is set)")
    seed: int = setting(1234, "random seed")
    device: str = setting("cuda", "where to train", choices=DEVICES)
    bf16: bool = setting(False, "bf16 parameters (as Megatron-LM's Float16Module), gradients "
                         "accumulated and reduced in fp32, fp32 main weights in the optimizer")

    def __post_init__(self) -> None:
        _at_least(self, 1, "micro_batch_size", "global_batch_size", "train_iters",
                  "exit_interval")
        _at_least(self, 0, "seed")
        require(self.seed < SEED_BELOW, "training.seed", self.seed,
                f"an integer in [0, {SEED_BELOW}) (Megatron seeds torch and numpy with it plus "
                "per-rank offsets)")


@dataclass(frozen=True)
class DataArgs:
    SECTION = "data"
    mock_data: bool = setting(False, "train on the built-in corpus (Python stdlib sources as "
                              "bytes)")
    data_path: str | None = setting(None, "Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    microbatch_order: str = setting(
        "auto", "how each global batch's documents form the micro-batches: balanced (regrouped "
        "and ordered for the pipeline and the data-parallel replicas by their estimated "
        "compute; the loss and gradients do not change), arrival (packed in stream order), "
        "auto (balanced with --pipeline-model-parallel-size > 1, else arrival)",
        flag="--zeppelin-microbatch-order", choices=MICROBATCH_ORDERS)


@dataclass(frozen=True)
class CheckpointArgs:
    """Megatron's distributed checkpoints (``docs/training.md``): ``{save}/iter_NNNNNNN/`` in
    megatron-core's ``dist_checkpointing`` format and ``latest_checkpointed_iteration.txt``."""

    SECTION = "checkpoint"
    save: str | None = setting(None, "folder to save checkpoints to (at the end, and every "
                               "--save-interval iterations)")
    load: str | None = setting(None, "folder to resume from: its latest checkpoint (model, "
                               "optimizer, LR schedule, RNG states, data position); an empty "
                               "or missing folder starts from scratch, as in Megatron")
    save_interval: int | None = setting(None, "iterations between checkpoints (with --save; "
                                        "the startup banner says when it goes unused)")
    exit_on_missing_checkpoint: bool = setting(False, "with --load: refuse to start when the "
                                               "folder holds no checkpoint")
    load_optim: bool = setting(True, "with --load: restore the optimizer state and LR schedule")
    load_rng: bool = setting(True, "with --load: restore the RNG states")
    override_opt_param_scheduler: bool = setting(
        False, "with --load: the LR and weight-decay schedule of these flags replaces the "
        "checkpoint's (Megatron-LM's flag; the step count still comes from the checkpoint)",
        flag="--override-opt_param-scheduler", aliases=("--override-opt-param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = setting(
        False, "with --load: keep the checkpoint's LR and weight-decay schedule, whatever these "
        "flags say (Megatron-LM's flag)", flag="--use-checkpoint-opt_param-scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler",))

    def __post_init__(self) -> None:
        _at_least(self, 1, "save_interval")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler cannot be used together: "
                              "take the schedule of the flags or of the checkpoint")
        only_with(self, LOAD_ONLY, self.load is not None, "with --load (it says how to resume)")
        if self.load is not None:
            require(not os.path.isfile(self.load), "checkpoint.load", self.load,
                    "a checkpoint folder (this is a file)")


@dataclass(frozen=True)
class LoggingArgs:
    SECTION = "logging"
    log_interval: int = setting(1, "iterations between log lines")
    tensorboard_dir: str | None = setting(None, "TensorBoard folder")
    log_json: str | None = setting(None, "rank 0 appends one JSON object per iteration here")

    def __post_init__(self) -> None:
        _at_least(self, 1, "log_interval")


@dataclass(frozen=True)
class ZeppelinRuntimeArgs:
    """Zeppelin options that are not planner options (flags ``--zeppelin-<field>``)."""

    SECTION = "zeppelin"
    strategy: str = setting(
        "zeppelin", "what plans each micro-batch in --context-parallel-mode zeppelin: "
        f"{sorted({*STRATEGIES, dynamic_cp.NAME})} (the peers as their users run them, on "
        "the same engine and data; each strategy's options are flags too: --zeppelin-cp-size, "
        "--max-seqlen-per-dp-cp-rank, ...)")
    cluster: str | None = setting(None, "cluster YAML (path or shipped name) for the planner's "
                                  "cost model")
    hardware: str | None = setting(None, "hardware profile YAML (default: the cluster's)")
    gpus_per_node: int | None = setting(
        None, "GPUs per node (default: torchrun's local world size); on CPU this groups ranks "
        "into emulated nodes; CP x TP must be whole nodes")
    attention_backend: str = setting("auto", "attention kernel (auto: native on CUDA fp16/bf16, "
                                     "torch otherwise)", choices=attention_backends())
    validate_plan: bool = setting(False, "check every plan's contract (Plan.validate) before "
                                  "using it")
    planner_process: bool = setting(True, "plan in a separate process (never holding the "
                                    "training process's GIL); --no-zeppelin-planner-process "
                                    "plans on a thread of the training process")
    watchdog_timeout: float = setting(
        20.0, "seconds a rank may go without a heartbeat before every other rank stops and "
        "names it (frozen, or killed on another node); 0 turns the watchdog off")

    fit_interval: int = setting(
        0, "iterations between refits of the hardware profile from this run's measurements "
        "(runtime/probe.py, fit.py): rank 0 combines every rank's fit and broadcasts it, every "
        "rank's planner switches at the same micro-batch; 0 turns fitting off")
    profile_out: str | None = setting(
        None, "write the fitted hardware profile YAML here after every refit (for "
        "--zeppelin-hardware of the next run and zeppelin plan/simulate --hardware)")

    def __post_init__(self) -> None:
        _at_least(self, 1, "gpus_per_node")
        require(self.watchdog_timeout == 0 or self.watchdog_timeout >= 1.0,
                "zeppelin.watchdog_timeout", self.watchdog_timeout,
                "0 (off) or seconds >= 1 (heartbeats go every min(1 s, T/4) through the store)")
        require(self.strategy in STRATEGIES or self.strategy == dynamic_cp.NAME,
                "zeppelin.strategy", self.strategy, f"one of {list(STRATEGIES)}")
        require(self.strategy in STRATEGIES, "zeppelin.strategy", self.strategy,
                f"one of {list(STRATEGIES)} ({dynamic_cp.NAME} needs megatron-core's "
                f"{dynamic_cp.CLASS}, which the installed megatron-core does not have)")
        _at_least(self, 0, "fit_interval")
        if self.profile_out is not None:
            require(self.fit_interval > 0, "zeppelin.profile_out", self.profile_out,
                    "given only with --zeppelin-fit-interval > 0 (nothing is fitted otherwise)")
            require(writable_file(self.profile_out), "zeppelin.profile_out", self.profile_out,
                    "a file in an existing, writable folder (not a folder)")
