"""megatron-core 0.16.1 on CPU/gloo: CUDA bridge, per-document RoPE, packed GPT, DDP + optimizer.

(a) a packed batch of documents through ``PackedGPTModel`` + ``PackedCoreAttention`` gives the
    per-token losses and gradients of Megatron's stock GPT run on each document separately;
(b) two gloo ranks with Megatron's DDP, optimizer and ``get_forward_backward_func()`` schedule
    (per-token loss normalisation) match one process training on the union of the data.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import os

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.bench.workers import free_port
from megatron_zeppelin.config import ModelSpec
from megatron_zeppelin.megatron.common import cpu
from megatron_zeppelin.megatron.common.model import (PackedCoreAttention, build_gpt_model,
                                              make_transformer_config)
from megatron_zeppelin.megatron.common.packing import (ZeppelinPackedSeqParams, gather_rotary_pos_emb,
                                                packed_seq_params_for_documents,
                                                packed_seq_params_for_rank,
                                                packed_seq_params_from_segments)
from megatron_zeppelin.plan import AttentionTask, Plan, Segment, Tier, Topology

from distributed import run_world

SPEC = ModelSpec(name="cpu-test", num_layers=2, hidden_size=32, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=48, vocab_size=64, swiglu=True,
                 bytes_per_element=4)
MAX_LEN = 64


@contextlib.contextmanager
def megatron_world(tp: int = 1):
    """CPU mode, a one-process gloo group and megatron's parallel state; all undone after."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized in this process")
    with cpu.cpu_mode():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            model_parallel_cuda_manual_seed(1234)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            # megatron-core 0.16.1's destroy_model_parallel leaves these two alive; a live gloo
            # group makes ranks forked later (run_world) hang creating their own gloo groups.
            parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
            parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
            dist.destroy_process_group()
            gc.collect()


@pytest.fixture(autouse=True)
def _release_process_groups():
    """Free this test's megatron modules (and the gloo groups they hold) before the next test:
    a gloo group alive in the pytest process makes ranks forked later (run_world) hang."""
    yield
    gc.collect()


