"""Megatron-LM's own training step in zeppelin and static mode on CPU/gloo.

Needs MEGATRON_LM_PATH (a Megatron-LM checkout at tag core_v0.16.1, core_v0.17.1, core_v0.18.2 or
core_v0.19.0; skipped otherwise, so CI skips it). A patched mirror of the checkout is made in a temporary folder (symlinks, with the
patched files and megatron-core's prebuilt ``helpers_cpp`` copied); the checkout is never
modified. ``tests/megatron_lm_driver.py`` runs Megatron-LM's pretrain pieces under torchrun.

"Static mode" on CPU is Megatron-LM's own static path with ``--context-parallel-size 1`` on the
same ranks (Megatron's local core attention refuses CP > 1; TE's CP attention needs CUDA): the
same samples per iteration, so the same loss. MoE runs are compared with one process, whose
micro-batches group the samples as a pool's do. See docs/megatron-lm.md.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lm_imports import missing_in_log, missing_module, skip_for
from megatron_zeppelin import env
from megatron_zeppelin.config import ZeppelinConfig

pytestmark = [pytest.mark.skipif(env.megatron_lm_path() is None,
                                 reason="MEGATRON_LM_PATH is not set"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "megatron_lm_driver.py"
PATCHED = ("pretrain_gpt.py", "gpt_builders.py", "megatron/training/arguments.py",
           "megatron/training/yaml_arguments.py", "megatron/training/training.py")
REAL_DIRS = ("megatron", "megatron/training", "megatron/core", "megatron/core/datasets")
SEQ, GBS = 256, 4
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
          "--split", "90,10,0", "--num-workers", "0", "--num-layers", "2", "--hidden-size", "64",
          "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--seq-length", str(SEQ),
          "--max-position-embeddings", str(SEQ), "--swiglu", "--disable-bias-linear",
          "--normalization", "RMSNorm", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
          "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--train-iters", "3",
          "--eval-iters", "1", "--eval-interval", "1000", "--lr", "1e-3",
          "--calculate-per-token-loss", "--seed", "1234",
          # CPU only: no TE/apex kernels, gloo
          "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
          "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
          "--no-rope-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
          "--distributed-backend", "gloo"]
ZEPPELIN = ["--context-parallel-mode", "zeppelin"]
PIPELINE = ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--position-embedding-type", "rope"]
STATIC = ["--context-parallel-mode", "static", "--context-parallel-size", "1"]


def mirror(src: Path, dst: Path, rel: str = "") -> None:
    """``dst`` mirrors ``src``: symlinks, real folders on the way to the files we write."""
    (dst / rel).mkdir(parents=True, exist_ok=True)
    for entry in (src / rel).iterdir():
        name = f"{rel}/{entry.name}" if rel else entry.name
        if name in REAL_DIRS:
            mirror(src, dst, name)
        elif name in PATCHED:
            (dst / name).write_bytes(entry.read_bytes())
        elif entry.name not in (".git", "tests"):
            (dst / name).symlink_to(entry)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("megatron-lm")
    mirror(Path(env.megatron_lm_path()), dst)
    helpers = Path(importlib.util.find_spec("megatron.core.datasets.helpers_cpp").origin)
    (dst / "megatron/core/datasets" / helpers.name).unlink(missing_ok=True)
    (dst / "megatron/core/datasets" / helpers.name).write_bytes(helpers.read_bytes())
    (dst / "megatron_lm_spec.py").symlink_to(ROOT / "tests" / "megatron_lm_spec.py")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"), str(dst)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    missing = missing_module(dst, DRIVER)  # six, regex, pydantic, ...: skip, naming it
    if missing:
        skip_for(missing)
    return dst


def run(tree: Path, tmp_path: Path, name: str, nproc: int, *flags: str,
        stop: int | None = None, ok: bool = True, common: list[str] = COMMON):
    """torchrun the driver with ``common + flags``; returns rank 0's results (ok) or the
    finished process."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(29500 + os.getpid() % 500 + nproc), str(DRIVER),
           "--harness-out", str(out), *([] if stop is None else ["--harness-stop", str(stop)]),
           *common, *flags]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    missing = missing_in_log(proc.stderr) if proc.returncode else None
    if missing:  # imported by Megatron-LM only while training
        skip_for(missing)
    if not ok:
        return proc
    assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return json.loads(out.read_text())


def assert_same_training(zeppelin: dict, static: dict, rel: float = 2e-6) -> None:
    assert zeppelin["core_attention"] in ("ZeppelinCoreAttention",
                                          "ZeppelinTEDotProductAttention")
    # torch FSDP2's fully_shard renames a module's class FSDP<name>
    assert zeppelin["model"].removeprefix("FSDP") == "PackedGPTModel"
    assert static["model"].removeprefix("FSDP") == "GPTModel"
    assert zeppelin["losses"] == pytest.approx(static["losses"], rel=rel)
    assert zeppelin["grad_norms"] == pytest.approx(static["grad_norms"], rel=20 * rel)
    assert zeppelin["tokens_per_iteration"] == static["tokens_per_iteration"]
    assert zeppelin["valid_loss"] == pytest.approx(static["valid_loss"], rel=rel)  # evaluate()


