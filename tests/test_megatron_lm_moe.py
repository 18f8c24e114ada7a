"""Zeppelin mode as Megatron-LM runs it, without Megatron-LM (CI covers it here): megatron-core's
CP groups are the pool (Megatron CP 2 in its parallel state), Megatron-like batch fields are cut
into the linear layout (``lm_batch``), an MoE GPT built from Megatron's spec with core attention
swapped runs on it; loss (aux loss included) and every gradient match one process. The same
with multi-latent attention (value head dim != query/key head dim, RoPE part by in-document
position under Megatron's CP group of 2) and interleaved sliding-window layers."""
from __future__ import annotations

import pytest
import torch

from distributed import run_world

pytestmark = pytest.mark.distributed
EOD, VOCAB, SAMPLES, SEQ = 0, 64, 2, 48


def aux_loss_coeff() -> float:
    """0.01 where one process is the reference for the aux loss: megatron-core 0.19 multiplies
    each rank's aux loss by the TP x CP size (in static CP too), so a pool of 2 then matches
    static CP 2, which no CPU can run, not one process; the loss itself is compared anyway."""
    from megatron_zeppelin.megatron.common.compat import megatron_core_version

    return 0.01 if megatron_core_version()[:2] == (0, 16) else 0.0


def fields() -> dict:
    """Two samples of SEQ tokens with end-of-document tokens (--reset-attention-mask data)."""
    g = torch.Generator().manual_seed(3)
    text = torch.randint(1, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    text[0, [20, 29, 30]] = EOD
    text[1, [5, 40]] = EOD
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    positions = torch.zeros_like(tokens)
    for row in range(SAMPLES):
        start = 0
        for i in range(SEQ):
            positions[row, i] = i - start
            if tokens[row, i] == EOD:
                start = i + 1
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(SAMPLES, SEQ),
            "position_ids": positions}


# multi-latent attention (q/k head dim 6 + 4, v head dim 6) and a window of 5 on layer 1 only
MLA_SWA = dict(multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6,
               qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope", window_size=(5, 0),
               window_attn_skip_freq=[1, 0])
VARIANTS = {"gqa": {}, "mla-swa": MLA_SWA}


def layer_spec(variant: str):
    """Megatron's local MoE layer spec (MLA's for the MLA variant)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm",
                                    multi_latent_attention=bool(VARIANTS[variant]))


def build(layer_spec, variant: str = "gqa"):
    """An MoE GPT (4 experts, top-2, aux loss) from Megatron's local spec, fixed init."""
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    from megatron_zeppelin.megatron.common.packing import PackedGPTModel

    extra = VARIANTS[variant]
    config = (MLATransformerConfig if extra else TransformerConfig)(**extra, num_layers=2, hidden_size=32, num_attention_heads=4,
                               num_query_groups=2, ffn_hidden_size=64, num_moe_experts=4,
                               moe_router_topk=2, moe_aux_loss_coeff=aux_loss_coeff(),
                               normalization="RMSNorm",
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               bias_activation_fusion=False, bias_dropout_fusion=False,
                               apply_rope_fusion=False, masked_softmax_fusion=False,
                               persist_layer_norm=False, gradient_accumulation_fusion=False,
                               calculate_per_token_loss=True, use_cpu_initialization=True)
    torch.manual_seed(5)
    return PackedGPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                          max_sequence_length=SEQ, position_embedding_type="rope")


def setup(cp: int):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_zeppelin.megatron.common.cpu import enable_cpu_mode

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))


def step(model, tokens, labels, mask, positions, params) -> tuple[torch.Tensor, dict]:
    losses = model(tokens, positions, None, labels=labels, packed_seq_params=params)
    total = (losses * mask).sum()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def pool_body(rank: int, world: int, variant: str = "gqa"):
    """Megatron CP = 2 = the pool; each rank trains on its linear layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.megatron.common.core_attention import ZeppelinAttentionState
    from megatron_zeppelin.megatron.lm.batch import linear_batch, sample_sequences
    from megatron_zeppelin.megatron.common.spec import swap_core_attention
    from megatron_zeppelin.planner import make_plan

    from conftest import make_cost

    setup(cp=world)
    pool = parallel_state.get_context_parallel_group()
    state = ZeppelinAttentionState(pool, backend="torch", windows=(None, 5))
    spec = swap_core_attention(layer_spec(variant), state)
    model = build(spec, variant)
    data = fields()
    lengths = sample_sequences(data["tokens"], EOD, split_at_eod=True)
    plan = make_plan("zeppelin", lengths, make_cost("llama-7b", "h200-8nic", nodes=1,
                                                    gpus_per_node=world),
                     ZeppelinConfig(max_seqlen=SEQ, capacity_factor=1.5))
    batch = linear_batch(data, plan, rank, lengths, max_position=SEQ)
    total, grads = step(model, batch.tokens, batch.labels, batch.loss_mask, batch.position_ids,
                        batch.packed_seq_params)
    state.close()
    for tensor in [total, *grads.values()]:
        dist.all_reduce(tensor, group=pool)
    return total, grads, batch.tokens.numel()


def reference_body(rank: int, world: int, variant: str = "gqa"):
    """One process, Megatron CP 1: every sequence whole, exact packed attention."""
    from megatron_zeppelin.megatron.lm.batch import sample_sequences
    from megatron_zeppelin.megatron.common.model import PackedCoreAttention
    from megatron_zeppelin.megatron.common.packing import (PackedMLASelfAttention,
                                                    packed_seq_params_for_documents)

    setup(cp=1)
    spec = layer_spec(variant)
    if VARIANTS[variant]:
        spec.submodules.self_attention.module = PackedMLASelfAttention
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    model = build(spec, variant)
    data = fields()
    params = packed_seq_params_for_documents(sample_sequences(data["tokens"], EOD, True))
    flat = {k: v.reshape(1, -1) for k, v in data.items()}
    return step(model, flat["tokens"], flat["labels"], flat["loss_mask"], flat["position_ids"],
                params)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_on_the_linear_layout_matches_one_process(variant):
    pool = run_world(pool_body, 2, variant, start_method="spawn", timeout_s=300)
    (ref_total, ref_grads), = run_world(reference_body, 1, variant, start_method="spawn",
                                        timeout_s=300)
    total, grads, _ = pool[0]
    assert sum(tokens for _, _, tokens in pool) == SAMPLES * SEQ
    assert abs(total.item() - ref_total.item()) < 1e-4 * abs(ref_total.item())
    assert any("experts" in name for name in grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
