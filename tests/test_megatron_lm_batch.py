"""Megatron-LM's micro-batch in zeppelin's linear layout (``megatron/lm/batch.py``), the
sequence-parallel padding through core attention, and the core-attention swap of Megatron's
specs (``megatron/common/spec.py``)."""
from __future__ import annotations

import pytest
import torch

from megatron_zeppelin.config import ConfigError, ModelSpec
from megatron_zeppelin.megatron.lm.batch import (HostBatchTap, PoolStats, host_lengths,
                                                 linear_batch, linear_index, sample_sequences)
from megatron_zeppelin.plan import AttentionTask, Plan, Segment, Tier, Topology

EOD = 0


def test_sequences_follow_megatron_attention_mask():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 8, 9, 3], [0, 1, 2, 3, 4, 0, 6, 6]])
    # --reset-attention-mask: split after every EOD (the EOD ends its document)
    assert sample_sequences(tokens, EOD, True) == [3, 2, 3, 1, 5, 2]
    # Megatron's default: a whole sample is one causal sequence
    assert sample_sequences(tokens, EOD, False) == [8, 8]
    # packed SFT: cu_seqlens (micro-batch of one sample) win over EOD tokens
    assert sample_sequences(tokens[:1], EOD, True, torch.tensor([[0, 5, 8]])) == [5, 3]
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 5, 7\] do not cover a sample of 8"):
        sample_sequences(tokens[:1], EOD, False, torch.tensor([0, 5, 7]))
    # Megatron-LM 0.19's --dataloader-inter-document-masking: a row per sample, padded with seq
    padded = torch.tensor([[0, 3, 8, 8, 8], [0, 1, 2, 6, 8]])
    assert sample_sequences(tokens, EOD, False, padded) == [3, 5, 1, 1, 4, 2]
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 3, 3, 8\] do not cover a sample"):
        sample_sequences(tokens, EOD, False, torch.tensor([[0, 3, 3, 8], [0, 2, 8, 8]]))
    with pytest.raises(ValueError, match=r"cu_seqlens of 5 entries for a micro-batch of 2"):
        sample_sequences(tokens, EOD, False, torch.tensor([0, 3, 5, 7, 8]))


def test_lengths_come_from_the_host_batch_tp_rank_0_read():
    """The sequence boundaries are read from the host batch the data iterator handed out (no
    copy back from the device fields); without one, from the fields."""
    host = {"tokens": torch.tensor([[5, 6, 0, 7, 0, 8, 9, 3]])}
    tap = HostBatchTap(iter([host]))
    fields = {"tokens": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1]])}  # what a broadcast delivered
    assert tap.batch is None and next(tap) is host and tap.batch is host
    assert host_lengths(tap, fields, EOD, True, None) == [3, 2, 3]
    untapped = HostBatchTap(iter([]))
    untapped.batch = {"tokens": [5, 0]}  # not a tensor batch: the fields are read instead
    assert host_lengths(untapped, fields, EOD, True, None) == [8]
    with pytest.raises(RuntimeError, match="no TP rank read this micro-batch"):
        host_lengths(HostBatchTap(iter([])), fields, EOD, True, None)


def _tp_lengths(rank: int, world: int) -> list[int]:
    """TP rank 0 reads the batch, TP rank 1 receives its lengths over the gloo TP group."""
    import torch.distributed as dist

    from megatron_zeppelin.megatron.common.groups import new_tp_host_group
    from megatron_zeppelin.parallel import PoolLayout

    group = new_tp_host_group(PoolLayout(world, 2, 1, 2))
    assert dist.get_process_group_ranks(group) == [rank - rank % 2, rank - rank % 2 + 1]
    tap = HostBatchTap(iter([{"tokens": torch.tensor([[0, 5, 0, 7, 7, 0, 1, 2]]) + rank}]))
    if rank % 2 == 0:
        next(tap)
    return host_lengths(tap, {}, EOD, True, group)


def test_tp_ranks_receive_the_lengths_tp_rank_0_read():
    from distributed import run_world

    assert run_world(_tp_lengths, 4) == [[1, 2, 3, 2]] * 2 + [[8]] * 2