@pytest.mark.parametrize("pool,extra,nodes", [
    (2, [], []),  # Megatron-LM's defaults: learned_absolute positions, whole samples
    (4, ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
         "--position-embedding-type", "rope", "--use-rope-scaling",
         "--recompute-granularity", "selective"],
     ["--zeppelin-gpus-per-node", "2"]),  # documents, two nodes, core attention recomputed
])
def test_zeppelin_trains_like_static_with_the_same_batch_and_memory(tree, tmp_path, pool, extra,
                                                                     nodes):
    flags = ["--global-batch-size", str(GBS * pool // 2), *extra]
    zeppelin = run(tree, tmp_path, "zeppelin", pool, *ZEPPELIN, "--context-parallel-size",
                   str(pool), *nodes, *flags)
    static = run(tree, tmp_path, "static", pool, *STATIC, *flags)
    assert_same_training(zeppelin, static)
    assert zeppelin["tokens_per_iteration"] == [GBS * pool // 2 * SEQ] * 3
    capacity = ZeppelinConfig().capacity_factor * SEQ / pool  # the planner's memory bound
    for per_rank, pads in zip(zeppelin["rank_tokens"], zeppelin["rank_pads"]):
        assert len(per_rank) == pool  # [rank][micro-batch] real tokens, and pad tokens
        for micro, pad in zip(zip(*per_rank), zip(*pads)):
            # the pool holds one micro-batch of MBS x seq tokens, each rank within capacity;
            # a rank the plan leaves empty holds one pad token, no other rank any
            assert sum(micro) == SEQ and max(micro) <= capacity
            assert list(pad) == [int(n == 0) for n in micro]
    assert zeppelin["pad_tokens"] == sum(sum(map(sum, pads)) for pads in zeppelin["rank_pads"])


@pytest.mark.parametrize("parallel", [[], ["--tensor-model-parallel-size", "2"], PIPELINE],
                         ids=["pool", "tp", "pp"])
def test_inter_document_masking_gives_the_documents_to_zeppelin(tree, tmp_path, parallel):
    """Megatron-LM core_v0.19's ``--dataloader-inter-document-masking`` (documents as
    ``cu_seqlens``, positions reset per document) trains exactly as zeppelin splitting at
    end-of-document tokens with reset positions, with the same plans (the mock documents end
    with EOD and, under a vocabulary larger than any document, hold no other), on a pool of 2,
    with TP 2 (Megatron broadcasts the ``cu_seqlens`` over TP) and with PP 2 (every stage
    plans from the same lengths); and it feeds Megatron's FLOPs statistics the documents'
    lengths, as static mode's packed path does."""
    probe = subprocess.run([sys.executable, "-c", TYPING_OVERRIDE + "import sys; "
                            "sys.path.insert(0, '.'); from megatron.training.arguments import "
                            "add_megatron_arguments as a; import argparse; "
                            "print(a(argparse.ArgumentParser()).get_default("
                            "'dataloader_inter_document_masking'))"],
                           cwd=tree, capture_output=True, text=True, timeout=300)
    if probe.stdout.strip() != "False":
        pytest.skip("this Megatron-LM has no --dataloader-inter-document-masking (core_v0.19 on)")
    seq = 1024  # mock documents are 1-4095 tokens long: samples of 1024 hold boundaries
    flags = [*ZEPPELIN, "--context-parallel-size", "2", "--vocab-size", "8192",
             "--seq-length", str(seq), "--max-position-embeddings", str(seq)]
    ranks = 4 if parallel else 2
    masked = run(tree, tmp_path, "masked", ranks, *flags, *parallel,
                 "--dataloader-inter-document-masking")
    split = run(tree, tmp_path, "split", ranks, *flags, *parallel, "--reset-attention-mask",
                "--reset-position-ids")
    assert masked["losses"] == pytest.approx(split["losses"], rel=1e-6)
    assert masked["grad_norms"] == pytest.approx(split["grad_norms"], rel=1e-5)
    assert masked["plans"] == split["plans"]
    assert all(stats == [None, None] for stats in split["seqlen_stats"])  # none: as static
    stats = masked["seqlen_stats"]  # sum(L), sum(L^2) of each global batch
    assert [tokens for tokens, _ in stats] == [GBS * seq] * len(stats)
    assert all(squares <= GBS * seq ** 2 for _, squares in stats)
    assert sum(squares < GBS * seq ** 2 for _, squares in stats) >= 2  # documents were cut


def test_multi_token_prediction_trains_like_static(tree, tmp_path):
    """--mtp-num-layers 2 on whole samples split over a pool of 2: the shifted ids and labels of
    a rank's last tokens come from the other rank; losses, gradient norms (MTP layers
    included) and Megatron's logged "mtp_i loss" match static mode's."""
    flags = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
             "--position-embedding-type", "rope"]
    zeppelin = run(tree, tmp_path, "zeppelin", 2, *ZEPPELIN, "--context-parallel-size", "2",
                   *flags)
    static = run(tree, tmp_path, "static", 2, *STATIC, *flags)
    assert_same_training(zeppelin, static)
    assert len(zeppelin["mtp_losses"]) == 3 and all(len(v) == 2 for v in zeppelin["mtp_losses"])
    for mine, theirs in zip(zeppelin["mtp_losses"], static["mtp_losses"]):
        assert mine == pytest.approx(theirs, rel=2e-6)


@pytest.mark.parametrize("softmax", ["learnable", "off-by-one"])
def test_attention_sinks_train_like_static(tree, tmp_path, softmax):
    """--softmax-type learnable (a trained sink logit per head, GPT-OSS style) and off-by-one
    over a pool of 2: zeppelin core attention merges the sink into each row after its ring
    blocks, static mode runs megatron-core's SoftmaxOne; losses, gradient norms (the sinks'
    included) and validation loss match."""
    flags = ["--softmax-type", softmax]
    zeppelin = run(tree, tmp_path, "zeppelin", 2, *ZEPPELIN, "--context-parallel-size", "2",
                   *flags)
    static = run(tree, tmp_path, "static", 2, *STATIC, *flags)
    assert_same_training(zeppelin, static)


def tree_version(tree: Path) -> tuple[int, int, int]:
    """The megatron-core version of the Megatron-LM tree (its own ``megatron/core``)."""
    info = runpy.run_path(str(tree / "megatron/core/package_info.py"))
    return info["MAJOR"], info["MINOR"], info["PATCH"]


def test_moe_experts_on_the_linear_layout_match_one_process(tree, tmp_path):
    # no z-loss: Megatron divides its coefficient by the TP x CP size (static CP too), so a
    # pool's z-loss is not one process's. From core_v0.19 each rank's aux loss is multiplied by
    # the TP x CP size under --calculate-per-token-loss (router.py, the same formula in static
    # CP): a pool of 2 trains as one process with twice the coefficient (measured: equal
    # parameters; with the same coefficient 1e-4 apart)
    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    scale = 2 if tree_version(tree) >= (0, 19, 0) else 1
    zeppelin = run(tree, tmp_path, "moe-zeppelin", 2, *ZEPPELIN, "--context-parallel-size",
                   "2", *moe, "--moe-aux-loss-coeff", "0.01")
    one = run(tree, tmp_path, "moe-one", 1, *STATIC, *moe, "--moe-aux-loss-coeff",
              str(0.01 * scale))
    assert_same_training(zeppelin, one, rel=1e-5)
    assert zeppelin["param_sum"] == pytest.approx(one["param_sum"], rel=1e-6)
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
          "--num-experts", "4", "--moe-router-topk", "2"]
    zeppelin = run(tree, tmp_path, "ep-zeppelin", 2, *ZEPPELIN, "--context-parallel-size", "2",
                   *ep)
    static = run(tree, tmp_path, "ep-static", 2, *STATIC, *ep)
    assert_same_training(zeppelin, static, rel=1e-5)


def test_sequence_parallel_pads_to_tp_and_counts_the_padding(tree, tmp_path):
    sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--reset-attention-mask",
          "--position-embedding-type", "rope", "--spec", "megatron_lm_spec", "SPEC"]
    zeppelin = run(tree, tmp_path, "sp-zeppelin", 4, *ZEPPELIN, "--context-parallel-size", "2",
                   "--no-zeppelin-remap", *sp)  # the attention layout: odd token counts
    static = run(tree, tmp_path, "sp-static", 2, *STATIC, *sp)
    assert_same_training(zeppelin, static, rel=1e-5)
    assert zeppelin["pad_tokens"] > 0


