"""Why zeppelin refuses some FSDP settings, written once for both entry points: our
``scripts/pretrain_gpt.py`` (``loop/args.check_fsdp``) and Megatron-LM through the patch
(``lm/features.RULES``), each of which adds the flag it names and the way out. Every reason is
a megatron-core behaviour measured on CPU/gloo, not a limit of zeppelin's engine; the
``*_EXACT`` version is the first megatron-core measured exact, from which both entry points
accept the setting. Standard library only (strings and version tuples)."""

NO_SHARD = ("megatron-core 0.16.1 and 0.17.1's Megatron-FSDP fail at the first optimizer step "
            "with no_shard, in static mode too (start_param_sync all-gathers weight buckets that "
            "no_shard never allocates)")
# measured exact against Megatron DDP with 0.18.2 and 0.19.2 (our script, overlapped) and
# through the patch with core_v0.18.2 and core_v0.19.0
NO_SHARD_EXACT = (0, 18, 0)


def runs_from(version: tuple[int, int, int]) -> str:
    """How a refusal names the first megatron-core that runs the setting exactly."""
    return f"megatron-core {version[0]}.{version[1]} runs it (measured exact there)"


NO_SHARD_FIXED = runs_from(NO_SHARD_EXACT)

# On the last micro-batch (after no_sync exits) the backward hooks reduce each bucket through
# GradReducePipeline._bucket_group_gradient_reduce (megatron/core/distributed/fsdp/src/
# megatron_fsdp/param_and_grad_buffer.py), which with optim's unsharded gradient buffer
# reduce-scatters into a new tensor and adds it ('local_grad += reduced_grad') to this rank's
# slice of its own unreduced gradient: each shard is the DP x CP sum plus the rank's own part
# (tests/test_training_fsdp.py measures it; from 0.17 the shard is copied, exact: both entry
# points refuse it with 0.16.x only, OPTIM_OVERLAP_EXACT). Without overlap finish_grad_sync
# reduce-scatters the buffer in place (reduce_scatter_gradients), exact, provided the hooks
# never reduce:
# Megatron-LM sets no_sync_func only with --overlap-grad-reduce (training.py), and so does our
# loop for Megatron-FSDP (train.build_stage).
OPTIM_OVERLAP = ("with optim sharding megatron-core 0.16.x's Megatron-FSDP reduces the "
                 "gradients in its backward hooks (GradReducePipeline."
                 "_bucket_group_gradient_reduce) and adds each rank's own unreduced gradient to "
                 "the reduced shard ('local_grad += reduced_grad': grad norms about 9% off "
                 "Megatron DDP's), so it is not exact")
# megatron-core 0.17 copies the reduced shard instead: exact, measured in our script
# (tests/test_training_fsdp.py with 0.17.1, 0.18.2, 0.19.2) and through the Megatron-LM patch
# (tests/test_megatron_lm_train.py with core_v0.17.1 to core_v0.19.0, once its test driver set
# Megatron-LM's no_sync_func as train() does: without it the hooks reduced every micro-batch,
# which was the 2026-11-29 "inexact through Megatron-LM" finding)
OPTIM_OVERLAP_EXACT = (0, 17, 0)
OPTIM_OVERLAP_FIXED = "megatron-core 0.17 fixed it (measured exact there)"

# Megatron-LM's Megatron-FSDP without --use-distributed-optimizer (a plain optimizer on the
# shards): measured through the patch with the CPU driver, pool of 2, against Megatron DDP
PLAIN_OPTIMIZER = ("without it Megatron-LM core_v0.16.1 and core_v0.17.1 step a plain "
                   "optimizer on the FSDP shards, in static mode too (grad norm 0.388 vs "
                   "Megatron DDP's 0.465 at the first iteration on CPU/gloo); core_v0.18.2 "
                   "and core_v0.19.0 train it exactly")
PLAIN_OPTIMIZER_EXACT = (0, 18, 0)

TP_WITHOUT_TE = ("megatron-core 0.16.1 and 0.17.1's Megatron-FSDP find tensor-parallel "
                 "parameters through Transformer Engine's TELinear: with local layers they fail "
                 "(0.16.1 mended: grad norms 8.8x off Megatron DDP's, CPU/gloo, TP 2 x PP 2)")
# from 0.18 the adapter compares class names (no TELinear import): TP 2 x CP 2 with
# local layers measured exact against Megatron DDP with 0.18.2 and 0.19.2 (our script) and
# through the patch with core_v0.18.2 and core_v0.19.0
TP_WITHOUT_TE_EXACT = (0, 18, 0)
TP_WITHOUT_TE_FIXED = runs_from(TP_WITHOUT_TE_EXACT)