def two_rank_plan() -> Plan:
    """Sequences 5, 3 (sample 0) and 8 (sample 1): the 8 is split over both ranks."""
    return Plan(strategy="hand", topology=Topology(1, 2), seqlens=(5, 3, 8),
                sources=(Segment(0, 0, 5), Segment(1, 0, 3), Segment(2, 0, 8)),
                tasks=(AttentionTask(0, (0,), Tier.LOCAL), AttentionTask(1, (1,), Tier.LOCAL),
                       AttentionTask(2, (0, 1), Tier.INTRA)),
                linear=((Segment(0, 0, 5), Segment(2, 0, 3)),
                        (Segment(1, 0, 3), Segment(2, 3, 8))),
                capacity=9).validate()


def megatron_fields() -> dict:
    """What Megatron's GPTDataset gives for 2 samples of 8 (labels: next tokens, the last one
    from beyond the sample; --eod-mask-loss zeroes EOD positions; reset position ids)."""
    tokens = torch.tensor([[11, 12, 13, 14, 0, 21, 22, 0], [31, 32, 33, 34, 35, 36, 37, 38]])
    labels = torch.tensor([[12, 13, 14, 0, 21, 22, 0, 31], [32, 33, 34, 35, 36, 37, 38, 39]])
    loss_mask = (labels != 0).float()
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], list(range(8))])
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}


def test_each_rank_gets_megatron_fields_of_its_linear_pieces():
    plan, fields = two_rank_plan(), megatron_fields()
    lengths = sample_sequences(fields["tokens"], EOD, True)
    assert lengths == [5, 3, 8]
    assert linear_index(plan, 1, lengths).tolist() == [5, 6, 7, 11, 12, 13, 14, 15]
    rank0 = linear_batch(fields, plan, 0, lengths)
    rank1 = linear_batch(fields, plan, 1, lengths)
    assert rank0.tokens.tolist() == [[11, 12, 13, 14, 0, 31, 32, 33]]
    # the label of a piece's last token is the next token of its sequence, held by rank 1
    assert rank0.labels.tolist() == [[12, 13, 14, 0, 21, 32, 33, 34]]
    assert rank0.loss_mask.tolist() == [[1, 1, 1, 0, 1, 1, 1, 1]]
    assert rank1.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert rank1.labels[0, -1].item() == 39  # Megatron's label beyond the sample is kept
    both = torch.cat([rank0.tokens, rank1.tokens], dim=1).sort().values
    assert torch.equal(both, fields["tokens"].reshape(1, -1).sort().values)  # nothing lost


def test_sequence_parallel_padding_is_masked_and_counted():
    plan, fields = two_rank_plan(), megatron_fields()
    lengths = [5, 3, 8]
    batch = linear_batch(fields, plan, 0, lengths, pad_multiple=3, max_position=8)
    assert batch.tokens.shape == (1, 9) and batch.pad_tokens == 1
    assert batch.loss_mask[0, -1].item() == 0 and batch.tokens[0, -1].item() == 0
    params = batch.packed_seq_params
    assert params.num_tokens == 8 and params.max_seqlen_q == 8 and params.cp_group.size() == 1
    stats = PoolStats()
    stats.add(batch, 0.002)
    assert "pad tokens 1 (11.11%)" in stats.summary() and "max 9" in stats.summary()


def test_a_rank_the_plan_leaves_empty_holds_pad_tokens_only():
    """A plan placing the whole micro-batch on rank 0 (as hybrid DP may): rank 1 holds one
    pad token (TP of them with sequence parallelism), no loss, no sequence; counted."""
    plan = Plan(strategy="hand", topology=Topology(1, 2), seqlens=(8,),
                sources=(Segment(0, 0, 8),), tasks=(AttentionTask(0, (0,), Tier.LOCAL),),
                linear=((Segment(0, 0, 8),), ()), capacity=8).validate()
    fields = {name: value[1:] for name, value in megatron_fields().items()}
    assert linear_index(plan, 1, [8]).numel() == 0
    stats = PoolStats()
    for pad_multiple in (1, 2):
        empty = linear_batch(fields, plan, 1, [8], pad_multiple=pad_multiple, max_position=8)
        assert empty.tokens.shape == (1, pad_multiple) and empty.pad_tokens == pad_multiple
        assert empty.loss_mask.sum().item() == 0 and empty.packed_seq_params.num_tokens == 0
        stats.add(empty, 0.001)
    full = linear_batch(fields, plan, 0, [8], pad_multiple=2)
    assert full.pad_tokens == 0 and full.tokens.tolist() == fields["tokens"].tolist()
    stats.add(full, 0.001)
    assert "pad tokens 3 (27.27%), empty (pad only) in 2 micro-batches" in stats.summary()


