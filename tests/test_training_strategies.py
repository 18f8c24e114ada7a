"""Every registered strategy trains through ``pretrain_gpt.py``'s loop (``--zeppelin-strategy``)
on 4 gloo ranks as 2 nodes x 2, on the same documents, and ends on static mode's loss (fp32),
measured side by side by ``zeppelin bench train --strategies``; a strategy the engine cannot
run is refused before training in one line, with the engine's reason."""
from __future__ import annotations

import json

import pytest

from conftest import load_script
from megatron_zeppelin import cli
from megatron_zeppelin.bench.train import parse_entry
from megatron_zeppelin.planner import STRATEGIES

pytestmark = pytest.mark.distributed



FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--seq-length", "512", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr-warmup-iters", "0", "--seed", "3", "--no-zeppelin-planner-process",
         "--zeppelin-validate-plan"]
# each with an option of its own, as its users set it
OPTIONS = {"static-cp": ":zeppelin-cp-size=2", "hybrid-dp": ":max-seqlen-per-dp-cp-rank=512",
           "megatron-hybrid-cp": ":max-seqlen-per-dp-cp-rank=128",
           "megatron-dynamic-cp": ":max-seqlen-per-dp-cp-rank=128"}


def test_every_strategy_trains_to_static_modes_loss(tmp_path, capsys):
    """On an ArXiv-like corpus written by scripts/make_corpora.py (Megatron's indexed format)."""
    corpora = load_script("make_corpora")
    assert corpora.main(["--output", str(tmp_path), "--corpus", "arxiv", "--tokens", "96K"]) == 0
    from megatron_zeppelin.megatron.loop.corpus import IndexedDocuments

    assert list(IndexedDocuments(str(tmp_path / "arxiv")).lengths()) == \
        corpora.corpus_lengths("arxiv", 96 * 1024, corpora.SCALE, 0)
    names = ["static", *STRATEGIES]
    strategies = ",".join(name + OPTIONS.get(name, "") for name in names)
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "train", "--strategies", strategies, "--iterations", "2",
                     "--warmup", "1", "--rounds", "1", "--json", str(out), "--", *FLAGS,
                     "--data-path", str(tmp_path / "arxiv")])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    ran, refused = result["strategies"], result["refused"]
    assert code == 0, printed
    # every strategy runs (megatron-dynamic-cp only where megatron-core has its scheduler)
    assert set(ran) | set(refused) == set(names) and "flexsp" in ran, (ran, refused)
    for name, reason in refused.items():
        assert name == "megatron-dynamic-cp" and "\n" not in reason, (name, reason)
    static = ran["static"]["final_loss"]
    for name, entry in ran.items():
        assert entry["final_loss"] == pytest.approx(static, rel=2e-5), (name, entry, static)
        assert len(entry["steps_s"]) == 1 and entry["median_step_s"] > 0
    assert ran["hybrid-dp"]["options"] == {"max-seqlen-per-dp-cp-rank": "512"}
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


def test_the_corpora_table_counts_wins_and_losses_per_peer_with_geomean_and_median():
    bench = load_script("bench_corpora")

    def run(steps: dict) -> dict:
        return {"strategies": {n: {"median_step_s": t, "tokens_per_s": 1000.0 / t,
                                   "final_loss": 5.0, "tuning": ""} for n, t in steps.items()},
                "refused": {"flexsp": "cannot run here: ..."}}

    results = {"longtail": run({"static": 4.0, "zeppelin": 1.0, "hybrid-dp": 2.0}),
               "arxiv": run({"static": 2.0, "zeppelin": 1.0, "hybrid-dp": 0.5}),
               "prolong": run({"static": 1.0, "zeppelin": 1.0, "hybrid-dp": 1.0})}
    assert bench.speedups(results) == {"hybrid-dp": {"longtail": 2.0, "arxiv": 0.5,
                                                     "prolong": 1.0}}
    rows = bench.summary(results)
    hybrid = next(r for r in rows if r.startswith("| hybrid-dp |"))
    assert hybrid == "| hybrid-dp | 2.00x | 0.50x | 1.00x | 1.00x | 1.00x | 1 / 1 |"
    baseline = next(r for r in rows if r.startswith("| static (paper's baseline) |"))
    assert baseline.endswith("| 2.00x | 2.00x | 2 / 0 |")
    table = "\n".join(bench.corpus_table("arxiv", results["arxiv"]))
    assert "| hybrid-dp | 0.500 | 2,000 | 0.50x | - | - | 5.00000 | - / - / - | as given |" \
        in table
    assert "| flexsp | not run |" in table


