"""Megatron-Core pieces both training worlds use: core attention, layer spec, packing, groups, data iterator, version and CPU bridges."""
