"""The planner process: same plans as in-process, failures raised in training with bounded
waits, the data iterator fed by it; and the layers below the runtime import no torch."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_zeppelin.planner import make_plan
from megatron_zeppelin.planner.service import PlanFunction, PlannerService, PlannerServiceError

from conftest import make_cost

LENGTHS = [[30000, 2000, 700, 90, 5], [64, 64, 12000, 48000], [9000] * 7]


def same_plan(a, b) -> bool:
    return (a.tasks, a.linear, a.sources, a.candidate, a.estimates) == \
        (b.tasks, b.linear, b.sources, b.candidate, b.estimates)


def test_plans_from_the_process_are_the_in_process_plans_in_order():
    cost = make_cost(nodes=2)
    with PlannerService(PlanFunction("zeppelin", cost, validate=True)) as service:
        tickets = [service.submit(lengths) for lengths in LENGTHS]
        plans = [service.result(t) for t in tickets]
    with pytest.raises(ProcessLookupError):  # closing waited for the process
        os.kill(service.pid, 0)
    for lengths, plan in zip(LENGTHS, plans):
        assert same_plan(plan, make_plan("zeppelin", lengths, cost))


def test_a_planner_error_names_the_micro_batch_and_the_cause():
    with PlannerService(PlanFunction("zeppelin", make_cost())) as service:
        good, bad = service.submit([100, 200]), service.submit([100, 0])
        assert service.result(good).strategy == "zeppelin"
        with pytest.raises(PlannerServiceError, match=r"micro-batch 1 \(2 documents\).*"
                           r"ValueError: sequence 1 has length 0"):
            service.result(bad)
        assert service.result(service.submit([50])).seqlens == (50,)  # it keeps serving


def test_a_dead_process_fails_at_once_naming_its_exit():
    service = PlannerService(PlanFunction("zeppelin", make_cost()))
    try:
        os.kill(service.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(PlannerServiceError, match=r"micro-batch \d+: the planner process "
                           r"\(pid \d+\) ended with exit code -9"):
            service.result(service.submit([100]))
        assert time.monotonic() - started < 10
    finally:
        service.close()


def test_waiting_is_bounded():
    with PlannerService(PlanFunction("zeppelin", make_cost()), timeout_s=0.001) as service:
        with pytest.raises(PlannerServiceError, match=r"no plan for micro-batch 0 \(1 documents\)"
                           r" within 0.001 s \(ZEPPELIN_PLANNER_TIMEOUT_S\)"):
            service.result(service.submit([100]))


def children() -> set[str]:
    return {pid for task in os.listdir("/proc/self/task")
            for pid in open(f"/proc/self/task/{task}/children").read().split()}


def test_a_planner_that_cannot_be_sent_is_refused():
    before = children()
    with pytest.raises(PlannerServiceError, match="must be picklable"):
        PlannerService(lambda lengths: None)
    assert children() <= before  # the process it started is gone


def test_the_data_iterator_takes_its_plans_from_the_process():
    import torch

    from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator

    cost = make_cost(nodes=1, gpus_per_node=2)
    docs = [[torch.arange(n) for n in lengths] for lengths in LENGTHS]
    plan_fn = PlanFunction("zeppelin", cost)
    threaded = ZeppelinDataIterator(iter(docs), plan_fn, rank=1)
    served = ZeppelinDataIterator(iter(docs), PlannerService(plan_fn), rank=1)
    try:
        for _ in range(2):
            a, b = next(threaded), next(served)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
            assert same_plan(a.plan, b.plan)
    finally:
        threaded.close()
        served.close()


def test_layers_below_the_runtime_import_no_torch():
    modules = ["megatron_zeppelin.plan", "megatron_zeppelin.plan_checks",
               "megatron_zeppelin.cost_model", "megatron_zeppelin.estimate",
               "megatron_zeppelin.fit",
               "megatron_zeppelin.config", "megatron_zeppelin.planner",
               "megatron_zeppelin.planner.service", "megatron_zeppelin.router",
               "megatron_zeppelin.sim.simulator", "megatron_zeppelin.sim.sweep",
               "megatron_zeppelin.sim.report", "megatron_zeppelin.sim.cli"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_planning_benchmark_pairs_rounds_so_drifting_load_cancels():
    from megatron_zeppelin.bench.planning import paired_ratio

    # the machine gets twice as slow in the second round; planning alongside costs 1% in each
    times = {"precomputed": [1.0, 1.0, 2.0, 2.0, 2.0], "process": [1.01, 1.01, 2.02, 2.02, 2.02]}
    assert paired_ratio(times, "process", 2) == pytest.approx(1.01)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_finite_stream_hands_out_every_micro_batch_then_stops(prefetch):
    """The last micro-batch was lost: planning ahead past the stream's end raised
    StopIteration while the current micro-batch was still to be returned."""
    import torch

    from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator

    plan_fn = PlanFunction("zeppelin", make_cost(nodes=1, gpus_per_node=2))
    stream = iter([[torch.arange(n)] for n in (5, 6, 7)])
    data = ZeppelinDataIterator(stream, plan_fn, rank=0, prefetch=prefetch)
    try:
        got = [sum(s for _, _, s in b.plan.sources) for b in data]
        assert got == [5, 6, 7]
        with pytest.raises(StopIteration):
            next(data)
    finally:
        data.close()


@pytest.mark.parametrize("batch,match", [
    ([], r"micro-batch 0 is empty: expected a non-empty list"),
    (None, r"micro-batch 0 is a NoneType"),
    ([[1, 2, 3]], r"micro-batch 0, document 0 is list: expected a non-empty 1-D integer"),
    (["2d"], r"document 0 is a 2-D torch.int64 tensor of 4 elements"),
    (["float"], r"document 0 is a 1-D torch.float32 tensor"),
    (["empty"], r"document 0 is a 1-D torch.int64 tensor of 0 elements"),
])
def test_a_bad_micro_batch_is_refused_naming_it(batch, match):
    import torch

    from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator

    named = {"2d": torch.zeros(2, 2, dtype=torch.int64), "float": torch.zeros(3),
             "empty": torch.zeros(0, dtype=torch.int64)}
    if isinstance(batch, list):
        batch = [named.get(d, d) if isinstance(d, str) else d for d in batch]
    plan_fn = PlanFunction("zeppelin", make_cost(nodes=1, gpus_per_node=2))
    data = ZeppelinDataIterator(iter([batch]), plan_fn, rank=0, prefetch=False)
    with pytest.raises(ValueError, match=match):
        next(data)
