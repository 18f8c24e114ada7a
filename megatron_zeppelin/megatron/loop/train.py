"""GPT pretraining on megatron-core with ``--context-parallel-mode static|zeppelin``.

Process layout (``parallel.PoolLayout``: Megatron's order, TP innermost): for each TP rank,
the CP group of ``--context-parallel-size`` ranks is the *pool* the planner places each
micro-batch on (``static``: every document zigzag over the pool, as TE/Megatron CP;
``zeppelin``: the hierarchical partitioner with routing and remapping); every TP rank of a
pool position holds the same tokens and its own heads.
Megatron itself runs with its CP at 1, so its data-parallel group is DP x CP: DDP reduces
gradients over all of it, and ``calculate_per_token_loss`` divides them by the tokens
of the whole global batch. Model state is the same in both modes (core attention has no
parameters), so checkpoints load across modes.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import time

import torch
import torch.distributed as dist

from megatron_zeppelin import api, env
from megatron_zeppelin.config import (MLA_FIELDS, ConfigError, ModelSpec, load_cluster,
                                      load_hardware)
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.megatron.loop import (args as train_args, checkpoint, checkpoint_files,
                                             fatal, microbatch_order, pipeline, preflight)
from megatron_zeppelin.megatron.common import compat
from megatron_zeppelin.megatron.common.core_attention import ZeppelinAttentionState, planning_hardware
from megatron_zeppelin.megatron.loop.corpus import (DocumentSource, MicroBatchSampler,
                                                    documents_per_pass)
from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator
from megatron_zeppelin.megatron.common.groups import Pool
from megatron_zeppelin.megatron.common.pipeline_p2p import schedule_kwargs
from megatron_zeppelin.megatron.common.online_fit import FitSettings, OnlineFit
from megatron_zeppelin.megatron.loop.train_log import Logger, StepLog, banner
from megatron_zeppelin.megatron.loop.watchdog import start_watchdog, watched
from megatron_zeppelin.megatron.common.model import (build_gpt_model, make_transformer_config,
                                                     windowed_layers)
from megatron_zeppelin.options import from_flags, name_flags
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.planner.registry import strategy_class
from megatron_zeppelin.planner.service import PlanFunction, PlannerService
from megatron_zeppelin.router import RouterTopology


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The planner's view of the model (sliding windows included: ``windowed_layers``;
    multi-latent attention's dims)."""
    fields = train_args.AttentionArgs.from_namespace(args).config_fields(args.num_layers)
    window, layers = windowed_layers(fields.get("window_size"),
                                     fields.get("window_attn_skip_freq"), args.num_layers)
    mla = {key: fields[key] for key in MLA_FIELDS if key in fields}
    return ModelSpec(name="pretrain_gpt", num_layers=args.num_layers,
                     hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                     num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
                     vocab_size=train_args.vocab_size(args), swiglu=args.swiglu,
                     bytes_per_element=4 if args.device == "cpu" else 2, window_size=window,
                     window_layers=layers, **mla)


def make_cost_model(args: argparse.Namespace, spec: ModelSpec, layout: PoolLayout) -> CostModel:
    """The planner's cost model on one pool: ``layout.nodes`` nodes of
    ``layout.gpus_per_node`` GPUs (a pool rank per TP group) of ``--zeppelin-cluster``."""
    default = "cpu-2x2" if args.device == "cpu" else "h200-8nic"
    cluster = load_cluster(args.zeppelin_cluster or default)
    cluster = cluster.with_topology(layout.nodes, layout.gpus_per_node)
    hardware = load_hardware(args.zeppelin_hardware) if args.zeppelin_hardware else \
        planning_hardware(cluster, args.zeppelin_attention_backend, args.device,
                          torch.bfloat16 if args.bf16 else torch.float32, spec.qk_dim)
    return CostModel(spec, cluster, hardware, layout.tp)