def test_checkpoints_load_across_modes(tree, tmp_path):
    pool = ["--context-parallel-size", "2"]
    full_zeppelin = run(tree, tmp_path, "full-z", 2, *ZEPPELIN, *pool)
    full_static = run(tree, tmp_path, "full-s", 2, *STATIC)
    for first, second, full in ((ZEPPELIN + pool, STATIC, full_zeppelin),
                                (STATIC, ZEPPELIN + pool, full_static)):
        ckpt = tmp_path / f"ckpt-{first[1]}"
        run(tree, tmp_path, "first", 2, *first, "--save", str(ckpt), "--save-interval", "1000",
            stop=2)
        resumed = run(tree, tmp_path, "second", 2, *second, "--load", str(ckpt))
        assert resumed["start"] == 2
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=2e-6)
        assert resumed["param_sum"] == pytest.approx(full["param_sum"], rel=1e-6)


def test_bf16_trains_like_static(tree, tmp_path):
    """--bf16 through the patch (Megatron-LM's Float16Module and bf16 optimizer, the latter
    run on CPU by the bridge), a pool of 2 on documents: zeppelin trains like static mode in
    bf16 (measured: losses 1e-6 and grad norms 3e-5 apart), and bf16 really ran (its losses
    are not fp32's)."""
    pool = ["--context-parallel-size", "2"]
    zeppelin = run(tree, tmp_path, "bf16-z", 2, *ZEPPELIN, *pool, *DOCUMENTS, "--bf16")
    static = run(tree, tmp_path, "bf16-s", 2, *STATIC, *DOCUMENTS, "--bf16")
    fp32 = run(tree, tmp_path, "fp32-s", 2, *STATIC, *DOCUMENTS)
    assert_same_training(zeppelin, static, rel=1e-5)
    assert static["losses"] != pytest.approx(fp32["losses"], rel=1e-6)


