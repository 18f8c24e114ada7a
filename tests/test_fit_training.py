"""The online profile fit in training (gloo): ranks agree on one set of coefficients (rank 0's
combination of everyone's, a stalled rank outvoted), a run measures, refits, switches every
rank at the same micro-batch and writes a profile the planner reads; bad flags are refused."""
from __future__ import annotations

import dataclasses
import math

import pytest

from distributed import run_world
from megatron_zeppelin import fit
from megatron_zeppelin.config import ConfigError, load_hardware
from megatron_zeppelin.config_yaml import write_yaml
from megatron_zeppelin.megatron.loop import args as train_args

pytestmark = pytest.mark.distributed

SUMMARIES = [[1.0, 2.0, math.nan, 4.0], [1.1, math.nan, 3.0, 4.1],
             [9.0, 20.0, 30.0, 40.0], [0.9, 2.2, 3.2, 3.9]]  # rank 2 stalled: 10x slow


def _agree(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from megatron_zeppelin.runtime.probe import agree

    return agree(SUMMARIES[rank], dist.group.WORLD)


def test_ranks_agree_on_rank_0s_combination_and_a_stalled_rank_is_outvoted():
    results = run_world(_agree, 4)
    assert all(r == results[0] for r in results)  # the same doubles on every rank
    assert results[0] == fit.combine(SUMMARIES)
    assert results[0][0] == pytest.approx(1.05) and results[0][2] == pytest.approx(3.2)


FLAGS = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--vocab-size", "256", "--seq-length", "512", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "4", "--mock-data",
         "--zeppelin-overlong", "split", "--zeppelin-cluster", "cpu-2x2", "--seed", "5",
         "--log-interval", "1", "--context-parallel-mode", "zeppelin",
         "--context-parallel-size", "4", "--zeppelin-gpus-per-node", "2"]


def _train(rank: int, world: int, out: str, process: bool):
    from megatron_zeppelin.megatron.common import online_fit
    from megatron_zeppelin.megatron.loop import preflight, train

    seen = []
    step = online_fit.OnlineFit.step

    def recording(self, iteration):
        step(self, iteration)
        seen.append((iteration, self.cost.hardware, list(self.switches)))

    online_fit.OnlineFit.step = recording
    argv = FLAGS + ["--zeppelin-fit-interval", "2", "--zeppelin-profile-out", out,
                    "--zeppelin-hardware", out + ".prior.yaml"]
    if not process:
        argv.append("--no-zeppelin-planner-process")
    args = train_args.parse_args(argv)
    layout = train_args.validate_args(args, world, None)
    ready = preflight.check(args)
    train.setup_megatron(args)
    logs = train.train(args, layout, ready)
    return seen, logs


@pytest.mark.parametrize("process", [True, False])
def test_a_run_fits_switches_every_rank_alike_and_writes_the_profile(tmp_path, process):
    out = str(tmp_path / "fitted.yaml")
    # the prior: the shipped CPU profile without host work per ring step or remap and with
    # the 1024^3 GEMM rate (what calibrate measures), so that the plans ring and remap and
    # every coefficient is measured (and a device per rank: shared cores make all-local
    # plans the cheaper ones)
    prior = dataclasses.replace(load_hardware("cpu"), gemm_tflops=0.08,
                                ring_step_overhead_us=0.0, remap_overhead_us=0.0, shared_by=1.0)
    write_yaml(prior, out + ".prior.yaml", "test prior")
    results = run_world(_train, 4, out, process, start_method="spawn", timeout_s=400)
    seen = [r[0] for r in results]
    assert all(s == seen[0] for s in seen)  # same profiles, same switch points, every rank
    assert [(i, sw) for i, _, sw in seen[0]] == [(1, []), (2, [(2, 5)]), (3, [(2, 5)]),
                                                 (4, [(2, 5), (4, 9)])]
    fitted = seen[0][-1][1]
    assert fitted.source.startswith("fitted during training") and fitted.kernel == "cpu"
    assert fitted.ring_step_overhead_us > 0  # the engine's host work was measured
    assert fitted.attention_tflops != prior.attention_tflops
    assert load_hardware(out) == fitted  # the file holds what the ranks planned with
    logs = results[0][1]
    assert len(logs) == 4 and all(log.estimated_s > 0 for log in logs)
    assert "(est. " in logs[-1].line(4)


@pytest.mark.parametrize("extra,match", [
    (["--zeppelin-fit-interval", "-1"], r"--zeppelin-fit-interval=-1 is invalid"),
    (["--zeppelin-profile-out", "p.yaml"], r"--zeppelin-profile-out='p.yaml' is invalid: "
                                           r"expected given only with"),
    (["--zeppelin-fit-interval", "1", "--zeppelin-profile-out", "/nonexistent/p.yaml"],
     r"--zeppelin-profile-out='/nonexistent/p.yaml' is invalid: expected a file in an "
     r"existing"),
])
def test_bad_fit_flags_are_refused_naming_the_flag(extra, match):
    with pytest.raises(ConfigError, match=match):
        train_args.validate_args(train_args.parse_args(FLAGS + extra), 4, None)


