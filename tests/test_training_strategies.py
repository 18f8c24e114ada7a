"""Every registered strategy trains through ``pretrain_gpt.py``'s loop (``--zeppelin-strategy``)
on 4 gloo ranks as 2 nodes x 2, on the same documents, and ends on static mode's loss (fp32);
a strategy the engine cannot run is refused before training in one line, with its reason."""
from __future__ import annotations

import pytest

from distributed import run_world

pytestmark = pytest.mark.distributed

FLAGS = ["--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--vocab-size", "256", "--seq-length", "512", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "2", "--mock-data",
         "--zeppelin-overlong", "split", "--zeppelin-cluster", "cpu-2x2", "--seed", "3",
         "--lr", "0.01", "--context-parallel-size", "4", "--zeppelin-gpus-per-node", "2",
         "--no-zeppelin-planner-process", "--zeppelin-validate-plan"]
# each with an option of its own, as its users set it
STRATEGIES = {"zeppelin": [], "static-cp": ["--zeppelin-cp-size", "2"], "static-cp-best": [],
              "hybrid-dp": ["--max-seqlen-per-dp-cp-rank", "256"],
              "megatron-hybrid-cp": ["--max-seqlen-per-dp-cp-rank", "128"], "hydraulis": [],
              "flexsp": []}


def body(rank: int, world: int) -> dict:
    from megatron_zeppelin.config import ConfigError
    from megatron_zeppelin.megatron import args as train_args, preflight, train
    from megatron_zeppelin.planner import STRATEGIES as REGISTERED

    def run(extra: list[str]) -> list:
        args = train_args.parse_args(FLAGS + extra)
        layout = train_args.validate_args(args, world, None)
        train.setup_megatron(args)
        return train.train(args, layout, preflight.check(args))

    def losses(logs: list) -> tuple:
        counts = zip(*[(log.local, log.intra, log.inter) for log in logs])
        return [log.loss for log in logs], tuple(sum(c) for c in counts)

    out = {"static": losses(run(["--context-parallel-mode", "static"]))}
    for name in REGISTERED:
        extra = ["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", name,
                 *STRATEGIES.get(name, [])]
        try:
            out[name] = losses(run(extra))
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def test_every_strategy_trains_to_static_modes_loss():
    result = run_world(body, 4, start_method="spawn", timeout_s=600)[0]
    static, static_tiers = result.pop("static")
    assert len(static) == 2
    placements = {static_tiers}
    for name, losses in result.items():
        if isinstance(losses, str):  # refused: only a strategy the engine cannot run
            assert name == "flexsp" and "\n" not in losses, (name, losses)
            assert losses.startswith("--zeppelin-strategy flexsp cannot run here: the "
                                     "attention engine"), losses
            continue
        losses, tiers = losses
        placements.add(tiers)
        assert losses == pytest.approx(static, rel=2e-5), (name, losses, static)
    assert len(placements) >= 3  # the strategies placed the documents differently