def test_refusals_through_megatron_lm_parser(tree, tmp_path):
    at = COMMON.index("--attention-dropout")
    flags = COMMON[:at] + COMMON[at + 2:]  # Megatron-LM's default: 0.1
    proc = run(tree, tmp_path, "dropout", 2, *ZEPPELIN, "--context-parallel-size", "2",
               ok=False, common=flags)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("megatron-zeppelin:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "--attention-dropout=0.1 is not supported" in lines[0]
    proc = run(tree, tmp_path, "stray", 1, *STATIC, "--zeppelin-routing", "--no-zeppelin-remap",
               ok=False)
    assert "--zeppelin-remap only applies to --context-parallel-mode zeppelin" in proc.stderr


# Megatron-LM core_v0.18 imports typing.override (Python 3.12); on 3.11 typing_extensions' one
# (as tests/megatron_lm_driver.py does)
TYPING_OVERRIDE = """
import typing, typing_extensions
if not hasattr(typing, "override"):
    typing.override = typing_extensions.override
"""
PARSE = TYPING_OVERRIDE + """
import sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
if sys.argv[1] == "without":
    sys.modules["megatron_zeppelin"] = None  # as if megatron-zeppelin were not installed
sys.argv = ["pretrain_gpt.py"] + sys.argv[2:]
import pretrain_gpt as P
from megatron.training.arguments import parse_args, validate_args
args = parse_args(P.extra_args_provider)
validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
print("MODE", args.context_parallel_mode)
"""


def test_a_rank_killed_in_training_is_named_by_every_other_rank(tree, tmp_path):
    """Zeppelin's watchdog through the patch: rank 3 dies (SIGKILL) before iteration 2; every
    rank still running names it (its heartbeat thread, the explanation of the gloo error it
    met, or torchrun's SIGTERM asking it first) and exits with status 1; no live rank is
    blamed."""
    proc = run(tree, tmp_path, "killed", 4, *ZEPPELIN, "--context-parallel-size", "2",
               "--harness-kill", "3:2", ok=False)
    assert proc.returncode != 0
    named = re.findall(r"pretrain_gpt.py: error: rank (\d): rank 3 \(pid \d+ on .*\) died",
                       proc.stderr)
    assert set(named) == {"0", "1", "2"}, proc.stderr[-3000:]  # (torchrun repeats them)
    assert not re.search(r"error: rank \d: rank [012] ", proc.stderr)
    assert "zeppelin watchdog: a rank silent for 20 s is named" in proc.stdout


def test_static_mode_does_not_need_megatron_zeppelin(tree):
    flags = [f for f in COMMON if f != "--use-cpu-initialization"]

    def parse(which, *extra):
        return subprocess.run([sys.executable, "-c", PARSE, which, *flags, *extra], cwd=tree,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})

    static = parse("without", "--context-parallel-mode", "static")
    assert static.returncode == 0 and "MODE static" in static.stdout, static.stderr[-2000:]
    zeppelin = parse("without", "--context-parallel-mode", "zeppelin")
    assert zeppelin.returncode != 0
    assert "--context-parallel-mode zeppelin needs megatron-zeppelin" in zeppelin.stderr
    other = subprocess.run(  # the other entry points use Megatron's parser without the flag
        [sys.executable, "-c", TYPING_OVERRIDE + "import sys; sys.path.insert(0, '.'); from "
         "megatron.training.arguments import parse_args; parse_args()",
         "--context-parallel-mode", "zeppelin"],
        cwd=tree, capture_output=True, text=True, timeout=300)
    assert "unrecognized arguments: --context-parallel-mode zeppelin" in other.stderr


YAML = TYPING_OVERRIDE + """
import argparse, copy, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
import pretrain_gpt as P
from megatron.training.arguments import add_megatron_arguments, parse_args
from megatron.training.yaml_arguments import validate_yaml
args = parse_args(P.extra_args_provider)
print("PARSED", args.context_parallel_mode, args.zeppelin_routing)
# Megatron-LM 0.16.1's example YAML lacks keys its validate_yaml reads: add parser defaults
defaults = add_megatron_arguments(argparse.ArgumentParser())
for _ in range(300):
    try:
        validate_yaml(copy.deepcopy(args), {})
        break
    except AttributeError as exc:
        if hasattr(args, exc.name):
            raise
        setattr(args, exc.name, defaults.get_default(exc.name))
"""


