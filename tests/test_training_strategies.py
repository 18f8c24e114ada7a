"""Every registered strategy trains through ``pretrain_gpt.py``'s loop (``--zeppelin-strategy``)
on 4 gloo ranks as 2 nodes x 2, on the same documents, and ends on static mode's loss (fp32),
measured side by side by ``zeppelin bench train --strategies``; a strategy the engine cannot
run is refused before training in one line, with the engine's reason."""
from __future__ import annotations

import json

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench.train import parse_entry
from megatron_zeppelin.planner import STRATEGIES

pytestmark = pytest.mark.distributed

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--seq-length", "512", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr-warmup-iters", "0", "--seed", "3", "--no-zeppelin-planner-process",
         "--zeppelin-validate-plan"]
# each with an option of its own, as its users set it
OPTIONS = {"static-cp": ":zeppelin-cp-size=2", "hybrid-dp": ":max-seqlen-per-dp-cp-rank=256",
           "megatron-hybrid-cp": ":max-seqlen-per-dp-cp-rank=128",
           "megatron-dynamic-cp": ":max-seqlen-per-dp-cp-rank=128"}


def test_every_strategy_trains_to_static_modes_loss(tmp_path, capsys):
    names = ["static", *STRATEGIES]
    strategies = ",".join(name + OPTIONS.get(name, "") for name in names)
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "train", "--strategies", strategies, "--iterations", "2",
                     "--warmup", "1", "--rounds", "1", "--json", str(out), "--", *FLAGS])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    ran, refused = result["strategies"], result["refused"]
    assert code == 0, printed
    assert set(ran) | set(refused) == set(names) and "zeppelin" in ran and "static" in ran
    for name, reason in refused.items():  # only a strategy the engine cannot run
        assert name == "flexsp" and "\n" not in reason, (name, reason)
        assert reason.startswith("--zeppelin-strategy flexsp cannot run here: the attention "
                                 "engine"), reason
    static = ran["static"]["final_loss"]
    for name, entry in ran.items():
        assert entry["final_loss"] == pytest.approx(static, rel=2e-5), (name, entry, static)
        assert len(entry["steps_s"]) == 1 and entry["median_step_s"] > 0
    assert ran["hybrid-dp"]["options"] == {"max-seqlen-per-dp-cp-rank": "256"}
    # the strategies placed the documents differently
    assert len({tuple(e["sequences_local_intra_inter"]) for e in ran.values()}) >= 3
    assert "final losses agree" in printed and "step / zeppelin's" in printed


def test_bench_train_refuses_bad_input_in_one_line(capsys):
    with pytest.raises(ValueError, match="option 'cap' is not FLAG=VALUE"):
        parse_entry("hybrid-dp:cap")
    assert cli.main(["bench", "train", "--strategies", "ring"]) == 2
    assert "--strategies: unknown strategy 'ring'" in capsys.readouterr().err
    assert cli.main(["bench", "train", "--iterations", "2", "--warmup", "1", "--",
                     "--lr-warmup-iters", "2"]) == 2
    assert "--lr-warmup-iters=2 is invalid" in capsys.readouterr().err
