"""The public API (``megatron_zeppelin.api``): docs/api.md's custom training loop is
``examples/custom_loop.py`` verbatim, and it trains on 4 gloo ranks, where every
rank logs the same global per-token loss. (Exactness of the same API calls against one
process: ``tests/test_megatron_zeppelin.py``, through ``megatron/loop/train.py``.)"""
from __future__ import annotations

import pathlib
import re
import runpy

import pytest

from distributed import run_world

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_loop.py"


def test_the_doc_shows_the_example_verbatim():
    doc = (ROOT / "docs" / "api.md").read_text()
    code = EXAMPLE.read_text()
    assert f"```python\n{code}```" in doc
    body = code.split("def main", 1)[1]
    assert len(body.splitlines()) <= 60  # the loop the doc promises: about 60 lines


def loop_body(rank: int, world: int, *fit) -> list[float]:
    return runpy.run_path(str(EXAMPLE))["main"](2, *fit)


@pytest.mark.distributed
def test_the_custom_loop_trains_like_the_script():
    losses = run_world(loop_body, 4, start_method="spawn", timeout_s=300)
    assert all(l == losses[0] for l in losses)  # every rank logs the same global mean
    assert len(losses[0]) == 2
    assert all(5.0 < loss < 6.0 for loss in losses[0])  # 256 tokens: ln 256 = 5.55 at init


@pytest.mark.distributed
def test_the_custom_loop_refits_the_planner_from_its_measurements(tmp_path):
    """``api.online_fit`` in the example loop: every iteration a refit (a collective), the
    planner switches on every rank, rank 0 writes the profile, which loads as a hardware
    profile fitted at the last iteration; training goes on alike on every rank."""
    from megatron_zeppelin.config import load_hardware

    out = tmp_path / "fitted.yaml"
    losses = run_world(loop_body, 4, 1, str(out), start_method="spawn", timeout_s=300)
    assert all(l == losses[0] for l in losses) and len(losses[0]) == 2
    profile = load_hardware(out)
    assert profile.source == "fitted during training from 'cpu': iteration 2"


def test_runtime_options_refuse_unknown_names_and_modes():
    from megatron_zeppelin import api

    options = api.runtime_options(512, "static", "cpu", zeppelin_cluster="cpu-2x2")
    assert (options.seq_length, options.context_parallel_mode, options.zeppelin_cluster) == \
        (512, "static", "cpu-2x2")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['zeppelin_clustr'\]"):
        api.runtime_options(512, zeppelin_clustr="cpu-2x2")
    with pytest.raises(ValueError, match="mode='ring' is invalid"):
        api.runtime_options(512, "ring")


@pytest.mark.parametrize("kwargs,match", [
    ({"device": "tpu"}, r"device='tpu' is invalid: expected one of \['cuda', 'cpu'\]"),
    ({"zeppelin_routing": "no"}, r"--zeppelin-routing='no' is invalid: expected true or false"),
    ({"zeppelin_validate_plan": "x"}, r"zeppelin.validate_plan='x' is invalid"),
    ({"zeppelin_attention_backend": "tpu"}, r"zeppelin.attention_backend='tpu' is invalid"),
    ({"zeppelin_capacity_factor": "2"}, r"--zeppelin-capacity-factor='2' is invalid"),
    ({"context_parallel_size": 4}, r"option\(s\) \['context_parallel_size'\] are invalid here: "
                                   r"the PoolLayout gives the CP size"),
    ({"pipeline_model_parallel_size": "2"}, r"option\(s\) \['pipeline_model_parallel_size'\] are "
                                            r"invalid here: the PoolLayout gives the pipeline"),
    ({"num_layers": 2}, r"option\(s\) \['num_layers'\] are invalid here: the ModelSpec gives "
                        r"the model's shape \(model.num_layers\)"),
    ({"window_attn_skip_freq": 2}, r"window_attn_skip_freq=2 without window_size: pass the "
                                   r"window"),
    ({"window_size": "abc"}, r"--window-size='abc' is invalid: expected 'L,0'"),
])
def test_runtime_options_check_values_given_from_python(kwargs, match):
    """Values no parser typed (a string for a bool, a negative timeout), a device that does
    not exist, a window pattern without a window and flags the layout or the model sets:
    refused naming them, not accepted or a deep error."""
    from megatron_zeppelin import api

    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        api.runtime_options(512, **kwargs)