def example_yaml() -> str:
    """Megatron-LM's example ``--yaml-cfg`` file (``examples/gpt3/gpt_config.yaml``): from the
    checkout, or, where the tag dropped it (core_v0.18 on), from core_v0.16.1 in the checkout's
    git history; skipped when neither has it."""
    checkout = Path(env.megatron_lm_path())
    example = checkout / "examples/gpt3/gpt_config.yaml"
    if example.exists():
        return example.read_text()
    old = subprocess.run(["git", "-C", str(checkout), "show",
                          "core_v0.16.1:examples/gpt3/gpt_config.yaml"],
                         capture_output=True, text=True)
    if old.returncode:
        pytest.skip(f"{checkout} has no examples/gpt3/gpt_config.yaml (removed in core_v0.18) "
                    "and its git history no core_v0.16.1 to take it from")
    return old.stdout


def test_yaml_cfg_keeps_the_zeppelin_flags(tree, tmp_path):
    cfg = tmp_path / "gpt.yaml"
    # (core_v0.19's parse_args reads disable_msc_deprecated, which no YAML file had)
    cfg.write_text(example_yaml() + "\ncontext_parallel_mode: zeppelin\nenable_msc: false\n"
                   "disable_msc_deprecated: false\n")
    proc = subprocess.run([sys.executable, "-c", YAML, "--yaml-cfg", str(cfg),
                           "--no-zeppelin-routing"], cwd=tree, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WORLD_SIZE": "1",
                                            "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "PARSED zeppelin False" in proc.stdout, proc.stderr[-2000:]
    # validate_yaml ran zeppelin's checks: the example does not set calculate_per_token_loss
    assert "megatron-zeppelin: --calculate-per-token-loss=False is not supported" in proc.stderr
    cfg.write_text(cfg.read_text() + "zeppelin_routing: true\n")
    proc = subprocess.run([sys.executable, "-c", YAML, "--yaml-cfg", str(cfg),
                           "--no-zeppelin-routing"], cwd=tree, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WORLD_SIZE": "1"})
    assert "--zeppelin-routing=False on the command line and zeppelin_routing: True" in \
        proc.stderr


def test_distributed_optimizer_trains_and_resumes_like_static(tree, tmp_path):
    """--use-distributed-optimizer through the patch (Megatron's own optimizer setup and
    checkpoints, Adam sharded over DP x CP): zeppelin trains like static mode with it, and a
    zeppelin checkpoint resumes in static mode. The checkpoint is megatron-core's
    ``fully_reshardable`` layout: its default ``dp_reshardable`` resumes inexactly on CPU in
    static mode too (a megatron-core path without Apex/TE, not zeppelin's; docs/megatron-lm.md)."""
    pool = ["--context-parallel-size", "2"]
    sharded = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
    zeppelin = run(tree, tmp_path, "do-z", 2, *ZEPPELIN, *pool, *sharded)
    static = run(tree, tmp_path, "do-s", 2, *STATIC, *sharded)
    assert_same_training(zeppelin, static)
    ckpt = tmp_path / "ckpt-do"
    run(tree, tmp_path, "do-first", 2, *ZEPPELIN, *pool, *sharded, "--save", str(ckpt),
        "--save-interval", "1000", stop=2)
    resumed = run(tree, tmp_path, "do-second", 2, *STATIC, *sharded, "--load", str(ckpt))
    assert resumed["start"] == 2
    assert resumed["losses"] == pytest.approx(static["losses"][2:], rel=2e-6)
    assert resumed["param_sum"] == pytest.approx(static["param_sum"], rel=1e-6)


# ----------------------------------------------------------------------------- pipelines
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
SCHEDULES = {"1f1b": [], "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"]}


@pytest.fixture(scope="module", params=list(SCHEDULES))
def pipelined(request, tree, tmp_path_factory):
    """``(schedule, zeppelin, static, documents)``: PP 2 x CP 2 on 4 ranks through the patch
    (1F1B; or interleaved: 2 chunks of one layer per stage), zeppelin (a pool of 2 per stage)
    and static mode (CP 1, DP 2) with the same flags, and a zeppelin run on mock-data
    documents. 1F1B compares the modes on documents. Interleaved compares them on whole
    samples: Megatron-LM's static get_batch gives a middle model chunk no attention mask (it
    returns None there), so static mode attends across documents in those chunks."""
    tmp = tmp_path_factory.mktemp(f"pp-{request.param}")
    flags = [*PIPELINE, *SCHEDULES[request.param]]
    documents = run(tree, tmp, "pp-documents", 4, *ZEPPELIN, "--context-parallel-size", "2",
                    *flags, *DOCUMENTS)
    if request.param == "1f1b":
        zeppelin = documents
        static = run(tree, tmp, "pp-static", 4, *STATIC, *flags, *DOCUMENTS)
    else:
        zeppelin = run(tree, tmp, "pp-zeppelin", 4, *ZEPPELIN, "--context-parallel-size", "2",
                       *flags)
        static = run(tree, tmp, "pp-static", 4, *STATIC, *flags)
    return request.param, zeppelin, static, documents


def test_pipeline_parallelism_trains_like_static(pipelined):
    _, zeppelin, static, _ = pipelined
    assert_same_training(zeppelin, static)  # losses, grad norms, validation loss
    assert zeppelin["tokens_per_iteration"] == [GBS * SEQ] * 3
    for per_rank in zeppelin["rank_tokens"]:  # the first stage's pool: ranks 0 and 1
        assert all(sum(micro) == SEQ for micro in zip(*per_rank[:2])) and per_rank[2:] == [[]] * 2


def test_every_stage_and_chunk_runs_each_micro_batch_with_the_same_plan(pipelined):
    schedule, _, _, documents = pipelined
    plans = documents["plans"]  # [rank][(chunk, plan digest)], every get_batch in order
    chunks = 2 if schedule == "interleaved" else 1
    reference = [digest for chunk, digest in plans[0] if chunk == 0]
    assert len(reference) == 3 * GBS + GBS  # 3 iterations of 4 micro-batches, one evaluation
    assert len(set(reference)) > 1  # documents differ per micro-batch, and so do the plans
    for rank in range(4):  # both stages, both pool ranks
        for chunk in range(chunks):
            assert [d for c, d in plans[rank] if c == chunk] == reference, (rank, chunk)


def test_the_online_fit_refits_every_stage_alike_and_trains_like_static(pipelined, tree,
                                                                         tmp_path):
    """--zeppelin-fit-interval 1 through the patch (PP 2 x CP 2): after every step each rank
    measures, rank 0 broadcasts the fit, every stage and chunk switches at the same micro-batch
    (the first of the next step) and still plans each micro-batch alike; the profile is
    written; the log gives each step's time and estimate; training equals static mode's."""
    from megatron_zeppelin.config import load_hardware

    schedule, _, static, _ = pipelined
    flags = [*PIPELINE, *SCHEDULES[schedule], *(DOCUMENTS if schedule == "1f1b" else [])]
    profile = tmp_path / "fitted.yaml"
    proc = run(tree, tmp_path, "pp-fit", 4, *ZEPPELIN, "--context-parallel-size", "2", *flags,
               "--zeppelin-fit-interval", "1", "--zeppelin-profile-out", str(profile),
               "--log-interval", "1", ok=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fitted = json.loads((tmp_path / "pp-fit.json").read_text())
    assert_same_training(fitted, static)
    for iteration in (1, 2, 3):
        assert f"hardware profile refitted at iteration {iteration}: plans from micro-batch " \
               f"{GBS * iteration} on use it" in proc.stdout
        assert f"; iteration {iteration}: {GBS} micro-batches, step " in proc.stdout
    assert proc.stdout.count("(est. ") == 3
    assert load_hardware(str(profile)).source.startswith("fitted during training")
    plans = fitted["plans"]
    for rank in range(4):
        for chunk in range(2 if schedule == "interleaved" else 1):
            assert [d for c, d in plans[rank] if c == chunk] == \
                [d for c, d in plans[0] if c == 0], (rank, chunk)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_multi_token_prediction_with_pipelines_trains_like_static(tree, tmp_path, schedule):
    """--mtp-num-layers 1 with PP 2 x CP 2: megatron-core builds the MTP layer on the last
    stage (the last model chunk with virtual stages) with its own copy of the word embedding,
    tied to the first stage's through the embedding group; the shift within documents runs in
    the last stage's pools (the plan every stage made alike). Under Megatron DDP and
    Megatron-FSDP. Whole samples: Megatron-LM's
    static path rolls across documents with --reset-attention-mask."""
    flags = [*PIPELINE, *SCHEDULES[schedule], "--mtp-num-layers", "1",
             "--mtp-loss-scaling-factor", "0.3"]
    zeppelin = run(tree, tmp_path, "pp-mtp-zeppelin", 4, *ZEPPELIN, "--context-parallel-size",
                   "2", *flags)
    static = run(tree, tmp_path, "pp-mtp-static", 4, *STATIC, *flags)
    assert_same_training(zeppelin, static)
    assert len(zeppelin["mtp_losses"]) == 3  # logged from the last stage, one per depth
    assert all(len(v) == 1 and v[0] > 1.0 for v in zeppelin["mtp_losses"])
    fsdp = run(tree, tmp_path, "pp-mtp-fsdp", 4, *ZEPPELIN, "--context-parallel-size", "2",
               *flags, *FSDP, "optim_grads_params")  # the embedding copy's grads summed whole
    assert fsdp["wrapper"] == "FullyShardedDataParallel"
    assert_same_training(fsdp, static)
    for mine in (zeppelin, fsdp):
        for ours, theirs in zip(mine["mtp_losses"], static["mtp_losses"]):
            assert ours == pytest.approx(theirs, rel=2e-6)


def test_pipeline_checkpoints_resume_like_the_uninterrupted_run(pipelined, tree, tmp_path):
    """PP 2 x CP 2 through the patch: a zeppelin checkpoint saved after iteration 2
    (Megatron-LM's ``model`` key, or ``model0``/``model1`` per chunk with virtual stages)
    resumes in zeppelin mode and in static mode with the uninterrupted runs' last loss and
    parameters."""
    schedule, zeppelin, static, _ = pipelined
    flags = [*PIPELINE, *SCHEDULES[schedule], *(DOCUMENTS if schedule == "1f1b" else [])]
    pool = ["--context-parallel-size", "2"]
    ckpt = tmp_path / "ckpt-pp"
    run(tree, tmp_path, "pp-first", 4, *ZEPPELIN, *pool, *flags, "--save", str(ckpt),
        "--save-interval", "1000", stop=2)
    for name, mode, full in (("zeppelin", ZEPPELIN + pool, zeppelin), ("static", STATIC, static)):
        resumed = run(tree, tmp_path, f"pp-resumed-{name}", 4, *mode, *flags, "--load",
                      str(ckpt))
        assert resumed["start"] == 2, name
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=2e-6), name
        assert resumed["param_sum"] == pytest.approx(full["param_sum"], rel=1e-6), name


def test_tensor_and_sequence_parallelism_with_pipelines_train_like_static(tree, tmp_path):
    """TP 2 + --sequence-parallel with PP 2 x CP 2 (8 ranks) vs static mode TP 2 x PP 2 (4
    ranks, the same global batch): the stages send each rank's linear-layout share padded to
    a multiple of TP, split over the TP ranks ([tokens / TP, 1, hidden])."""
    sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--reset-attention-mask",
          "--spec", "megatron_lm_spec", "SPEC"]
    zeppelin = run(tree, tmp_path, "pp-sp-zeppelin", 8, *ZEPPELIN, "--context-parallel-size",
                   "2", "--no-zeppelin-remap", *PIPELINE, *sp)
    static = run(tree, tmp_path, "pp-sp-static", 4, *STATIC, *PIPELINE, *sp)
    assert_same_training(zeppelin, static, rel=1e-5)
    assert zeppelin["tokens_per_iteration"] == [GBS * SEQ] * 3 and zeppelin["pad_tokens"] > 0


FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--data-parallel-sharding-strategy"]


def test_megatron_fsdp_trains_like_static_and_ddp(tree, tmp_path):
    """--use-megatron-fsdp through the patch (Megatron-LM's own FSDP wrapping and optimizer;
    its streams bridged on CPU), a pool of 2: zeppelin trains like static mode with
    Megatron-FSDP and like Megatron DDP, with the three sharding strategies that run."""
    pool = ["--context-parallel-size", "2"]
    zeppelin = run(tree, tmp_path, "fsdp-z", 2, *ZEPPELIN, *pool, *FSDP, "optim_grads_params")
    static = run(tree, tmp_path, "fsdp-s", 2, *STATIC, *FSDP, "optim_grads_params")
    ddp = run(tree, tmp_path, "ddp-s", 2, *STATIC)
    assert_same_training(zeppelin, static)
    assert_same_training(zeppelin, ddp)
    assert zeppelin["param_sum"] == pytest.approx(ddp["param_sum"], rel=1e-6)
    for strategy in ("optim_grads", "optim"):
        sharded = run(tree, tmp_path, f"fsdp-z-{strategy}", 2, *ZEPPELIN, *pool, *FSDP, strategy)
        assert_same_training(sharded, ddp)
    # optim with the hooks' overlapped reduce: megatron-core 0.16's adds each rank's own
    # gradient to the reduced shard (refused there), 0.17 fixed it (exact)
    overlap = [*ZEPPELIN, *pool, *FSDP, "optim", "--overlap-grad-reduce"]
    if tree_version(tree) < (0, 17, 0):
        proc = run(tree, tmp_path, "fsdp-z-overlap", 2, *overlap, ok=False)
        assert proc.returncode != 0 and "--overlap-grad-reduce with --use-megatron-fsdp" in \
            proc.stderr
    else:
        overlapped = run(tree, tmp_path, "fsdp-z-overlap", 2, *overlap)
        assert_same_training(overlapped, ddp)
        assert overlapped["param_sum"] == pytest.approx(ddp["param_sum"], rel=1e-6)
    # a plain optimizer on the shards (no --use-distributed-optimizer): Megatron-LM 0.16 and
    # 0.17 step it wrongly in static mode too (refused there), 0.18 on exactly
    plain = [*ZEPPELIN, *pool, *(f for f in FSDP if f != "--use-distributed-optimizer"),
             "optim_grads_params"]
    if tree_version(tree) < (0, 18, 0):
        proc = run(tree, tmp_path, "fsdp-z-plain", 2, *plain, ok=False)
        assert proc.returncode != 0 and "without --use-distributed-optimizer" in proc.stderr
    else:
        unsharded = run(tree, tmp_path, "fsdp-z-plain", 2, *plain)
        assert_same_training(unsharded, ddp)
        assert unsharded["param_sum"] == pytest.approx(ddp["param_sum"], rel=1e-6)


