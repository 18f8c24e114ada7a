"""Why zeppelin refuses some FSDP settings, written once for both entry points: our
``scripts/pretrain_gpt.py`` (``loop/args.check_fsdp``) and Megatron-LM through the patch
(``lm/features.RULES``), each of which adds the flag it names and the way out. Every reason is
a megatron-core 0.16.1 behaviour measured on CPU/gloo, not a limit of zeppelin's engine.
Standard library only (strings)."""

NO_SHARD = ("megatron-core 0.16.1's Megatron-FSDP fails at the first optimizer step with "
            "no_shard, in static mode too (start_param_sync all-gathers weight buckets that "
            "no_shard never allocates)")

OPTIM_OVERLAP = ("with optim sharding megatron-core 0.16.1's Megatron-FSDP reduces the "
                 "gradients in its backward hooks (GradReducePipeline."
                 "_bucket_group_gradient_reduce) and adds each rank's own unreduced gradient to "
                 "the reduced shard ('local_grad += reduced_grad': grad norms about 9% off "
                 "Megatron DDP's), so it is not exact")

TP_WITHOUT_TE = ("megatron-core 0.16.1's Megatron-FSDP finds tensor-parallel parameters "
                 "through Transformer Engine's TELinear: with local layers it fails, and mended "
                 "its grad norms were 8.8x off Megatron DDP's (CPU/gloo, TP 2 x PP 2)")

FSDP2_BF16 = ("untested, so refused: megatron-core 0.16.1's FSDP2 wrapper gives fully_shard no "
              "mixed-precision policy (bf16 shards, bf16 reduce-scatters) and its bf16 "
              "optimizer takes only CUDA tensors, so no CPU/gloo test compares it with Megatron "
              "DDP in bf16 and none has run on a GPU")
