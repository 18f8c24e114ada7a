"""Megatron integration on gloo: 4 ranks as 2 nodes x 2 in zeppelin and static mode give the
loss and every gradient of one process running the same documents; checkpoints cross modes."""
from __future__ import annotations

import pytest
import torch

from distributed import run_world

pytestmark = pytest.mark.distributed

FLAGS = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--vocab-size", "256", "--seq-length", "1024", "--global-batch-size", "1",
         "--train-iters", "1", "--mock-data", "--context-parallel-size", "4",
         "--zeppelin-gpus-per-node", "2", "--zeppelin-cluster", "cpu-2x2",
         "--zeppelin-capacity-tokens-per-gpu", "280", "--zeppelin-validate-plan", "--seed", "7"]
LENGTHS = [600, 150, 90, 33, 17, 5, 2, 1, 64, 12]  # 974 tokens; 600 cannot fit one node (2 x 280)


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]


def reference(module, docs, dtype: torch.dtype | None = None):
    """One process: every document whole, exact packed attention; mean per-token loss + grads
    (with ``module``'s weights in ``dtype`` if given)."""
    from megatron_zeppelin.megatron.common.model import build_gpt_model
    from megatron_zeppelin.megatron.common.packing import packed_seq_params_for_documents

    ref = build_gpt_model(module.spec, module.config, max_sequence_length=1024)
    ref = ref if dtype is None else ref.to(dtype)
    ref.load_state_dict(module.state_dict())
    params = packed_seq_params_for_documents([d.numel() for d in docs])
    tokens = torch.cat(docs)[None]
    labels = torch.cat([torch.cat([d[1:], d.new_zeros(1)]) for d in docs])[None]
    mask = torch.cat([torch.cat([torch.ones(d.numel() - 1), torch.zeros(1)]) for d in docs])
    losses = ref(tokens, params.position_ids(), None, labels=labels, packed_seq_params=params)
    loss = (losses[0] * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def run_mode(mode: str, rank: int, save: str | None = None, load: str | None = None,
             extra: tuple[str, ...] = (), device: str = "cpu", docs=None,
             strategy=None):
    """One step of ``mode`` on the fixed documents (or ``docs``; ``strategy``, a registered
    ``Strategy``, overrides the mode's planner); returns (plan, loss, grads, module)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_zeppelin.megatron.loop import args as train_args, checkpoint, train
    from megatron_zeppelin.megatron.common.data import slice_rank

    args = train_args.parse_args(FLAGS + ["--context-parallel-mode", mode, *extra] +
                                 (["--load", load] if load else []))
    layout = train_args.validate_args(args, 4, None)
    spec = train.model_spec(args)
    runtime = train.build_pool_runtime(args, layout, spec)
    torch.manual_seed(1 if mode == "zeppelin" else 2)  # different inits: --load must win
    model, optimizer = train.build_training(args, runtime.state, spec)
    # the gradients compared below went through the overlapped bucket reduction (the default)
    assert model.ddp_config.overlap_grad_reduce == ("--no-overlap-grad-reduce" not in extra)
    run = checkpoint.Training(model, optimizer, train.make_scheduler(args, optimizer), "cpu")
    if load:  # the model only: the saving run took no optimizer step
        checkpoint.load(checkpoint.inspect(load, True), run, load_optim=False, load_rng=False)
    docs = documents() if docs is None else docs
    lengths = [d.numel() for d in docs]
    plan = runtime.planner(lengths)
    if mode == "zeppelin" or strategy:  # zeppelin: force the hierarchical plan with the remap,
        # so that every layer is exercised (the portfolio picks no remap for this tiny batch)
        from megatron_zeppelin.config import ZeppelinConfig
        from megatron_zeppelin.planner import get_strategy

        config = ZeppelinConfig(max_seqlen=args.seq_length,
                                capacity_tokens_per_gpu=args.zeppelin_capacity_tokens_per_gpu)
        chosen = strategy or get_strategy("zeppelin", portfolio=False)
        plan = chosen.plan(lengths, runtime.cost, config).validate()
    batch = slice_rank(plan, runtime.pool.rank, docs, device)
    stored = get_forward_backward_func()(
        forward_step_func=train.forward_step, data_iterator=iter([batch]), model=[model],
        num_microbatches=1, seq_length=0, micro_batch_size=1, forward_only=False)
    sums = torch.stack([d["lm loss"] for d in stored]).sum(0)
    dist.all_reduce(sums)
    if save:
        checkpoint.save(save, 1, run, {"mode": mode, "world_size": 4})
    runtime.close()
    module = model.module
    module.spec, module.config = spec, model.config
    grads = {n: p.main_grad for n, p in module.named_parameters()}
    return plan, (sums[0] / sums[1]).item(), grads, module


def compare(loss, grads, module, docs, what):
    ref_loss, ref_grads = reference(module, docs)
    assert abs(loss - ref_loss) < 1e-5, (what, loss, ref_loss)
    worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    assert worst < 1e-5, (what, worst)


def equivalence_body(rank: int, world: int, tmp: str) -> None:
    from megatron_zeppelin.megatron.loop import args as train_args, train

    args = train_args.parse_args(FLAGS)
    train.setup_megatron(args)
    docs = documents()
    plan, loss, grads, module = run_mode("zeppelin", rank, save=tmp)
    tiers = plan.tier_counts()
    assert tiers["inter"] >= 1 and tiers["intra"] + tiers["local"] >= 1, tiers
    assert plan.linear != plan.attention  # the remapping layer is exercised
    compare(loss, grads, module, docs, "zeppelin")
    static_plan, static_loss, static_grads, static_module = run_mode("static", rank, load=tmp)
    assert all(len(t.ring) == min(4, static_plan.seqlens[t.seq] // 2) or
               static_plan.seqlens[t.seq] == 1 for t in static_plan.tasks)
    for name, tensor in module.state_dict().items():  # the zeppelin checkpoint loaded as is
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(static_module.state_dict()[name], tensor), name
    assert abs(static_loss - loss) < 1e-5
    compare(static_loss, static_grads, static_module, docs, "static")


def test_zeppelin_and_static_modes_match_one_process_and_share_checkpoints(tmp_path):
    run_world(equivalence_body, 4, str(tmp_path), start_method="spawn", timeout_s=300)


def empty_rank_body(rank: int, world: int) -> None:
    from megatron_zeppelin.megatron.loop import args as train_args, train

    args = train_args.parse_args(FLAGS)
    train.setup_megatron(args)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (40, 30)]
    from megatron_zeppelin.planner import get_strategy

    whole = get_strategy("hybrid-dp", max_seqlen_per_rank=64)  # each document on one rank
    plan, loss, grads, module = run_mode("zeppelin", rank, docs=docs, strategy=whole)
    assert sorted(plan.linear_tokens()) == [0, 0, 30, 40]  # two ranks get no token at all
    compare(loss, grads, module, docs, "a plan that leaves ranks empty")


def test_a_plan_that_leaves_ranks_without_tokens_trains_exactly():
    """Megatron's layers cannot run on an empty buffer: such a rank holds one pad token (no
    loss, no attention) and still joins every collective."""
    run_world(empty_rank_body, 4, start_method="spawn", timeout_s=300)


TP_FLAGS = ("--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
            "--zeppelin-capacity-tokens-per-gpu", "640",
            "--no-overlap-grad-reduce")  # the other DDP reduction (one after the backward)


def gather_tensor_parallel(module, tensors: dict) -> dict:
    """Full tensors from this TP rank's shards (megatron's ``partition_dim``); SwiGLU's fc1 is
    stored per rank as [gate shard; up shard] and is put back as [gate; up]."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in module.named_parameters():
        t = tensors[name].detach().clone()
        # megatron-core splits a learnable attention sink by head without marking it
        sink = name.endswith("softmax_offset")
        if getattr(param, "tensor_model_parallel", False) or sink:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            if name.endswith("linear_fc1.weight"):
                halves = [p.chunk(2, dim=0) for p in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            t = torch.cat(parts, dim=0 if sink else param.partition_dim)
        full[name] = t
    return full


def tensor_parallel_body(rank: int, world: int, tmp: str, extra: tuple[str, ...]) -> None:
    from megatron_zeppelin.megatron.loop import args as train_args, train

    args = train_args.parse_args(FLAGS + list(TP_FLAGS))
    train.setup_megatron(args)
    plan, loss, grads, module = run_mode("zeppelin", rank, extra=TP_FLAGS + extra)
    assert plan.topology.nodes == 2 and plan.topology.gpus_per_node == 1
    params = gather_tensor_parallel(module, dict(module.named_parameters()))
    full_grads = gather_tensor_parallel(module, grads)
    if rank == 0:
        torch.save({"loss": loss, "params": params, "grads": full_grads}, f"{tmp}/tp.pt")


def tensor_parallel_reference_body(rank: int, world: int, tmp: str,
                                   extra: tuple[str, ...]) -> None:
    import dataclasses

    from megatron_zeppelin.megatron.loop import args as train_args, train
    from megatron_zeppelin.megatron.common.model import make_transformer_config

    args = train_args.parse_args(FLAGS)
    train.setup_megatron(args)
    saved = torch.load(f"{tmp}/tp.pt", weights_only=False)
    spec = train.model_spec(args)

    class Holder(torch.nn.Module):  # what reference() reads: state, spec and config
        pass

    holder = Holder()
    config = make_transformer_config(spec, normalization="RMSNorm")
    fields = train_args.AttentionArgs.from_namespace(train_args.parse_args(FLAGS + list(extra)))
    holder.spec = spec
    holder.config = dataclasses.replace(config, **fields.config_fields(spec.num_layers))
    holder.state_dict = lambda: saved["params"]
    compare(saved["loss"], saved["grads"], holder, documents(), "zeppelin TP=2")


@pytest.mark.parametrize("extra", [(), ("--softmax-type", "learnable")],
                         ids=["vanilla", "learnable sink"])
def test_zeppelin_with_tensor_parallelism_matches_one_process(tmp_path, extra):
    """TP 2 x CP 2 against one process, every gradient gathered over TP (a learnable sink's
    too: megatron-core splits it by head)."""
    run_world(tensor_parallel_body, 4, str(tmp_path), extra, start_method="spawn",
              timeout_s=300)
    run_world(tensor_parallel_reference_body, 1, str(tmp_path), extra, start_method="spawn",
              timeout_s=300)