def make_planner(args: argparse.Namespace, cost: CostModel, layout: PoolLayout) -> PlanFunction:
    """lengths -> Plan for one micro-batch of the pool (deterministic: same on every rank;
    picklable, so that the planner process can run it)."""
    name, options = train_args.planner_strategy(args, layout.cp)
    return PlanFunction(name, cost, train_args.zeppelin_config(args), options=options,
                        validate=args.zeppelin_validate_plan)


def check_strategy(args: argparse.Namespace, planner: PlanFunction,
                   state: ZeppelinAttentionState) -> None:
    """Plan one document of ``--seq-length`` tokens and build its attention runtime (the
    engine's own checks), so that a strategy this run cannot execute is refused before
    training, in one line, with the planner's or the engine's reason."""
    try:
        state.prepare(planner([args.seq_length]))
    except (ValueError, ImportError) as exc:
        reason = name_flags(str(exc).splitlines()[0], train_args.PLANNER_FLAGS)
        raise ConfigError(f"--zeppelin-strategy {planner.strategy} cannot run here: "
                          f"{reason}") from None


def build_state(args: argparse.Namespace, pool: Pool, cost: CostModel, planner: PlanFunction
                ) -> ZeppelinAttentionState:
    """The attention state of the pool: inter-node rings go through the routing layer when the
    strategy routes them (zeppelin) and ``--zeppelin-routing`` is on."""
    routed = strategy_class(planner.strategy).routed and args.zeppelin_routing and \
        cost.cluster.nodes > 1
    backend = None if args.zeppelin_attention_backend == "auto" else args.zeppelin_attention_backend
    # routing works on pool ranks: with TP, a pool rank is a TP group of its node
    cluster = cost.cluster.with_topology(cost.cluster.nodes, cost.cluster.gpus_per_node // cost.tp)
    return ZeppelinAttentionState(
        pool.group, backend=backend, inter_mode="routed" if routed else "ring",
        route_group=pool.route_group if routed else None,
        router_topology=RouterTopology.from_cluster(cluster) if routed else None,
        device=args.device, windows=train_args.AttentionArgs.from_namespace(args).windows(
            args.num_layers))


@dataclasses.dataclass
class PoolRuntime:
    """The zeppelin side of one rank's pool: its process groups, the planner's cost model,
    the attention state core attention runs on, and the planner (lengths -> Plan)."""

    pool: Pool
    cost: CostModel
    state: ZeppelinAttentionState
    planner: PlanFunction

    def close(self) -> None:
        self.state.close()


def build_pool_runtime(args: argparse.Namespace, layout: PoolLayout, spec: ModelSpec
                       ) -> PoolRuntime:
    """Wire one pool (every rank calls it, in the same order: it creates every pool's process
    groups): groups -> cost model -> attention state -> planner. ``args``: the training
    flags (``args.py``); Megatron-LM's namespace needs ``device`` added (``lm.py``)."""
    pool = api.process_groups(layout)
    cost = make_cost_model(args, spec, layout)
    planner = make_planner(args, cost, layout)
    state = build_state(args, pool, cost, planner)
    check_strategy(args, planner, state)
    return PoolRuntime(pool, cost, state, planner)


def build_chunks(args: argparse.Namespace, state: ZeppelinAttentionState, spec: ModelSpec):
    """This stage's model chunks (a PackedGPTModel with zeppelin core attention each: one per
    stage, or one per virtual stage, ``pipeline.py``) and their shared config."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    attention = train_args.AttentionArgs.from_namespace(args)
    use_te = train_args.te_layers(args)
    chunks = pipeline.virtual_size(args)
    config = make_transformer_config(spec, normalization=args.normalization,
                                     calculate_per_token_loss=True,
                                     use_cpu_initialization=args.device == "cpu",
                                     tensor_model_parallel_size=args.tensor_model_parallel_size,
                                     params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                     attention=attention.config_fields(args.num_layers),
                                     mtp=from_flags(train_args.ModelArgs, args).mtp_fields(),
                                     pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=chunks)
    layer_spec = api.layer_spec(state, normalization=args.normalization, use_te=use_te,
                                multi_latent_attention=attention.multi_latent_attention)
    modules = []
    for vp_stage in range(chunks) if chunks else [None]:
        module = build_gpt_model(
            spec, config, max_sequence_length=args.seq_length, layer_spec=layer_spec,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(False, vp_stage),
            vp_stage=vp_stage, mtp_use_te=use_te)
        if args.bf16:  # every parameter bf16, as Megatron-LM's Float16Module makes them (the
            module = module.bfloat16()  # local norms are built in fp32 whatever params_dtype)
        modules.append(module.cuda() if args.device == "cuda" else module)
    return config, modules


def build_training(args: argparse.Namespace, state: ZeppelinAttentionState, spec: ModelSpec):
    """(Megatron DDP model, optimizer) of a run with one model chunk per stage (no virtual
    pipeline stages: ``build_stage`` returns every chunk)."""
    chunks, optimizer = build_stage(args, state, spec)
    if len(chunks) != 1:
        raise ValueError(f"{len(chunks)} model chunks (virtual pipeline stages): use "
                         "build_stage")
    return chunks[0], optimizer


def build_stage(args: argparse.Namespace, state: ZeppelinAttentionState, spec: ModelSpec):
    """This stage's model chunks (Megatron DDP around each of ``build_chunks``) + optimizer."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_zeppelin.megatron.common.fsdp_stages import summing_shared_embeddings

    config, modules = build_chunks(args, state, spec)
    chunks = data_parallel_chunks(args, config, modules)
    # Megatron-FSDP without overlap reduces after the backward only if no_sync never ran
    # (common/fsdp_limits.OPTIM_OVERLAP): no no_sync_func then, as Megatron-LM's training.py
    if args.overlap_grad_reduce or not args.use_megatron_fsdp:
        config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else \
            [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    if args.use_megatron_fsdp:  # shared embeddings across stages: summed as whole tensors
        config.finalize_model_grads_func = summing_shared_embeddings(finalize_model_grads)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                        weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                        clip_grad=args.clip_grad, bf16=args.bf16,
                        use_distributed_optimizer=chunks[0].ddp_config.use_distributed_optimizer),
        chunks)
    return chunks, optimizer


