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
    # each candidate's timed repeats are kept (1 here), their median the measurement
    assert [r for r, in batch["repeats"]] == batch["measured_s"]
    # the pick is the lowest estimate (ties: the earlier candidate), as the portfolio decides
    best = min(range(len(names)), key=lambda i: (batch["estimated_s"][i], i))
    assert batch["pick"] in names and names[best] == batch["pick"]
    # identical plans are measured once, under their names joined by '/'
    singles = [n for name in names for n in name.split("/")]
    assert len(singles) == len(set(singles))
    assert result["summary"]["pick_accuracy_pct"] in (0.0, 100.0)
    assert math.isclose(result["summary"]["median_regret"], batch["regret"])
    assert "pick = measured fastest in" in printed and "<- pick" in printed
    assert "Mann-Whitney" in printed
    # the pick against the peers' own plans measured in the same rounds
    assert "static-cp(cp=1)" in result["versus_peers"] and "the pick vs hybrid-dp" in printed


def _brute_p(xs, ys):
    """The two-sided rank-sum p-value by listing every split of the pooled values."""
    import itertools

    from megatron_zeppelin.bench.decisions_stats import ranks as midranks

    pooled = midranks([*xs, *ys])
    mean = len(xs) * sum(pooled) / len(pooled)
    far = abs(sum(pooled[:len(xs)]) - mean)
    splits = list(itertools.combinations(range(len(pooled)), len(xs)))
    return sum(abs(sum(pooled[i] for i in s) - mean) >= far - 1e-9 for s in splits) / len(splits)


