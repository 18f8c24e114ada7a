"""Resume and checkpoints on gloo ranks: a run saved at iteration 2 and resumed to 4 repeats
the uninterrupted run bit for bit; a checkpoint saved by 4 ranks in zeppelin mode loads on 2
ranks in static mode (model, optimizer, LR schedule, data position) and a mismatched model is
refused naming the checkpoint."""
from __future__ import annotations

import pytest
import torch

from distributed import run_world

pytestmark = pytest.mark.distributed

FLAGS = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--vocab-size", "256", "--seq-length", "512", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "4", "--mock-data",
         "--zeppelin-overlong", "split", "--zeppelin-cluster", "cpu-2x2", "--seed", "5",
         "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "1",
         "--lr-decay-style", "cosine", "--log-interval", "1"]  # every iteration recorded
ZEPPELIN_4 = ["--context-parallel-mode", "zeppelin", "--context-parallel-size", "4",
              "--zeppelin-gpus-per-node", "2"]


def run(world: int, argv: list[str]) -> list:
    """One ``pretrain_gpt.py`` run inside an existing gloo world: validation, preflight,
    Megatron setup and the training loop; rank 0's per-iteration logs."""
    from megatron_zeppelin.megatron.loop import args as train_args, preflight, train

    args = train_args.parse_args(argv)
    layout = train_args.validate_args(args, world, None)
    ready = preflight.check(args)
    train.setup_megatron(args)
    return train.train(args, layout, ready)


def deterministic(logs: list) -> list[tuple]:
    """What a log line says about the numbers (not the timings)."""
    return [(log.iteration, log.lr, log.loss, log.grad_norm, log.local, log.intra, log.inter)
            for log in logs]


def resume_body(rank: int, world: int, tmp: str) -> None:
    whole = run(world, FLAGS + ZEPPELIN_4)
    first = run(world, FLAGS + ZEPPELIN_4 + ["--save", tmp, "--save-interval", "2",
                                             "--exit-interval", "2"])
    second = run(world, FLAGS + ZEPPELIN_4 + ["--load", tmp])
    if rank == 0:
        assert [log.iteration for log in first] == [1, 2]
        assert [log.iteration for log in second] == [3, 4]
        assert deterministic(first) == deterministic(whole[:2])
        assert deterministic(second) == deterministic(whole[2:])  # bitwise: the same floats
        assert whole[0].lr == 0.0 and whole[1].lr == 0.01  # warmup from 0 to --lr
        assert 0.001 < whole[3].lr < whole[2].lr < 0.01  # cosine decay towards --min-lr


def test_resume_repeats_the_uninterrupted_run_bitwise(tmp_path):
    run_world(resume_body, 4, str(tmp_path), start_method="spawn", timeout_s=400)


def save_body(rank: int, world: int, tmp: str) -> list:
    logs = run(world, FLAGS + ZEPPELIN_4 + ["--save", tmp, "--save-interval", "2",
                                            "--exit-interval", "2"])
    rest = run(world, FLAGS + ZEPPELIN_4 + ["--load", tmp])
    return [(log.iteration, log.loss) for log in logs + rest]


def cross_body(rank: int, world: int, tmp: str) -> list:
    from megatron_zeppelin.config import ConfigError

    static_2 = ["--context-parallel-mode", "static", "--context-parallel-size", "2",
                "--zeppelin-gpus-per-node", "2"]
    with pytest.raises(ConfigError, match=r"checkpoint .*iter_0000002 was saved for another "
                       r"model: .* has shape"):
        run(world, FLAGS + static_2 + ["--load", tmp, "--hidden-size", "64"])
    logs = run(world, FLAGS + static_2 + ["--load", tmp])
    return [(log.iteration, log.loss) for log in logs]


def test_a_checkpoint_crosses_modes_and_pool_sizes(tmp_path):
    """Saved by 4 ranks in zeppelin mode at iteration 2, loaded by 2 ranks in static mode:
    iterations 3 and 4 see the same documents with the same weights and optimizer state, so
    their losses match the 4-rank run's up to the modes' float rounding."""
    four = run_world(save_body, 4, str(tmp_path), start_method="spawn", timeout_s=400)[0]
    two = run_world(cross_body, 2, str(tmp_path), start_method="spawn", timeout_s=400)[0]
    assert [i for i, _ in two] == [3, 4]
    for (i, loss), (j, reference) in zip(two, four[2:]):
        assert i == j and loss == pytest.approx(reference, abs=2e-4), (i, loss, reference)
    assert torch.tensor([loss for _, loss in two]).isfinite().all()


ZEPPELIN_2 = ["--context-parallel-mode", "zeppelin", "--context-parallel-size", "2",
              "--zeppelin-gpus-per-node", "2"]


def longer_schedule_body(rank: int, world: int, tmp: str) -> None:
    """A first leg of 4 iterations of an 8-iteration LR schedule (--train-iters 4
    --lr-decay-iters 8), resumed with --train-iters 8: the weight-decay steps (--train-iters x
    GBS, as in Megatron-LM) differ, so the resume is refused in one line naming the flags that
    resolve it; each of them resumes as the uninterrupted 8-iteration run."""
    from megatron_zeppelin.config import ConfigError

    schedule = FLAGS + ZEPPELIN_2 + ["--lr-decay-iters", "8"]  # --train-iters 4
    eight = [f if f != "4" or schedule[i - 1] != "--train-iters" else "8"
             for i, f in enumerate(schedule)]
    whole = run(world, eight)
    first = run(world, schedule + ["--save", tmp])
    with pytest.raises(ConfigError, match=r"^--load: checkpoint .*iter_0000004 was trained with "
                       r"another LR/weight-decay schedule: --train-iters gives wd_incr_steps=16 "
                       r"there, 32 now .*--override-opt_param-scheduler .*"
                       r"--use-checkpoint-opt_param-scheduler"):
        run(world, eight + ["--load", tmp])
    override = run(world, eight + ["--load", tmp, "--override-opt_param-scheduler"])
    # the checkpoint's schedule: --lr 0.05 is ignored
    kept = run(world, eight + ["--load", tmp, "--use-checkpoint-opt_param-scheduler", "--lr",
                               "0.05"])
    if rank == 0:
        assert deterministic(first) == deterministic(whole[:4])
        assert [log.iteration for log in override] == [5, 6, 7, 8]
        assert deterministic(override) == deterministic(whole[4:])
        assert deterministic(kept) == deterministic(whole[4:])
        assert 0.001 < whole[7].lr < whole[4].lr < 0.01  # still decaying after iteration 4


def test_a_first_leg_of_a_longer_schedule_resumes_with_megatrons_scheduler_flags(tmp_path):
    run_world(longer_schedule_body, 2, str(tmp_path), start_method="spawn", timeout_s=400)