def data_parallel_chunks(args: argparse.Namespace, config, modules: list) -> list:
    """Megatron DDP around each model chunk (gradients reduced over DP x CP), or with
    ``--use-megatron-fsdp`` megatron-core's Megatron-FSDP around the one chunk (parameters,
    gradients and Adam state sharded over DP x CP as ``--data-parallel-sharding-strategy``
    says; it always runs the distributed optimizer, as in Megatron-LM), or with
    ``--use-torch-fsdp2`` torch FSDP2 through megatron-core (``torch_fsdp2.py``: the plain
    optimizer on sharded parameters). On CPU the FSDP streams are bridged (``cpu_fsdp.py``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if args.use_torch_fsdp2:
        from megatron_zeppelin.megatron.common.torch_fsdp2 import torch_fsdp2

        return [torch_fsdp2(config, module, args.device) for module in modules]
    fsdp = args.use_megatron_fsdp
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=args.overlap_grad_reduce,
        grad_reduce_in_fp32=args.bf16,  # Megatron-LM's default for bf16 (validate_args)
        use_distributed_optimizer=args.use_distributed_optimizer or fsdp,
        use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        **(compat.fsdp_fp32_main_grads(args.bf16) if fsdp else {}))
    if not fsdp:
        return [DistributedDataParallel(config, ddp_config, module, disable_bucketing=index > 0)
                for index, module in enumerate(modules)]
    return megatron_fsdp_chunks(args, config, ddp_config, modules)


def megatron_fsdp_chunks(args: argparse.Namespace, config, ddp_config, modules: list) -> list:
    """megatron-core's Megatron-FSDP around each model chunk, meshed over this rank's
    pipeline stage (``fsdp_stages.py``); on CPU its CUDA streams bridged (``cpu_fsdp.py``)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from megatron_zeppelin.megatron.common.fsdp_stages import stage_mesh

    device = None
    if args.device == "cpu":
        from megatron_zeppelin.megatron.common.cpu_fsdp import enable_megatron_fsdp_on_cpu

        enable_megatron_fsdp_on_cpu()
        device = torch.device("cpu")
    with stage_mesh(parallel_state.get_pipeline_model_parallel_group()):
        return [FullyShardedDataParallel(config, ddp_config, module, device=device)
                for module in modules]


