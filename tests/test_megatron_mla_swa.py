"""Multi-latent attention, sliding windows and attention sinks in training, on gloo: 4 ranks as 2
nodes x 2 in zeppelin and static mode give the loss and every gradient of one process running
the same documents (exact packed attention: every document alone, its window mask), for MLA
(value head dim != query/key head dim, RoPE part by in-document position), interleaved
sliding-window layers, both together, a learnable sink logit per head (its gradient too) and
the off-by-one softmax with windows."""
from __future__ import annotations

import pytest

from distributed import run_world

pytestmark = pytest.mark.distributed

MLA = ("--num-query-groups", "4", "--multi-latent-attention",  # MLA: a KV head per head
       "--q-lora-rank", "16", "--kv-lora-rank", "8",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6")
SWA = ("--window-size", "40,0", "--window-attn-skip-freq", "2")  # layer 1 local, layer 2 global
SINK = ("--softmax-type", "learnable")  # GPT-OSS: a trained sink logit per head
VARIANTS = {"mla": MLA, "swa": SWA, "mla+swa": MLA + ("--window-size", "12,0"), "sink": SINK,
            "off-by-one+swa": ("--softmax-type", "off-by-one") + SWA}


def variants_body(rank: int, world: int, names: list[str], tmp: str) -> None:
    from test_megatron_zeppelin import FLAGS, compare, documents, run_mode

    from megatron_zeppelin.megatron.loop import args as train_args, train

    train.setup_megatron(train_args.parse_args(FLAGS))
    docs = documents()
    for name in names:
        extra = VARIANTS[name]
        save = f"{tmp}/{name}"  # static mode loads the zeppelin run's weights
        plan, loss, grads, module = run_mode("zeppelin", rank, save=save, extra=extra)
        assert plan.tier_counts()["inter"] >= 1 and plan.linear != plan.attention
        compare(loss, grads, module, docs, f"zeppelin {name}")
        _, static_loss, static_grads, static_module = run_mode("static", rank, load=save,
                                                               extra=extra)
        assert abs(static_loss - loss) < 1e-5, (name, static_loss, loss)
        compare(static_loss, static_grads, static_module, docs, f"static {name}")
        if "swa" in name:  # the window really changes the model: full attention differs
            full = without_windows(extra)
            _, full_loss, full_grads, _ = run_mode("zeppelin", rank, load=save, extra=full)
            moved = max((full_grads[n] - g).abs().max().item() for n, g in grads.items())
            assert moved > 1e-4, (name, moved, full_loss, loss)  # 10x the exactness bound


def without_windows(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` less the window flags and their values."""
    out, skip = [], False
    for flag in flags:
        if not skip and flag.startswith("--window"):
            skip = True
            continue
        if not skip:
            out.append(flag)
        skip = False
    return tuple(out)


def test_mla_and_sliding_windows_match_static_mode_and_one_process(tmp_path):
    run_world(variants_body, 4, list(VARIANTS), str(tmp_path), start_method="spawn",
              timeout_s=600)