def make_documents(lengths, seed: int):
    """Token and label ids per document: lists of ``[len]`` int64 tensors."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, SPEC.vocab_size, (n,), generator=gen) for n in lengths]
    labels = [torch.randint(0, SPEC.vocab_size, (n,), generator=gen) for n in lengths]
    return tokens, labels


# ----------------------------------------------------------------------------- the bridge
def test_cpu_mode_enables_idempotently_and_reverts():
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer_mod
    import megatron.core.tensor_parallel.random as tp_random

    assert not cpu.cpu_mode_enabled()
    originals = (torch.cuda.current_device, optimizer_mod.clip_grad_by_total_norm_fp32,
                 tp_random.CudaRNGStatesTracker.add, clip_grads.l2_norm_impl)
    cpu.enable_cpu_mode()
    cpu.enable_cpu_mode()
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        # bound by name in optimizer.py and as l2_norm_impl in clip_grads.py: swapped there too
        assert optimizer_mod.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
        assert optimizer_mod.clip_grad_by_total_norm_fp32 is not originals[1]
        assert clip_grads.l2_norm_impl.__zeppelin_cpu_wrapped__ is originals[3]
    finally:
        cpu.disable_cpu_mode()
    assert not cpu.cpu_mode_enabled()
    assert (torch.cuda.current_device, optimizer_mod.clip_grad_by_total_norm_fp32,
            tp_random.CudaRNGStatesTracker.add, clip_grads.l2_norm_impl) == originals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_embeddings_gradient_is_summed_in_fp32_as_on_cuda(dtype):
    """CPU's embedding backward sums a bf16 weight's gradient in bf16: with ids repeating
    (the tiny GPT's byte vocabulary) it lost 8-14% of the norm and made zeppelin and static
    CP disagree by 1-2%. In CPU mode the sum is fp32, rounded once, as CUDA does; other calls
    (fp32, an option given) are torch's own."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 8192), generator=gen)
    grad = torch.randn(2, 8192, 64, generator=gen).to(dtype)
    want = torch.zeros(256, 64).index_add_(0, ids.reshape(-1), grad.reshape(-1, 64).float())

    def weight_grad(weight, *options):
        weight = weight.detach().requires_grad_()
        out = F.embedding(ids, weight, *options)
        out.backward(grad.to(weight.dtype))
        return out, weight.grad

    weight = torch.randn(256, 64, generator=gen)
    cpu.enable_cpu_mode()
    try:
        out, got = weight_grad(weight.to(dtype))
        assert torch.equal(out, weight.to(dtype)[ids]) and torch.equal(got, want.to(dtype))
        assert torch.equal(weight_grad(weight)[1], torch.ops.aten.embedding_dense_backward(
            grad.float(), ids, 256, -1, False))  # fp32: torch's own
        _, padded = weight_grad(weight.to(dtype), 0)  # padding_idx given: torch's own
        assert (padded[0] == 0).all()
    finally:
        cpu.disable_cpu_mode()
    assert not hasattr(F.embedding, "__wrapped__")
    _, own = weight_grad(weight.to(dtype))
    assert (own.float() - want).norm() > 3 * (want.to(dtype).float() - want).norm()


def test_cuda_to_cpu_mode_redirects_devices():
    with cpu.CudaToCpuMode():
        made = [torch.zeros(2, device="cuda"), torch.ones(2, device="cuda:1"),
                torch.tensor([1, 2], device=0, pin_memory=True), torch.empty(3).cuda(),
                torch.arange(3).to("cuda"), torch.arange(3).to(device=torch.device("cuda", 0)),
                torch.arange(2).pin_memory()]
    assert all(t.device.type == "cpu" for t in made)
    assert made[2].tolist() == [1, 2]
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # outside the mode nothing is redirected


class _FakeGroup:
    """Just what ``get_pos_emb_on_this_cp_rank`` reads from a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_replacements_equal_the_megatron_originals_redirected():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import utils as transformer_utils

    assert not cpu.cpu_mode_enabled()
    emb = torch.randn(24, 1, 1, 6)

    def calls():
        return (transformer_utils.get_default_causal_mask(5),
                transformer_utils.get_sliding_window_causal_mask(4, 7, (2, 1)),
                rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _FakeGroup(3, 1)))

    with cpu.CudaToCpuMode():  # megatron's own code, its CUDA devices redirected
        expected = calls()
    with cpu.cpu_mode():
        got = calls()
    for want, have in zip(expected, got):
        assert have.device.type == "cpu" and torch.equal(want, have)
    assert got[2].shape == (8, 1, 1, 6)


def test_rng_tracker_runs_on_the_cpu_generator(caplog):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    with megatron_world():
        torch.manual_seed(7)
        expected_default = torch.rand(3)
        torch.manual_seed(7)
        tracker = get_cuda_rng_tracker()
        with caplog.at_level(logging.WARNING):
            with tracker.fork():
                first = torch.rand(4)
            assert torch.equal(torch.rand(3), expected_default)  # default stream untouched
            model_parallel_cuda_manual_seed(1234)
            with tracker.fork():
                again = torch.rand(4)
            with tracker.fork():
                after = torch.rand(4)
        assert torch.equal(first, again) and not torch.equal(again, after)
        assert "CPU RNG state changed" not in caplog.text


# ----------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("interleaved,percent,interp", [(False, 1.0, None), (True, 1.0, None),
                                                         (False, 0.5, 2.0)])
def test_rope_by_position_id_matches_each_document(interleaved, percent, interp):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    with megatron_world():
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                   rotary_interleaved=interleaved, apply_rope_fusion=False)
        cp_group = parallel_state.get_context_parallel_group()
        rope = RotaryEmbedding(kv_channels=16, rotary_percent=percent,
                               rotary_interleaved=interleaved,
                               seq_len_interpolation_factor=interp, use_cpu_initialization=True,
                               cp_group=cp_group)
        lengths = [7, 1, 12, 5]
        docs = [torch.randn(n, 1, 2, 16, dtype=torch.float32) for n in lengths]
        whole = [apply_rotary_pos_emb(d, rope(len(d)), config, cp_group=cp_group) for d in docs]
        # pieces as a linear layout holds them: several start inside their document
        pieces = [Segment(2, 3, 12), Segment(0, 0, 7), Segment(3, 1, 4), Segment(1, 0, 1),
                  Segment(2, 0, 3)]
        params = packed_seq_params_from_segments(pieces)
        packed = torch.cat([docs[s.seq][s.start:s.end] for s in pieces])
        freqs = gather_rotary_pos_emb(rope(params.max_seqlen_q), params.position_ids())
        assert freqs.shape == (packed.shape[0], 1, 1, int(16 * percent))
        out = apply_rotary_pos_emb(packed, freqs, config, cp_group=cp_group)
        expected = torch.cat([whole[s.seq][s.start:s.end] for s in pieces])
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_packed_params_validate_their_input():
    with pytest.raises(ValueError, match="lengths\\[1\\]=0"):
        packed_seq_params_for_documents([3, 0])
    with pytest.raises(ValueError, match="qkv_format='thd'"):
        ZeppelinPackedSeqParams(qkv_format="thd", segments=(Segment(0, 0, 2),))
    params = packed_seq_params_from_segments([Segment(4, 5, 9), Segment(1, 0, 2)])
    assert params.cu_seqlens_q.tolist() == [0, 4, 6] and params.max_seqlen_q == 9
    assert params.position_ids().tolist() == [[5, 6, 7, 8, 0, 1]]
    table = torch.randn(9, 1, 1, 4)
    with pytest.raises(ValueError, match="batch 1"):
        gather_rotary_pos_emb(table, torch.zeros(2, 6, dtype=torch.long))


def test_packed_params_of_a_plan_rank_follow_its_linear_layout():
    plan = Plan(strategy="hand", topology=Topology(1, 2), seqlens=(5, 3),
                sources=(Segment(0, 0, 5), Segment(1, 0, 3)),
                tasks=(AttentionTask(0, (0,), Tier.LOCAL), AttentionTask(1, (1,), Tier.LOCAL)),
                linear=((Segment(0, 0, 4),), (Segment(0, 4, 5), Segment(1, 0, 3))),
                capacity=8).validate()
    params = packed_seq_params_for_rank(plan, 1)
    assert params.plan is plan and params.rank == 1 and params.num_tokens == 4
    assert params.position_ids().tolist() == [[4, 0, 1, 2]]
    assert params.cu_seqlens_kv.tolist() == [0, 1, 4] and params.max_seqlen_kv == 5
    with pytest.raises(ValueError, match="rank=2"):
        packed_seq_params_for_rank(plan, 2)


# ----------------------------------------------------------------------------- (a) packed GPT
def reference_gpt(config, packed_model):
    """Megatron's stock local GPT (``DotProductAttention``) with the packed model's weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ref = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization),
                   vocab_size=SPEC.vocab_size, max_sequence_length=MAX_LEN,
                   position_embedding_type="rope")
    ref.load_state_dict(packed_model.state_dict())
    return ref


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_packed_gpt_matches_documents_run_separately(normalization):
    with megatron_world():
        config = make_transformer_config(SPEC, normalization=normalization)
        model = build_gpt_model(SPEC, config, max_sequence_length=MAX_LEN)
        ref = reference_gpt(config, model)
        lengths = [9, 1, 23, 4, 14]
        tokens, labels = make_documents(lengths, seed=3)
        params = packed_seq_params_for_documents(lengths)
        losses = model(torch.cat(tokens)[None], params.position_ids(), None,
                       labels=torch.cat(labels)[None], packed_seq_params=params)
        assert losses.shape == (1, sum(lengths))
        losses.sum().backward()
        ref_losses = torch.cat([ref(t[None], torch.arange(len(t))[None], None, labels=y[None])
                                for t, y in zip(tokens, labels)], dim=1)
        ref_losses.sum().backward()
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        named_ref = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, named_ref[name].grad, atol=1e-5, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_packed_core_attention_refuses_mismatched_packing():
    from megatron.core.transformer.enums import AttnMaskType

    with megatron_world():
        config = make_transformer_config(SPEC)
        attn = PackedCoreAttention(config, 1, AttnMaskType.causal, "self")
        q, kv = torch.randn(10, 1, 4, 8), torch.randn(10, 1, 2, 8)
        with pytest.raises(ValueError, match="hold 9 tokens but q has 10"):
            attn(q, kv, kv, None, packed_seq_params=packed_seq_params_for_documents([4, 5]))
        out = attn(q, kv, kv, None, packed_seq_params=packed_seq_params_for_documents([4, 6]))
        assert out.shape == (10, 1, 32)