def forward_step(data_iterator, model):
    """Megatron forward_step_func: per-token loss sum and token count of this rank's share
    (the loss mask also masks multi-token prediction's shifted labels, as in Megatron-LM)."""
    batch = next(data_iterator)
    losses = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                   loss_mask=batch.loss_mask, packed_seq_params=batch.packed_seq_params)
    return losses, api.loss_func(batch)


def make_scheduler(args: argparse.Namespace, optimizer):
    """Megatron's LR schedule (megatron-core's ``OptimizerParamScheduler``, values from
    ``args.schedule``), in samples as in Megatron-LM: it steps by ``--global-batch-size`` after
    every iteration. On ``--load`` it takes the checkpoint's values, or this run's with
    --override-opt_param-scheduler (preflight refused a mismatch without either flag)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, **train_args.schedule(args),
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)


def make_data(args: argparse.Namespace, source: DocumentSource, runtime: PoolRuntime,
              device, position: dict | None) -> tuple[ZeppelinDataIterator, MicroBatchSampler]:
    """Micro-batches of MBS x seq-length tokens per pool (Megatron's meaning: a CP group runs
    MBS samples of seq-length tokens; an iteration GBS x seq-length tokens), from one global
    stream dealt to the pools; documents longer than --seq-length follow --zeppelin-overlong.
    ``position``: a checkpoint's data position to continue from. Plans come from the planner
    process (``--zeppelin-planner-process``, the default) or a thread of this one; each plan's
    attention runtime is prepared ahead, on the iterator's worker thread."""
    planner = runtime.planner
    sampler = make_sampler(args, source, runtime)
    if position is not None:
        why = sampler.load_state_dict(position)
        if why and dist.get_rank() == 0:
            print(f"data position of the checkpoint not used ({why}): reading the corpus from "
                  "its beginning", flush=True)
    if args.zeppelin_planner_process:
        planner = PlannerService(planner)
    return api.planned_micro_batches(sampler, runtime, device, planner=planner,
                                     max_position=args.seq_length), sampler


def make_sampler(args: argparse.Namespace, source: DocumentSource, runtime: PoolRuntime
                 ) -> MicroBatchSampler:
    """This pool's micro-batches of the global stream, in ``--zeppelin-microbatch-order``
    (``microbatch_order.py``: balanced regroups each global batch by the pool's cost model)."""
    layout, tokens = runtime.pool.layout, args.micro_batch_size * args.seq_length
    common = (source, tokens, args.seed, args.seq_length, args.zeppelin_overlong)
    if microbatch_order.resolve(args.zeppelin_microbatch_order, layout.pp) == "arrival":
        return MicroBatchSampler(*common, pools=layout.dp, pool=runtime.pool.index)
    regroup = microbatch_order.Regrouper(
        runtime.cost, layout.cp, layout.micro_batches(args.global_batch_size,
                                                      args.micro_batch_size),
        layout.dp, tokens, layout.pp, pipeline.virtual_size(args) or 1,
        estimate=dist.get_rank() == 0)  # the rank that prints the run summary
    return microbatch_order.BalancedSampler(*common, regroup, pools=layout.dp,
                                            pool=runtime.pool.index)


