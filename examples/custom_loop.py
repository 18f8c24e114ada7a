"""A custom Megatron-Core training loop with zeppelin CP (docs/api.md). Run on CPU:
torchrun --nproc-per-node 4 examples/custom_loop.py   (4 gloo ranks: 2 nodes x 2)."""
import itertools

import torch
import torch.distributed as dist

from megatron_zeppelin import api


def documents(step: int, seed: int = 0) -> list[torch.Tensor]:
    """Your data: one micro-batch = a list of 1-D token tensors (the same on every pool rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    lengths = torch.randint(1, 300, (8,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def main(iterations: int = 2, fit_every: int = 0, profile_out: str | None = None
         ) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_zeppelin.megatron.common.cpu import enable_cpu_mode
    from megatron_zeppelin.megatron.common.model import build_gpt_model, make_transformer_config

    enable_cpu_mode()  # CPU/gloo only; on GPUs leave it out and use device="cuda"
    parallel_state.initialize_model_parallel()  # Megatron CP 1: the pools are zeppelin's
    model_parallel_cuda_manual_seed(1)
    layout = api.PoolLayout(dist.get_world_size(), tp=1, cp=4, gpus_per_node=2)
    spec = api.ModelSpec(name="tiny", num_layers=2, hidden_size=32, num_attention_heads=4,
                         num_query_groups=2, ffn_hidden_size=64, vocab_size=256)
    runtime = api.pool_runtime(layout, spec, seq_length=1024, device="cpu",
                               zeppelin_cluster="cpu-2x2")
    config = make_transformer_config(spec, calculate_per_token_loss=True,
                                     use_cpu_initialization=True)
    model = DDP(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                build_gpt_model(spec, config, max_sequence_length=1024,
                                layer_spec=api.layer_spec(runtime, use_te=False)))
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [model])
    stream = (documents(i) for i in itertools.count())  # endless: planned one ahead
    batches = api.planned_micro_batches(stream, runtime, "cpu", max_position=1024)
    # the planner's cost model refitted to this run's measurements (0: off)
    fit = api.online_fit(runtime, batches, interval=fit_every, profile_out=profile_out)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                       packed_seq_params=batch.packed_seq_params)
        return output, api.loss_func(batch)

    losses = []
    for iteration in range(1, iterations + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        stored = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=fit.watch(batches), model=[model],
            num_microbatches=1, seq_length=0, micro_batch_size=1, forward_only=False)
        fit.finish()
        optimizer.step()
        fit.step(iteration)
        losses.append(api.global_mean_loss(stored))
    batches.close()
    runtime.close()
    return losses


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with api.watchdog(20.0):  # a rank that dies, freezes or raises is named by the others
        print("losses", main())
    dist.destroy_process_group()
