#!/usr/bin/env python3
"""GPT pretraining on megatron-core with ``--context-parallel-mode {static,zeppelin}``.

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --yaml-cfg configs/train/gpt-tiny-cpu.yaml

Flags follow Megatron-LM's names (``--num-layers``, ``--context-parallel-size``, ...); see
``python scripts/pretrain_gpt.py --help``. The training loop lives in
``megatron_zeppelin.megatron.train``; exit status 2 is a user error (one line from rank 0),
1 a fault (every surviving rank names the failed one): ``docs/training.md``.
"""
import sys
import warnings

# megatron-core announces every optional dependency it falls back from (Transformer Engine,
# Apex) once per module and rank; the fallbacks are expected on CPU and listed in the README.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex|Apex) (are|is) not "
                        r"installed")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")

from megatron_zeppelin.megatron import fatal  # noqa: E402
from megatron_zeppelin.megatron.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(fatal.run(main))
