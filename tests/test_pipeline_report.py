"""scripts/make_pipeline_report.py: every peer at its best settings, the best peer per setting,
a subset run says it is one, a bad --workloads is refused with one line."""
from __future__ import annotations

import pytest

from conftest import load_script
from megatron_zeppelin.config import PipelineSpec
from megatron_zeppelin.sim.pipeline import PipelineRow, PipelineSettingResult
from megatron_zeppelin.sim.sweep import VARIANTS, Setting



def test_every_peer_runs_at_its_best_settings():
    script = load_script("make_pipeline_report")
    assert {"static-cp-best", "hybrid-dp-tuned", "megatron-hybrid-cp-tuned", "flexsp",
            "hydraulis"} <= set(script.PEERS)
    assert not {"hybrid-dp", "megatron-hybrid-cp"} & set(script.PEERS)  # untuned ones
    assert all(VARIANTS[p].tune_cap for p in script.PEERS if p.endswith("-tuned"))


def _result(steps: dict[str, float]) -> PipelineSettingResult:
    rows = tuple(PipelineRow(label, "balanced", step, 0.1) for label, step in steps.items())
    return PipelineSettingResult(Setting("llama-7b", "a800-4nic", 4, "github"),
                                 PipelineSpec(pp=2), 32, rows, ())


def test_the_best_peer_is_the_fastest_peer_run_in_that_setting():
    script = load_script("make_pipeline_report")
    result = _result({"zeppelin": 10.0, "static-cp": 14.0, "flexsp": 9.0, "hydraulis": 12.0})
    assert script.speedup(result, script.BEST, "balanced") == pytest.approx(0.9)
    assert script.speedup(result, "hydraulis", "balanced") == pytest.approx(1.2)
    assert script.speedup(result, script.BEST, "arrival") is None
    lines = script.headline([result])
    assert any(line.startswith("- zeppelin vs best peer (balanced micro-batches): geomean "
                               "0.90x") and "github PP=2/VPP=1 (0.90x)" in line
               for line in lines)


def test_a_subset_says_it_is_one_and_the_full_run_does_not():
    script = load_script("make_pipeline_report")
    assert script.subset(script.settings(False)) == ""
    part = script.subset(script.settings(False, ("github", "magi")))
    assert part.startswith("**A subset:**") and "github, magi" in part
    assert "PP=2/VPP=1, PP=4/VPP=1, PP=4/VPP=2" in part
    assert "github, arxiv at PP=2/VPP=1 only" in script.subset(script.settings(True))


@pytest.mark.parametrize("value", ["githb", "github,github", ","])
def test_a_bad_workload_list_is_refused_with_one_line(value, capsys):
    assert load_script("make_pipeline_report").main(["--workloads", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"make_pipeline_report.py: error: --workloads {value!r} is invalid: "
                   "expected distinct names among github,prolong64k,magi,wlb128k,stdlib,"
                   "arxiv,longtail,uniform-short")