def spin(seconds: float) -> None:
    """Compute (this thread's CPU) for ``seconds``."""
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_probe_splits_a_micro_batch_into_what_the_estimate_prices():
    import time

    from megatron_zeppelin.runtime.probe import Probe

    probe = Probe("cpu")
    probe.flops_per_square = 2.0 * 4 * 16  # heads x head_dim of the calls
    micro = probe.start()
    engine = probe.start()
    round_s, busy = time.perf_counter(), probe.busy_s
    call = probe.start()
    spin(0.1)
    time.sleep(0.1)  # descheduled (a peer holds the shared core): wall time, not work
    probe.attention(call, "forward", [30.0, 10.0], "intra")
    probe.link("intra", 4096.0, time.perf_counter() - 0.01, 0.005)
    probe.ring_round(round_s, busy)
    probe.stop(engine, ("engine",))
    remap = probe.start()
    probe.stop(remap, ("remap", 1024.0))
    spin(0.01)
    probe.stop(micro, ("linear", 40))
    got = probe.take()
    (phase, length, flops, seconds, tier), = got.attention
    assert (phase, length, tier) == ("forward", 25.0, "intra")  # (900 + 100) / 40
    assert flops == 128.0 * 1000 and 0.1 <= seconds < 0.15  # the call's work, not its wall
    assert got.link[0][:2] == ("intra", 4096.0) and got.exposed == [("intra", 0.005)]
    assert 0.0 <= got.ring_host[0] < seconds  # the kernel and the wait are not host work
    (total, rounds), = got.ring_rounds  # the micro-batch's round: host work + the wait
    assert rounds == 1 and total == pytest.approx(got.ring_host[0] + 0.005)
    (tokens, linear), = got.linear
    assert tokens == 40 and 0.01 <= linear < 0.08  # the engine (>= 0.1 s) left out
    assert got.remap[0][0] == 1024.0 and probe.take().attention == []


def test_the_probe_counts_a_sliding_windows_work_as_the_estimate_prices_it():
    """With the engine's calls under a window, a call's FLOPs are the pairs the window keeps
    (``cost_model.window_work`` of each whole sequence, spread over a ring's steps), and its
    length stays the chunks' (where the estimate looks its rate up)."""
    from megatron_zeppelin.cost_model import window_work
    from megatron_zeppelin.runtime.probe import Probe

    probe = Probe("cpu")
    probe.flops_per_square, probe.window = 2.0 * 4 * 16, 64
    probe.attention(probe.start(), "forward", [1000.0, 50.0], "local")
    probe.attention(probe.start(), "backward", [250.0], "intra", [1000.0])
    local, ring = probe.take().attention
    assert local[:3] == ("forward", (1000.0 ** 2 + 50.0 ** 2) / 1050.0,
                         128.0 * (1000.0 ** 2 * window_work(1000.0, 64, 1.0) + 50.0 ** 2))
    assert ring[:3] == ("backward", 250.0, 128.0 * 250.0 ** 2 * window_work(1000.0, 64, 1.0))
    assert window_work(1000.0, 64, 1.0) == pytest.approx((2 * 1000 * 65 - 64 * 65) / 1e6)
    assert window_work(65.0, 64, 1.0) == 1.0 and window_work(1000.0, 64, 0.0) == 1.0


class FakeEvent:
    """``torch.cuda.Event`` for the probe's CUDA path on CPU: recorded at a clock the test
    sets; done once the test says so."""

    clock, done_until = 0.0, 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self, stream=None) -> None:
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at <= FakeEvent.done_until

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_the_probe_on_cuda_reads_spans_a_micro_batch_later_in_order(monkeypatch):
    """On CUDA the spans are events read when done (no host wait), in recording order: each
    micro-batch's linear record subtracts its own engine spans and carries its own ring
    rounds (timed on the host when they ran), however late its events are read."""
    import time

    import torch

    from megatron_zeppelin.runtime.probe import Probe

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "done_until", 0.0)
    probe = Probe("cuda")
    for micro, (engine_s, linear_s, rounds) in enumerate(((2.0, 5.0, 3), (1.0, 4.0, 1))):
        FakeEvent.clock = 10.0 * micro
        span = probe.start()
        engine = probe.start()
        for _ in range(rounds):
            probe.ring_round(time.perf_counter(), probe.busy_s)
        FakeEvent.clock += engine_s
        probe.stop(engine, ("engine",))
        FakeEvent.clock += linear_s - engine_s
        probe.stop(span, ("linear", 100 + micro))
    FakeEvent.done_until = 6.0  # the device finished micro-batch 0 only
    first = probe.take()
    assert [tokens for tokens, _ in first.linear] == [100]
    assert first.linear[0][1] == pytest.approx(3.0)  # 5 s less its engine's 2 s
    assert [count for _, count in first.ring_rounds] == [3]
    FakeEvent.done_until = 100.0
    second = probe.take()
    assert [tokens for tokens, _ in second.linear] == [101]
    assert second.linear[0][1] == pytest.approx(3.0)  # 4 s less its own engine's 1 s
    assert [count for _, count in second.ring_rounds] == [1]


