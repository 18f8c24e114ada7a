"""Our training loop (``scripts/pretrain_gpt.py``): flags, data position, checkpoints, log, watchdog."""