def test_pool_runtime_refuses_a_model_or_layout_of_the_wrong_type():
    from megatron_zeppelin import api
    from megatron_zeppelin.parallel import PoolLayout

    layout = PoolLayout(world_size=4, tp=1, cp=4, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"model=None is invalid: expected a ModelSpec"):
        api.pool_runtime(layout, None, seq_length=512, device="cpu")
    with pytest.raises(ValueError, match=r"layout=None is invalid: expected a PoolLayout"):
        api.pool_runtime(None, None, seq_length=512, device="cpu")


def test_the_api_names_a_bad_length_or_runtime():
    from megatron_zeppelin import api

    for bad in (None, 0, "1024", True, 10.5):
        with pytest.raises(ValueError, match=r"seq_length=.* is invalid: expected an integer"):
            api.runtime_options(bad, device="cpu")
    with pytest.raises(ValueError, match=r"max_position='x' is invalid"):
        api.planned_micro_batches(iter([]), None, max_position="x")
    with pytest.raises(ValueError, match=r"runtime=None is invalid: expected the PoolRuntime"):
        api.planned_micro_batches(iter([]), None)


MODEL = dict(name="tiny", num_layers=2, hidden_size=32, num_attention_heads=4,
             num_query_groups=2, ffn_hidden_size=64, vocab_size=256)


@pytest.mark.parametrize("flags,match", [
    ({"num_layers": 7}, r"num_layers=7 is invalid here: the ModelSpec gives the model's shape "
                        r"\(num_layers=2\)"),
    ({"hidden_size": 4096}, r"hidden_size=4096 is invalid here: .* \(hidden_size=32\)"),
    ({"pipeline_model_parallel_size": 2}, r"pipeline_model_parallel_size=2 is invalid here: the "
                                          r"PoolLayout gives the pipeline stages \(layout.pp=1\)"),
    ({"pipeline_model_parallel_size": "1"}, r"pipeline_model_parallel_size='1' is invalid here"),
    ({"num_layers_per_virtual_pipeline_stage": 1}, r"num_layers_per_virtual_pipeline_stage=1 is "
                                                   r"invalid here: .* builds no model chunks"),
    ({"context_parallel_size": 2}, r"context_parallel_size=2 is invalid here: the PoolLayout "
                                   r"gives the CP size \(layout.cp=4\)"),
    ({"window_attn_skip_freq": 2}, r"window_attn_skip_freq=2 without window_size"),
    ({"window_size": "256,0", "window_attn_skip_freq": "[1,1,1]"},
     r"window_attn_skip_freq='\[1,1,1\]' is invalid: .*\(2 layers"),
    ({"window_size": "128,0", "model": {"window_size": 256}},
     r"model.window_size=256, window_layers=None is invalid with the window the attention runs "
     r"\(window_size='128,0', window_attn_skip_freq=None: a window of 128 on 2 layers\)"),
    ({"model": {"window_size": 256, "window_layers": 1}},
     r"model.window_size=256, window_layers=1 is invalid .*: none\): the planner would price"),
])
def test_pool_runtime_refuses_flags_the_layout_or_model_decide_otherwise(flags, match):
    """The layout gives the parallel sizes and the model its shape: a flag saying otherwise
    (or a window pattern that does not fit the model's layers) is refused before any process
    group exists, naming the value that holds, not silently ignored."""
    from megatron_zeppelin import api

    layout = api.PoolLayout(world_size=4, tp=1, cp=4, gpus_per_node=2)
    model = api.ModelSpec(**MODEL, **flags.pop("model", {}))
    with pytest.raises(ValueError, match=match):
        api.pool_runtime(layout, model, seq_length=512, device="cpu", **flags)


def windows_body(rank: int, world: int) -> tuple[list, str]:
    from megatron_zeppelin import api

    windows, refusal = [], ""
    for flags in ({"window_attn_skip_freq": 2}, {"window_attn_skip_freq": "[1,0]"},
                  {"window_attn_skip_freq": 2, "num_layers": 2, "pipeline_model_parallel_size": 1}):
        runtime = api.pool_runtime(api.PoolLayout(1, 1, 1, 1), api.ModelSpec(**MODEL),
                                   seq_length=512, device="cpu", window_size="256,0", **flags)
        windows.append((runtime.state.windows, runtime.cost.model.window_size,
                        runtime.cost.model.window_layers))
        try:
            api.swap_core_attention(None, runtime)
        except ValueError as exc:
            refusal = str(exc)
        runtime.close()
    return windows, refusal


