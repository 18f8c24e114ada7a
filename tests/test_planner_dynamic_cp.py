"""Megatron's dynamic-CP scheduler as a peer strategy (``planner/dynamic_cp.py``): registered
exactly when the installed megatron-core defines it, refused by name otherwise."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import make_cost
from megatron_zeppelin.planner import STRATEGIES, dynamic_cp


def test_registered_only_where_megatron_core_has_the_scheduler():
    assert (dynamic_cp.NAME in STRATEGIES) == dynamic_cp.available()


@pytest.mark.skipif(dynamic_cp.available(), reason="this megatron-core has the scheduler")
def test_missing_scheduler_is_named():
    with pytest.raises(ImportError, match=r"needs megatron-core's megatron.core.datasets."
                                          r"data_schedule.DefaultDynamicCPScheduler"):
        dynamic_cp.plan_megatron_dynamic_cp([4096, 100, 50], make_cost())


@pytest.mark.skipif(not dynamic_cp.available(), reason="no DefaultDynamicCPScheduler installed")
def test_dynamic_cp_places_every_document_in_valid_rings():
    lengths = [32768, 9000, 4000] + [300] * 60
    plan = dynamic_cp.plan_megatron_dynamic_cp(lengths, make_cost()).validate()
    assert plan.strategy == dynamic_cp.NAME and len(plan.tasks) == len(lengths)
    assert max(len(t.ring) for t in plan.tasks) > 1  # the long document is sharded


def test_availability_check_imports_no_torch():
    code = ("import sys; from megatron_zeppelin.planner import dynamic_cp; dynamic_cp.available();"
            " assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
