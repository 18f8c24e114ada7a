"""Multi-token prediction (``--mtp-num-layers``) in training, on gloo: 4 ranks as 2 nodes x 2 in
zeppelin mode (documents split over ranks: the shifted ids and labels of a piece's last tokens
come from other ranks) and static mode give the loss, every gradient (MTP layers included) and
the logged MTP losses of one process running megatron-core's own packed MTP on the same
documents (documents of 1 and 2 tokens: shorter than the depth)."""
from __future__ import annotations

import pytest
import torch

from distributed import run_world

pytestmark = pytest.mark.distributed

MTP = ("--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3")


def tracked_mtp_losses() -> list[float]:
    """Megatron's logged MTP losses of the last step (``track_mtp_metrics``' values, one
    micro-batch), cleared."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_zeppelin.megatron.common.compat import mtp_tracker

    tracker = mtp_tracker(MTPLossLoggingHelper)
    tracker.reduce()
    values = MTPLossLoggingHelper.tracker[tracker.key].tolist()
    tracker.clean()
    return values


def reference(module, docs):
    """One process, whole documents, megatron-core's own MTP and packed roll: (mean loss,
    gradients as the schedule leaves them: per-token sums over the global token count,
    MTP losses as logged)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_zeppelin.megatron.common.model import build_gpt_model
    from megatron_zeppelin.megatron.common.packing import packed_seq_params_for_documents

    ref = build_gpt_model(module.spec, module.config, max_sequence_length=1024)
    ref.load_state_dict(module.state_dict())
    params = packed_seq_params_for_documents([d.numel() for d in docs])
    assert params.plan is None  # megatron-core's roll_tensor runs, not the zeppelin shift
    tokens = torch.cat(docs)[None]
    labels = torch.cat([torch.cat([d[1:], d.new_zeros(1)]) for d in docs])[None]
    mask = torch.cat([torch.cat([torch.ones(d.numel() - 1), torch.zeros(1)]) for d in docs])[None]
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))  # what the schedule sets (per-token loss)
    losses = ref(tokens, params.position_ids(), None, labels=labels, loss_mask=mask,
                 packed_seq_params=params)
    total = (losses * mask).sum()
    total.backward()
    count = mask.sum()
    return ((total / count).item(), {n: p.grad / count for n, p in ref.named_parameters()},
            tracked_mtp_losses())


def compare(loss, grads, mtp_losses, reference_result, what):
    ref_loss, ref_grads, ref_mtp = reference_result
    assert abs(loss - ref_loss) < 1e-5, (what, loss, ref_loss)
    assert set(grads) == set(ref_grads) and any(n.startswith("mtp.") for n in grads)
    worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    assert worst < 1e-5, (what, worst)
    assert len(mtp_losses) == 2 and max(abs(a - b) for a, b in zip(mtp_losses, ref_mtp)) < 1e-5, \
        (what, mtp_losses, ref_mtp)


def mtp_body(rank: int, world: int, tmp: str) -> None:
    from test_megatron_zeppelin import FLAGS, documents, run_mode

    from megatron_zeppelin.megatron.loop import args as train_args, train

    train.setup_megatron(train_args.parse_args(FLAGS))
    docs = documents()
    plan, loss, grads, module = run_mode("zeppelin", rank, save=f"{tmp}/mtp", extra=MTP)
    mtp_losses = tracked_mtp_losses()
    split = [seq for seq in range(len(plan.seqlens))
             if len({r for r, segs in enumerate(plan.linear) for s in segs if s.seq == seq}) > 1]
    assert split, "no document is split over ranks: the test would not cross ranks"
    expected = reference(module, docs)
    compare(loss, grads, mtp_losses, expected, "zeppelin")
    _, static_loss, static_grads, static_module = run_mode("static", rank, load=f"{tmp}/mtp",
                                                           extra=MTP)
    compare(static_loss, static_grads, tracked_mtp_losses(), expected, "static")
    # both MTP layers train: gradients 10x the exactness bound
    for depth in range(2):
        layer = [g for n, g in grads.items() if n.startswith(f"mtp.layers.{depth}.")]
        assert layer and max(g.abs().max().item() for g in layer) > 1e-4, depth
    refuses_plain_mtp_attention(module.config)


def refuses_plain_mtp_attention(config) -> None:
    """MTP layers built from Megatron's own layer spec (no zeppelin core attention) are refused
    when the decoder runs zeppelin's; swapped, the same spec builds."""
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_zeppelin import api
    from megatron_zeppelin.megatron.common.core_attention import ZeppelinAttentionState
    from megatron_zeppelin.megatron.common.model import gpt_layer_spec
    from megatron_zeppelin.megatron.common.packing import PackedGPTModel

    state = ZeppelinAttentionState(dist.group.WORLD)
    plain = get_gpt_mtp_block_spec(config, gpt_layer_spec(DotProductAttention),
                                   use_transformer_engine=False)
    build = dict(config=config, transformer_layer_spec=api.layer_spec(state, use_te=False),
                 vocab_size=256, max_sequence_length=1024, position_embedding_type="rope")
    with pytest.raises(ValueError, match=r"MTP layer\(s\) \[1, 2\] have no zeppelin core"):
        PackedGPTModel(**build, mtp_block_spec=plain)
    PackedGPTModel(**build, mtp_block_spec=api.swap_core_attention(plain, state))


def test_mtp_matches_static_mode_and_one_process(tmp_path):
    run_world(mtp_body, 4, str(tmp_path), start_method="spawn", timeout_s=600)