@pytest.mark.distributed
def test_pool_runtime_takes_the_layer_count_of_a_window_pattern_from_the_model():
    """A window pattern needs the layer count: the ModelSpec gives it (the same value as a flag
    is accepted) and, having no window, takes the one the flags run; a runtime's spec must be
    a Megatron spec."""
    [(windows, refusal)] = run_world(windows_body, 1, timeout_s=300)
    # one of the 2 layers windowed (the engine prepares both), and the planner prices that
    assert windows == [((None, 256), 256, 1)] * 3
    assert refusal.startswith("spec=None is invalid: expected a Megatron layer ModuleSpec")


@pytest.mark.parametrize("call,match", [
    (lambda api: api.global_mean_loss([{"x": 1}]),
     r"stored\[0\]=\{'x': 1\} is invalid: expected loss_func's dict"),
    (lambda api: api.global_mean_loss(None), r"stored=None is invalid: expected the list"),
    (lambda api: api.swap_core_attention(None, None),
     r"runtime=None is invalid: expected the object pool_runtime returned"),
    (lambda api: api.layer_spec(None), r"runtime=None is invalid: expected the object"),
    (lambda api: api.loss_func(None), r"batch=None is invalid: expected the MicroBatch"),
    (lambda api: api.process_groups(None), r"layout=None is invalid: expected a PoolLayout"),
    (lambda api: api.pool_runtime_from_args(None, None, None),
     r"args=None is invalid: expected an argparse.Namespace"),
    (lambda api: api.planned_micro_batches(iter([]), None, planner=len),
     r"runtime=None is invalid: expected the PoolRuntime"),
])
def test_the_api_names_an_argument_of_the_wrong_type(call, match):
    """Every public function checks its arguments at entry: one ValueError naming the argument
    and what it expects, not a KeyError, AttributeError or None further down."""
    from megatron_zeppelin import api

    with pytest.raises(ValueError, match=match):
        call(api)


class Recording:
    """An ``argparse.Namespace`` stand-in that records the flags read from it."""

    def __init__(self, options: dict) -> None:
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str):
        self.read.add(name)
        return self._options[name]


def reads_body(rank: int, world: int) -> list[set]:
    from megatron_zeppelin import api, api_checks as checks
    from megatron_zeppelin.megatron.loop import train

    reads, model = [], api.ModelSpec(**MODEL)
    for flags in ({}, {"zeppelin_strategy": "static-cp", "zeppelin_cp_size": 1},
                  {"zeppelin_strategy": "hybrid-dp"}, {"window_size": "256,0", "bf16": True}):
        options = vars(api.runtime_options(512, device="cpu", zeppelin_cluster="cpu-2x2",
                                           **flags))
        filled = {f: getattr(model, f) for f in checks.model_flags(options)  # as
                  if options[f] is None and getattr(model, f) is not None}  # pool_runtime does
        args = Recording({**options, **filled})
        runtime = train.build_pool_runtime(args, api.PoolLayout(1, 1, 1, 1), model)
        runtime.close()
        reads.append(args.read)
    return reads


@pytest.mark.distributed
def test_the_pool_runtime_reads_only_the_flags_the_api_takes():
    """The flags ``runtime_options`` takes (and refuses the others of) are those the pool
    runtime reads: a flag read but refused could not be set from Python; one taken but never
    read would be silently ignored."""
    from megatron_zeppelin import api_checks as checks

    [reads] = run_world(reads_body, 1, timeout_s=300)
    read = set().union(*reads)
    layout = set(checks.LAYOUT_FLAGS) | {checks.VIRTUAL_STAGES}
    assert read - layout - set(checks.ARGUMENT_FLAGS) - set(checks.model_flags(read)) <= \
        checks.read_flags()
    taken = {f"zeppelin_{name}" for name in checks.RUNTIME_FLAGS} | set(checks.WINDOW_FLAGS)
    assert taken <= read