# ----------------------------------------------------------------------------- (b) DDP on 2 ranks
LR, CLIP, STEPS, MICROBATCHES = 1e-3, 0.05, 2, 2


def batch_lengths(step: int, rank: int, micro: int) -> list[int]:
    """Uneven packed batches: ranks and microbatches hold different token counts."""
    base = [[5, 17, 2], [11, 3], [8, 8, 1, 6], [20]]
    return [n + step for n in base[(2 * rank + micro) % 4]]


def microbatch(step: int, rank: int, micro: int):
    lengths = batch_lengths(step, rank, micro)
    tokens, labels = make_documents(lengths, seed=1000 * step + 10 * rank + micro)
    params = packed_seq_params_for_documents(lengths)
    return torch.cat(tokens)[None], torch.cat(labels)[None], params


def forward_step(data_iterator, model):
    """Megatron forward_step_func: per-token loss sum + token count (calculate_per_token_loss)."""
    tokens, labels, params = next(data_iterator)
    losses = model(tokens, params.position_ids(), None, labels=labels, packed_seq_params=params)

    def loss_func(output):
        total = output.float().sum()
        num_tokens = torch.tensor(output.numel(), dtype=torch.int)
        return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}

    return losses, loss_func


def reference_grads(ref, ref_opt, step: int, world: int) -> float:
    """One process on the union of all ranks' microbatches: grads of the mean per-token loss."""
    ref_opt.zero_grad()
    total, count = 0.0, 0
    for rank in range(world):
        for micro in range(MICROBATCHES):
            tokens, labels, params = microbatch(step, rank, micro)
            losses = ref(tokens, params.position_ids(), None, labels=labels,
                         packed_seq_params=params)
            losses.sum().backward()
            total, count = total + losses.sum().item(), count + losses.numel()
    for p in ref.parameters():
        p.grad /= count
    return total


