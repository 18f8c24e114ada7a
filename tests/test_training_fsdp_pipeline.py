"""--use-megatron-fsdp with pipeline stages (PP 2 x CP 2 on 4 gloo ranks, fp32): every
stage's model chunks sharded by Megatron-FSDP over its DP x CP ranks, plain (1F1B) and virtual
(2 chunks per stage, the interleaved schedule), 1F1B with multi-token prediction (a word
embedding shared by the two stages). Zeppelin mode gives the losses and gradient
norms of zeppelin mode under Megatron DDP with the same pipeline, and (interleaved) of static
mode with FSDP; a checkpoint saved with FSDP x PP resumes under DDP x PP, and a DDP x PP
checkpoint resumes with FSDP, each repeating the uninterrupted run's iterations 2 and 3."""
from __future__ import annotations

import pytest

from distributed import run_world
from test_distributed_optimizer import FLAGS, close, run
from test_training_fsdp import FSDP, with_values

pytestmark = pytest.mark.distributed

# 4 layers over 2 stages; 4 micro-batches of 512 tokens per iteration, at most 300 per rank: a
# document of 301-512 tokens rings over the stage's 2 CP ranks (one per emulated node)
PIPELINE = with_values(FLAGS, num_layers="4", micro_batch_size="1") + [
    "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
    "--zeppelin-gpus-per-node", "1", "--zeppelin-capacity-tokens-per-gpu", "300"]
ZEPPELIN = ["--context-parallel-mode", "zeppelin"]
STATIC = ["--context-parallel-mode", "static"]
VIRTUAL = ["--num-layers-per-virtual-pipeline-stage", "1"]
# multi-token prediction: the last stage's copy of the word embedding, its gradient summed
# with the first stage's across the stages (fsdp_stages.summing_shared_embeddings)
MTP = ["--mtp-num-layers", "1"]


def exactness_body(rank: int, world: int) -> None:
    for extra in (MTP, VIRTUAL):  # 1F1B with MTP, interleaved: one world (CI time)
        ddp = run(world, PIPELINE + ZEPPELIN + extra, tiers=True)
        fsdp = run(world, PIPELINE + ZEPPELIN + FSDP + extra)
        # static mode with FSDP once (the interleaved schedule)
        static_fsdp = run(world, PIPELINE + STATIC + FSDP + extra) if extra == VIRTUAL else None
        if rank == 0:
            assert sum(intra + inter for *_, intra, inter in ddp) > 0, ddp  # some ring
            ddp = [log[:3] for log in ddp]
            assert [it for it, _, _ in fsdp] == [1, 2, 3], fsdp
            assert close(fsdp, ddp, 1e-5), (extra, fsdp, ddp)
            assert static_fsdp is None or close(static_fsdp, ddp, 1e-5), (static_fsdp, ddp)


def test_megatron_fsdp_with_pipeline_matches_ddp_and_static_mode():
    """1F1B and the interleaved schedule."""
    run_world(exactness_body, 4, start_method="spawn", timeout_s=600)


def checkpoints_body(rank: int, world: int, tmp: str) -> None:
    flags = PIPELINE + ZEPPELIN + VIRTUAL
    whole = run(world, flags)
    first = ["--exit-interval", "1", "--save"]
    run(world, flags + FSDP + first + [f"{tmp}/f1"])
    run(world, flags + first + [f"{tmp}/d1"])
    # FSDP <- FSDP without stages: test_training_fsdp.py
    resumed = {"DDP <- FSDP": run(world, flags + ["--load", f"{tmp}/f1"]),
               "FSDP <- DDP": run(world, flags + FSDP + ["--load", f"{tmp}/d1"])}
    if rank == 0:
        for what, logs in resumed.items():
            assert close(logs, whole[1:], 1e-5), (what, logs, whole)


def test_megatron_fsdp_pipeline_checkpoints_resume_across_data_parallel_wrappers(tmp_path):
    run_world(checkpoints_body, 4, str(tmp_path), start_method="spawn", timeout_s=600)


class _Meta:
    def __init__(self, rows: tuple[int, int], width: int) -> None:
        self.offsets, self.sizes = (rows[0], 0), (rows[1] - rows[0], width)


class _Sharded:
    """A stand-in for Megatron-FSDP's uneven DTensor: ``rows`` of a ``[8, 3]`` tensor."""

    def __init__(self, full, rows: tuple[int, int]) -> None:
        self._local_tensor = full[rows[0]:rows[1]].clone()
        meta = _Meta(rows, full.shape[1])
        self._local_tensor.__create_chunk_list__ = lambda: [meta]

    def to_local(self):
        return self._local_tensor

    def __create_chunk_list__(self):
        return self._local_tensor.__create_chunk_list__()


def _add_other_stages(rank: int, world: int) -> list:
    """2 stages of 2 ranks, each stage sharding an [8, 3] tensor its own way (stage 0 rows
    0-2 | 3-7, stage 1 rows 0-4 | 5-7; with an empty shard too); the shared group pairs rank r
    of stage 0 with rank r of stage 1, as Megatron's embedding group does."""
    import types

    import torch
    import torch.distributed as dist

    from megatron_zeppelin.megatron.common.fsdp_tensors import add_other_stages

    stage, position = divmod(rank, 2)
    splits = [[(0, 3), (3, 8)], [(0, 5), (5, 8)], [(0, 8), (8, 8)]]
    dp = [dist.new_group([2 * s, 2 * s + 1]) for s in range(2)][stage]  # every rank, in order
    shared = [dist.new_group([p, p + 2]) for p in range(2)][position]
    answers = []
    for case in ((0, 1), (2, 1)):  # unequal splits; a stage holding all rows on one rank
        full = [torch.arange(24.0).view(8, 3) * (s + 1) for s in range(2)]
        rows = splits[case[stage]][position]
        sharded, owner = _Sharded(full[stage], rows), types.SimpleNamespace()
        add_other_stages(sharded, owner, dp, shared)
        first = sharded.to_local().clone()
        add_other_stages(sharded, owner, dp, shared)  # again (both stages summed): the
        # exchanges kept on the owner after the first call
        answers.append((first.tolist(), sharded.to_local().tolist(),
                        (full[0] + full[1])[rows[0]:rows[1]].tolist(),
                        (2 * (full[0] + full[1]))[rows[0]:rows[1]].tolist()))
    return answers


def test_a_weight_shared_by_two_stages_is_summed_across_their_unequal_shards():
    for answers in run_world(_add_other_stages, 4):
        for first, second, summed, doubled in answers:
            assert first == summed and second == doubled