@pytest.mark.parametrize("flags,match", [
    ({"lr": 1e-3}, r"option\(s\) \['lr'\] are invalid here: the pool runtime does not read "
                   r"them \(flags of scripts/pretrain_gpt.py's training loop"),
    ({"zeppelin_planner_process": False},
     r"\['zeppelin_planner_process'\] are invalid here: .*zeppelin_planner_process: pass "
     r"planned_micro_batches\(\.\.\., planner=PlannerService\(runtime.planner\)\)"),
    ({"zeppelin_watchdog_timeout": 5.0, "zeppelin_fit_interval": 2},
     r"\['zeppelin_fit_interval', 'zeppelin_watchdog_timeout'\] are invalid here: .*"
     r"zeppelin_fit_interval: use fit = api.online_fit\(runtime, batches, interval=, "
     r"profile_out=\) in your loop; zeppelin_watchdog_timeout: wrap your loop in "
     r"api.watchdog\(timeout_s\)"),
    ({"_given_flags": set()}, r"\['_given_flags'\] are invalid here"),
    ({"zeppelin_cluster": "nope"}, r"zeppelin_cluster='nope' is invalid: unknown clusters "
                                   r"config 'nope'; shipped: \["),
    ({"zeppelin_hardware": "h999"}, r"zeppelin_hardware='h999' is invalid: unknown hardware"),
])
def test_runtime_options_refuse_flags_the_runtime_does_not_read_and_bad_files(flags, match):
    """A training-loop flag given to the API would do nothing (the caller's loop runs the
    planner, the watchdog and the fit): refused naming it, with where its job is done; a
    cluster or hardware name that does not load is refused by ``runtime_options`` itself, not
    only when ``pool_runtime`` builds the cost model."""
    from megatron_zeppelin import api

    with pytest.raises(ValueError, match=match):
        api.runtime_options(512, device="cpu", **flags)
    layout = api.PoolLayout(world_size=4, tp=1, cp=4, gpus_per_node=2)
    with pytest.raises(ValueError, match=match):
        api.pool_runtime(layout, api.ModelSpec(**MODEL), seq_length=512, device="cpu", **flags)


def fit_refusals_body(rank: int, world: int, folder: str) -> list[str]:
    from megatron_zeppelin import api

    runtime = api.pool_runtime(api.PoolLayout(1, 1, 1, 1), api.ModelSpec(**MODEL),
                               seq_length=512, device="cpu", zeppelin_cluster="cpu-2x2")
    batches = api.planned_micro_batches(iter([]), runtime, "cpu")
    other = api.planned_micro_batches(iter([]), runtime, "cpu", planner=runtime.planner.__call__)
    refusals = []
    for args, kwargs in [((None, batches), {"interval": 1}),
                         ((runtime, iter([])), {"interval": 1}),
                         ((runtime, other), {"interval": 1}),
                         ((runtime, batches), {"interval": -1}),
                         ((runtime, batches), {"interval": True}),
                         ((runtime, batches), {"interval": 0, "profile_out": "p.yaml"}),
                         ((runtime, batches), {"interval": 2, "profile_out": folder}),
                         ((runtime, batches), {"interval": 2, "profile_out": "/nonexistent/p.yaml"})]:
        try:
            api.online_fit(*args, **kwargs)
            refusals.append("accepted")
        except ValueError as exc:
            refusals.append(str(exc))
    off = api.online_fit(runtime, batches, interval=0)
    assert off.watch(batches) is batches and off.switches == []
    other.close(), batches.close(), runtime.close()
    return refusals


@pytest.mark.distributed
def test_online_fit_refuses_what_it_cannot_refit(tmp_path):
    [refusals] = run_world(fit_refusals_body, 1, str(tmp_path), timeout_s=300)
    expected = [r"runtime=None is invalid: expected the PoolRuntime",
                r"batches=<list_iterator .*> is invalid: expected what planned_micro_batches",
                r"batches is invalid here: .* another planner than runtime.planner",
                r"interval=-1 is invalid: expected an integer >= 0",
                r"interval=True is invalid",
                r"profile_out='p.yaml' is invalid: .* with interval > 0",
                rf"profile_out='{tmp_path}' is invalid: expected None or a file",
                r"profile_out='/nonexistent/p.yaml' is invalid"]
    assert len(refusals) == len(expected)
    for said, pattern in zip(refusals, expected):
        assert re.match(pattern, said), (said, pattern)
