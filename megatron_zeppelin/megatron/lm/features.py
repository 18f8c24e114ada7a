"""Which Megatron-LM features zeppelin mode supports, and how the others are refused.

One table, ``RULES``: each ``Rule`` names a Megatron-LM flag, when its value is refused in
``--context-parallel-mode zeppelin`` and what to use instead. ``refusals(args)`` returns one
message per refused setting (``lm.validate_megatron_lm_args`` raises on the first);
``docs/megatron-lm.md`` shows the same table (a test checks that every flag here is named there).
Supported features need no rule: they run through Megatron's own code (the builder, the data
pipeline, the optimizer) with only core attention and the batch layout changed (``lm.py``).

Values are read with ``getattr(args, name, default)``: Megatron-LM's experimental ``--yaml-cfg``
namespace may lack keys its parser would have defaulted. Standard library only (and the
FSDP reasons of ``common/fsdp_limits.py``, which our script's checks share).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from megatron_zeppelin.megatron.common import fsdp_limits


@dataclass(frozen=True)
class Rule:
    """``flag`` (the Megatron-LM flag), ``name`` (its ``args`` attribute), ``default`` (its
    parser default), ``refused(value, args)`` and the ``alternative`` the message offers."""

    flag: str
    name: str
    default: Any
    refused: Callable[[Any, argparse.Namespace], bool]
    reason: str
    alternative: str
    given: str | None = None  # how the message names the setting (default: flag=value)
    fixed_in: tuple[int, int, int] | None = None  # megatron-core version that needs no refusal

    def check(self, args: argparse.Namespace,
              version: tuple[int, int, int] | None = None) -> str | None:
        """The refusal message, or None. ``version``: megatron-core's (None: unknown, so a rule
        with ``fixed_in`` refuses)."""
        if self.fixed_in is not None and version is not None and tuple(version) >= self.fixed_in:
            return None
        value = getattr(args, self.name, self.default)
        if not self.refused(value, args):
            return None
        given = self.given or f"{self.flag}={_show(value)}"
        return (f"{given} is not supported with --context-parallel-mode "
                f"zeppelin: {self.reason}; {self.alternative}")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(getattr(value, "name", value))


def _set(value: Any, args: argparse.Namespace) -> bool:
    return value not in (None, False, 0, [], ())


def _get(args: argparse.Namespace, name: str, default: Any) -> Any:
    return getattr(args, name, default)


def _virtual_stages(args: argparse.Namespace) -> bool:
    """Whether Megatron-LM's flags ask for virtual pipeline stages (before ``validate_args``
    derives ``virtual_pipeline_model_parallel_size``)."""
    return _get(args, "pipeline_model_parallel_size", 1) > 1 and any(
        _get(args, name, None) is not None for name in (
            "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
            "pipeline_model_parallel_layout"))


def _causal_window(value: Any) -> bool:
    """Whether Megatron's ``window_size`` is ``(L, 0)`` with ``L >= 0`` (or ``-1``: none)."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and value[0] >= -1 \
        and value[1] == 0


STATIC_ONLY = "use --context-parallel-mode static for it"
NO_GRAPH = "token counts and rings change every micro-batch, so no graph can be captured"

