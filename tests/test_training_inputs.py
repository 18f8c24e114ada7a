"""Bad input to ``pretrain_gpt.py`` is refused before any process group exists, with one line
naming the flag, file or variable, the value and what is allowed: flags and their
combinations, the corpus, environment variables, optional packages, output folders and the
checkpoint ``--load`` names (format, safety, completeness). Also: the LR schedule, the line
printed once, and ``zeppelin plan`` refusing documents no pool can hold."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch

from megatron_zeppelin import cli
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.loop import args as train_args, checkpoint, fatal, preflight

ROOT = Path(__file__).resolve().parent.parent
README_YAML = str(ROOT / "configs" / "train" / "gpt-tiny-cpu.yaml")
BASE = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "256", "--global-batch-size", "2",
        "--train-iters", "4", "--mock-data", "--vocab-size", "256",
        "--zeppelin-overlong", "split"]


def validated(flags: list[str], world: int = 1):
    args = train_args.parse_args(flags)
    train_args.validate_args(args, world, None)
    return args


# ----------------------------------------------------------------------------- flags
def test_data_path_on_the_command_line_replaces_mock_data_of_the_yaml(tmp_path):
    args = validated(["--yaml-cfg", README_YAML, "--data-path", str(tmp_path / "corpus")], 4)
    assert args.mock_data is False and "replaces mock_data: true of" in args.data_note
    with pytest.raises(ConfigError, match=r"--data-path '.*corpus': .*corpus.idx does not "
                                          r"exist \(expected Megatron's indexed dataset"):
        preflight.check(args)


def test_mock_data_and_data_path_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--mock-data and --data-path are both given"):
        train_args.parse_args(BASE + ["--data-path", "x"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mock_data: true\ndata_path: corpus\n")
    with pytest.raises(ConfigError, match=r"--mock-data and --data-path='corpus' are both set "
                                          r"\(in .*c.yaml\): pass one"):
        validated([x for x in BASE if x != "--mock-data"] + ["--yaml-cfg", str(cfg)])


@pytest.mark.parametrize("flags,match", [
    (["--min-lr", "0.5"], r"^--min-lr=0.5 is invalid: expected a rate <= --lr 0.001"),
    (["--lr-warmup-iters", "4"], r"^--lr-warmup-iters=4 is invalid: expected < "
                                 r"--lr-decay-iters 4 \(default: --train-iters\)"),
    (["--lr-decay-iters", "0"], r"^--lr-decay-iters=0 is invalid: expected >= 1"),
    (["--lr-decay-style", "exponential"], r"invalid choice: 'exponential'"),
    (["--save-interval", "0"], r"^--save-interval=0 is invalid: expected >= 1"),
    (["--exit-interval", "0"], r"^--exit-interval=0 is invalid: expected >= 1"),
    (["--zeppelin-watchdog-timeout", "-1"], r"^--zeppelin-watchdog-timeout=-1.0 is invalid"),
    (["--zeppelin-watchdog-timeout", "0.001"],
     r"^--zeppelin-watchdog-timeout=0.001 is invalid: expected 0 \(off\) or seconds >= 1"),
    (["--lr", "inf"], r"argument --lr: 'inf' is invalid: expected a finite number"),
    (["--min-lr", "1e400"], r"argument --min-lr: '1e400' is invalid: expected a finite"),
    (["--zeppelin-capacity-factor", "nan"], r"'nan' is invalid: expected a finite number"),
    (["--seq-length", "1"], r"^--seq-length=1 is invalid: expected >= 2"),
    (["--mtp-loss-scaling-factor", "0.5"], r"^--mtp-loss-scaling-factor=0.5 is invalid: "
                                           r"expected given only with --mtp-num-layers"),
    (["--exit-on-missing-checkpoint"], r"^--exit-on-missing-checkpoint=True is invalid: "
                                       r"expected given only with --load"),
    (["--no-load-optim"], r"^--load-optim=False is invalid: expected given only with --load"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler", "--load",
      "/nonexistent"], r"^--override-opt_param-scheduler and "
                       r"--use-checkpoint-opt_param-scheduler cannot be used together"),
    (["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", "static-cp",
      "--zeppelin-cp-size", "2", "--zeppelin-cp-nodes", "1"], r"^--zeppelin-cp-nodes=1 is invalid: expected unset when the CP size is given"),
    (["--hidden-size", "66"], r"^--hidden-size=66 is invalid: expected a multiple of "
                              r"--num-attention-heads=4$"),
    (["--num-query-groups", "3"], r"^--num-query-groups=3 is invalid: expected a divisor of "
                                  r"--num-attention-heads=4$"),
    (["--tp", "0"], r"unrecognized arguments: --tp 0"),
    (["--lr-warmup", "2"], r"unrecognized arguments: --lr-warmup 2"),  # no abbreviations
    # what megatron-core's TP layers split (they asserted on every rank)
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
     r"^--tensor-model-parallel-size=2 is invalid: expected a divisor of --num-query-groups 1"),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "127"],
     r"^--tensor-model-parallel-size=2 is invalid: expected a divisor of --ffn-hidden-size 127"),
    (["--tensor-model-parallel-size", "2", "--vocab-size", "257"],
     r"^--tensor-model-parallel-size=2 is invalid: expected a divisor of --vocab-size 257"),
    (["--seed", str(10 ** 23)], r"^--seed=10+ is invalid: expected an integer in \[0, "
                                r"2147483648\)"),  # torch.manual_seed overflowed
    (["--lr", "1e300"], r"^--lr=1e\+300 is invalid: expected a number <= 3.403e\+38"),
])
def test_bad_training_flags_are_refused_by_name(flags, match):
    with pytest.raises(ConfigError, match=match):
        validated(BASE + flags)


def test_bad_files_and_pool_options_are_refused_by_name(tmp_path):
    """A file as --load, a folder as --zeppelin-profile-out, an empty or repeated --yaml-cfg,
    an empty --data-path or --zeppelin-cluster and --zeppelin-cp-nodes the pool cannot run:
    one error each, naming the flag; a YAML list is a window (window_size: [L, 0])."""
    afile, empty, listed = tmp_path / "afile", tmp_path / "empty.yaml", tmp_path / "w.yaml"
    afile.write_text("x")
    empty.write_text("")
    listed.write_text("window_size: [64, 0]\nwindow_attn_skip_freq: [1, 0]\n")
    cases = [
        (BASE + ["--load", str(afile)], r"^--load='.*afile' is invalid: expected a checkpoint "
                                         r"folder \(this is a file\)"),
        (BASE + ["--zeppelin-fit-interval", "1", "--zeppelin-profile-out", str(tmp_path)],
         r"^--zeppelin-profile-out='.*' is invalid: expected a file in an existing, writable "
         r"folder \(not a folder\)"),
        (BASE + ["--yaml-cfg", str(empty)], r"^--yaml-cfg '.*empty.yaml' is empty"),
        (["--yaml-cfg", README_YAML, "--yaml-cfg", str(empty)], r"^--yaml-cfg is given 2 times"),
        (["--yaml-cfg="], r"^--yaml-cfg='' is invalid: expected a YAML file"),
        ([x for x in BASE if x != "--mock-data"] + ["--data-path", ""],
         r"^argument --data-path: '' is invalid: expected a non-empty value"),
        (BASE + ["--zeppelin-cluster", " "],  # an empty name was the default cluster
         r"^argument --zeppelin-cluster: ' ' is invalid: expected a non-empty value"),
    ]
    for flags, match in cases:
        with pytest.raises(ConfigError, match=match):
            validated(flags)
    with pytest.raises(ConfigError, match=r"^--zeppelin-cp-nodes=3 is invalid: expected a "
                                          r"divisor of the pool's 2 node\(s\)"):
        validated(["--yaml-cfg", README_YAML, "--zeppelin-strategy", "static-cp",
                   "--zeppelin-cp-nodes", "3"], 4)
    with pytest.raises(ConfigError, match=r"^--zeppelin-cp-size=3 is invalid: expected a "
                                          r"divisor of the pool's 4 ranks"):
        validated(["--yaml-cfg", README_YAML, "--zeppelin-strategy", "static-cp",
                   "--zeppelin-cp-size", "3"], 4)
    args = validated(BASE + ["--yaml-cfg", str(listed)])
    assert (args.window_size, args.window_attn_skip_freq) == ("64,0", "1,0")


# ----------------------------------------------------------------------------- preflight
@pytest.mark.parametrize("variable,value,match", [
    ("ZEPPELIN_ATTENTION_BACKEND", "bogus", r"ZEPPELIN_ATTENTION_BACKEND='bogus' is invalid: "
                                            r"expected one of \['auto', 'native', 'torch'"),
    ("ZEPPELIN_ROUTER_BACKEND", "bogus", r"ZEPPELIN_ROUTER_BACKEND='bogus' is invalid: "
                                         r"expected one of \['auto', 'cpp', 'python'\]"),
    ("ZEPPELIN_P2P_TIMEOUT_S", "soon", r"ZEPPELIN_P2P_TIMEOUT_S='soon' is invalid"),
    ("ZEPPELIN_P2P_TIMEOUT_S", "10", r"--zeppelin-watchdog-timeout=20 is invalid: expected "
                                     r"fewer seconds than ZEPPELIN_P2P_TIMEOUT_S=10"),
    ("ZEPPELIN_PLANNER_TIMEOUT_S", "-1", r"ZEPPELIN_PLANNER_TIMEOUT_S='-1' is invalid: expected "
                                         r"a positive finite number of seconds"),
    ("ZEPPELIN_P2P_TIMEOUT_S", "inf", r"ZEPPELIN_P2P_TIMEOUT_S='inf' is invalid"),  # timedelta
    ("ZEPPELIN_PLANNER_TIMEOUT_S", "nan", r"ZEPPELIN_PLANNER_TIMEOUT_S='nan' is invalid"),
    ("LOCAL_WORLD_SIZE", "abc", r"LOCAL_WORLD_SIZE='abc' is invalid: expected a positive "),
    ("ZEPPELIN_PLANNER_BACKEND", "rust", r"ZEPPELIN_PLANNER_BACKEND='rust' is invalid"),
    ("ZEPPELIN_REMAP_EXCHANGE", "ring", r"ZEPPELIN_REMAP_EXCHANGE='ring' is invalid: expected "
                                        r"one of \['all-to-all', 'pairs'\]"),
])
def test_bad_environment_variables_are_refused_before_training(monkeypatch, variable, value,
                                                               match):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=match):
        preflight.check(validated(BASE))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="TensorBoard is installed here")
def test_tensorboard_dir_without_tensorboard_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"--tensorboard-dir '.*' needs TensorBoard, which is "
                                          r"not installed: pip install"):
        preflight.check(validated(BASE + ["--tensorboard-dir", str(tmp_path)]))


def test_a_process_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """--device cuda: no GPU at all, or a LOCAL_RANK past the node's GPUs (more processes
    than GPUs), is one line before any process group."""
    cuda = [f if f != "cpu" else "cuda" for f in BASE]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda but no CUDA device is visible"):
        preflight.check_device_and_packages(validated(cuda))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    preflight.check_device_and_packages(validated(cuda))
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this node shows 2 GPU\(s\): start "
                                          r"at most one process per GPU"):
        preflight.check_device_and_packages(validated(cuda))


def test_output_paths_are_checked(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--save '.*file/ckpt': cannot create the folder"):
        preflight.check(validated(BASE + ["--save", str(blocker / "ckpt")]))
    with pytest.raises(ConfigError, match=r"--log-json '.*': folder .*missing does not exist"):
        preflight.check(validated(BASE + ["--log-json", str(tmp_path / "missing" / "l.jsonl")]))
    with pytest.raises(ConfigError, match=r"--log-json '.*' is a folder: expected a file"):
        preflight.check(validated(BASE + ["--log-json", str(tmp_path)]))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_output_paths_where_no_file_can_be_made_are_refused_before_training():
    """/proc: permissions let root write there, yet no file can be made (``unwritable_folder``
    makes one to know): refused before training, naming the flag."""
    with pytest.raises(ConfigError, match=r"^--save '/proc/ckpt': cannot create the folder"):
        preflight.check(validated(BASE + ["--save", "/proc/ckpt"]))
    with pytest.raises(ConfigError, match=r"^--save '/proc': '/proc' is not writable"):
        preflight.check(validated(BASE + ["--save", "/proc"]))
    with pytest.raises(ConfigError, match=r"^--log-json '/proc/l.jsonl': not writable"):
        preflight.check(validated(BASE + ["--log-json", "/proc/l.jsonl"]))
    with pytest.raises(ConfigError, match=r"^--zeppelin-profile-out='/proc/p.yaml' is invalid: "
                                          r"expected a file in an existing, writable folder"):
        validated(BASE + ["--zeppelin-fit-interval", "1", "--zeppelin-profile-out",
                          "/proc/p.yaml"])


@pytest.mark.parametrize("flag,value,match", [
    ("--zeppelin-cluster", "nope", r"^--zeppelin-cluster 'nope': unknown clusters config "
                                   r"'nope'; shipped: \[.*'cpu-2x2'"),
    ("--zeppelin-hardware", "missing.yaml", r"^--zeppelin-hardware 'missing.yaml': hardware "
                                            r"config file 'missing.yaml' does not exist"),
])
def test_planner_files_are_checked_by_flag(flag, value, match):
    with pytest.raises(ConfigError, match=match):
        preflight.check(validated(BASE + [flag, value]))


@pytest.mark.parametrize("variables,match", [
    ({"MASTER_PORT": "abc"}, r"MASTER_PORT='abc' is invalid: expected a port number in "
                             r"\[1, 65535\]"),
    ({"MASTER_PORT": "99999"}, r"MASTER_PORT='99999' is invalid"),
    ({"MASTER_ADDR": ""}, r"MASTER_ADDR is not set: torchrun sets it"),
    ({"RANK": "4"}, r"RANK='4' is invalid: expected an integer in \[0, 4\) \(WORLD_SIZE=4\)"),
    ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is invalid: expected an integer >= 1"),
])
def test_a_process_started_by_hand_needs_a_sound_rendezvous(monkeypatch, variables, match):
    """What torchrun sets, set by hand: a bad one is one line naming it, before
    torch.distributed reads it (it raised a traceback)."""
    from megatron_zeppelin import env

    base = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in {**base, **variables}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        env.check_rendezvous()


def test_overlong_error_is_checked_against_the_corpus():
    args = validated(BASE[:-2] + ["--zeppelin-overlong", "error"])
    with pytest.raises(ConfigError, match=r"--mock-data: document \d+ has [\d,]+ tokens, more "
                                          r"than --seq-length 256"):
        preflight.check(args)


def indexed_dataset(prefix: Path, documents: list[list[int]]) -> None:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.int32)
    for doc in documents:
        builder.add_item(torch.tensor(doc, dtype=torch.int32))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def test_a_megatron_indexed_dataset_is_read_and_bad_ones_are_refused(tmp_path):
    prefix = tmp_path / "corpus"
    indexed_dataset(prefix, [[1, 2, 3], list(range(100)), [7] * 40])
    flags = [x for x in BASE if x != "--mock-data"] + ["--data-path", str(prefix)]
    ready = preflight.check(validated(flags))
    assert list(ready.source.lengths()) == [3, 100, 40]
    assert ready.source.tokens(1, 10, 14).tolist() == [10, 11, 12, 13]
    data = (tmp_path / "corpus.bin").read_bytes()
    (tmp_path / "corpus.bin").write_bytes(data[:100])
    with pytest.raises(ConfigError, match=r"corpus.bin has 100 bytes, its index needs 572: the "
                                          r"file is truncated"):
        preflight.check(validated(flags))
    index = (tmp_path / "corpus.idx").read_bytes()
    (tmp_path / "corpus.idx").write_bytes(index[:30])
    with pytest.raises(ConfigError, match=r"corpus.idx is truncated \(30 bytes\)"):
        preflight.check(validated(flags))
    (tmp_path / "corpus.idx").write_bytes(index[:-8])
    with pytest.raises(ConfigError, match=r"corpus.idx is not a readable Megatron index \("
                                          r"version 1, 94 bytes where 3 sequences and 4 "
                                          r"documents take 102\)"):
        preflight.check(validated(flags))
    (tmp_path / "corpus.idx").write_bytes(b"garbage" * 10)
    with pytest.raises(ConfigError, match=r"corpus.idx is not a Megatron index \(it starts "
                                          r"with b'garbagega', not b'MMIDIDX"):
        preflight.check(validated(flags))
    # header (34 bytes: dtype code at 17), then 3 int32 sizes, 3 int64 pointers (bytes into
    # .bin), document indices: a negative size, a pointer out of the file, a float dtype
    (tmp_path / "corpus.bin").write_bytes(data)
    for offset, fmt, value, match in (
            (34 + 4, "<i", -50, r"corpus.idx is corrupt: sequence 1 has size -50 at byte 12 "),
            (46 + 8, "<q", 10 ** 9, r"corpus.idx is corrupt: sequence 1 has size 100 at byte "
                                     r"1000000000 of a 572-byte .bin"),
            (17, "<B", 7, r"corpus.idx stores tokens as dtype code 7: expected an integer "
                          r"dtype")):
        broken = bytearray(index)
        struct.pack_into(fmt, broken, offset, value)
        (tmp_path / "corpus.idx").write_bytes(bytes(broken))
        with pytest.raises(ConfigError, match=match):
            preflight.check(validated(flags))


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_document(tmp_path):
    """A corpus tokenized for another vocabulary: the piece that holds an id >= --vocab-size
    (or < 0) is refused when read, naming the file, the document and the position (the
    embedding's IndexError on every rank before)."""
    prefix = tmp_path / "corpus"
    indexed_dataset(prefix, [[1, 2, 3], [5, 300, 7], [4, -1]])
    flags = [x for x in BASE if x != "--mock-data"] + ["--data-path", str(prefix)]
    source = preflight.check(validated(flags)).source
    assert source.tokens(0, 0, 3).tolist() == [1, 2, 3]
    assert source.tokens(1, 0, 1).tolist() == [5]  # the piece read is checked, not the rest
    with pytest.raises(ConfigError, match=r"--data-path '.*corpus': document 1 holds token id "
                                          r"300 at position 1, outside \[0, --vocab-size 256\)"):
        source.tokens(1, 0, 3)
    with pytest.raises(ConfigError, match=r"document 2 holds token id -1 at position 1"):
        source.tokens(2, 1, 2)
    wide = validated(flags[:flags.index("--vocab-size")] + ["--vocab-size", "512"] +
                     flags[flags.index("--vocab-size") + 2:])
    assert preflight.check(wide).source.tokens(1, 0, 3).tolist() == [5, 300, 7]


def test_empty_documents_are_skipped_and_counted(tmp_path):
    """Zero-token documents (the planner refused them from the planner process, naming no
    file) are passed over by the stream and counted in the banner's corpus line; a corpus of
    nothing else is refused up front."""
    from megatron_zeppelin.megatron.loop.corpus import (DocumentStream, check_overlong,
                                                         describe_lengths)

    prefix = tmp_path / "corpus"
    indexed_dataset(prefix, [[1, 2, 3], [], [4, 5], []])
    flags = [x for x in BASE if x != "--mock-data"] + ["--data-path", str(prefix)]
    lengths = preflight.check(validated(flags)).source.lengths()
    assert describe_lengths(lengths, 256).endswith("; 2 empty (0 tokens), skipped")
    stream = DocumentStream(lengths, seed=0, max_len=256, overlong="split")
    seen = []
    for _ in range(6):
        seen.append(stream.peek())
        stream.advance()
    assert {doc for doc, _, _ in seen} == {0, 2} and all(end > start for _, start, end in seen)
    indexed_dataset(prefix, [[], []])
    with pytest.raises(ConfigError, match=r"--data-path '.*corpus': .*corpus.bin is empty: "
                                          r"the dataset holds no tokens"):
        preflight.check(validated(flags))
    with pytest.raises(ConfigError, match=r"^--data-path 'x': all 2 documents are empty"):
        check_overlong([0, 0], 256, "split", "--data-path 'x'")


def test_a_corpus_smaller_than_an_iteration_is_reported(capsys):
    """Documents that repeat within an iteration (a pass over the corpus holds fewer tokens
    than GBS x seq-length) are said so in the banner's corpus line, and the run's summary
    counts the passes over the corpus."""
    import types

    from megatron_zeppelin.megatron.loop.corpus import (DocumentStats, documents_per_pass,
                                                         repeat_note, trained_documents)
    from megatron_zeppelin.megatron.loop.train_log import Logger

    lengths = [300, 0, 100, 50]
    assert trained_documents(lengths, 256, "split") == (3, 450)
    assert trained_documents(lengths, 256, "drop") == (2, 150)
    assert repeat_note(lengths, 256, "split", 450) == ""
    assert repeat_note(lengths, 256, "drop", 256) == (
        "; a pass trains on 150 tokens (2 documents), fewer than one iteration's 256 "
        "(--global-batch-size x --seq-length): documents repeat within an iteration")
    assert documents_per_pass(lengths) == 3
    args = types.SimpleNamespace(seq_length=256, tensorboard_dir=None)
    Logger(args, None, True, DocumentStats(documents=7), False, 1,
           per_pass=documents_per_pass(lengths)).close()
    assert capsys.readouterr().out.startswith(
        "documents read: 7 (2.33 passes over the corpus's 3 non-empty documents); longer "
        "than --seq-length 256")


# ----------------------------------------------------------------------------- checkpoints
def dcp_checkpoint(root: Path, iteration: int = 3) -> Path:
    """A checkpoint folder in torch_dist layout (DCP .metadata + shard, Megatron's files)."""
    import torch.distributed.checkpoint as dcp

    path = root / f"iter_{iteration:07d}"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"iteration": iteration}, path / "common.pt")
    (root / checkpoint.TRACKER).write_text(str(iteration))
    return path