def init_process_group(args: argparse.Namespace) -> None:
    """gloo on CPU; on CUDA this process's GPU (torchrun's LOCAL_RANK) is made current
    first, so that NCCL binds every communicator to it."""
    timeout = datetime.timedelta(seconds=env.p2p_timeout_s())
    if args.device == "cuda":
        torch.cuda.set_device(env.local_rank())  # preflight checked it is a GPU of this node
    try:
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", timeout=timeout)
    except (dist.DistStoreError, dist.DistNetworkError) as exc:  # a rank or a store never came
        host, port = env.master_address()
        fatal.fault(f"the {env.world_size()} ranks did not all meet at the rendezvous "
                    f"{host}:{port} within ZEPPELIN_P2P_TIMEOUT_S={timeout.total_seconds():g} s "
                    f"({str(exc).strip().splitlines()[0]}); start WORLD_SIZE processes in "
                    "all (torchrun --nnodes x --nproc-per-node), each with this MASTER_ADDR and "
                    "MASTER_PORT")


def setup_megatron(args: argparse.Namespace) -> None:
    """megatron-core's parallel state and seeds (again from scratch when called again)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if args.device == "cpu":
        from megatron_zeppelin.megatron.common.cpu import enable_cpu_mode

        enable_cpu_mode()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=pipeline.virtual_size(args))
    torch.manual_seed(args.seed)
    get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(args.seed)


def train(args: argparse.Namespace, layout: PoolLayout, ready: preflight.Ready,
          watchdog_line: str = "off") -> list[StepLog]:
    """Run to ``--train-iters`` (from ``--load``'s checkpoint when there is one); returns the
    per-iteration logs on rank 0 (which prints them), an empty list elsewhere."""
    spec = model_spec(args)
    runtime = build_pool_runtime(args, layout, spec)
    try:
        rates = checkpoint_files.scheduler_rates(args, ready.resume)
        chunks, optimizer = build_stage(rates, runtime.state, spec)
        runtime.state.keep_used = pipeline.runtimes_in_flight(layout, len(chunks))
        device = "cuda" if args.device == "cuda" else "cpu"
        run = checkpoint.Training(chunks, optimizer, make_scheduler(args, optimizer), device)
        if dist.get_rank() == 0:
            print(banner(args, layout, [c.module for c in chunks], ready.source, watchdog_line),
                  flush=True)
        start, position = resume(args, ready, run)
        data, sampler = make_data(args, ready.source, runtime, device, position)
        _, pool_rank, tp_rank = layout.position(dist.get_rank())
        first_stage = layout.stage(dist.get_rank()) == 0
        logger = Logger(args, runtime.cost, dist.get_rank() == 0, sampler.stats,
                        counts_plans=pool_rank == 0 and tp_rank == 0 and first_stage,
                        pools=layout.dp, order=getattr(sampler, "regroup", None),
                        per_pass=documents_per_pass(ready.source.lengths()))
        online = OnlineFit(FitSettings.from_args(args), runtime.pool, runtime.state,
                           runtime.planner, replanning(data, logger), device) \
            if args.zeppelin_fit_interval else None
        try:
            loop(args, layout, run, data, logger, start, online)
        finally:
            data.close()
            sampler.close()
            logger.close()
    finally:
        runtime.close()
    return logger.history


def replanning(data: ZeppelinDataIterator, logger: Logger):
    """The online fit's ``switch``: ``data`` plans with the refitted planner from the
    micro-batch after the one planned ahead, and the log's estimates follow its profile."""
    def switch(planner) -> int:
        logger.cost = planner.cost
        return data.replan(planner)

    return switch


def resume(args: argparse.Namespace, ready: preflight.Ready, run: checkpoint.Training
           ) -> tuple[int, dict | None]:
    """(iteration to continue after, data position) from ``--load``'s checkpoint."""
    if ready.resume is not None:
        saved = checkpoint.load(ready.resume, run, args.load_optim, args.load_rng)
        return ready.resume.iteration, saved.get("data")
    if args.load and dist.get_rank() == 0:
        print(f"--load {args.load}: no checkpoint there ({checkpoint.TRACKER} missing): "
              "training from scratch", flush=True)
    return 0, None


def loop(args: argparse.Namespace, layout: PoolLayout, run: checkpoint.Training,
         data: ZeppelinDataIterator, logger: Logger, start: int,
         online: OnlineFit | None = None) -> None:
    """Iterations ``start + 1 .. --train-iters``: step, LR schedule, log line, checkpoints
    (every --save-interval, at --exit-interval and at the end); ``online``: the profile fit
    measures every micro-batch and refits (``online_fit.py``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro = layout.micro_batches(args.global_batch_size, args.micro_batch_size)
    pipelined = schedule_kwargs(run.model.config)
    if start >= args.train_iters and dist.get_rank() == 0:
        print(f"the checkpoint is at iteration {start}, --train-iters is {args.train_iters}: "
              "nothing to train", flush=True)
    for iteration in range(start + 1, args.train_iters + 1):
        started = time.perf_counter()
        lr = run.optimizer.param_groups[0]["lr"]
        for chunk in run.chunks:
            chunk.zero_grad_buffer()
        run.optimizer.zero_grad()
        stream = logger.watch(online.watch(data) if online else data)
        stored = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=pipeline.data_iterators(stream, len(run.chunks)),
            model=run.chunks, num_microbatches=micro, seq_length=args.seq_length,
            micro_batch_size=1, forward_only=False, **pipelined)
        if online is not None:
            online.finish()
        _, grad_norm, _ = run.optimizer.step()
        run.scheduler.step(increment=args.global_batch_size)
        logger.step(iteration, stored, grad_norm, time.perf_counter() - started, lr)
        if online is not None:
            online.step(iteration)
        leaving = bool(args.exit_interval) and iteration % args.exit_interval == 0
        interval = bool(args.save_interval) and iteration % args.save_interval == 0
        if args.save and (interval or leaving or iteration == args.train_iters):
            save(args, run, layout, data, iteration)
        if leaving and iteration < args.train_iters:
            if dist.get_rank() == 0:
                print(f"exiting after iteration {iteration} (--exit-interval "
                      f"{args.exit_interval})", flush=True)
            return


def save(args: argparse.Namespace, run: checkpoint.Training, layout: PoolLayout,
         data: ZeppelinDataIterator, iteration: int) -> None:
    extra = {"format": 1, "mode": args.context_parallel_mode, "world_size": layout.world_size,
             "tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp,
             "vpp_chunks": len(run.chunks), "data": data.state_dict()}
    checkpoint.save(args.save, iteration, run, extra)


def main(argv=None) -> int:
    """``scripts/pretrain_gpt.py``: everything is validated before the process group exists
    (flags, layout, environment, data, checkpoint); a ``ConfigError`` ends the run with one
    line from rank 0 (``fatal.run``)."""
    args = train_args.parse_args(argv)
    if not env.launched_by_torchrun():
        raise ConfigError("launch with torchrun (it sets RANK/WORLD_SIZE), e.g. torchrun "
                          "--nproc-per-node 4 scripts/pretrain_gpt.py --yaml-cfg ...")
    try:
        env.check_rendezvous()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    layout = train_args.validate_args(args, env.world_size(), env.local_world_size())
    ready = preflight.check(args)
    init_process_group(args)
    try:
        watchdog, line = start_watchdog(args.zeppelin_watchdog_timeout)
        with watched(watchdog):
            setup_megatron(args)
            train(args, layout, ready, line)
    except ConfigError:
        dist.destroy_process_group()  # every rank raised it at the same point
        raise
    dist.destroy_process_group()
    return 0
