#!/usr/bin/env python3
"""GPT pretraining on megatron-core with ``--context-parallel-mode {static,zeppelin}``.

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --yaml-cfg configs/train/gpt-tiny-cpu.yaml

Flags follow Megatron-LM's names (``--num-layers``, ``--context-parallel-size``, ...); see
``python scripts/pretrain_gpt.py --help``. The training loop lives in
``megatron_zeppelin.megatron.loop.train``; exit status 2 is a user error (one line, from rank 0),
1 a fault (every surviving rank names the failed one): ``docs/training.md``.

Imports stay under the ``__main__`` guard: megatron-core's checkpoint writer starts a helper
process with the ``spawn`` method, which re-imports this file; it then stays light.
"""
import sys
import warnings


def quiet_known_warnings() -> None:
    """megatron-core announces every optional dependency it falls back from (Transformer
    Engine, Apex) once per module and rank, and its checkpoint loader calls torch APIs that
    torch marks deprecated; both are expected (README) and would repeat on every rank."""
    for message in (r".*(Transformer Engine and Apex|Apex) (are|is) not installed",
                    r"full scope is deprecated", r"`load_state_dict` is deprecated",
                    r"Please use DTensor instead and we are deprecating ShardedTensor"):
        warnings.filterwarnings("ignore", message=message)


if __name__ == "__main__":
    from megatron_zeppelin.megatron.loop import fatal

    fatal.take_sigterm()  # before torch starts threads: a launcher's SIGTERM names a dead peer
    quiet_known_warnings()
    from megatron_zeppelin.megatron.loop.train import main

    sys.exit(fatal.run(main))
