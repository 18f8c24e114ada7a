"""The training log records what is asked for and nothing more: an iteration that no log line,
JSON log or TensorBoard records joins no collective (no host wait for the device on a GPU)."""
from __future__ import annotations

import argparse

import pytest

from distributed import run_world

pytestmark = pytest.mark.distributed


def _logged(rank: int, world: int, json_path: str | None) -> list[int]:
    import torch

    from megatron_zeppelin.megatron.loop.corpus import DocumentStats
    from megatron_zeppelin.megatron.loop.train_log import Logger

    args = argparse.Namespace(log_interval=3, train_iters=7, log_json=json_path,
                              tensorboard_dir=None)
    logger = Logger(args, cost=None, printing=rank == 0, documents=DocumentStats(),
                    counts_plans=False, pools=1)
    reductions = []
    original = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: reductions.append(1) or original(*a, **k)
    try:
        for iteration in range(1, 8):
            stored = [{"lm loss": torch.tensor([2.0 * iteration, 1.0])}]
            logger.step(iteration, stored, 1.0, 0.5, 1e-3)
    finally:
        torch.distributed.all_reduce = original
    assert len(reductions) == (7 if json_path else 3)
    return [log.iteration for log in logger.history]


def test_only_recorded_iterations_reduce(tmp_path):
    """--log-interval 3 of 7 iterations: 3, 6 and the last; --log-json records every one."""
    assert run_world(_logged, 2, None)[0] == [3, 6, 7]
    assert run_world(_logged, 2, str(tmp_path / "log.jsonl"))[0] == list(range(1, 8))
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 7
