"""megatron-core and Megatron-LM version differences, in one place.

Supported: megatron-core ``>= 0.16.1, < 0.20`` (``setup.py`` pins this range; CI tests the floor,
0.16.1, the newest release for Python 3.11). What differs across that range and where it is
handled:

* The CPU bridge (``cpu.py``) replaces megatron-core functions by name; its targets exist in
  0.16.x to 0.19.x (``CPU_BRIDGE_SERIES``; 0.19's DDP also asks for
  ``torch.cuda.current_stream``, which the bridge stands in for, and
  ``MegatronOptimizer.has_grad_norm_group`` makes a tensor on "cuda": ``CPU_BRIDGE_REDIRECTS``).
  Other versions run on GPUs
  only: ``check_cpu_bridge`` refuses them by version instead of failing inside megatron-core.
* Megatron-LM's ``get_batch_on_this_tp_rank``: at core_v0.16.1 it lives in
  ``megatron.training.utils`` and reads the data iterator itself (0.17.1 keeps it); core_v0.18
  moved it to ``megatron.core.utils``, taking the batch TP rank 0 read and the run's settings
  (core_v0.19 renamed its ``is_sft`` ``has_cu_seqlens``). ``batch_on_this_tp_rank`` is the one
  call site. The Megatron-LM patch exists for core_v0.16.1, core_v0.17.1, core_v0.18.2 and
  core_v0.19.0 (``patches/``, ``MEGATRON_LM_PATCHED``; from core_v0.18 its batch hook sits in
  ``forward_step``, ``docs/megatron-lm.md``).
* Megatron-FSDP's optim sharding with overlapped gradient reduction: not exact in 0.16.x;
  our script and the Megatron-LM patch refuse it there only (``since(fsdp_limits.
  OPTIM_OVERLAP_EXACT)``, ``lm/features`` ``fixed_in``), as every other Megatron-FSDP limit.
* A checkpoint's common state: ``common.pt`` up to 0.18, inside the shards from 0.19
  (``common_state_in_shards``); MTP's logging helper renamed its tracker key and clean-up in
  0.19 (``mtp_tracker``).
* MTP's token counts: from 0.17 the count ``roll_tensor`` returns with the loss mask also
  weighs the depth's gradient under ``calculate_per_token_loss`` (``mtp_count_scales_gradient``;
  ``mtp.py`` returns a count that keeps the gradient exact and corrects the logged loss).
* An MTP layer's transformer-layer spec: ``submodules.transformer_layer`` in 0.16,
  ``submodules.mtp_model_layer`` from 0.17 (``MTP_INNER_LAYER``; ``spec.swap_core_attention``
  swaps the core attention inside either).
* Everything else the package uses (``GPTModel._preprocess``/``forward`` with ``padding_mask``,
  ``PackedSeqParams.cp_group``, ``SelfAttention``'s core-attention constructor, layer specs as
  ``ModuleSpec``, ``BalancedCPScheduler``) has the same interface in 0.16.1 and 0.19.2 (read in
  both sources; 0.19.2's GPU run of ``scripts/pretrain_gpt.py`` is recorded in
  ``docs/megatron-lm.md``); the test suite passes with 0.18.2 and 0.19.2 on Python 3.11.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

from megatron_zeppelin.errors import ConfigError

MEGATRON_CORE_MIN = (0, 16, 1)
MEGATRON_CORE_BELOW = (0, 20, 0)
CPU_BRIDGE_SERIES = ((0, 16), (0, 17), (0, 18), (0, 19))  # series the CPU bridge is tested on
# megatron-core versions of the Megatron-LM tags with a patch in patches/ (tag core_v0.19.0
# reports 0.19.1)
MEGATRON_LM_PATCHED = ("0.16.1", "0.17.1", "0.18.2", "0.19.1")
# 0.16.x's MoE router reads te_general_gemm, imported only with TE (0.19 sets it to None): an
# MoE model without TE fails with NameError in 0.16.x on GPUs too (use TE or 0.19)
CPU_BRIDGE_MISSING_NAMES = (
    ((0, 16), "megatron.core.transformer.moe.moe_utils", "te_general_gemm", None),
)
# functions with literal CUDA devices that exist only in some series: (series, module, path)
CPU_BRIDGE_REDIRECTS = (
    ((0, 19), "megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group"),
) + tuple(  # ties the last pipeline stage's embedding copy (MTP) to the first's: weight.cuda()
    (series, "megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer") for series in CPU_BRIDGE_SERIES)
# the field of an MTP layer's submodules that holds its transformer layer's spec: renamed
# after 0.16 (``MultiTokenPredictionLayerSubmodules``)
MTP_INNER_LAYER = ("transformer_layer", "mtp_model_layer")


def since(first: tuple[int, int, int], version: tuple[int, int, int] | None = None) -> bool:
    """Whether ``version`` (default: the installed megatron-core's) is ``first`` or later."""
    return (version or megatron_core_version()) >= first


MTP_COUNT_SCALES_GRADIENT = (0, 17, 0)


def mtp_count_scales_gradient(version: tuple[int, int, int] | None = None) -> bool:
    """Whether megatron-core's MTP weighs each depth's loss by ``original / rolled`` token
    counts under ``calculate_per_token_loss`` (>= 0.17: the count ``roll_tensor`` returns
    then scales gradients; 0.16 only logs it)."""
    return since(MTP_COUNT_SCALES_GRADIENT, version)


# megatron-core 0.19 keeps a checkpoint's common (non-sharded) state as a ShardedObject
# ("common_state") inside the torch_dist shards instead of common.pt, and reads both
# (dist_checkpointing.serialization.load_common_state_dict)
COMMON_STATE_IN_SHARDS = (0, 19, 0)


def common_state_in_shards(version: tuple[int, int, int] | None = None) -> bool:
    """Whether this megatron-core may write a checkpoint's common state inside its shards
    (``COMMON_STATE_IN_SHARDS``)."""
    return since(COMMON_STATE_IN_SHARDS, version)


def fsdp_fp32_main_grads(bf16: bool) -> dict:
    """``DistributedDataParallelConfig`` fields that keep Megatron-FSDP's gradients in fp32
    under ``--bf16``, as Megatron DDP's ``grad_reduce_in_fp32`` does: from 0.18 Megatron-FSDP
    has ``megatron_fsdp_main_grads_dtype``, and 0.19 no longer follows
    ``grad_reduce_in_fp32`` when it is unset (the parameters' dtype, bf16): its bf16 gradients
    were 7e-4 off the fp32-gradient runs in grad norm after one step (measured, 0.19.2 on
    CPU). Set to fp32 wherever the field exists (0.18.2 passes the bf16 tests with it, as
    without)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig

    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    if not bf16 or "megatron_fsdp_main_grads_dtype" not in names:
        return {}
    import torch

    return {"megatron_fsdp_main_grads_dtype": torch.float32}


class MTPTracker(NamedTuple):
    """megatron-core's ``MTPLossLoggingHelper`` as this version spells it: the key of the
    per-depth losses in its ``tracker``, and its methods that reduce and clear them."""

    key: str
    reduce: Callable[[], None]
    clean: Callable[[], None]


def mtp_tracker(helper: Any) -> MTPTracker:
    """``MTPTracker`` of ``helper`` (0.19 renamed the key and both methods when it added
    acceptance rates: "loss_values", ``reduce_metrics_in_tracker``, ``clean_metrics_in_tracker``)."""
    if hasattr(helper, "clean_metrics_in_tracker"):
        return MTPTracker("loss_values", helper.reduce_metrics_in_tracker,
                          helper.clean_metrics_in_tracker)
    return MTPTracker("values", helper.reduce_loss_in_tracker, helper.clean_loss_in_tracker)


def parse_version(text: str) -> tuple[int, int, int]:
    """``'0.19.2'`` / ``'0.16.0rc0.dev1'`` -> ``(0, 19, 2)`` / ``(0, 16, 0)``."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple((parts + [0, 0, 0])[:3])


@functools.cache  # the installed megatron-core: read once (MTP asks every micro-batch)
def megatron_core_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    return parse_version(package_info.__version__)


def _show(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def megatron_core_version_text() -> str:
    """The installed megatron-core version as ``0.16.1`` (for messages)."""
    return _show(megatron_core_version())


def check_megatron_core(version: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """The installed megatron-core version, or ConfigError when it is outside the range."""
    version = version or megatron_core_version()
    if not MEGATRON_CORE_MIN <= version < MEGATRON_CORE_BELOW:
        raise ConfigError(f"megatron-core {_show(version)} is installed; megatron-zeppelin "
                          f"supports >= {_show(MEGATRON_CORE_MIN)}, < "
                          f"{_show(MEGATRON_CORE_BELOW)}")
    return version


def bridge_series() -> str:
    """``CPU_BRIDGE_SERIES`` in words: '0.16.x, 0.17.x, 0.18.x and 0.19.x'."""
    names = [f"{_show(s)}.x" for s in CPU_BRIDGE_SERIES]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def check_cpu_bridge(version: tuple[int, int, int] | None = None) -> None:
    """RuntimeError unless the CPU bridge's targets exist in this megatron-core."""
    version = check_megatron_core(version)
    if version[:2] not in CPU_BRIDGE_SERIES:
        raise RuntimeError(f"megatron-core {_show(version)} is installed; the CPU bridge "
                           f"(--device cpu) targets {bridge_series()}: train on a GPU or install "
                           "megatron-core 0.16.1")


def cpu_bridge_redirects(version: tuple[int, int, int] | None = None) -> list[tuple[str, str]]:
    """(module, attribute path) of this version's extra functions to run under the bridge's
    CUDA-to-CPU device redirect."""
    series = (version or megatron_core_version())[:2]
    return [(module, path) for s, module, path in CPU_BRIDGE_REDIRECTS if s == series]


def cpu_bridge_missing_names(version: tuple[int, int, int] | None = None
                             ) -> list[tuple[str, str, Any]]:
    """(module, name, value) that this version reads but leaves undefined without TE."""
    series = (version or megatron_core_version())[:2]
    return [(module, name, value) for s, module, name, value in CPU_BRIDGE_MISSING_NAMES
            if s == series]


def batch_on_this_tp_rank(data_iterator: Any, every_field: bool = False) -> dict:
    """Megatron-LM's micro-batch on this TP rank (read by TP rank 0, broadcast to the others):
    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[samples, seq]`` and, for packed
    SFT samples, ``cu_seqlens``. ``every_field``: all of them on every pipeline stage (with
    pipelines Megatron-LM broadcasts only the fields a stage's own layers read, except on the
    stage holding MTP layers: that branch, ``mtp_on_this_rank``, is taken)."""
    from megatron.training import utils

    fetch = getattr(utils, "get_batch_on_this_tp_rank", None)
    if fetch is not None:  # core_v0.16.1, core_v0.17.1: it reads the iterator itself
        return fetch(data_iterator, mtp_on_this_rank=True) if every_field else fetch(data_iterator)
    return _broadcast_tp_batch(data_iterator, every_field)


def data_brings_cu_seqlens(args: Any) -> bool:
    """Whether Megatron-LM's micro-batches carry ``cu_seqlens``: ``--sft``'s packed samples, or
    the documents of core_v0.19's ``--dataloader-inter-document-masking``."""
    return bool(args.sft or getattr(args, "dataloader_inter_document_masking", False))


# the fields core_v0.18's pretrain_gpt.get_batch moves to the GPU (absent ones: None)
_TP_BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "labels", "loss_mask",
                  "max_seqlen", "position_ids", "tokens")


def _broadcast_tp_batch(data_iterator: Any, every_field: bool) -> dict:
    """core_v0.18 on: TP rank 0 reads the iterator and moves the fields to the GPU (as that
    tag's ``pretrain_gpt.get_batch`` does), megatron-core's ``get_batch_on_this_tp_rank``
    broadcasts them with the run's settings."""
    from megatron.core import parallel_state as mpu
    from megatron.core import utils as core_utils
    from megatron.training import get_args

    fetch = getattr(core_utils, "get_batch_on_this_tp_rank", None)
    if fetch is None:
        from megatron.core import package_info

        raise ConfigError(f"this Megatron-LM (megatron-core {package_info.__version__}) has no "
                          "get_batch_on_this_tp_rank; zeppelin's Megatron-LM patch exists for "
                          f"{', '.join(MEGATRON_LM_PATCHED)}")
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict = {}
    if tp_rank == 0:
        batch = dict(next(data_iterator))
        for key in _TP_BATCH_KEYS:
            value = batch.get(key)
            batch[key] = None if value is None else value.cuda(non_blocking=True)
    # core_v0.19 renamed is_sft has_cu_seqlens (and its data brings them for documents too)
    packed = {"has_cu_seqlens": data_brings_cu_seqlens(args)} \
        if "has_cu_seqlens" in inspect.signature(fetch).parameters else {"is_sft": args.sft}
    return fetch(batch, **packed, is_hybrid_cp=False,
                 create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
                 broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
                 broadcast_group=mpu.get_tensor_model_parallel_group(),
                 cp_size=args.context_parallel_size, tp_rank=tp_rank,
                 micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                 mtp_on_this_rank=every_field,
                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                 is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
                 is_pipeline_last_stage=mpu.is_pipeline_last_stage())


def fix_mla_without_te() -> None:
    """megatron-core 0.16's ``multi_latent_attention`` sets ``HAVE_TE = True`` even without
    Transformer Engine (its TE extension module imports, with mock classes), and then
    ``MLASelfAttention.__init__`` calls ``isinstance(linear_proj, TELinear)`` on a mock, which
    raises TypeError: MLA cannot be built without TE. When TE is not importable, say so in that
    module (``HAVE_TE = False``), as it meant to. A no-op with TE or a version without the flag."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None and \
            not isinstance(getattr(multi_latent_attention, "TELinear", None), type):
        multi_latent_attention.HAVE_TE = False
