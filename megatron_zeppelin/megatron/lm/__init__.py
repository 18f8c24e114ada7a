"""Glue for Megatron-LM's own ``pretrain_gpt.py`` (applied by ``patches/``)."""
