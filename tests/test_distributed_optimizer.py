"""--use-distributed-optimizer on 4 gloo ranks (Megatron's DistributedOptimizer, Adam state
sharded over DP x CP): zeppelin mode gives the plain optimizer's losses and gradient norms;
its checkpoint (zeppelin) resumes in static mode with the distributed optimizer and with the
plain one exactly as the uninterrupted run (iteration 3 checks the Adam state and step the
resumed optimizer carries); a plain checkpoint (static) resumes with the distributed
optimizer (zeppelin) too. Megatron-FSDP: test_training_fsdp.py."""
from __future__ import annotations

import pytest

from distributed import run_world

pytestmark = pytest.mark.distributed

FLAGS = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--vocab-size", "256", "--seq-length", "512", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "3", "--mock-data",
         "--zeppelin-overlong", "split", "--zeppelin-cluster", "cpu-2x2", "--seed", "5",
         "--lr", "0.01", "--log-interval", "1", "--no-zeppelin-planner-process"]
ZEPPELIN = ["--context-parallel-mode", "zeppelin", "--context-parallel-size", "4",
            "--zeppelin-gpus-per-node", "2"]
STATIC = ["--context-parallel-mode", "static", "--context-parallel-size", "4"]
DISTRIBUTED = ["--use-distributed-optimizer"]


def run(world: int, argv: list[str], tiers: bool = False) -> list[tuple]:
    """One ``pretrain_gpt.py`` run in the gloo world: (iteration, loss, grad norm) per
    iteration on rank 0, then (sequences local, intra-node ring, inter-node ring) if
    ``tiers``."""
    from megatron_zeppelin.megatron.loop import args as train_args, preflight, train

    args = train_args.parse_args(argv)
    layout = train_args.validate_args(args, world, None)
    ready = preflight.check(args)
    train.setup_megatron(args)
    return [(log.iteration, log.loss, log.grad_norm) +
            ((log.local, log.intra, log.inter) if tiers else ())
            for log in train.train(args, layout, ready)]


def close(a: list[tuple], b: list[tuple], tol: float = 1e-6,
          grad_tol: float | None = None) -> bool:
    """Same iterations, losses within ``tol`` and grad norms within ``grad_tol`` (default
    ``tol``), relative."""
    grad_tol = tol if grad_tol is None else grad_tol
    return len(a) == len(b) and all(x[0] == y[0] and abs(x[1] - y[1]) <= tol * abs(y[1]) and
                                    abs(x[2] - y[2]) <= grad_tol * abs(y[2])
                                    for x, y in zip(a, b))


def body(rank: int, world: int, tmp: str) -> None:
    plain = run(world, FLAGS + ZEPPELIN)
    sharded = run(world, FLAGS + ZEPPELIN + DISTRIBUTED + ["--save", f"{tmp}/d"])
    run(world, FLAGS + ZEPPELIN + DISTRIBUTED + ["--save", f"{tmp}/d1", "--exit-interval", "1"])
    static_sharded = run(world, FLAGS + STATIC + DISTRIBUTED + ["--load", f"{tmp}/d1"])
    static_plain = run(world, FLAGS + STATIC + ["--load", f"{tmp}/d1"])
    run(world, FLAGS + STATIC + ["--save", f"{tmp}/p1", "--exit-interval", "1"])
    from_plain = run(world, FLAGS + ZEPPELIN + DISTRIBUTED + ["--load", f"{tmp}/p1"])
    if rank == 0:
        assert [it for it, _, _ in sharded] == [1, 2, 3]
        assert close(sharded, plain), (sharded, plain)  # the same training, Adam sharded
        assert close(static_sharded, plain[1:]), (static_sharded, plain)
        assert close(static_plain, plain[1:]), (static_plain, plain)
        assert close(from_plain, plain[1:]), (from_plain, plain)


def test_distributed_optimizer_is_exact_and_its_checkpoints_cross_modes(tmp_path):
    run_world(body, 4, str(tmp_path), start_method="spawn", timeout_s=400)

