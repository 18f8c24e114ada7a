"""megatron-core version differences handled in ``megatron/common/compat.py`` and where they
are used, checked on the installed megatron-core (CI: 0.16.1) with the later versions' names
and formats stood in for; the whole suite also ran against megatron-core 0.18.2 and 0.19.2
(``docs/megatron-lm.md``, "Versions")."""
from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.common import compat, fsdp_limits
from megatron_zeppelin.megatron.loop import checkpoint_files


def test_mtp_logging_names_follow_the_version():
    calls = []

    class Before:  # megatron-core <= 0.18
        tracker: dict = {}
        reduce_loss_in_tracker = staticmethod(lambda: calls.append("reduce 0.16"))
        clean_loss_in_tracker = staticmethod(lambda: calls.append("clean 0.16"))

    class After:  # 0.19: acceptance rates beside the losses
        tracker: dict = {}
        reduce_metrics_in_tracker = staticmethod(lambda: calls.append("reduce 0.19"))
        clean_metrics_in_tracker = staticmethod(lambda: calls.append("clean 0.19"))

    for helper, key, version in ((Before, "values", "0.16"), (After, "loss_values", "0.19")):
        tracker = compat.mtp_tracker(helper)
        tracker.reduce()
        tracker.clean()
        assert tracker.key == key and calls[-2:] == [f"reduce {version}", f"clean {version}"]


def test_the_common_state_and_fsdp_gradients_follow_the_version():
    assert not compat.common_state_in_shards((0, 18, 2))
    assert compat.common_state_in_shards((0, 19, 2))
    assert compat.since(fsdp_limits.OPTIM_OVERLAP_EXACT, (0, 17, 1))
    assert not compat.since(fsdp_limits.OPTIM_OVERLAP_EXACT, (0, 16, 1))
    assert compat.fsdp_fp32_main_grads(bf16=False) == {}
    import dataclasses

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    # the field exists from megatron-core 0.18 (not in CI's 0.16.1)
    assert compat.fsdp_fp32_main_grads(bf16=True) == (
        {"megatron_fsdp_main_grads_dtype": torch.float32}
        if "megatron_fsdp_main_grads_dtype" in fields else {})


def test_a_checkpoint_without_common_pt_is_read_as_its_version_writes_it(tmp_path, monkeypatch):
    """Up to 0.18 the common state is common.pt; from 0.19 megatron-core may keep it inside
    the shards: then megatron-core's own reader is asked, and a failure names both places."""
    os.makedirs(tmp_path / "iter")
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 18, 2))
    with pytest.raises(ConfigError, match=r"has an unreadable common.pt \(FileNotFoundError"):
        checkpoint_files._read_common(str(tmp_path / "iter"))
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 19, 2))
    with pytest.raises(ConfigError, match=r"has an unreadable common state \(no common.pt, nor "
                                          r"megatron-core 0.19's common_state object\)"):
        checkpoint_files._read_common(str(tmp_path / "iter"))


def test_resuming_under_the_checkpoints_schedule_builds_the_optimizer_with_its_rates():
    """megatron-core 0.19 matches a saved optimizer's parameter groups by their rates: with
    --use-checkpoint-opt_param-scheduler the groups get the checkpoint's --lr / --min-lr."""
    args = argparse.Namespace(lr=0.05, min_lr=0.0, use_checkpoint_opt_param_scheduler=True)
    found = SimpleNamespace(schedule={"max_lr": 0.01, "min_lr": 0.001})
    taken = checkpoint_files.scheduler_rates(args, found)
    assert (taken.lr, taken.min_lr) == (0.01, 0.001) and args.lr == 0.05
    assert checkpoint_files.scheduler_rates(args, None) is args
    args.use_checkpoint_opt_param_scheduler = False
    assert checkpoint_files.scheduler_rates(args, found) is args