def test_a_sound_checkpoint_is_found(tmp_path):
    path = dcp_checkpoint(tmp_path)
    found = checkpoint.inspect(str(tmp_path), exit_on_missing=False)
    assert (found.path, found.iteration) == (str(path), 3)
    assert checkpoint.inspect(str(tmp_path / "empty"), exit_on_missing=False) is None
    with pytest.raises(ConfigError, match=r"--load '.*empty': no checkpoint there \(no "
                                          r"latest_checkpointed_iteration.txt\)"):
        checkpoint.inspect(str(tmp_path / "empty"), exit_on_missing=True)


class Boom:
    def __reduce__(self):
        return (os.system, ("touch boom-was-executed",))


CORRUPT = {
    "tracker": (lambda root, path: (root / checkpoint.TRACKER).write_text("latest"),
                r"latest_checkpointed_iteration.txt holds 'latest': expected the iteration"),
    "folder": (lambda root, path: (root / checkpoint.TRACKER).write_text("9"),
               r"iter_0000009 named by .* does not exist"),
    "backend": (lambda root, path: (path / "metadata.json").write_text(
        '{"sharded_backend": "zarr"}'), r"is in format 'zarr': expected 'torch_dist'"),
    "json": (lambda root, path: (path / "metadata.json").write_text("{"),
             r"has no readable metadata.json"),
    "metadata": (lambda root, path: (path / ".metadata").write_bytes(
        (path / ".metadata").read_bytes()[:50]), r"has an unreadable .metadata \(truncated"),
    "pickle": (lambda root, path: (path / ".metadata").write_bytes(pickle.dumps(Boom())),
               r"refusing to load posix.system \(not checkpoint metadata\)"),
    "shard": (lambda root, path: (path / "__0_0.distcp").write_bytes(b"x" * 10),
              r"is incomplete: __0_0.distcp has 10 bytes, \d+ expected"),
    "common": (lambda root, path: (path / "common.pt").write_bytes(pickle.dumps(Boom())),
               r"has an unreadable common.pt"),
}


