"""Drive Megatron-LM's own (patched) ``pretrain_gpt.py`` training step on CPU/gloo.

Test scaffolding, not project code: run from a patched Megatron-LM tree (core_v0.16.1 to
core_v0.19.0) with ``torchrun --nproc-per-node N tests/megatron_lm_driver.py --harness-out OUT.json
[--harness-stop N] [--harness-kill R:I] <Megatron-LM flags>`` (``--harness-stop``: the last
iteration to run, default ``--train-iters``; ``--harness-kill``: rank R kills itself with
SIGKILL before iteration I). It mirrors ``megatron.training.pretrain()``: Megatron's ``parse_args`` (with
``pretrain_gpt``'s extra-args provider) and ``validate_args`` (which runs zeppelin's checks),
``setup_model_and_optimizer`` (Megatron's builder, which loads ``--load``), Megatron's data
iterators and ``train_step(forward_step)``; ``--save`` saves with Megatron's
``save_checkpoint`` after the last iteration, after one ``evaluate`` pass on the validation
iterator. Rank 0 writes per-iteration losses and grad norms, the validation loss, the tokens
each rank's batches held (real and pad tokens) and what the checkpoint step did.

What replaces Megatron-LM's CUDA-only start-up on CPU (each is a CPU-only stand-in, listed in
``docs/megatron-lm.md``): ``initialize_megatron`` (gloo instead of NCCL, no fused-kernel build),
megatron-core's CPU bridge (``megatron_zeppelin.megatron.common.cpu``), no-op CUDA streams/events and
memory statistics, CPU RNG for ``torch.cuda.get_rng_state``, ``get_device_arch_version``
(asked by ``validate_args`` for its CUDA_DEVICE_MAX_CONNECTIONS check) and split sizes made
numpy for the alltoall token dispatcher (it converts them only when they were on a GPU).
Megatron-LM core_v0.18 imports ``typing.override`` (Python 3.12); on 3.11 it gets
``typing_extensions``' one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.getcwd())

import typing  # noqa: E402

if not hasattr(typing, "override"):  # Python 3.11: Megatron-LM core_v0.18 imports it
    import typing_extensions

    typing.override = typing_extensions.override

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron.training.arguments as megatron_arguments  # noqa: E402

megatron_arguments.get_device_arch_version = lambda: 10  # CPU: no CUDA device to ask
# Megatron-LM asserts 1 for TP/CP > 1 before Blackwell (arch 10 here: not asked) and not 1
# with either FSDP
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8" if {
    "--use-megatron-fsdp", "--use-torch-fsdp2"} & set(sys.argv) else "1")

import pretrain_gpt as P  # noqa: E402
from functools import partial  # noqa: E402

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.utils import get_model_config  # noqa: E402
from megatron.training import get_args, training as T  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.checkpointing import save_checkpoint  # noqa: E402
from megatron.training.global_vars import get_timers, set_global_variables  # noqa: E402

from megatron_zeppelin.megatron.common.cpu import enable_cpu_mode, run_on_cpu  # noqa: E402


class _NoOp:
    """A CUDA stream or event on CPU: every method does nothing and returns another one."""

    def __getattr__(self, name):
        return lambda *a, **k: _NoOp()


def cpu_stand_ins() -> None:
    """CUDA streams/events/memory statistics and the CUDA RNG state on a CPU-only torch."""
    torch.cuda.Stream = lambda *a, **k: _NoOp()
    torch.cuda.Event = lambda *a, **k: _NoOp()
    torch.cuda.current_stream = lambda *a, **k: _NoOp()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu(tensor, as_numpy=False, record_stream=False):
        """The alltoall dispatcher's split sizes become numpy only when they were on CUDA."""
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = dispatcher.maybe_move_tensor_to_cpu = to_cpu