RULES: tuple[Rule, ...] = (
    Rule("--no-overlap-p2p-communication", "overlap_p2p_comm", True,
         lambda v, a: not v and _virtual_stages(a),
         "with virtual pipeline stages zeppelin's ordered pipeline P2P sends one direction per "
         "call, overlapped, as Megatron-LM's default does (megatron/common/pipeline_p2p.py)",
         "drop the flag", given="--no-overlap-p2p-communication"),
    Rule("--calculate-per-token-loss", "calculate_per_token_loss", False,
         lambda v, a: not v, "ranks of a pool hold different token counts, so the loss must be "
         "normalised over the tokens of the whole global batch", "pass --calculate-per-token-loss"),
    Rule("--attention-dropout", "attention_dropout", 0.1, lambda v, a: v > 0.0,
         "zeppelin attention has no dropout (Megatron-LM's default is 0.1)",
         "pass --attention-dropout 0.0"),
    Rule("--position-embedding-type", "position_embedding_type", "learned_absolute",
         lambda v, a: v in ("mrope", "relative"), "only rope, yarn, learned_absolute and none "
         "position embeddings take per-token positions", STATIC_ONLY),
    Rule("--hybrid-context-parallel", "hybrid_context_parallel", False, _set,
         "Megatron's hybrid CP and zeppelin are alternative schedulers", "pick one of the two"),
    Rule("--hierarchical-context-parallel-sizes", "hierarchical_context_parallel_sizes", None,
         _set, "the planner chooses each sequence's ring and tier itself",
         "drop the flag (set --zeppelin-gpus-per-node for the node size)"),
    Rule("--cp-comm-type", "cp_comm_type", ["p2p"],
         lambda v, a: list(v if isinstance(v, (list, tuple)) else [v]) != ["p2p"],
         "it selects static CP's attention communication", STATIC_ONLY),
    Rule("--multi-latent-attention", "multi_latent_attention", False,
         lambda v, a: bool(v) and _get(a, "apply_rope_fusion", True),
         "with RoPE fusion MLA's fused kernels rotate by buffer position 0..n-1, and the packed "
         "linear layout needs in-document positions", "pass --no-rope-fusion"),
    Rule("--experimental-attention-variant", "experimental_attention_variant", None, _set,
         "zeppelin core attention implements standard (GQA) and multi-latent attention",
         STATIC_ONLY),
    Rule("--window-size", "window_size", None, lambda v, a: _set(v, a) and not _causal_window(v),
         "zeppelin attention is causal: a window sees the L tokens before each token and none "
         "after it", "use --window-size L,0 (L >= 0)"),
    Rule("--use-legacy-models", "use_legacy_models", False, _set,
         "the zeppelin model is a megatron-core GPTModel", "drop --use-legacy-models"),
    Rule("--transformer-impl", "transformer_impl", "transformer_engine",
         lambda v, a: v == "inference_optimized", "training needs local or transformer_engine "
         "layers", "use --transformer-impl transformer_engine or local"),
    Rule("--attention-backend", "attention_backend", "auto",
         lambda v, a: _show(v) != "auto", "it selects Transformer Engine's attention kernel, "
         "which zeppelin core attention replaces", "set --zeppelin-attention-backend instead"),
    Rule("--use-kitchen-attention", "use_kitchen_attention", False, _set,
         "it replaces core attention, as zeppelin does", STATIC_ONLY),
    Rule("--qk-clip", "qk_clip", False, _set,
         "it reads attention logits from Transformer Engine's kernel", STATIC_ONLY),
    Rule("--log-max-attention-logit", "log_max_attention_logit", False, _set,
         "it reads attention logits from Transformer Engine's kernel", STATIC_ONLY),
    Rule("--fp8-format", "fp8", None, _set,
         "FP8 GEMMs need token counts in multiples of 16 and are untested with the linear "
         "layout", "train in bf16 or use --context-parallel-mode static"),
    Rule("--fp4-format", "fp4", None, _set,
         "FP4 GEMMs need fixed token multiples and are untested with the linear layout",
         "train in bf16 or use --context-parallel-mode static"),
    Rule("--enable-cuda-graph", "enable_cuda_graph", False, _set, NO_GRAPH,
         "drop the flag"),
    Rule("--cuda-graph-impl", "cuda_graph_impl", "none", lambda v, a: v != "none",
         NO_GRAPH, "use --cuda-graph-impl none"),
    Rule("--external-cuda-graph", "external_cuda_graph", False, _set, NO_GRAPH,
         "drop the flag"),
    Rule("--tp-comm-overlap", "tp_comm_overlap", False, _set,
         "Transformer Engine's userbuffers are sized for a fixed micro-batch x seq-length, "
         "and a rank's token count changes every micro-batch", "drop the flag"),
    Rule("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", False, _set,
         "its schedule builds the model's forward without the packed batch layout",
         "drop the flag"),
    Rule("--moe-token-dispatcher-type", "moe_token_dispatcher_type", "allgather",
         lambda v, a: v == "allgather" and _get(a, "expert_model_parallel_size", 1) > 1,
         "the allgather dispatcher gathers equal token counts over expert-parallel ranks, and "
         "the ranks of a pool hold different counts", "use --moe-token-dispatcher-type alltoall"),
    Rule("--moe-router-load-balancing-type", "moe_router_load_balancing_type", "aux_loss",
         lambda v, a: "seq_aux_loss" in (v if isinstance(v, (list, tuple)) else [v])
         and _get(a, "micro_batch_size", 1) > 1,
         "the sequence-level loss needs one sample per micro-batch once samples are packed",
         "use --micro-batch-size 1 or another load-balancing type"),
    Rule("--use-tp-pp-dp-mapping", "use_tp_pp_dp_mapping", False, _set,
         "pools are Megatron's CP groups in its default rank order (TP, CP, DP)",
         "drop the flag"),
    Rule("--use-megatron-fsdp", "use_megatron_fsdp", False,
         lambda v, a: bool(v) and not _get(a, "use_distributed_optimizer", False),
         fsdp_limits.PLAIN_OPTIMIZER, "add --use-distributed-optimizer, or use Megatron-LM "
         "core_v0.18.2 or later", given="--use-megatron-fsdp without --use-distributed-optimizer",
         fixed_in=fsdp_limits.PLAIN_OPTIMIZER_EXACT),
    Rule("--data-parallel-sharding-strategy", "data_parallel_sharding_strategy", "no_shard",
         lambda v, a: v == "no_shard" and _get(a, "use_megatron_fsdp", False),
         f"(Megatron-LM's default) {fsdp_limits.NO_SHARD}",
         "pass --data-parallel-sharding-strategy optim_grads_params, optim_grads or optim, or "
         "use Megatron-LM core_v0.18.2 or later", fixed_in=fsdp_limits.NO_SHARD_EXACT),
    Rule("--overlap-grad-reduce", "overlap_grad_reduce", False,
         lambda v, a: bool(v) and _get(a, "use_megatron_fsdp", False)
         and _get(a, "data_parallel_sharding_strategy", "no_shard") == "optim",
         f"{fsdp_limits.OPTIM_OVERLAP}; {fsdp_limits.OPTIM_OVERLAP_FIXED}",
         "drop --overlap-grad-reduce, use --data-parallel-sharding-strategy optim_grads or "
         "optim_grads_params, or Megatron-LM core_v0.17.1 or later",
         given="--overlap-grad-reduce with --use-megatron-fsdp "
               "--data-parallel-sharding-strategy optim", fixed_in=fsdp_limits.OPTIM_OVERLAP_EXACT),
    Rule("--tensor-model-parallel-size", "tensor_model_parallel_size", 1,
         lambda v, a: v > 1 and _get(a, "use_megatron_fsdp", False)
         and _get(a, "transformer_impl", "transformer_engine") == "local",
         fsdp_limits.TP_WITHOUT_TE,
         "use --transformer-impl transformer_engine, --use-distributed-optimizer under "
         "Megatron DDP, or Megatron-LM core_v0.18.2 or later",
         given="--tensor-model-parallel-size > 1 with --use-megatron-fsdp "
         "--transformer-impl local", fixed_in=fsdp_limits.TP_WITHOUT_TE_EXACT),
    Rule("--save", "save", None,
         lambda v, a: (_get(a, "use_megatron_fsdp", False) or _get(a, "use_torch_fsdp2", False))
         and (_set(v, a) or _set(_get(a, "load", None), a)),
         "Megatron-LM's checkpoints of FSDP runs have not run through this patch: "
         "Megatron-FSDP's fsdp_dtensor save fails in fp32 with --swiglu in static mode too (it "
         "looks up module.<name>, the Float16Module's; core_v0.16.1 and core_v0.19.0), with "
         "core_v0.16.1 did not finish without --swiglu on "
         "CPU/gloo, and with --bf16 fails in static mode too ('DTensor chunk metadata is "
         "invalid', uneven_dtensor.py); FSDP2's torch_dist checkpoints fail in static mode "
         "too (its optimizer matches parameters by the id of DTensor.to_local(), a new tensor "
         "each call in torch 2.13)",
         "train without --save/--load here, or use --use-distributed-optimizer (checkpoints "
         "checked), or scripts/pretrain_gpt.py (its FSDP checkpoints cross modes)",
         given="--save or --load with --use-megatron-fsdp or --use-torch-fsdp2"),
    Rule("--no-zeppelin-planner-process", "zeppelin_planner_process", True, lambda v, a: not v,
         "through Megatron-LM, get_batch plans each micro-batch on the training thread (neither "
         "a planner process nor a thread)", "drop the flag",
         given="--no-zeppelin-planner-process"),
    Rule("--zeppelin-overlong", "zeppelin_overlong", "error", lambda v, a: v != "error",
         "Megatron-LM's samples hold at most --seq-length tokens, so no sequence is ever longer "
         "than the planner's limit", "drop the flag"),
)


def refusals(args: argparse.Namespace,
             version: tuple[int, int, int] | None = None) -> list[str]:
    """One message per setting of ``args`` that zeppelin mode refuses with megatron-core
    ``version`` (None: unknown; every rule applies) (empty: all supported)."""
    return [message for rule in RULES if (message := rule.check(args, version)) is not None]