def test_a_training_step_is_timed_from_its_first_micro_batch_and_estimated(monkeypatch):
    """``PoolStats``: training micro-batches (with their plan) make the step; evaluation's
    (no plan) are counted in the totals only; ``end_step`` sums the plans' estimates and
    times the step from its first micro-batch."""
    import dataclasses

    from megatron_zeppelin.cost_model import CostModel
    from megatron_zeppelin.config import load_cluster, load_hardware
    from megatron_zeppelin.estimate import estimate_plan
    from megatron_zeppelin.megatron.lm import batch as lm_batch

    plan, fields = two_rank_plan(), megatron_fields()
    batch = linear_batch(fields, plan, 0, [5, 3, 8], max_position=8)
    hardware = dataclasses.replace(load_hardware("cpu"), linear_fixed_us=1000.0)
    cost = CostModel(ModelSpec(name="t", num_layers=2, hidden_size=64, num_attention_heads=4),
                     load_cluster("cpu-2x2"), hardware)
    clock = iter([10.0, 10.75])
    monkeypatch.setattr(lm_batch.time, "perf_counter", lambda: next(clock))
    stats = PoolStats()
    stats.add(batch, 0.001, None)  # evaluation
    stats.add(batch, 0.001, plan)  # the step starts (10.0)
    stats.add(batch, 0.001, plan)
    estimated, measured, micro = stats.end_step(cost)  # ends at 10.75
    assert micro == 2 and measured == pytest.approx(0.75)
    # the plans' estimates and the fixed time of each micro-batch (1 ms)
    assert estimated == pytest.approx(2 * (estimate_plan(plan, cost).step_s + 1e-3))
    line = stats.summary(7, (estimated, measured, micro))
    assert line.startswith("zeppelin: 3 micro-batches on this rank") and \
        f"; iteration 7: 2 micro-batches, step 0.750 s (est. {estimated:.3f} s)" in line
    assert stats.end_step(cost) == (0.0, 0.0, 0) and stats.steps == 2


def test_model_chunks_share_each_micro_batch_plan():
    """Virtual pipeline stages: chunk 0 reads micro-batches 0, 1, then chunk 1 reads them
    (the interleaved schedule's order); each is planned once and both chunks get that plan."""
    from megatron_zeppelin.megatron.lm.batch import ChunkPlans

    calls = []

    def planner(lengths):
        calls.append(lengths)
        return object()

    plans = ChunkPlans(2)
    first, planned = plans.plan(0, [5, 3], planner)
    second, _ = plans.plan(0, [8], planner)
    assert planned and plans.plan(1, [5, 3], planner) == (first, False)
    assert plans.plan(1, [8], planner) == (second, False)
    assert calls == [[5, 3], [8]] and not plans.pending  # each planned once, then dropped
    assert plans.next_index == 2  # a planner switched now plans from micro-batch 2 on
    plans.plan(0, [4, 4], planner)
    assert plans.next_index == 3
    with pytest.raises(RuntimeError, match=r"model chunk 1 read micro-batch 2 with sequence "
                                           r"lengths \[8\], an earlier chunk with \[4, 4\]"):
        plans.plan(1, [8], planner)
    with pytest.raises(ValueError, match=r"model chunk 2 is invalid"):
        plans.plan(2, [8], planner)
    one = ChunkPlans(1)  # no virtual stages: every micro-batch planned, nothing kept
    assert one.plan(0, [8], planner)[1] and one.plan(0, [8], planner)[1] and not one.pending


def test_fields_must_hold_the_planned_tokens():
    fields = megatron_fields()
    fields["labels"] = fields["labels"][:, :7]
    with pytest.raises(ValueError, match="'labels' holds 14 tokens, the planned sequences 16"):
        linear_batch(fields, two_rank_plan(), 0, [5, 3, 8])


