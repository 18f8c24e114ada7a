"""The public API (``megatron_zeppelin.api``): docs/api.md's custom training loop is
``examples/custom_loop.py`` verbatim, and it trains on 4 gloo ranks, where every
rank logs the same global per-token loss. (Exactness of the same API calls against one
process: ``tests/test_megatron_zeppelin.py``, through ``megatron/loop/train.py``.)"""
from __future__ import annotations

import pathlib
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


def loop_body(rank: int, world: int) -> list[float]:
    return runpy.run_path(str(EXAMPLE))["main"](iterations=2)


@pytest.mark.distributed
def test_the_custom_loop_trains_like_the_script():
    losses = run_world(loop_body, 4, start_method="spawn", timeout_s=300)
    assert all(l == losses[0] for l in losses)  # every rank logs the same global mean
    assert len(losses[0]) == 2
    assert all(5.0 < loss < 6.0 for loss in losses[0])  # 256 tokens: ln 256 = 5.55 at init


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
    ({"zeppelin_planner_process": "no"}, r"zeppelin.planner_process='no' is invalid: expected "
                                         r"true or false"),
    ({"zeppelin_validate_plan": "x"}, r"zeppelin.validate_plan='x' is invalid"),
    ({"zeppelin_watchdog_timeout": -1}, r"--zeppelin-watchdog-timeout=-1 is invalid"),
    ({"zeppelin_capacity_factor": "2"}, r"--zeppelin-capacity-factor='2' is invalid"),
    ({"context_parallel_size": 4}, r"option\(s\) \['context_parallel_size'\] are invalid here: "
                                   r"the PoolLayout gives the CP size"),
])
def test_runtime_options_check_values_given_from_python(kwargs, match):
    """Values no parser typed (a string for a bool, a negative timeout), a device that does
    not exist and flags the layout sets: refused naming them, not accepted or a deep error."""
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
