"""scripts/make_benchmarks_report.py: settings in parallel processes give the results of one
process, the pipeline section is kept from the previous report, FlexSP's solver line."""
from __future__ import annotations

from conftest import load_script
from megatron_zeppelin.sim.sweep import Setting



def test_settings_in_two_processes_give_the_results_of_one():
    script = load_script("make_benchmarks_report")
    settings = [Setting("llama-7b", "a800-4nic", 2, w, batches=1, seed=7)
                for w in ("arxiv", "github")]
    labels = ("static-cp", "flexsp")
    one, two = script.sweep(settings, labels, "test"), script.sweep(settings, labels, "test", 2)
    for a, b in zip(one, two):
        assert a.setting == b.setting
        assert [(r.label, r.batch_s) for r in a.results] == \
            [(r.label, r.batch_s) for r in b.results]
    lines = script.flexsp_solver_lines(one)
    assert len(lines) == 1 and "2 batches" in lines[0] and "node limit ended" in lines[0]
    assert script.flexsp_solver_lines([]) == ["FlexSP planned no batch in this run."]


def test_the_pipeline_section_of_the_previous_report_is_kept(tmp_path):
    script = load_script("make_benchmarks_report")
    from make_pipeline_report import BEGIN, END

    old = tmp_path / "benchmarks.md"
    assert script.kept_sections(old) == []
    old.write_text(f"# old\n\nstale table\n\n{BEGIN}\n## Pipeline\nrows\n{END}\n\n"
                   "### Hand-written findings\n- one\n\n")
    assert script.kept_sections(old) == [BEGIN, "## Pipeline", "rows", END, "",
                                         "### Hand-written findings", "- one"]


def test_saved_sweeps_carry_the_flags_they_were_run_with(tmp_path):
    """--results FILE read back: the report's header describes the saved sweeps (--quick,
    --batches) whatever the command line says; the flags that would change them are
    refused, not ignored (tests/test_scripts_bad_input.py)."""
    import pickle

    script = load_script("make_benchmarks_report")
    saved = tmp_path / "results.pkl"
    saved.write_bytes(pickle.dumps({"quick": True, "batches": 3, "sweeps": (1, 2, 3, 4)}))
    args = script.parse_args(["--results", str(saved)])
    assert script.saved_sweeps(args) == (1, 2, 3, 4)
    assert (args.quick, args.batches) == (True, 3)
    args = script.parse_args(["--results", str(saved), "--quick", "--batches", "3"])
    assert script.saved_sweeps(args) == (1, 2, 3, 4)
