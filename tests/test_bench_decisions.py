"""``zeppelin bench decisions``: the pick-accuracy / regret / rank-correlation arithmetic on
synthetic measurements, and the plumbing (4 gloo ranks measuring every portfolio candidate of a
micro-batch as a training step) on a tiny model. No timed assertions."""
from __future__ import annotations

import json
import math

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench.decisions import decide, ranks, spearman, summarize


def test_ranks_share_ties_and_spearman_is_the_pearson_of_ranks():
    assert ranks([3.0, 1.0, 2.0, 1.0]) == [4.0, 1.5, 3.0, 1.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # d = (0, 0, 1, -1): 1 - 6 * 2 / (4 * 15) = 0.8 (no ties)
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)
    assert spearman([1, 1, 1], [1, 2, 3]) is None and spearman([1], [2]) is None
    with pytest.raises(ValueError, match="3 estimates but 2 measurements"):
        spearman([1, 2, 3], [1, 2])


def test_pick_accuracy_and_regret_on_a_synthetic_case():
    names = ["a", "b", "c"]
    # the estimate ranks a < b < c, measurement b < a < c: pick a, fastest b, regret 2/1 - 1
    wrong = decide(0, [8, 4], names, [1.0, 2.0, 3.0], [2.0, 1.0, 4.0], "a")
    assert (wrong.fastest, wrong.right) == ("b", False)
    assert wrong.regret == pytest.approx(1.0)
    assert wrong.spearman == pytest.approx(0.5)
    right = decide(1, [8], names, [1.0, 2.0, 3.0], [1.0, 1.5, 3.0], "a")
    assert right.right and right.regret == 0.0 and right.spearman == pytest.approx(1.0)
    near = decide(2, [8], names, [1.0, 2.0, 3.0], [1.04, 1.0, 3.0], "a", noise=0.2)
    assert not near.right and near.regret == pytest.approx(0.04) and near.noise == 0.2
    assert summarize([near], tolerance=0.05)["pick_within_tolerance_pct"] == 100.0
    assert summarize([near], tolerance=0.03)["pick_within_tolerance_pct"] == 0.0
    s = summarize([wrong, right, right, right])
    assert s["pick_accuracy_pct"] == pytest.approx(75.0)
    assert s["pick_within_tolerance_pct"] == pytest.approx(75.0)
    assert s["median_regret"] == 0.0 and s["max_regret"] == pytest.approx(1.0)
    assert s["geomean_regret"] == pytest.approx(2 ** 0.25 - 1)
    assert s["median_spearman"] == pytest.approx(1.0)
    assert s["mean_spearman"] == pytest.approx((0.5 + 3) / 4)
    with pytest.raises(ValueError, match="the pick 'd' is not among"):
        decide(2, [8], names, [1, 2, 3], [1, 2, 3], "d")
    with pytest.raises(ValueError, match="no micro-batch"):
        summarize([])


def test_bench_decisions_refuses_bad_input_in_one_line(capsys):
    assert cli.main(["bench", "decisions", "--batches", "0"]) == 2
    assert "--batches=0 is invalid" in capsys.readouterr().err
    assert cli.main(["bench", "decisions", "--tolerance", "1.5"]) == 2
    assert "--tolerance=1.5 is invalid" in capsys.readouterr().err
    assert cli.main(["bench", "decisions", "--", "--lr-warmup-iters", "-1"]) == 2
    assert "--lr-warmup-iters" in capsys.readouterr().err


@pytest.mark.distributed
def test_every_candidate_of_a_micro_batch_is_measured(tmp_path, capsys):
    out = tmp_path / "decisions.json"
    flags = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64",
             "--seq-length", "512", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--seed", "3", "--no-zeppelin-planner-process"]
    code = cli.main(["bench", "decisions", "--batches", "1", "--stride", "2", "--repeats", "1",
                     "--warmup", "0", "--json", str(out), "--", *flags])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    batch, = result["micro_batches"]
    assert batch["index"] == 1  # the 2nd micro-batch of the stream
    assert sum(batch["lengths"]) <= 2 * 512
    names = batch["names"]
    assert len(names) >= 3 and batch["pick"] in names and "hierarchical" in names
    assert all(t > 0 for t in batch["measured_s"] + batch["estimated_s"])
    # the pick is the lowest estimate (ties: the earlier candidate), as the portfolio decides
    best = min(range(len(names)), key=lambda i: (batch["estimated_s"][i], i))
    assert batch["pick"] in names and names[best] == batch["pick"]
    # identical plans are measured once, under their names joined by '/'
    singles = [n for name in names for n in name.split("/")]
    assert len(singles) == len(set(singles))
    assert result["summary"]["pick_accuracy_pct"] in (0.0, 100.0)
    assert math.isclose(result["summary"]["median_regret"], batch["regret"])
    assert "pick = measured fastest in" in printed and "<- pick" in printed
