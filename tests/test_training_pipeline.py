"""Pipeline parallelism on gloo (fp32): PP 2 x CP 2 on 4 ranks, plain (1F1B) and virtual
(2 chunks per stage, the interleaved schedule), in zeppelin and static mode, give the loss and
every gradient of one process running the same micro-batches (exact packed attention, every
document alone); every stage runs each micro-batch with the same plan; a run saved at
iteration 2 and resumed to 4 repeats the uninterrupted run; bad pipeline flags are one line.
``--zeppelin-microbatch-order`` is tested in test_training_microbatch_order.py."""
from __future__ import annotations

import re

import pytest
import torch

from distributed import run_world
from test_megatron_zeppelin import FLAGS as ZEPPELIN_FLAGS
from test_training_resume import FLAGS as RESUME_FLAGS

pytestmark = pytest.mark.distributed

FLAGS = [*ZEPPELIN_FLAGS, "--num-layers", "4", "--seq-length", "512", "--global-batch-size",
         "4", "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--zeppelin-gpus-per-node", "1", "--zeppelin-capacity-tokens-per-gpu", "300"]
VIRTUAL = ["--num-layers-per-virtual-pipeline-stage", "1"]
MICRO_BATCHES = [[300, 100, 40, 5], [200, 150, 1, 64], [500], [90, 33, 17, 12, 2, 1]]


def micro_batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [[torch.randint(0, 256, (n,), generator=g) for n in lengths]
            for lengths in MICRO_BATCHES]


def global_names(chunk) -> dict[str, torch.nn.Parameter]:
    """A model chunk's parameters under one-process names (its layers renumbered by their
    global layer number)."""
    module, named = chunk.module, {}
    offset = module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0
    for name, param in module.named_parameters():
        name = re.sub(r"^decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
        named[name] = param
    return named


def pipeline_step(mode: str, extra: list[str], rank: int) -> dict:
    """One forward-backward of the four micro-batches through Megatron's pipeline schedule;
    this rank's loss, plans, weights and gradients (one-process names)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_zeppelin.megatron.common.data import slice_rank
    from megatron_zeppelin.megatron.common.pipeline_p2p import schedule_kwargs
    from megatron_zeppelin.megatron.loop import args as train_args, pipeline, train

    args = train_args.parse_args(FLAGS + ["--context-parallel-mode", mode, *extra])
    layout = train_args.validate_args(args, 4, None)
    train.setup_megatron(args)  # same seeds: both modes start from the same weights
    spec = train.model_spec(args)
    runtime = train.build_pool_runtime(args, layout, spec)
    chunks, _ = train.build_stage(args, runtime.state, spec)
    runtime.state.keep_used = pipeline.runtimes_in_flight(layout, len(chunks))
    built = runtime.state.builds
    plans, batches = [], []
    for docs in micro_batches():
        plans.append(runtime.planner([d.numel() for d in docs]))
        batches.append(slice_rank(plans[-1], runtime.pool.rank, docs))
    stored = get_forward_backward_func()(
        forward_step_func=train.forward_step,
        data_iterator=pipeline.data_iterators(iter(batches), len(chunks)), model=chunks,
        num_microbatches=len(batches), seq_length=args.seq_length, micro_batch_size=1,
        forward_only=False, **schedule_kwargs(chunks[0].config))
    # one attention runtime per micro-batch: chunk 1 reuses chunk 0's (keep_used)
    assert runtime.state.builds - built == len(batches), (runtime.state.builds, built)
    sums = torch.stack([d["lm loss"] for d in stored]).sum(0) if stored else torch.zeros(2)
    dist.all_reduce(sums)
    runtime.close()
    named = {k: v for chunk in chunks for k, v in global_names(chunk).items()}
    return {"loss": (sums[0] / sums[1]).item(), "stage": layout.stage(rank),
            "plans": [(p.linear, p.attention, p.tasks) for p in plans],
            "weights": {k: p.detach().clone() for k, p in named.items()},
            "grads": {k: p.main_grad.clone() for k, p in named.items()}}


def modes_body(rank: int, world: int, extra: list[str]) -> dict:
    import torch.distributed as dist

    out = {mode: pipeline_step(mode, extra, rank) for mode in ("zeppelin", "static")}
    for mode, result in out.items():  # every stage planned every micro-batch alike
        plans = [None] * world
        dist.all_gather_object(plans, result.pop("plans"))
        assert plans[rank] == plans[(rank + 2) % world], (mode, rank)
    return out


def reference_body(rank: int, world: int, weights: dict, batches: list | None = None,
                   extra: tuple = ()) -> tuple[float, dict]:
    """One process: every micro-batch's documents whole (``batches``, default
    ``micro_batches()``), exact packed attention (``extra``: more flags, e.g. MTP: then
    megatron-core's own MTP and packed roll); the mean per-token loss over all micro-batches
    and the gradients (MTP losses as the schedule scales them: per token)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_zeppelin.megatron.common.model import build_gpt_model, make_transformer_config
    from megatron_zeppelin.megatron.common.packing import packed_seq_params_for_documents
    from megatron_zeppelin.megatron.loop import args as train_args, train
    from megatron_zeppelin.options import from_flags

    args = train_args.parse_args(FLAGS + ["--pipeline-model-parallel-size", "1", *extra])
    train.setup_megatron(args)
    spec = train.model_spec(args)
    mtp = from_flags(train_args.ModelArgs, args).mtp_fields()
    ref = build_gpt_model(spec, make_transformer_config(spec, mtp=mtp), max_sequence_length=512)
    ref.load_state_dict(weights, strict=False)
    assert set(weights) == {n for n, _ in ref.named_parameters()}
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))  # what the schedule sets (per-token loss)
    total, count = 0.0, 0.0
    for docs in batches or micro_batches():
        params = packed_seq_params_for_documents([d.numel() for d in docs])
        labels = torch.cat([torch.cat([d[1:], d.new_zeros(1)]) for d in docs])[None]
        mask = torch.cat([torch.cat([torch.ones(d.numel() - 1), torch.zeros(1)]) for d in docs])
        losses = ref(torch.cat(docs)[None], params.position_ids(), None, labels=labels,
                     loss_mask=mask[None], packed_seq_params=params)
        total = total + (losses[0] * mask).sum()
        count += mask.sum().item()
    total.backward()  # the sum: MTPLossAutoScaler adds the MTP losses' gradients unscaled
    return (total / count).item(), {n: p.grad / count for n, p in ref.named_parameters()}