@pytest.mark.parametrize("what", CORRUPT)
def test_a_corrupt_checkpoint_is_refused_naming_it(tmp_path, monkeypatch, what):
    monkeypatch.chdir(tmp_path)
    path = dcp_checkpoint(tmp_path)
    corrupt, match = CORRUPT[what]
    corrupt(tmp_path, path)
    with pytest.raises(ConfigError, match=r"^--load.*" + match):
        checkpoint.inspect(str(tmp_path), exit_on_missing=False)
    assert not (tmp_path / "boom-was-executed").exists()  # nothing in the files ran


# ----------------------------------------------------------------------------- LR schedule
class Groups:
    def __init__(self, lr: float, min_lr: float) -> None:
        self.param_groups = [{"max_lr": lr, "min_lr": min_lr}]


@pytest.mark.parametrize("style,expected", [
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1]),
    ("cosine", [0.0, 0.5, 1.0, 0.8681980515, 0.55, 0.2318019485, 0.1]),
])
def test_the_lr_schedule_is_megatrons(style, expected):
    """Warmup from 0 over 2 iterations, then decay to --min-lr at iteration 6 (steps count
    samples: iterations x global batch)."""
    from megatron_zeppelin.megatron.loop.train import make_scheduler

    args = train_args.parse_args(BASE + ["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters",
                                         "2", "--lr-decay-style", style, "--lr-decay-iters",
                                         "6", "--global-batch-size", "8"])
    optimizer = Groups(1.0, 0.1)
    scheduler = make_scheduler(args, optimizer)
    rates = []
    for _ in expected:
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=8)
    assert rates == pytest.approx(expected)


