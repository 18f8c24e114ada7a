"""Glue for Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1 to core_v0.19.0), from ``patches/``.

The patch adds these hooks to Megatron-LM, each importing this package only in zeppelin mode
(or when ``--zeppelin-*`` flags are given), so static mode and other entry points never need it:

* ``pretrain_gpt.py``'s extra-args provider adds ``--context-parallel-mode {static,zeppelin}``
  and, when this package is installed, the ``--zeppelin-*`` flags (``args.add_zeppelin_args``);
  with ``--yaml-cfg`` they are carried into Megatron's YAML namespace;
* ``validate_args`` / ``validate_yaml`` call ``validate_megatron_lm_args(args)``: every refused
  feature is named with its alternative (``lm_features.RULES``), the ``PoolLayout`` is built
  (GPUs per node: ``--zeppelin-gpus-per-node``, else torchrun's local world size); in static
  mode a ``--zeppelin-*`` flag that would do nothing is refused;
* ``gpt_builder`` builds whatever model Megatron's own builder chose (MoE, heterogeneous,
  ``--spec``, RoPE scaling, TE or local layers) as a ``PackedGPTModel`` whose self-attention
  layers run zeppelin core attention (``zeppelin_gpt_model``);
* ``get_batch`` (from core_v0.18: ``forward_step``) takes this rank's share of the micro-batch
  in the linear layout (``get_batch``, ``lm/batch.py``), on every pipeline stage (Megatron-LM's
  dataset is built on every stage in zeppelin mode: ``is_dataset_built_on_rank``);
* ``megatron.training.training.get_forward_backward_func`` gives Megatron's schedules, with
  pipeline parallelism, variable sequence lengths and the ordered P2P communicator
  (``pipelined_schedule``);
* ``get_model`` wraps the chunks in Megatron-FSDP over each pipeline stage's ranks
  (``fsdp_stage_mesh``), and in torch FSDP2 with per-token loss (``torch_fsdp2_class``);
* ``train_step`` ends (after the optimizer step, on every rank) with ``train_step_done``: the
  online profile fit (``--zeppelin-fit-interval``) and the log line of the step's estimated
  and measured time.

Megatron keeps its own CP groups: ``--context-parallel-size`` ranks form a pool, exactly the
ranks a static CP group would be. So Megatron's data loader, micro-batch count, DDP gradient
reduction (DP x CP), per-token loss normalisation and checkpoint layout are those of static CP
with the same flags: the pool loads ``micro-batch-size x seq-length`` tokens per micro-batch and
each rank holds about ``1/CP`` of them. Only core attention and the batch layout change.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from megatron_zeppelin import env
from megatron_zeppelin.config import MLA_FIELDS, ConfigError, ModelSpec, ZeppelinConfig
from megatron_zeppelin.megatron.common import compat
from megatron_zeppelin.megatron.loop import args as train_args, fatal, preflight
from megatron_zeppelin.megatron.loop.watchdog import check_timeout, start_watchdog
from megatron_zeppelin.megatron.lm.features import refusals
from megatron_zeppelin.options import dest_of, from_flags, settings
from megatron_zeppelin.parallel import PoolLayout

_STATE: dict = {}  # Megatron-LM runs one model per process: its PoolRuntime and PoolStats


def _zeppelin_defaults() -> dict[str, object]:
    """``{dest: default}`` of every ``--zeppelin-*`` flag (strategy options: None)."""
    from megatron_zeppelin.planner.registry import option_dests

    sections = (ZeppelinConfig, train_args.ZeppelinRuntimeArgs)
    return {**{dest_of(f, train_args.ZEPPELIN_PREFIX): f.default
               for section in sections for f in settings(section) if f.name != "max_seqlen"},
            **dict.fromkeys(option_dests(train_args.ZEPPELIN_PREFIX))}


def check_megatron_lm_args(args: argparse.Namespace) -> None:
    """Refuse what the mode cannot honour (ConfigError naming the flag and the alternative);
    in zeppelin mode set ``args.zeppelin_gpus_per_node`` (the pool layout is valid). ``args``
    holds plain values only: Megatron saves it in every checkpoint and loads it with
    ``weights_only=True``."""
    mode = getattr(args, "context_parallel_mode", "static")
    if mode != "zeppelin":
        given = [dest for dest, default in _zeppelin_defaults().items()
                 if getattr(args, dest, default) != default]
        if given:
            flags = ", ".join("--" + d.replace("_", "-") for d in given)
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"{flags} only {verb} to --context-parallel-mode zeppelin (the mode "
                              f"is {mode}): drop them or pass --context-parallel-mode zeppelin")
        return
    refused = refusals(args, compat.megatron_core_version())  # the checkout's megatron/core
    if refused:
        raise ConfigError(refused[0])
    from_flags(train_args.ZeppelinRuntimeArgs, args, train_args.ZEPPELIN_PREFIX)  # its checks
    check_timeout(args.zeppelin_watchdog_timeout)  # shorter than ZEPPELIN_P2P_TIMEOUT_S
    seq_length = getattr(args, "seq_length", None) or getattr(args, "encoder_seq_length", None)
    if seq_length:  # the planner's options (Megatron's validate_args requires a length)
        from_flags(ZeppelinConfig, args, train_args.ZEPPELIN_PREFIX, max_seqlen=seq_length)
    layout = pool_layout(args, env.local_world_size())
    args.zeppelin_gpus_per_node = layout.gpus_per_node
    train_args.planner_strategy(args, layout.cp, layout.topology)  # the strategy, options
    preflight.check_planner_files(args)  # --zeppelin-cluster, --zeppelin-hardware


def pool_layout(args: argparse.Namespace, local_world_size: int | None = None) -> PoolLayout:
    """The pools of Megatron-LM's ``args``: its CP groups (``--context-parallel-size``), on
    every pipeline stage (``--pipeline-model-parallel-size``)."""
    return PoolLayout.resolve(args.world_size, args.tensor_model_parallel_size,
                              args.context_parallel_size, args.zeppelin_gpus_per_node,
                              local_world_size, getattr(args, "pipeline_model_parallel_size", 1))


def validate_megatron_lm_args(args: argparse.Namespace) -> None:
    """``check_megatron_lm_args`` for Megatron-LM's ``validate_args``: a refused setting is one
    line on rank 0 and exit status 2 on every rank (no traceback)."""
    try:
        check_megatron_lm_args(args)
    except ConfigError as exc:  # rank 0 prints; the others wait for torchrun to stop them
        raise SystemExit(fatal.user_error(exc, fatal.PEER_GRACE_S, "megatron-zeppelin: ",
                                          getattr(args, "rank", 0))) from None


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    from megatron_zeppelin.megatron.common.model import windowed_layers

    window, layers = windowed_layers(getattr(args, "window_size", None),
                                     getattr(args, "window_attn_skip_freq", None),
                                     args.num_layers)
    # multi-latent attention: megatron-core's MLA has a key/value head per query head, whatever
    # --num-query-groups says, and its own head dims
    mla = {key: getattr(args, key) for key in MLA_FIELDS} \
        if getattr(args, "multi_latent_attention", False) else {}
    return ModelSpec(name="megatron-lm", num_layers=args.num_layers,
                     hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                     num_query_groups=args.num_query_groups if args.group_query_attention
                     and not mla else None, ffn_hidden_size=args.ffn_hidden_size,
                     kv_channels=args.kv_channels, vocab_size=args.padded_vocab_size,
                     swiglu=args.swiglu, bytes_per_element=2 if args.bf16 or args.fp16 else 4,
                     num_experts=args.num_experts,  # Megatron-LM's topk is 2 without MoE
                     moe_router_topk=args.moe_router_topk if args.num_experts else 1,
                     window_size=window, window_layers=layers, **mla)


def _state(args: argparse.Namespace) -> dict:
    """``{"runtime": train.PoolRuntime, "stats": PoolStats, "tp_host": gloo TP group or
    None, "plans": ChunkPlans, "online": OnlineFit or None}``, built once after Megatron's
    init (every rank creates every pool's groups, in the same order)."""
    if _STATE:
        return _STATE
    from megatron.core import parallel_state

    from megatron_zeppelin.megatron.lm.batch import ChunkPlans, PoolStats
    from megatron_zeppelin.megatron.common.groups import new_tp_host_group
    from megatron_zeppelin.megatron.loop.pipeline import runtimes_in_flight
    from megatron_zeppelin.api import pool_runtime_from_args

    layout = pool_layout(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = argparse.Namespace(**{**vars(args), "device": device})  # Megatron has no --device
    runtime = pool_runtime_from_args(options, layout, _model_spec(args))
    megatron_cp = parallel_state.get_context_parallel_global_ranks()
    rank = torch.distributed.get_rank()
    replica, _, tp_rank = layout.position(rank)
    mine = layout.pool_ranks(replica, tp_rank, layout.stage(rank))
    if list(megatron_cp) != mine:
        runtime.close()
        raise ConfigError(f"Megatron's CP group of this rank is {list(megatron_cp)}, the zeppelin "
                          f"pool {mine}: zeppelin needs Megatron's default rank order (TP, CP, "
                          "DP, PP innermost first; drop --use-tp-pp-dp-mapping)")
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    runtime.state.keep_used = runtimes_in_flight(layout, chunks)
    plans = ChunkPlans(chunks)
    _STATE.update(runtime=runtime, stats=PoolStats(), tp_host=new_tp_host_group(layout),
                  plans=plans, online=_online_fit(options, runtime, plans))
    _watchdog(args)
    return _STATE


def _watchdog(args: argparse.Namespace) -> None:
    """Zeppelin's heartbeat watchdog (``--zeppelin-watchdog-timeout``, ``loop/watchdog.py``)
    for Megatron-LM's run (collective: every rank builds its model): a rank that dies, stops
    or fails is named by the others, which then exit (status 1) instead of waiting in a
    collective. An uncaught exception is handed to it (``sys.excepthook``: a communication
    error waits for the verdict naming the peer behind it; any other is this rank's failure,
    published), SIGTERM from the launcher first asks it which peer died (as our script does;
    Megatron-LM's ``--exit-signal-handler`` replaces this handler when training starts), and a
    normal exit tells the peers this rank is done (``atexit``)."""
    import atexit
    import sys

    dog, line = start_watchdog(args.zeppelin_watchdog_timeout)
    if args.rank == 0:
        print(f"zeppelin watchdog: {line}", flush=True)
    if dog is None:
        return
    previous = sys.excepthook

    def hook(kind, exc, traceback) -> None:
        previous(kind, exc, traceback)
        dog.explain(exc)

    sys.excepthook = hook
    fatal.take_sigterm_in_python()  # torchrun stops the others when a rank dies
    atexit.register(dog.leave, "done")


def _online_fit(args: argparse.Namespace, runtime, plans):
    """The online profile fit of ``--zeppelin-fit-interval`` (None without it): a refit
    switches ``runtime``'s planner from the next micro-batch ``get_batch`` plans (the same
    index on every rank: ``train_step_done`` runs on every rank after the same step)."""
    if not args.zeppelin_fit_interval:
        return None
    from megatron_zeppelin.megatron.common.online_fit import FitSettings, OnlineFit

    def switch(planner) -> int:
        runtime.planner = planner
        return plans.next_index

    return OnlineFit(FitSettings.from_args(args), runtime.pool, runtime.state, runtime.planner,
                     switch, args.device)


def zeppelin_gpt_model(args: argparse.Namespace, transformer_layer_spec):
    """``(model constructor, layer spec)`` for Megatron-LM's ``gpt_builder`` in zeppelin mode:
    the spec Megatron chose with every core attention swapped, built as a ``PackedGPTModel``
    (same constructor as ``GPTModel``, RoPE by position id on packed batches); the MTP block
    spec Megatron built from its own layer spec (``--mtp-num-layers``) gets zeppelin core
    attention too."""
    from megatron_zeppelin.megatron.common.packing import PackedGPTModel
    from megatron_zeppelin.api import swap_core_attention

    runtime = _state(args)["runtime"]
    where = f"--spec {' '.join(args.spec)}" if getattr(args, "spec", None) else \
        "Megatron's GPT layer spec"
    spec = swap_core_attention(transformer_layer_spec, runtime, where)

    def build(*model_args, mtp_block_spec=None, **kwargs) -> PackedGPTModel:
        if mtp_block_spec is not None:
            mtp_block_spec = swap_core_attention(mtp_block_spec, runtime,
                                                 "Megatron's MTP block spec")
        return PackedGPTModel(*model_args, mtp_block_spec=mtp_block_spec, **kwargs)

    return build, spec


def get_batch(data_iterator, vp_stage=None):
    """Megatron-LM's ``get_batch`` in zeppelin mode: (tokens, labels, loss_mask,
    attention_mask=None, position_ids, packed_seq_params) of this rank's linear layout.

    Every rank of the pool reads the same micro-batch (Megatron's data loader, as for static
    CP), splits it into the sequences Megatron's attention mask describes, plans them (the same
    plan on every rank) and keeps its own pieces. The sequence boundaries come from the host
    batch TP rank 0 read (shared over a gloo TP group): the host does not wait for the GPU's
    queue, so planning overlaps the previous micro-batch's backward on the GPU.

    With pipeline parallelism every stage reads the micro-batch (the patch builds the dataset
    on every stage) and plans it alike from the same lengths, so micro-batch ``i`` runs with
    the same plan on every stage without a message; a middle stage uses its positions and
    packed params. With virtual stages each model chunk (``vp_stage``) reads through its own
    iterator; micro-batch ``i`` is planned by the first chunk to read it (``ChunkPlans``).
    """
    from megatron.training import get_args, get_tokenizer

    from megatron_zeppelin.megatron.lm.batch import HostBatchTap, host_lengths, linear_batch

    args = get_args()
    state = _state(args)
    runtime, online = state["runtime"], state["online"]
    training = torch.is_grad_enabled()  # Megatron-LM evaluates under no_grad: not measured
    if online is not None:
        runtime.state.probe = online.probe if training else None
    tap = HostBatchTap(data_iterator)
    fields = compat.batch_on_this_tp_rank(tap, every_field=args.pipeline_model_parallel_size > 1)
    lengths = host_lengths(tap, fields, get_tokenizer().eod, args.reset_attention_mask,
                           state["tp_host"])
    started = time.perf_counter()
    plan, planned = state["plans"].plan(vp_stage or 0, lengths, runtime.planner)
    seconds = time.perf_counter() - started
    pad = args.tensor_model_parallel_size if args.sequence_parallel else 1
    batch = linear_batch(fields, plan, runtime.pool.rank, lengths, pad_multiple=pad,
                         max_position=args.seq_length)
    if planned:  # once per micro-batch, whichever chunk read it first
        state["stats"].add(batch, seconds, plan if training else None)
        if compat.data_brings_cu_seqlens(args):
            _count_packed_flops(lengths, batch.tokens.device)
        if online is not None and training:  # (the schedule ends the last span)
            online.begin(batch.packed_seq_params.num_tokens)  # real tokens
    return (batch.tokens, batch.labels, batch.loss_mask, None, batch.position_ids,
            batch.packed_seq_params)


def _count_packed_flops(lengths: list[int], device: torch.device) -> None:
    """Megatron-LM's FLOPs accounting of packed sequences (core_v0.18 on:
    ``update_seqlen_stats_from_cu_seqlens``, which static mode's ``forward_step`` feeds when
    the data brings ``cu_seqlens``): every rank adds the micro-batch's whole sequence lengths
    once, as every static CP rank does (Megatron divides by TP x CP x PP), so the TFLOP/s
    Megatron logs count the same work in both modes. A no-op before core_v0.18."""
    from megatron.training import training

    update = getattr(training, "update_seqlen_stats_from_cu_seqlens", None)
    if update is not None:
        bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        update(bounds.to(device, non_blocking=True))


def train_step_done(iteration: int | None) -> None:
    """The end of Megatron-LM's ``train_step`` (the patch calls it on every rank after the
    optimizer step; ``iteration``: the step just done, counted from 1 as Megatron logs it):
    the online fit collects the step's measurements and refits every
    ``--zeppelin-fit-interval`` steps (``common/online_fit.py``), and every ``--log-interval``
    steps rank 0 logs this rank's batches and the step's estimated and measured time
    (``PoolStats.summary``)."""
    from megatron.training import get_args

    args = get_args()
    state = _state(args)
    stats, online = state["stats"], state["online"]
    iteration = stats.steps + 1 if iteration is None else iteration
    estimated = stats.end_step(state["runtime"].planner.cost)  # the profile it planned with
    if online is not None:
        online.step(iteration)
    if args.rank == 0 and iteration % max(1, getattr(args, "log_interval", 1)) == 0:
        print(stats.summary(iteration, estimated), flush=True)


def pipelined_schedule(schedule):
    """Megatron's ``forward_backward_func`` for Megatron-LM's ``train_step`` and ``evaluate``
    (the patched ``get_forward_backward_func``): with pipeline parallelism the stages send
    ``[tokens, 1, hidden]`` whose token count changes per micro-batch
    (``variable_seq_lengths``) through the ordered P2P communicator our own loop uses
    (``megatron/common/pipeline_p2p.py``: megatron-core 0.16.1's batched shape messages meet
    the wrong receives with 2 stages); ``schedule`` itself without pipelines.

    The stages keep their sent outputs (no ``deallocate_pipeline_outputs``) on gloo and with
    Megatron-FSDP. Gloo reads a send's buffer in its own thread after ``isend`` returns, and
    Megatron's interleaved schedule frees the output of a send still in flight (safe in
    NCCL's stream order), so the freed buffer can be refilled (say, by the next micro-batch's
    output) before it is sent. Seen once through the patch under a full test suite's load (PP
    2 x CP 2, interleaved: iteration 3's loss 5e-5 off with the same plans), not reproduced in
    seven reruns; the deallocation saves nothing worth that on CPU. Megatron-FSDP's forward
    hooks return each unit's output as a view (``view_as``), which that deallocation refuses
    (freeing a view would release no memory). With Megatron-FSDP the gradients of weights
    shared across stages are summed row by row between overlapping shards (``fsdp_stages.py``).
    With the online fit the schedule ends the last micro-batch's timed span."""
    from megatron.training import get_args

    megatron_args = get_args()
    online = _STATE.get("online")
    if megatron_args.pipeline_model_parallel_size == 1:
        return schedule if online is None else _ending_spans(schedule, online)
    from megatron.core.utils import get_model_config

    from megatron_zeppelin.megatron.common.fsdp_stages import summing_shared_embeddings
    from megatron_zeppelin.megatron.common.pipeline_p2p import schedule_kwargs

    def run(*args, model, **kwargs):
        config = get_model_config(model[0] if isinstance(model, list) else model)
        config.variable_seq_lengths = True
        if megatron_args.use_megatron_fsdp or torch.distributed.get_backend() == "gloo":
            config.deallocate_pipeline_outputs = False
        if megatron_args.use_megatron_fsdp:
            config.finalize_model_grads_func = summing_shared_embeddings(
                config.finalize_model_grads_func)
        extra = schedule_kwargs(config)  # core_v0.19's train_step passes its own communicator
        if kwargs.get("pg_collection") is not None:  # and process groups: ours replaces the
            extra.pop("pg_collection")  # communicator, Megatron's groups stay
        return schedule(*args, model=model, **{**kwargs, **extra})

    return run if online is None else _ending_spans(run, online)


def _ending_spans(schedule, online):
    """``schedule`` ending the online fit's last micro-batch span when it returns, before the
    optimizer step (as our loop does): that span then holds no optimizer time."""
    def run(*args, **kwargs):
        try:
            return schedule(*args, **kwargs)
        finally:
            online.finish()

    return run


def fsdp_stage_mesh():
    """A context manager for Megatron-LM's ``get_model`` (the patched ``_fsdp_wrapping``):
    while Megatron-FSDP wraps the model chunks, megatron-core meshes this rank's pipeline
    stage instead of the whole world (``megatron/common/fsdp_stages.py``; megatron-core
    0.16.1 fails with pipeline stages otherwise). Nothing changes with one stage."""
    from megatron.core import parallel_state

    from megatron_zeppelin.megatron.common.fsdp_stages import stage_mesh

    return stage_mesh(parallel_state.get_pipeline_model_parallel_group())


def torch_fsdp2_class() -> type:
    """The data-parallel class Megatron-LM's ``get_model`` builds for ``--use-torch-fsdp2``
    (the patched ``_data_parallel_class``): megatron-core's FSDP2 wrapper mended for
    per-token loss (``megatron/common/torch_fsdp2.py``)."""
    from megatron_zeppelin.megatron.common.torch_fsdp2 import per_token_torch_fsdp2

    return per_token_torch_fsdp2()


__all__ = ["check_megatron_lm_args", "validate_megatron_lm_args", "zeppelin_gpt_model",
           "get_batch", "train_step_done", "pipelined_schedule", "fsdp_stage_mesh",
           "torch_fsdp2_class"]