@pytest.mark.parametrize("extra", [[], VIRTUAL], ids=["1f1b", "interleaved"])
def test_pipeline_matches_static_mode_and_one_process(extra):
    ranks = run_world(modes_body, 4, extra, start_method="spawn", timeout_s=600)
    weights = {}
    for result in ranks:
        weights.update(result["zeppelin"]["weights"])
    assert all(torch.equal(weights[n], w) for r in ranks for m in r.values()
               for n, w in m["weights"].items())  # both modes started from these weights
    (ref_loss, ref_grads), = run_world(reference_body, 1, weights, start_method="spawn")
    held = set()
    for result in ranks:
        for mode, got in result.items():
            assert abs(got["loss"] - ref_loss) < 1e-5, (mode, got["loss"], ref_loss)
            for name, grad in got["grads"].items():
                worst = (grad - ref_grads[name]).abs().max().item()
                assert worst < 1e-5, (mode, got["stage"], name, worst)
                held.add(name)
    assert held == set(ref_grads)  # the stages together hold the whole model


MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


def mtp_body(rank: int, world: int, extra: list[str]) -> dict:
    """zeppelin mode with MTP layers on the last stage; every stage planned alike; the
    logged MTP losses (held by the last stage) reach every stage."""
    import argparse

    import torch.distributed as dist

    from megatron_zeppelin.megatron.loop.train_log import mtp_losses

    result = pipeline_step("zeppelin", [*MTP, *extra], rank)
    plans = [None] * world
    dist.all_gather_object(plans, result.pop("plans"))
    assert plans[rank] == plans[(rank + 2) % world], rank
    logged = mtp_losses(argparse.Namespace(mtp_num_layers=2, pipeline_model_parallel_size=2),
                        [{}] * len(MICRO_BATCHES), None, 1, logged=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, logged)
    assert len(logged) == 2 and min(logged) > 0 and everyone == [logged] * world, everyone
    return result


@pytest.mark.parametrize("extra", [[], VIRTUAL], ids=["1f1b", "interleaved"])
def test_mtp_on_the_last_stage_matches_one_process(extra):
    ranks = run_world(mtp_body, 4, extra, start_method="spawn", timeout_s=600)
    weights = {}
    for result in ranks:
        weights.update(result["weights"])
    # the last stage's copy of the word embedding starts equal to the first stage's
    first, last = ranks[0], ranks[2]
    assert last["stage"] == 1 and any(n.startswith("mtp.") for n in last["grads"])
    name = "embedding.word_embeddings.weight"
    assert torch.equal(first["weights"][name], last["weights"][name])
    (ref_loss, ref_grads), = run_world(reference_body, 1, weights, None, tuple(MTP),
                                       start_method="spawn")
    for result in ranks:
        assert abs(result["loss"] - ref_loss) < 1e-5, (result["loss"], ref_loss)
        for key, grad in result["grads"].items():  # both embedding copies: the summed grad
            worst = (grad - ref_grads[key]).abs().max().item()
            assert worst < 1e-5, (result["stage"], key, worst)
    for depth in range(2):  # both MTP layers train: gradients 10x the exactness bound
        layer = [g for n, g in last["grads"].items() if n.startswith(f"mtp.layers.{depth}.")]
        assert layer and max(g.abs().max().item() for g in layer) > 1e-4, depth