def fsdp_on_cpu_device() -> None:
    """Megatron-LM's ``get_model`` wraps chunks in megatron-core's FSDP adapter without a
    device, which then names ``cuda:<current device>``: on CPU it gets the CPU device."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    original = FullyShardedDataParallel.__init__

    def init(self, *args, device=None, **kwargs):
        original(self, *args, device=device or torch.device("cpu"), **kwargs)

    FullyShardedDataParallel.__init__ = init


def initialize() -> None:
    """``initialize_megatron`` on CPU: args, global variables, rerun machine, gloo, mpu."""
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import (RerunDiagnostic, RerunErrorInjector, RerunMode,
                                                   initialize_rerun_state_machine)

    args = parse_args(P.extra_args_provider)
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    set_global_variables(args, build_tokenizer=True)
    args = get_args()
    initialize_rerun_state_machine(
        state_save_func=lambda: {"rng": tensor_parallel.get_cuda_rng_tracker().get_states()},
        state_restore_func=lambda sd: tensor_parallel.get_cuda_rng_tracker().set_states(sd["rng"]),
        mode=RerunMode(args.rerun_mode),
        error_injector=RerunErrorInjector(error_injection_rate=0,
                                          error_injection_type=RerunDiagnostic("transient_error")),
        result_rejected_tracker_filename=None)
    dist.init_process_group("gloo")
    enable_cpu_mode()
    cpu_stand_ins()
    if args.use_megatron_fsdp:  # its side streams and events
        from megatron_zeppelin.megatron.common.cpu_fsdp import enable_megatron_fsdp_on_cpu

        enable_megatron_fsdp_on_cpu()
        fsdp_on_cpu_device()
    if args.use_torch_fsdp2:  # its device mesh on gloo
        from megatron_zeppelin.megatron.common.cpu_fsdp import enable_torch_fsdp2_on_cpu

        enable_torch_fsdp2_on_cpu()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def count_tokens(record: list, plans: list):
    """Wrap the ``get_batch`` the patched ``forward_step`` calls (zeppelin's glue in zeppelin
    mode, ``pretrain_gpt``'s otherwise): record the real (unpadded) and pad tokens of every
    batch the first pipeline stage's first model chunk reads (each micro-batch once), and a
    digest of every zeppelin plan's placement (every stage and chunk) as ``(chunk, digest)``.
    core_v0.18's static ``get_batch`` returns its ``BATCH_KEYS`` in order (tokens last); the
    others ``(tokens, ..., packed_seq_params)``."""
    from megatron_zeppelin.megatron.lm import glue

    zeppelin = get_args().context_parallel_mode == "zeppelin"
    owner = glue if zeppelin else P
    original = owner.get_batch

    def get_batch(data_iterator, vp_stage=None):
        batch = original(data_iterator, vp_stage)
        if len(batch) != 6:  # core_v0.18 static: [attention_mask, ..., tokens]
            if mpu.get_pipeline_model_parallel_rank() == 0 and not vp_stage:
                record.append((batch[-1].numel(), 0))
            return batch
        params = batch[5]
        plan = getattr(params, "plan", None)
        if plan is not None:  # the placement (not the time planning took)
            placed = (plan.seqlens, plan.sources, plan.tasks, plan.linear, plan.attention,
                      plan.candidate)
            plans.append((vp_stage or 0, hashlib.sha1(repr(placed).encode()).hexdigest()))
        if mpu.get_pipeline_model_parallel_rank() == 0 and not vp_stage:
            real = params.num_tokens if hasattr(params, "num_tokens") else batch[0].numel()
            record.append((real, batch[0].numel() - real))
        return batch

    owner.get_batch = get_batch


def _harness_option(flag: str) -> str | None:
    """Take ``flag VALUE`` out of ``sys.argv`` (Megatron parses the rest)."""
    if flag not in sys.argv:
        return None
    at = sys.argv.index(flag)
    value = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    return value


def mtp_losses() -> list[float]:
    """This iteration's ``mtp_i loss`` values, computed by Megatron-LM's own logging helper."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    found: dict = {}
    MTPLossLoggingHelper.track_mtp_metrics(1 / get_num_microbatches(), 0, None, None, found)
    return [float(found[f"mtp_{i + 1} loss"]) for i in range(len(found))]


def data_iterators(chunks: int):
    """Megatron's train and validation iterators, one per model chunk with virtual pipeline
    stages (as ``pretrain()`` builds them)."""
    build = run_on_cpu(T.build_train_valid_test_data_iterators)
    P.train_valid_test_datasets_provider.is_distributed = True
    if get_args().virtual_pipeline_model_parallel_size is None:
        return build(P.train_valid_test_datasets_provider)[:2]
    train, valid = [], []
    for chunk in range(chunks):
        provider = partial(P.train_valid_test_datasets_provider, vp_stage=chunk)
        provider.is_distributed = True
        train_it, valid_it, _ = build(provider)
        train.append(train_it)
        valid.append(valid_it)
    return train, valid


def on_last_stage(values: dict, last_rank: int) -> dict:
    """The last pipeline stage's ``values`` on every rank (Megatron reduces the loss there
    only; without pipelines every rank has them)."""
    box = [values]
    dist.broadcast_object_list(box, src=last_rank)
    return box[0]


def parameters(chunk, inner) -> list:
    """The first model chunk's parameters, gathered whole from Megatron-FSDP's shards."""
    if not get_args().use_megatron_fsdp:
        return list(inner.parameters())
    from megatron_zeppelin.megatron.loop.checkpoint_fsdp import full_parameters

    return list(full_parameters(chunk).values())


def training_config(model: list, optimizer):
    """The model config as Megatron-LM's ``train()`` sets it up before its first step: loss
    scaling, timers, with ``--overlap-grad-reduce`` the chunks' ``no_sync`` (and with
    ``--align-grad-reduce`` their ``start_grad_sync``), with ``--overlap-param-gather
    --align-param-gather`` their ``start_param_sync``, and ``finalize_model_grads`` unless the
    builder installed one. (Without ``no_sync`` the overlapped hooks reduce every micro-batch.)"""
    from megatron.core.distributed import finalize_model_grads

    args = get_args()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()

    def per_chunk(name: str):
        found = [getattr(chunk, name) for chunk in model]
        return found[0] if len(found) == 1 else found

    if isinstance(model[0], (T.megatron_FSDP, T.DDP)) and args.overlap_grad_reduce:
        config.no_sync_func = per_chunk("no_sync")
        if args.align_grad_reduce:
            config.grad_sync_func = per_chunk("start_grad_sync")
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    if args.context_parallel_mode == "static":  # zeppelin's glue does it (pipelined_schedule):
        # gloo reads an isend's buffer after the call returns, and Megatron frees the output
        # of a send in flight
        config.deallocate_pipeline_outputs = False
    return config


def main() -> None:
    out_path, stop = _harness_option("--harness-out"), _harness_option("--harness-stop")
    kill = _harness_option("--harness-kill")  # "RANK:ITERATION": that rank dies (SIGKILL) there
    sys.argv[0] = "pretrain_gpt.py"
    initialize()
    args = get_args()
    rank = dist.get_rank()
    model, optimizer, scheduler = run_on_cpu(T.setup_model_and_optimizer)(  # core_v0.19 swapped
        model_provider_func=partial(P.model_provider, P.gpt_builder),  # the two: by name
        model_type=ModelType.encoder_or_decoder)
    start = args.iteration
    config = training_config(model, optimizer)
    train_it, valid_it = data_iterators(len(model))
    records: list = []
    plans: list = []
    count_tokens(records, plans)
    last_rank = dist.get_world_size() - 1  # on the last pipeline stage
    step = run_on_cpu(T.train_step)
    inner = model[0].module
    while not hasattr(inner, "decoder"):  # Megatron-FSDP: adapter -> MegatronFSDP -> model
        inner = inner.module
    core_attention = inner.decoder.layers[0].self_attention.core_attention
    result = {"mode": args.context_parallel_mode, "world": dist.get_world_size(),
              "wrapper": type(model[0]).__name__, "model": type(inner).__name__,
              "start": start, "losses": [], "grad_norms": [],
              "tokens_per_iteration": [], "rank_tokens": [], "rank_pads": [], "pad_tokens": 0,
              "core_attention": type(core_attention).__name__, "plans": []}
    last = int(stop) if stop else args.train_iters
    for iteration in range(start + 1, last + 1):
        if kill and kill == f"{rank}:{iteration}":
            os.kill(os.getpid(), signal.SIGKILL)
        before = len(records)
        out = step(P.forward_step, train_it, model, optimizer, scheduler, config,
                   T.get_forward_backward_func(), iteration=iteration - 1)  # 0-based, as train()
        args.consumed_train_samples += args.global_batch_size
        loss = on_last_stage({k: float(v) for k, v in out[0].items()}, last_rank)
        mine = records[before:]
        total = torch.tensor([sum(r for r, _ in mine), sum(p for _, p in mine)])
        dist.all_reduce(total)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, [r for r, _ in mine])
        pads = [None] * dist.get_world_size()
        dist.all_gather_object(pads, [p for _, p in mine])
        result["losses"].append(loss["lm loss"])
        result["grad_norms"].append(float(out[5]))
        result["tokens_per_iteration"].append(int(total[0]) // args.tensor_model_parallel_size)
        result["rank_tokens"].append(per_rank)
        result["rank_pads"].append(pads)
        result["pad_tokens"] += int(total[1])
        consume = getattr(T, "consume_seqlen_stats_in_iteration", None)  # core_v0.18 on
        if consume is not None:  # as train(): the packed-sequence FLOPs statistics, reduced
            result.setdefault("seqlen_stats", []).append(list(run_on_cpu(consume)()))
        if args.mtp_num_layers:  # as Megatron-LM's training_log: reduced, then cleared
            result.setdefault("mtp_losses", []).append(
                on_last_stage({"mtp": mtp_losses()}, last_rank)["mtp"])
    if args.do_valid and args.eval_iters:  # every rank: TP ranks > 0 have no iterator
        evaluated = run_on_cpu(T.evaluate)(P.forward_step, valid_it, model, None, config)
        valid = {k: float(v) for k, v in evaluated[0].items()}
        result["valid_loss"] = on_last_stage(valid, last_rank)["lm loss"]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, plans)
    result["plans"] = every  # [rank][(chunk, digest)], every get_batch in order
    if args.save:
        run_on_cpu(save_checkpoint)(last, model, optimizer, scheduler, 0)
    params = torch.cat([p.detach().float().reshape(-1) for p in parameters(model[0], inner)])
    result["param_sum"] = float(params.double().sum())
    result["param_abs_sum"] = float(params.double().abs().sum())
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