def test_megatron_fsdp_no_shard_and_tensor_parallel_local_layers(tree, tmp_path):
    """Megatron-LM's default sharding strategy (no_shard) and TP 2 with local layers under
    Megatron-FSDP through the patch: Megatron-LM core_v0.16.1 and core_v0.17.1 fail with
    them in static mode too (refused there, naming the way out); from core_v0.18.2 zeppelin
    (a pool of 2) trains like Megatron DDP with them, and TP 2 x PP 2 (a pool of 1 per stage)
    too."""
    from megatron_zeppelin.megatron.common import fsdp_limits

    pool = ["--context-parallel-size", "2"]
    no_shard = [*ZEPPELIN, *pool, *FSDP, "no_shard"]
    tp = ["--tensor-model-parallel-size", "2"]
    tensor_parallel = [*ZEPPELIN, *pool, *tp, *FSDP, "optim_grads_params"]
    if tree_version(tree) < fsdp_limits.NO_SHARD_EXACT:
        proc = run(tree, tmp_path, "fsdp-z-no-shard", 2, *no_shard, ok=False)
        assert proc.returncode != 0 and "--data-parallel-sharding-strategy=no_shard" in \
            proc.stderr
    else:
        ddp = run(tree, tmp_path, "ddp-s", 2, *STATIC)
        unsharded = run(tree, tmp_path, "fsdp-z-no-shard", 2, *no_shard)
        assert_same_training(unsharded, ddp)
        assert unsharded["param_sum"] == pytest.approx(ddp["param_sum"], rel=1e-6)
    if tree_version(tree) < fsdp_limits.TP_WITHOUT_TE_EXACT:
        proc = run(tree, tmp_path, "fsdp-z-tp", 4, *tensor_parallel, ok=False)
        assert proc.returncode != 0 and "--tensor-model-parallel-size > 1 with " \
            "--use-megatron-fsdp --transformer-impl local" in proc.stderr
    else:
        # with stages each stage checks its TP DTensors over its own ranks (stage_mesh)
        layouts = {"tp": ([], pool), "tp-pp": (PIPELINE, ["--context-parallel-size", "1"])}
        for name, (stages, cp) in layouts.items():
            ddp = run(tree, tmp_path, f"ddp-s-{name}", 4, *STATIC, *tp, *stages)
            fsdp = run(tree, tmp_path, f"fsdp-z-{name}", 4, *ZEPPELIN, *cp, *tp, *stages, *FSDP,
                       "optim_grads_params")
            assert fsdp["wrapper"] == "FullyShardedDataParallel"
            assert_same_training(fsdp, ddp)
            assert fsdp["param_sum"] == pytest.approx(ddp["param_sum"], rel=1e-6)