# ----------------------------------------------------------------------------- printing
def test_a_user_error_is_printed_by_rank_0_only(monkeypatch, capsys, tmp_path):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    assert fatal.user_error(ConfigError("--lr=-1.0 is invalid")) == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --lr=-1.0 is invalid\n"
    summary = json.loads(error_file.read_text())["message"]
    assert summary["extraInfo"]["py_callstack"] == "pretrain_gpt.py: error: --lr=-1.0 is invalid"
    monkeypatch.setenv("RANK", "3")  # still running after the grace: rank 0 did not fail
    assert fatal.user_error(ConfigError("--data-path 'x': x.idx does not exist"),
                            grace_s=0) == 2
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: rank 3: --data-path 'x': x.idx "
                                       "does not exist\n")


def test_zeppelin_plan_refuses_a_document_no_pool_can_hold(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n2000\n99999999999\n")
    code = cli.main(["plan", "--model", "llama-7b", "--cluster", "h200-8nic", "--nodes", "2",
                     "--lengths", str(lengths), "--validate"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert ("document 2 has 99,999,999,999 tokens; 2 x h200-8nic (16 GPUs x 141 GiB) holds at "
            "most 9,240,576 tokens of one document of llama-7b") in err


def test_an_attention_backend_that_cannot_run_is_refused_before_training():
    """An explicit --zeppelin-attention-backend not installed, or unable to run on the CPU in
    this dtype, is refused by preflight (before the process group), naming the flag."""
    for backend, match in (("flash_attn", r"needs flash_attn, which is not installed"),
                           ("native", r"needs fp16/bf16 tensors, got torch.float32")):
        args = validated(BASE + ["--zeppelin-attention-backend", backend])
        with pytest.raises(ConfigError, match=rf"^--zeppelin-attention-backend {backend}: "
                                              rf"{match}"):
            preflight.check_attention_backend(args)
    preflight.check_attention_backend(validated(BASE + ["--zeppelin-attention-backend",
                                                        "torch"]))


def test_a_model_no_memory_can_hold_is_refused_before_the_allocator_fails():
    """Weights and gradients alone, spread over every rank, above a rank's share of the RAM:
    one line naming the size flags (it was the allocator's traceback on every rank)."""
    args = validated(BASE + ["--ffn-hidden-size", "100000000000"])
    with pytest.raises(ConfigError, match=r"^the model has [0-9,]+ parameters or more "
                                          r"\(--num-layers 2, --hidden-size 64, "
                                          r"--ffn-hidden-size 100000000000, --vocab-size 256\)"
                                          r".* more than a rank's share of this node's RAM "
                                          r"\(4 ranks\) holds"):
        preflight.check_memory(args, 4, 4)
    preflight.check_memory(validated(BASE), 4, 4)  # the tiny model fits