def ddp_worker(rank: int, world: int, out_dir: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu.enable_cpu_mode()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    config = make_transformer_config(SPEC, calculate_per_token_loss=True)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    module = build_gpt_model(SPEC, config, max_sequence_length=MAX_LEN, pg_collection=groups)
    ref = build_gpt_model(SPEC, config, max_sequence_length=MAX_LEN, pg_collection=groups)
    ref.load_state_dict(module.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), module)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=CLIP), [model])
    metrics = {"grad": [], "param": [], "loss": []}
    for step in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        batches = iter([microbatch(step, rank, m) for m in range(MICROBATCHES)])
        stored = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=[model],
            num_microbatches=MICROBATCHES, seq_length=0, micro_batch_size=1, forward_only=False)
        ref_total = reference_grads(ref, ref_opt, step, world)
        named_ref = dict(ref.named_parameters())
        # main_grad: after the schedule's finalize_model_grads (DP sum / global token count)
        metrics["grad"].append(max((p.main_grad - named_ref[n].grad).abs().max().item()
                                   for n, p in module.named_parameters()))
        local = torch.stack([d["lm loss"] for d in stored]).sum(0)
        dist.all_reduce(local, group=groups.dp)
        metrics["loss"].append(abs(local[0].item() - ref_total) / local[1].item())
        update_ok, grad_norm, _ = optimizer.step()
        assert update_ok and grad_norm > CLIP, (update_ok, grad_norm)  # the clip bridge is used
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        metrics["param"].append(max((p - named_ref[n]).abs().max().item()
                                    for n, p in module.named_parameters()))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(metrics, f)


@pytest.mark.distributed
def test_ddp_optimizer_schedule_on_two_ranks_match_one_process(tmp_path):
    # spawned, not forked: a gloo group still alive in this process (any earlier test's) makes
    # forked ranks hang when they create their own gloo groups
    run_world(ddp_worker, 2, str(tmp_path), start_method="spawn", timeout_s=300)
    for rank in range(2):
        metrics = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key in ("grad", "param", "loss"):
            assert len(metrics[key]) == STEPS, (rank, key, metrics)
            assert max(metrics[key]) < 1e-5, (rank, key, metrics)