def test_exact_mann_whitney_matches_enumeration_with_ties():
    from megatron_zeppelin.bench.decisions_stats import mann_whitney_p, smallest_p

    cases = [([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), ([1, 3, 5, 7], [2, 4, 6, 8]),
             ([0.41, 0.40, 0.40, 0.43], [0.39, 0.40, 0.42]), ([2, 2, 2], [2, 2, 2]),
             ([0.5, 0.52, 0.49, 0.51, 0.5], [0.44, 0.45, 0.5, 0.43, 0.46])]
    for xs, ys in cases:
        assert mann_whitney_p(xs, ys) == pytest.approx(_brute_p(xs, ys))
        assert mann_whitney_p(xs, ys) == pytest.approx(mann_whitney_p(ys, xs))
    assert mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert mann_whitney_p([2, 2, 2], [2, 2, 2]) == 1.0
    assert smallest_p(4, 4) == pytest.approx(2 / 70) and smallest_p(3, 3) == pytest.approx(0.1)


def test_indistinguishable_is_reported_beside_the_strict_figure():
    from megatron_zeppelin.bench.decisions import summary_line

    names = ["a", "b"]
    # pick a measured 2% slower than b, the repeats overlapping: not right, but tied
    close = decide(0, [8], names, [1.0, 2.0], [1.02, 1.0], "a",
                   repeats=[[1.0, 1.02, 1.05, 1.01], [0.99, 1.0, 1.03, 1.0]])
    # pick a slower than b in every repeat (p = 2/70 < 0.05): not tied
    slow = decide(1, [8], names, [1.0, 2.0], [1.2, 1.0], "a",
                  repeats=[[1.2, 1.21, 1.19, 1.2], [1.0, 1.01, 0.99, 1.0]])
    assert (close.right, close.tied, slow.right, slow.tied) == (False, True, False, False)
    s = summarize([close, slow])
    assert s["pick_accuracy_pct"] == 0.0 and s["pick_indistinguishable_pct"] == 50.0
    line = summary_line(s)
    assert "pick = measured fastest in 0%" in line and "Mann-Whitney" in line and "in 50%" in line
    bare = summarize([decide(2, [8], names, [1.0, 2.0], [1.1, 1.0], "a")])
    assert bare["pick_indistinguishable_pct"] is None
    assert "unavailable (no repeats stored)" in summary_line(bare)
    with pytest.raises(ValueError, match="1 candidates' repeats for 2 candidates"):
        decide(3, [8], names, [1.0, 2.0], [1.0, 1.0], "a", repeats=[[1.0]])


def test_rejudge_re_estimates_stored_micro_batches_and_refuses_other_candidates(
        tmp_path, capsys):
    from megatron_zeppelin.bench.decisions_rejudge import planner_of
    from megatron_zeppelin.bench.measure_candidates import estimated_candidates

    flags = ["--seq-length", "1024", "--micro-batch-size", "2"]
    lengths = [900, 300, 400, 200, 248]
    plans, estimates, pick = estimated_candidates(lengths, planner_of(flags))
    names = [n for n, _ in plans]
    # synthetic measurements: the estimate's order reversed, so the pick is the slowest
    measured = [1.0 / e for e in estimates]
    stored = {"flags": flags, "micro_batches": [
        {"index": 7, "lengths": lengths, "names": names, "estimated_s": [0.0] * len(names),
         "measured_s": measured, "pick": names[0], "noise": 0.1}]}
    path = tmp_path / "stored.json"
    path.write_text(json.dumps(stored))
    out = tmp_path / "rejudged.json"
    assert cli.main(["bench", "decisions", "--rejudge", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    batch, = json.loads(out.read_text())["micro_batches"]
    assert batch["estimated_s"] == pytest.approx(estimates) and batch["pick"] == pick
    assert batch["measured_s"] == measured and batch["right"] is (pick == batch["fastest"])
    assert "unavailable (no repeats stored)" in printed
    stored["micro_batches"][0]["names"] = [*names[1:], names[0]]
    path.write_text(json.dumps(stored))
    assert cli.main(["bench", "decisions", "--rejudge", str(path)]) == 2
    err = capsys.readouterr().err
    assert "micro-batch 7's candidates" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["bench", "decisions", "--rejudge", str(path), "--repeats", "3"]) == 2
    assert "--repeats=3 measures: --rejudge" in capsys.readouterr().err
    path.write_text("{}")
    assert cli.main(["bench", "decisions", "--rejudge", str(path)]) == 2
    assert "not a 'bench decisions --json' result" in capsys.readouterr().err


def test_the_pick_is_compared_with_each_peers_own_plan_on_the_same_micro_batches():
    """Speedup of the pick over each peer's plan at a fixed setting (hybrid DP at Megatron's
    default cap, Hydraulis, static CP sizes), a merged candidate counting for every name; hybrid
    DP at a cap from the batch's longest document is not a fixed peer setting."""
    from megatron_zeppelin.bench.decisions import peer_lines, versus_peers

    names = ["hierarchical", "hybrid-dp/hydraulis", "static-cp(cp=2)", "hybrid-dp(cap=900)"]
    fast, slow = [1.0, 1.01, 0.99, 1.0, 1.02], [2.0, 2.1, 1.9, 2.0, 2.05]
    first = decide(0, [100], names, [1, 2, 3, 4], [1.0, 2.0, 0.5, 3.0], "hierarchical",
                   repeats=[fast, slow, [0.5] * 5, [3.0] * 5])
    second = decide(1, [100], names, [1, 2, 3, 4], [1.0, 1.0, 2.0, 1.0], "hierarchical")
    peers = versus_peers([first, second])
    assert set(peers) == {"hybrid-dp", "hydraulis", "static-cp(cp=2)"}
    hybrid = peers["hybrid-dp"]
    assert hybrid["geomean"] == pytest.approx(2.0 ** 0.5) and hybrid["median"] == 1.5
    assert (hybrid["faster"], hybrid["faster_shown"], hybrid["slower"]) == (1, 1, 0)
    assert peers["hydraulis"] == hybrid
    static = peers["static-cp(cp=2)"]
    assert (static["faster"], static["slower"], static["slower_shown"]) == (1, 1, 1)
    assert static["geomean"] == pytest.approx(1.0)
    line = peer_lines(peers)[0]
    assert line.startswith("the pick vs hybrid-dp, the same 2 micro-batch(es)")
    assert "geomean 1.414x, median 1.500x" in line and "faster in 1 (1 shown" in line