def pad_body(rank: int, world: int) -> None:
    """One rank, a one-rank pool: zeppelin attention on pieces + pad tokens equals it without
    the pads; the pads' output is zero."""
    import torch.distributed as dist
    from megatron_zeppelin.megatron.common.core_attention import (ZeppelinAttentionState,
                                                           zeppelin_attention)
    from megatron_zeppelin.megatron.common.packing import packed_seq_params_for_rank

    plan = Plan(strategy="hand", topology=Topology(1, 1), seqlens=(5, 3),
                sources=(Segment(0, 0, 5), Segment(1, 0, 3)),
                tasks=(AttentionTask(0, (0,), Tier.LOCAL), AttentionTask(1, (0,), Tier.LOCAL)),
                linear=((Segment(0, 0, 5), Segment(1, 0, 3)),), capacity=8).validate()
    state = ZeppelinAttentionState(dist.new_group([0]), backend="torch")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 1, h, 4, generator=g) for h in (4, 2, 2))
    padded = packed_seq_params_for_rank(plan, 0, pad_tokens=2)
    plain = packed_seq_params_for_rank(plan, 0)
    out = zeppelin_attention(state, q, k, v, padded, None)
    ref = zeppelin_attention(state, q[:8], k[:8], v[:8], plain, None)
    state.close()
    assert out.shape == (10, 1, 16) and torch.equal(out[8:], torch.zeros(2, 1, 16))
    torch.testing.assert_close(out[:8], ref)
    with pytest.raises(ValueError, match="q holds 9 tokens but the packed params describe 8 "
                                         r"\+ 2 pad tokens"):
        zeppelin_attention(state, q[:9], k[:9], v[:9], padded, None)


@pytest.mark.distributed
def test_pad_tokens_skip_core_attention():
    from distributed import run_world

    run_world(pad_body, 1)


# ----------------------------------------------------------------------------- spec swap
def test_every_attention_layer_of_a_moe_block_spec_gets_zeppelin_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_zeppelin.megatron.common.core_attention import ZeppelinCoreAttention
    from megatron_zeppelin.megatron.common.spec import swap_core_attention

    state = object()
    block = TransformerBlockSubmodules(layer_specs=[  # what Megatron's MoE block spec holds
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")])
    swapped = swap_core_attention(block, state)
    for layer in swapped.layer_specs:
        core = layer.submodules.self_attention.submodules.core_attention
        assert core.module is ZeppelinCoreAttention and core.params["zeppelin_state"] is state
    assert "MoELayer" in repr(swapped.layer_specs[1].submodules.mlp)  # Megatron's MoE kept
    original = block.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert original is not ZeppelinCoreAttention  # the caller's spec is not modified
    no_attention = get_gpt_layer_local_spec()
    no_attention.submodules.self_attention = IdentityOp
    kept = swap_core_attention(TransformerBlockSubmodules(layer_specs=[no_attention]), state)
    assert kept.layer_specs[0].submodules.self_attention is IdentityOp


def test_mtp_layers_get_zeppelin_core_attention_under_either_megatron_core_naming():
    """An MTP layer's transformer layer is ``submodules.transformer_layer`` in megatron-core
    0.16 and ``submodules.mtp_model_layer`` from 0.17: swapped in both (before, the later
    name was skipped silently); an MTP layer holding neither is refused by name."""
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_zeppelin.megatron.common.core_attention import ZeppelinCoreAttention
    from megatron_zeppelin.megatron.common.spec import swap_core_attention

    state = object()
    for field in ("transformer_layer", "mtp_model_layer", "mamba_layer"):
        inner = types.SimpleNamespace(eh_proj=None, **{field: get_gpt_layer_local_spec()})
        block = types.SimpleNamespace(layer_specs=[ModuleSpec(module=torch.nn.Module,
                                                              submodules=inner)])
        if field == "mamba_layer":
            with pytest.raises(ConfigError, match=r"MTP spec, layer 1: an MTP layer spec "
                                                  r"without a transformer_layer or "
                                                  r"mtp_model_layer field"):
                swap_core_attention(block, state, "MTP spec")
            continue
        swapped = getattr(swap_core_attention(block, state).layer_specs[0].submodules, field)
        core = swapped.submodules.self_attention.submodules.core_attention
        assert core.module is ZeppelinCoreAttention and core.params["zeppelin_state"] is state


def test_an_unknown_core_attention_is_refused_by_name():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_zeppelin.megatron.common.spec import swap_core_attention

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = torch.nn.Identity
    with pytest.raises(ConfigError, match=r"--spec my.spec: core attention 'Identity' has no "
                                          r"zeppelin replacement"):
        swap_core_attention(spec, object(), "--spec my.spec")