def test_the_corpora_table_pairs_the_same_steps_of_each_round():
    """Zeppelin's speedup step by step: each step's time over zeppelin's time of that step,
    per round, then over the rounds, with the rounds' 95% confidence interval."""
    bench = load_script("bench_corpora")
    zeppelin = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]  # 3 rounds of 2 steps: batches of unequal cost
    peer = [1.1, 2.2, 1.0, 2.0, 1.2, 2.4]      # 1.1x, 1.0x and 1.2x in the rounds
    result = {"iterations": 3, "warmup": 1, "strategies": {
        "zeppelin": {"median_step_s": 1.5, "steps_s": zeppelin, "tokens_per_s": 1.0,
                     "final_loss": 5.0, "tuning": ""},
        "hybrid-dp": {"median_step_s": 1.65, "steps_s": peer, "tokens_per_s": 1.0,
                      "final_loss": 5.0, "tuning": ""}}}
    pair = bench.paired_speedup(result, "hybrid-dp")
    assert pair.rounds == pytest.approx((1.1, 1.0, 1.2))
    assert pair.ratio == pytest.approx((1.1 * 1.0 * 1.2) ** (1 / 3))
    assert pair.low < 1.0 < 1.2 < pair.high  # 3 rounds: t(2) = 4.303 widens it
    assert bench.paired_speedup(result, "zeppelin") is None
    control = {**result["strategies"]["zeppelin"], "steps_s": [1.1, 2.0, 1.0, 2.0, 1.0, 2.0]}
    result["strategies"]["zeppelin (A/A control)"] = control
    # the control is zeppelin's noise floor in the corpus table, never a peer of the summary
    assert bench.speedups({"c": result}, bench.paired_ratio) == {"hybrid-dp": {"c": pair.ratio}}
    floor = next(r for r in bench.corpus_table("c", result)
                 if r.startswith("| zeppelin (A/A control) |"))
    assert bench.paired_speedup(result, "zeppelin (A/A control)").text() in floor
    row = next(r for r in bench.corpus_table("c", result) if r.startswith("| hybrid-dp |"))
    assert f"| {pair.text()} |" in row and "3 rounds" in row
    short = {**result, "strategies": {**result["strategies"], "hybrid-dp": {
        **result["strategies"]["hybrid-dp"], "steps_s": peer[:4]}}}
    assert bench.paired_speedup(short, "hybrid-dp") is None  # a run that stopped short


def test_paired_ratios_refuse_unequal_rounds_and_give_no_interval_for_one_round():
    from megatron_zeppelin.bench.paired import paired

    one = paired([2.0, 3.0], [1.0, 3.0], per_round=2)
    assert one.ratio == pytest.approx(2.0 ** 0.5) and one.low is None
    assert one.text() == "1.41x (1 round)"
    with pytest.raises(ValueError, match="same whole rounds of 2 steps: got 3 and 3"):
        paired([1.0] * 3, [1.0] * 3, per_round=2)
    with pytest.raises(ValueError, match="got 2 and 4"):
        paired([1.0] * 2, [1.0] * 4, per_round=2)


def test_tune_sweeps_each_peers_own_knob_and_keeps_the_fastest():
    from megatron_zeppelin.bench.train import Entry, tune

    times = {"4096": 3.0, "2048": 1.0, "1024": 2.0, "1": 5.0, "2": 4.0}

    class Runner:  # what tune reads of bench train's runner: measure(entries)
        def measure(self, entries):
            for e in entries:
                value = next(iter(e.options.values()))
                if value == "4":
                    e.refused = "--zeppelin-cp-size=4: refused"
                else:
                    e.steps_s = [times[value]]

    entries = [parse_entry(s) for s in ("zeppelin", "hybrid-dp", "static-cp",
                                        "megatron-hybrid-cp:max-seqlen-per-dp-cp-rank=512")]
    tuned = tune(entries, Runner(), 4096, 4)
    assert [e.label for e in tuned] == ["zeppelin", "hybrid-dp:max-seqlen-per-dp-cp-rank=2048",
                                        "static-cp:zeppelin-cp-size=2",
                                        "megatron-hybrid-cp:max-seqlen-per-dp-cp-rank=512"]
    assert tuned[1].tuning == ("--max-seqlen-per-dp-cp-rank 2048 (swept: 4096: 3.000 s, "
                               "2048: 1.000 s, 1024: 2.000 s)")
    assert tuned[2].tuning.endswith("(swept: 1: 5.000 s, 2: 4.000 s, 4: refused)")
    assert tuned[0] is entries[0] and tuned[3] is entries[3] and isinstance(tuned[1], Entry)


def test_bench_train_reports_each_peer_paired_with_zeppelin_step_by_step():
    from megatron_zeppelin.bench.train import Entry, report

    def entry(label: str, steps: list[float]) -> Entry:
        out = parse_entry(label)
        out.steps_s, out.tokens_per_s, out.final_loss = steps, [1.0], 5.0
        return out

    zeppelin = entry("zeppelin", [1.0, 3.0, 1.0, 3.0])
    peer = entry("hybrid-dp:max-seqlen-per-dp-cp-rank=4096", [1.2, 3.6, 0.9, 2.7])
    short = entry("static-cp", [1.0, 3.0])
    control = entry("zeppelin", [1.1, 2.7, 1.0, 3.0])
    control.control = True
    lines, agree = report([control, zeppelin, peer, short], 1e-4, per_round=2)
    assert agree
    assert lines[0].lstrip().startswith("zeppelin (A/A control): median step")
    assert ", paired 1.00x (95% CI " in lines[0]  # zeppelin, not its control, is the reference
    assert "paired" not in lines[1]
    assert ", paired 1.04x (95% CI " in lines[2] and lines[2].endswith(", 2 rounds)")
    assert "paired" not in lines[3]  # a run that stopped short is not paired


def test_bench_train_control_needs_zeppelin_among_the_strategies(capsys):
    assert cli.main(["bench", "train", "--strategies", "static,hybrid-dp", "--control"]) == 2
    err = capsys.readouterr().err
    assert "--control is invalid with --strategies static,hybrid-dp" in err
    assert len(err.strip().splitlines()) == 1