RESUME = [*RESUME_FLAGS, "--num-layers", "4", "--seq-length", "256", "--micro-batch-size", "1",
          "--global-batch-size", "2", "--context-parallel-mode", "zeppelin",
          "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", *VIRTUAL]

def leg_body(rank: int, world: int, argv: list[str]) -> list | None:
    """One ``pretrain_gpt.py`` run in its own world (as users run them): rank 0's logs."""
    from test_training_resume import deterministic, run

    logs = run(world, argv)
    return deterministic(logs) if rank == 0 else None


def test_resume_with_virtual_pipeline_repeats_the_uninterrupted_run(tmp_path):
    from megatron_zeppelin.config import ConfigError
    from megatron_zeppelin.megatron.loop import args as train_args, preflight

    def leg(argv):
        return run_world(leg_body, 4, argv, start_method="spawn", timeout_s=600)[0]

    save = str(tmp_path)
    whole = leg(RESUME)
    first = leg(RESUME + ["--save", save, "--save-interval", "2", "--exit-interval", "2"])
    second = leg(RESUME + ["--load", save])
    assert [log[0] for log in second] == [3, 4]
    assert first + second == whole
    plain = RESUME[:-len(VIRTUAL)]  # another pipeline shape (no virtual stages): one line
    args = train_args.parse_args(plain + ["--load", save])
    train_args.validate_args(args, 4, None)
    with pytest.raises(ConfigError, match="saved with --pipeline-model-parallel-size 2 and 2 "
                       "model chunk"):
        preflight.check(args)


def refusal(extra: list[str], world: int = 4) -> str:
    from megatron_zeppelin.config import ConfigError
    from megatron_zeppelin.megatron.loop import args as train_args

    args = train_args.parse_args(FLAGS + extra)
    with pytest.raises(ConfigError) as caught:
        train_args.validate_args(args, world, None)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_pipeline_flags_are_one_line_naming_the_flag():
    assert refusal(["--num-layers", "3"]).startswith(
        "--pipeline-model-parallel-size=2 is invalid: expected a divisor of --num-layers 3")
    assert "--pipeline-model-parallel-size=3 is invalid" in refusal(
        ["--pipeline-model-parallel-size", "3"], world=4)
    assert refusal(["--pipeline-model-parallel-size", "1", *VIRTUAL], world=2).startswith(
        "--num-layers-per-virtual-pipeline-stage=1 needs --pipeline-model-parallel-size > 1")
    assert refusal(["--num-layers-per-virtual-pipeline-stage", "3"]).startswith(
        "--num-layers-per-virtual-pipeline-stage=3 is invalid: expected a divisor of the 2 "
        "layers per stage")
    assert refusal(["--global-batch-size", "3", *VIRTUAL]).startswith(
        "--global-batch-size=3 gives 3 micro-batches per iteration: the interleaved schedule")
    assert "--context-parallel-size=4 is invalid" in refusal(["--context-parallel-size", "4"])


def test_pool_layout_follows_megatron_rank_order_with_stages():
    from megatron_zeppelin.parallel import PoolLayout

    layout = PoolLayout(16, tp=2, cp=2, gpus_per_node=4, pp=2)
    assert layout.dp == 2
    # g = ((stage * dp + replica) * cp + pool rank) * tp + tp rank
    assert layout.pool_ranks(1, 1, stage=1) == [13, 15]
    assert layout.position(13) == (1, 0, 1) and layout.stage(13) == 1
    assert layout.pipeline_ranks(5) == [5, 13]
    assert sorted(r for _, _, ranks in layout.pools() for r in ranks) == list(range(16))


def test_chunk_views_hand_every_chunk_the_same_items_in_order():
    from megatron_zeppelin.megatron.loop.pipeline import ChunkViews

    drawn = []

    def stream():
        for i in range(5):
            drawn.append(i)
            yield i

    views = ChunkViews(stream(), 2)
    first, second = views.views()
    assert [next(first), next(first), next(second), next(first)] == [0, 1, 0, 2]
    assert list(second) == [1, 2, 3, 4] and list(first) == [3, 4]
    assert drawn == [0, 1, 2, 3, 4] and views.buffer == []
