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
    assert "| hybrid-dp | 0.500 | 2,000 | 0.50x | - | 5.00000 | - / - / - | as given |" in table
    assert "| flexsp | not run |" in table


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