def test_megatron_fsdp_with_pipelines_trains_like_ddp(pipelined, tree, tmp_path):
    """--use-megatron-fsdp with PP 2 x CP 2 through the patch: Megatron-LM's get_model wraps
    each stage's chunks over that stage's pool (the patched ``_fsdp_wrapping``; megatron-core
    0.16.1 meshes the whole world and fails with stages, in static mode too), the word
    embedding tied to the output layer (Megatron-LM's default) has its gradient summed across
    the stages as a whole tensor, and the run trains like static mode's and zeppelin's Megatron
    DDP x PP, 1F1B and interleaved."""
    schedule, zeppelin, static, _ = pipelined
    flags = [*PIPELINE, *SCHEDULES[schedule], *(DOCUMENTS if schedule == "1f1b" else [])]
    fsdp = run(tree, tmp_path, "pp-fsdp", 4, *ZEPPELIN, "--context-parallel-size", "2", *flags,
               *FSDP, "optim_grads_params")
    assert fsdp["wrapper"] == "FullyShardedDataParallel"
    assert static["wrapper"] == zeppelin["wrapper"] == "DistributedDataParallel"
    assert_same_training(fsdp, static)
    assert fsdp["param_sum"] == pytest.approx(zeppelin["param_sum"], rel=1e-6)


def test_torch_fsdp2_trains_like_ddp(tree, tmp_path):
    """--use-torch-fsdp2 through the patch, a pool of 2 on documents: the patched get_model
    builds zeppelin's FSDP2 wrapper (gradients summed and scaled by the global batch's tokens;
    megatron-core 0.16.1's divides them by the rank count), which trains like static mode's
    Megatron DDP, in fp32 and in bf16. Megatron-LM asks FSDP2 for untied embeddings."""
    flags = [*DOCUMENTS, "--untie-embeddings-and-output-weights"]
    fsdp2 = run(tree, tmp_path, "fsdp2-z", 2, *ZEPPELIN, "--context-parallel-size", "2", *flags,
                "--use-torch-fsdp2")
    ddp = run(tree, tmp_path, "ddp-s-untied", 2, *STATIC, *flags)
    assert fsdp2["wrapper"] == "PerTokenTorchFSDP" and ddp["wrapper"] == "DistributedDataParallel"
    assert_same_training(fsdp2, ddp)
    assert fsdp2["param_sum"] == pytest.approx(ddp["param_sum"], rel=1e-6)
    # --bf16: Megatron-LM's Float16Module and bf16 optimizer around the wrapper's fp32 shards,
    # bf16 compute, fp32 accumulation and reduce-scatter, as Megatron DDP under --bf16
    bf16 = run(tree, tmp_path, "fsdp2-z-bf16", 2, *ZEPPELIN, "--context-parallel-size", "2",
               *flags, "--use-torch-fsdp2", "--bf16")
    ddp_bf16 = run(tree, tmp_path, "ddp-s-untied-bf16", 2, *STATIC, *flags, "--bf16")
    assert_same_training(bf16, ddp_bf16, rel=1e-5)
