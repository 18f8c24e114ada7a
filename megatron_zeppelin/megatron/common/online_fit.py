"""The hardware profile fitted during training (``--zeppelin-fit-interval N``; issue 19).

Every micro-batch is measured by the engine's ``runtime.probe.Probe`` (``watch`` adds each
micro-batch's linear span). Every N iterations each rank adds active link samples
(``probe.ping_links``: a link no plan uses is measured too) and kernel samples at the
attention lengths no call measured yet (``Probe.ping_attention``, up to ``--seq-length``:
a length no plan uses is measured too) and summarizes its measurements
(``fit.summarize``), rank 0 combines all ranks' summaries and broadcasts the coefficients
(``probe.agree``: one profile on every rank), and every rank switches to a ``PlanFunction`` on
the new profile from the same micro-batch index (``switch``: our loop's data iterator plans from
the one after the micro-batch already planned ahead, ``ZeppelinDataIterator.replan``; the
Megatron-LM glue from the next micro-batch ``get_batch`` reads). The log line's step estimate
uses the profile in force. ``--zeppelin-profile-out`` gets the profile after every refit
(rank 0).

Both training loops use it: ours (``loop/train.py``) and Megatron-LM's through the patch
(``lm/glue.py``: ``train_step`` calls ``step`` after the optimizer step; evaluation is not
measured).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch.distributed as dist

from megatron_zeppelin import fit
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.planner.service import PlanFunction
from megatron_zeppelin.runtime.probe import Probe, agree, ping_links


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """What the fit is told: refit every ``interval`` iterations (> 0), write the profile to
    ``profile_out`` (None: kept in memory), measure attention up to ``seq_length`` tokens;
    ``profile_flag`` names the setting in a failed write's message."""

    interval: int
    profile_out: str | None
    seq_length: int
    profile_flag: str = "--zeppelin-profile-out"

    @classmethod
    def from_args(cls, args) -> "FitSettings":
        """From the training flags (``--zeppelin-fit-interval``, ``--zeppelin-profile-out``,
        ``--seq-length``)."""
        return cls(args.zeppelin_fit_interval, args.zeppelin_profile_out, args.seq_length)


class OnlineFit:
    """Measure, refit and switch (module doc). ``state``: the pool's attention state (its
    engines get the probe); ``planner``: the pool's ``PlanFunction``; ``switch(planner)``
    plans with the refitted ``PlanFunction`` from a micro-batch index every rank shares and
    returns that index."""

    def __init__(self, settings: FitSettings, pool, state, planner: PlanFunction,
                 switch: Callable[[PlanFunction], int], device: str) -> None:
        self.settings, self.planner, self.switch, self.pool = settings, planner, switch, pool
        self.probe = Probe(device)
        state.probe = self.probe
        self.measured = fit.Measurements()
        self.window = fit.Measurements()  # since the last refit: the breakdown printed
        self.cost: CostModel = planner.cost
        self.switches: list[tuple[int, int]] = []  # (iteration fitted at, micro-batch index)
        self._span = None

    def watch(self, batches: Iterator) -> Iterator:
        """``batches`` with each micro-batch's span timed (``begin``)."""
        for batch in batches:
            self.begin(batch.packed_seq_params.num_tokens)
            yield batch

    def begin(self, tokens: int) -> None:
        """A micro-batch of ``tokens`` (this rank's real tokens, pads not counted) starts: the
        last one's span ends. Its linear time is the span less the engine's; the span of the
        last micro-batch of an iteration ends at ``finish`` (before the optimizer step). A
        micro-batch the plan gave this rank no token of (pad only) records 0 tokens: its time
        is the model's fixed cost per micro-batch (``fit._linear_line``), not a rate."""
        self.finish()
        self._span = (self.probe.start(), tokens)

    def finish(self) -> None:
        """End the last micro-batch's span (after the forward-backward pass)."""
        if self._span is not None:
            started, tokens = self._span
            self.probe.stop(started, ("linear", tokens))
            self._span = None

    def step(self, iteration: int) -> None:
        """After an iteration: collect, and every ``--zeppelin-fit-interval`` refit and
        switch (a collective over all ranks, called by every rank at the same iteration)."""
        self.finish()
        taken = self.probe.take()
        self.measured.add(taken)
        self.window.add(taken)
        if iteration % self.settings.interval:
            return
        parts, micro = self.window.breakdown(), max(1, len(self.window.linear))
        self.window = fit.Measurements()
        per_node = self.cost.cluster.topology(self.cost.tp).gpus_per_node  # pool ranks
        self.measured.ping.extend(ping_links(self.pool.group, per_node))
        prior = self.cost.hardware
        self.measured.attention_ping.extend(self.probe.ping_attention(
            fit.unmeasured_lengths(self.measured, prior, self.settings.seq_length)))
        coefficients = agree(fit.summarize(self.measured, prior), dist.group.WORLD)
        profile = fit.to_profile(coefficients, prior, self.cost,
                                 f"iteration {iteration}")
        self.cost = CostModel(self.cost.model, self.cost.cluster, profile, self.cost.tp)
        index = self.switch(dataclasses.replace(self.planner, cost=self.cost))
        self.switches.append((iteration, index))
        if dist.get_rank() == 0:
            measured = ", ".join(f"{k} {1e3 * v / micro:.1f}" for k, v in parts.items())
            print(f"hardware profile refitted at iteration {iteration}: plans from micro-batch "
                  f"{index} on use it ({describe(profile)}); rank 0 measured per micro-batch "
                  f"(ms): {measured}", flush=True)
            if self.settings.profile_out:
                save(profile, self.settings.profile_out, iteration, self.settings.profile_flag)


def save(profile, path: str, iteration: int, flag: str = "--zeppelin-profile-out") -> None:
    """``fit.save_profile`` to ``path`` (``flag``: the setting that gave it); a file system
    that refuses the write (the path was checked before training: full, gone read-only) ends
    the run with one line naming the setting (``ConfigError``)."""
    try:
        fit.save_profile(profile, path, f"iteration {iteration}")
    except OSError as exc:
        raise ConfigError(f"{flag}={path!r}: cannot write the profile "
                          f"fitted at iteration {iteration} ({exc.strerror or exc})") from None


def describe(profile) -> str:
    """The fitted figures in one phrase."""
    peak = max(t for _, t in profile.attention_tflops)
    links = "".join(f", {name} {value:.3g}" for name, value in (
        ("intra GB/s", profile.intra_gbyte_per_s), ("inter Gbit/s", profile.inter_gbit_per_s))
        if value is not None)
    return (f"attention peak {peak:.3g} TFLOP/s, bwd/fwd {profile.attention_bwd_ratio:.2f}, "
            f"GEMM {profile.gemm_tflops:.3g} TFLOP/s + {profile.linear_fixed_us / 1e3:.3g} ms "
            f"per micro-batch{links}, ring step {profile.ring_step_overhead_us:.1f} us")
