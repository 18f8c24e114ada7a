"""Shared fixtures: cost models on shipped configs, and small topologies for planner tests."""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

from megatron_zeppelin.config import load_setup
from megatron_zeppelin.cost_model import CostModel

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """``scripts/NAME.py`` as a module (the scripts are run as files, not a package), loaded
    once and registered under its name (its multiprocessing workers are pickled by name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_cost(model: str = "llama-7b", cluster: str = "h200-8nic", nodes: int = 2,
              gpus_per_node: int | None = None, tp: int = 1) -> CostModel:
    """A cost model on a shipped config, optionally with a different node size."""
    setup = load_setup(model, cluster, nodes=nodes)
    spec = setup.cluster
    if gpus_per_node is not None:
        spec = spec.with_topology(nodes, gpus_per_node)
    return CostModel(setup.model, spec, setup.hardware, tp)


@pytest.fixture
def cost_7b() -> CostModel:
    return make_cost()


@pytest.fixture
def one_intra_op_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waits when the CPU is oversubscribed."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["python", "cpp"])
def planner_backend(request, monkeypatch) -> str:
    """Run the test once per planner backend (``planner/native.py``); both must give the same
    plans, and the C++ twin must be built (``pip install -e .``)."""
    monkeypatch.setenv("ZEPPELIN_PLANNER_BACKEND", request.param)
    return request.param