def test_the_probe_pings_the_engines_kernel_at_lengths_no_call_measured():
    import torch

    from megatron_zeppelin.runtime import kernels
    from megatron_zeppelin.runtime.probe import PING_REPEATS, Probe

    probe = Probe("cpu")
    assert probe.ping_attention([64]) == []  # no engine call yet: shapes unknown
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 8)
    probe.flops_per_square = 2.0 * 4 * 16
    probe.calls_like(kernels.select(None, q), q, k, v, 0.25)
    got = probe.ping_attention([64, 256])
    assert [s[:3] for s in got] == [("forward", 64.0, 128.0 * 64 * 64)] * PING_REPEATS + \
        [("forward", 256.0, 128.0 * 256 * 256)] * PING_REPEATS
    assert all(s[3] > 0 and s[4] == "local" for s in got)


def probed_forward_backward(rank: int, world: int) -> list:
    """One rank's probe records of one forward + backward of a plan that leaves every
    sequence local (the engine's one fused call over the whole buffer)."""
    import torch
    import torch.distributed as dist

    from engine_cases import plan_of
    from megatron_zeppelin.runtime.engine import AttentionEngine
    from megatron_zeppelin.runtime.probe import Probe

    plan = plan_of("static-cp", 1, 2, [300, 200, 100, 60], cp_size=1)
    engine = AttentionEngine(plan, rank, dist.group.WORLD, timeout_s=30)
    engine.probe = Probe("cpu")
    n = engine.tokens
    q, k, v = (torch.randn(n, heads, 16, requires_grad=True) for heads in (4, 2, 2))
    engine.forward(q, k, v).sum().backward()
    engine.close()
    lengths = sorted(plan.seqlens[t.seq] for t in plan.tasks if t.ring == (rank,))
    return [lengths, [r[:3] + (r[4],) for r in engine.probe.take().attention]]


def test_a_rank_whose_sequences_are_all_local_has_its_attention_measured():
    """Before, the engine's one fused call over the whole buffer was not timed: its attention
    went into the linear remainder and the fit never saw a local call."""
    from distributed import run_world

    for lengths, records in run_world(probed_forward_backward, 2):
        length = sum(s * s for s in lengths) / sum(lengths)
        squares = 2.0 * 4 * 16 * sum(s * s for s in lengths)
        assert records == [("forward", length, squares, "local"),
                           ("backward", length, squares, "local")], (lengths, records)


def test_a_pad_only_micro_batch_prices_the_fixed_cost_not_the_tokens():
    """A micro-batch the plan gave this rank no token of (one pad token) costs the model's
    fixed time: ``OnlineFit`` records the real tokens (0 there), and the fit takes the line
    through the micro-batches: per token its slope, the pad-only ones its intercept (taken
    per token, through Megatron-LM, empty ranks rated the GEMM 100x slow)."""
    from types import SimpleNamespace

    from megatron_zeppelin.megatron.common.online_fit import FitSettings, OnlineFit

    state = SimpleNamespace(probe=None)
    online = OnlineFit(FitSettings(1, None, 64), None, state, SimpleNamespace(cost=None),
                       lambda planner: 0, "cpu")
    assert state.probe is online.probe  # the engines time their calls into it
    batches = [SimpleNamespace(packed_seq_params=SimpleNamespace(num_tokens=n))
               for n in (0, 40, 0, 40, 0, 40)]
    for batch in online.watch(batches):
        spin(0.01 + 0.02 * (batch.packed_seq_params.num_tokens > 0))
    online.finish()
    measured = online.probe.take()
    assert [n for n, _ in measured.linear] == [0, 40] * 3
    prior = load_hardware("cpu")
    coefficients = fit.summarize(measured, prior)
    per_token, fixed = coefficients[len(prior.attention_tflops) + 1], coefficients[-1]
    assert per_token == pytest.approx(0.02 * prior.shared_by / 40, rel=0.25)
    assert fixed == pytest.approx(0.01 * prior.shared_by, rel=0.25)


def test_a_profile_that_cannot_be_written_mid_run_ends_it_in_one_line_naming_the_flag(
        tmp_path):
    """The folder checked before training may be replaced (or fill) by the refit: the write's
    OSError becomes one line naming --zeppelin-profile-out (``fatal.run``: exit status 2)."""
    from megatron_zeppelin.megatron.common import online_fit

    profile = load_hardware("cpu")
    online_fit.save(profile, str(tmp_path / "p.yaml"), 4)
    assert load_hardware(str(tmp_path / "p.yaml")) == profile
    (tmp_path / "gone").write_text("a file where the folder was")
    with pytest.raises(ConfigError, match=r"^--zeppelin-profile-out='.*gone/p.yaml': cannot "
                                          r"write the profile fitted at iteration 8 \("):
        online_fit.save(profile, str(tmp_path / "gone" / "p.yaml"), 8)
    with pytest.raises(ConfigError, match=r"^online_fit's profile_out='.*gone/p.yaml': cannot"):
        online_fit.save(profile, str(tmp_path / "gone" / "p.yaml"), 8, "online_fit's profile_out")
