"""The Megatron-LM patch and its glue (``megatron_zeppelin/megatron/lm.py``).

Applying the patch needs a Megatron-LM checkout at tag core_v0.16.1: set MEGATRON_LM_PATH
(read through ``megatron_zeppelin.env``); that test is skipped otherwise. The checkout itself is
never modified: the two patched files are copied to a temporary folder first.
"""
from __future__ import annotations

import argparse
import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_zeppelin import env
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron import lm
from megatron_zeppelin.parallel import PoolLayout

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "apply_megatron_patch.sh"
FILES = ("pretrain_gpt.py", "megatron/training/arguments.py")


def copy_checkout(src: Path, dst: Path) -> None:
    for name in FILES:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, dst / name)
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)


@pytest.mark.skipif(env.megatron_lm_path() is None, reason="MEGATRON_LM_PATH is not set")
def test_patch_applies_to_megatron_lm_once(tmp_path):
    copy_checkout(Path(env.megatron_lm_path()), tmp_path)
    first = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 0 and "already applied" in again.stdout
    text = (tmp_path / "pretrain_gpt.py").read_text()
    assert "zeppelin_lm.get_batch(data_iterator, vp_stage)" in text
    assert "zeppelin_lm.select_builder(gpt_builder)" in text
    assert "adjust_megatron_args(args)" in (tmp_path / FILES[1]).read_text()
    for name in FILES:
        py_compile.compile(str(tmp_path / name), doraise=True)


def test_apply_script_refuses_a_folder_that_is_not_megatron_lm(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "is not a Megatron-LM checkout" in result.stderr


def megatron_lm_args(**overrides) -> argparse.Namespace:
    """The fields of Megatron-LM's args that the glue reads."""
    base = dict(context_parallel_mode="zeppelin", context_parallel_size=16, world_size=64,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                calculate_per_token_loss=True, hybrid_context_parallel=False,
                zeppelin_gpus_per_node=8)
    return argparse.Namespace(**{**base, **overrides})


def test_zeppelin_mode_turns_the_cp_ranks_into_the_pool():
    args = megatron_lm_args()
    lm.adjust_megatron_args(args)
    assert args.zeppelin_layout == PoolLayout(world_size=64, tp=2, cp=16, gpus_per_node=8)
    assert args.context_parallel_size == 1 and args.zeppelin_layout.dp == 2
    static = megatron_lm_args(context_parallel_mode="static")
    lm.adjust_megatron_args(static)
    assert static.context_parallel_size == 16 and not hasattr(static, "zeppelin_layout")


@pytest.mark.parametrize("overrides,match", [
    (dict(calculate_per_token_loss=False), "needs --calculate-per-token-loss"),
    (dict(pipeline_model_parallel_size=2), "without pipeline parallelism"),
    (dict(hybrid_context_parallel=True), "alternatives: pick one"),
    (dict(context_parallel_size=4, zeppelin_gpus_per_node=16),
     r"CP x TP = 8 GPUs must be whole nodes of --zeppelin-gpus-per-node=16"),
    (dict(context_parallel_size=3), r"--context-parallel-size=3 is invalid: expected a divisor "
                                    r"of world size / TP = 32"),
])
def test_bad_megatron_lm_settings_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        lm.adjust_megatron_args(megatron_lm_args(**overrides))


def test_extra_args_provider_adds_the_mode_and_keeps_other_providers():
    parser = argparse.ArgumentParser()
    seen = []
    provide = lm.extra_args_provider(lambda p: seen.append(p) or p)
    provide(parser)
    args = parser.parse_args(["--context-parallel-mode", "zeppelin", "--no-zeppelin-routing"])
    assert args.context_parallel_mode == "zeppelin" and args.zeppelin_routing is False
    assert seen == [parser]
    with pytest.raises(SystemExit):
        parser.parse_args(["--context-parallel-mode", "ring"])


def test_samples_split_into_documents_after_each_eod():
    eod = 0
    text = torch.tensor([[5, 6, 0, 7, 0, 8, 9], [0, 1, 2, 3, 4, 0, 0]])
    docs = lm.documents_of_samples(text, eod)
    assert [d.tolist() for d in docs] == [[5, 6, 0], [7, 0], [8, 9], [0], [1, 2, 3, 4, 0], [0]]
    assert sum(d.numel() for d in docs) == text.numel()

