"""The hardware profile fitted to the run (issue 19): measurements taken during training in,
a ``HardwareProfile`` the planner scores plans by out. Cost-model layer (no torch).

What is measured (``runtime/probe.py`` takes it per micro-batch; ``Measurements`` holds it):

* ``attention``: one attention kernel call: its phase (forward / backward), its query chunk
  length (a LOCAL call: its tokens' sum of squares over their sum; a ring step: s / G), its
  forward FLOPs in the cost model's convention (``2 a d c^2`` per sequence, causal), seconds
  of work and tier (``local`` / ``intra`` / ``inter``);
* ``linear``: a micro-batch's real tokens on this rank and the seconds of work of everything
  but attention and remap (forward + backward); a micro-batch that gave the rank pad tokens
  only is recorded with 0 tokens: its time is the model's fixed cost, a point of the line but
  no rate per token (taken per token, such ranks rated the GEMM 100x slow through Megatron-LM,
  whose planner had left half the pool empty);

Seconds of work: a device's own time on CUDA; on CPU the rank's own CPU seconds, since ranks
that share cores (``HardwareProfile.shared_by``) compute faster while their peers wait, so wall
time measures the moment's sharing, not the hardware. The profile's figures are per rank while
all ranks compute: work x ``shared_by``.
* ``link``: one ring exchange that was exposed (the ring waited for it, so its time is the
  transfer's): tier (``intra`` / ``inter``), bytes per layer and phase, seconds from post to
  completion;
* ``ring_host``: the engine's host work of one ring step (round time minus the kernels and the
  waits), seconds per layer and phase;
* ``ring_rounds``: per micro-batch, its ring rounds' host work plus their exchange waits
  (timed on CPU only; seconds) and the rounds' count;
* ``ping``: active link samples taken at a refit (``runtime.probe.ping_links``), as ``link``;
* ``attention_ping``: active kernel samples taken at a refit for the table's lengths that no
  call measured (``unmeasured_lengths``, ``runtime.probe.Probe.ping_attention``), as
  ``attention``: fitted with the calls;
* ``exposed``: every ring exchange's host wait (tier, seconds; zero when hidden): reported
  (``breakdown``);
* ``remap``: each remap all-to-all (bytes sent, seconds), ``REMAP_EXCHANGES`` per layer.

Fit (``summarize`` on each rank, ``combine`` across ranks, ``to_profile``): attention FLOP/s per
length of the prior's table (the prior's figure times the median measured/prior ratio of the
calls nearest that length in log; lengths with no call: times the median of those ratios;
calls shorter than the table's first length are left out: their time is the call's fixed
cost, which the table, clamped below its first length, would spread over every longer call);
the backward/forward ratio (median of backward seconds over the fitted forward time); the
linear seconds per token (the slope of seconds over tokens, so the model's fixed cost per
micro-batch is left out; else the median ratio: ``_linear_line``) -> ``gemm_tflops``, and the
line's intercept -> ``linear_fixed_us``; bandwidth and latency of each
tier (Theil-Sen line seconds = latency + bytes / bandwidth: the median of pairwise slopes,
robust to up to ~29% outliers) over the active samples and, unless the ring step's cost below
holds the exchange waits, the waited exchanges (a wait is the peer's lateness as much as the
transfer: counted once); the cost of a ring step beyond its kernels: where micro-batches
recorded ``ring_rounds``, the median over micro-batches of their mean round (host work and
waits: on shared cores a round's cost is a heavy tail of scheduler waits, which a per-round
median drops; the median over micro-batches still drops a stalled one), else the median host
work per ring step (CUDA: waits are not timed there); the remap's host work per
layer (``remap_overhead_us``): ``REMAP_EXCHANGES`` x the median all-to-all's time beyond its
bytes at the prior's in-node link where it states one (only where plans remapped: else the
prior's). Each rank's summary is a
fixed-length vector (NaN: nothing measured); ``combine`` takes the per-coefficient median over
ranks, so one stalled rank (everything slow) moves nothing when three or more ranks measured.
Rank 0 combines and broadcasts (``runtime/probe.agree``): every rank plans with the same
doubles.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from megatron_zeppelin.config_yaml import write_yaml
from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.hardware_profile import HardwareProfile
from megatron_zeppelin.twin_arithmetic import interp

LINK_TIERS = ("intra", "inter")
MAX_SAMPLES = 4096  # per kind and rank: the newest are kept (a few micro-batches of calls)
MAX_PAIRS = 64  # points a Theil-Sen fit pairs up (spread over the length range)
MIN_SAMPLES = 3  # fewer measurements of a coefficient keep the prior's value
LINE_SPREAD = 0.25  # linear fit: pairs whose token counts differ by this share of the largest
REMAP_EXCHANGES = 4  # remap all-to-alls per layer: q/k/v there and the output back, fwd + bwd


@dataclass
class Measurements:
    """One rank's measurements since the run began (bounded: the newest ``MAX_SAMPLES`` of
    each kind). Tuples as in the module doc."""

    attention: list[tuple[str, float, float, float, str]] = field(default_factory=list)
    linear: list[tuple[float, float]] = field(default_factory=list)
    link: list[tuple[str, float, float]] = field(default_factory=list)
    ring_host: list[float] = field(default_factory=list)
    exposed: list[tuple[str, float]] = field(default_factory=list)
    remap: list[tuple[float, float]] = field(default_factory=list)
    ring_rounds: list[tuple[float, int]] = field(default_factory=list)
    ping: list[tuple[str, float, float]] = field(default_factory=list)
    attention_ping: list[tuple[str, float, float, float, str]] = field(default_factory=list)

    def add(self, other: "Measurements") -> None:
        for name in KINDS:
            mine = getattr(self, name)
            mine.extend(getattr(other, name))
            del mine[:max(0, len(mine) - MAX_SAMPLES)]

    def breakdown(self) -> dict[str, float]:
        """Seconds in each part the estimate prices (sums over what is held): attention per
        tier, linear, remap, exposed communication, host work of the ring steps."""
        out = {f"attention_{tier}": sum(r[3] for r in self.attention if r[4] == tier)
               for tier in TIERS}
        out.update(linear=sum(s for _, s in self.linear), remap=sum(s for _, s in self.remap),
                   exposed=sum(s for _, s in self.exposed), ring_host=sum(self.ring_host))
        return out


KINDS = ("attention", "linear", "link", "ring_host", "exposed", "remap", "ring_rounds", "ping",
         "attention_ping")
TIERS = ("local", "intra", "inter")


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if math.isfinite(v)]
    return statistics.median(values) if values else math.nan


def robust_line(xs: Sequence[float], ys: Sequence[float], min_gap: float = 0.0,
                min_pairs: int = 1) -> tuple[float, float]:
    """Theil-Sen fit y = intercept + slope * x: (slope, intercept); NaNs when under
    ``MIN_SAMPLES`` points or fewer than ``min_pairs`` pairs of points whose x differ (by at
    least ``min_gap`` when given). Deterministic: at most ``MAX_PAIRS`` points, taken evenly
    over the points sorted by x."""
    points = sorted(zip(xs, ys))
    if len(points) > MAX_PAIRS:
        step = (len(points) - 1) / (MAX_PAIRS - 1)
        points = [points[round(i * step)] for i in range(MAX_PAIRS)]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
              for x2, y2 in points[i + 1:] if x2 > x1 and x2 - x1 >= min_gap]
    if len(points) < MIN_SAMPLES or len(slopes) < max(1, min_pairs):
        return math.nan, math.nan
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in points)


def _linear_line(samples: Sequence[tuple[float, float]], shared: float
                 ) -> tuple[float, float]:
    """``(seconds per token, fixed seconds per micro-batch)`` of the linear part from
    ``(tokens, seconds of work)`` per micro-batch (x ``shared``): the line's slope, so that the
    model's fixed cost per micro-batch (launches, the loop's host work: the same for every
    plan) is not spread over the tokens, which would over-price a plan's busiest rank by
    ``fixed x (n / typical n - 1)``, and its intercept. The slope is the median over pairs of
    micro-batches whose token counts differ by at least ``LINE_SPREAD`` of the largest (nearer
    pairs measure noise), a pad-only micro-batch at 0 tokens; with fewer than ``MIN_SAMPLES``
    such pairs, or a line with a negative fixed cost: the median seconds per token, fixed cost
    included (so 0 fixed). NaNs: nothing to rate."""
    tokens = [n for n, _ in samples]
    seconds = [s * shared for _, s in samples]
    ratios = [s / n for n, s in zip(tokens, seconds) if n > 0]
    ratio = (_median(ratios), 0.0) if len(ratios) >= MIN_SAMPLES else (math.nan, math.nan)
    slope, fixed = robust_line(tokens, seconds, LINE_SPREAD * max(tokens, default=0.0),
                               MIN_SAMPLES)
    return (slope, fixed) if slope > 0 and fixed >= 0 else ratio


def _nearest(length: float, log_lengths: Sequence[float]) -> int:
    x = math.log(length)
    return min(range(len(log_lengths)), key=lambda i: abs(log_lengths[i] - x))


def summary_size(prior: HardwareProfile) -> int:
    """Length of a summary vector for ``prior``'s length grid."""
    return len(prior.attention_tflops) + 9


def summarize(m: Measurements, prior: HardwareProfile) -> list[float]:
    """One rank's robust estimates, a vector of floats (NaN: not measured): attention FLOP/s
    at each of the prior's lengths, backward/forward ratio, linear seconds per token, then
    per link tier (intra, inter) seconds per byte and latency, host seconds per ring step
    (per layer and phase), then host seconds per remap all-to-all."""
    logs = prior.log_lengths
    by_length: list[list[float]] = [[] for _ in logs]
    shortest = prior.attention_tflops[0][0]
    shared = prior.shared_by  # work seconds -> seconds while every rank computes
    for phase, length, flops, seconds, _ in m.attention + m.attention_ping:  # measured /
        if phase == "forward" and seconds > 0 and length >= shortest:  # prior FLOP/s per call
            by_length[_nearest(length, logs)].append(
                flops / (seconds * shared) / prior.attention_flops_per_s(length))
    rates = [_median(v) * base if len(v) >= MIN_SAMPLES else math.nan
             for v, base in zip(by_length, prior.flops_per_s)]
    fitted = _attention_table(rates, prior)
    ratios = [seconds * shared * interp(math.log(length), logs, fitted) / flops
              for phase, length, flops, seconds, _ in m.attention
              if phase == "backward" and flops > 0 and length >= shortest]
    out = rates + [_median(ratios) if len(ratios) >= MIN_SAMPLES else math.nan]
    per_token, fixed = _linear_line(m.linear, shared)
    out.append(per_token)
    links = m.ping + (m.link if len(m.ring_rounds) < MIN_SAMPLES else [])
    for tier in LINK_TIERS:
        xs = [b for t, b, _ in links if t == tier]
        out.extend(robust_line(xs, [s for t, _, s in links if t == tier]))
    out.append(_ring_step_seconds(m))
    latency = (prior.intra_latency_us or 0.0) * 1e-6  # the in-node link, where stated
    per_byte = 1e-9 / prior.intra_gbyte_per_s if prior.intra_gbyte_per_s else 0.0
    beyond = [s - latency - b * per_byte for b, s in m.remap]
    out.append(_median(beyond) if len(beyond) >= MIN_SAMPLES else math.nan)
    out.append(fixed)
    return out


def unmeasured_lengths(m: Measurements, prior: HardwareProfile, longest: int) -> list[int]:
    """The lengths of the prior's attention table, up to ``longest`` (no call is longer),
    whose forward rate ``summarize`` would not fit from ``m`` (fewer than ``MIN_SAMPLES``
    calls nearest them, pings included): what ``runtime.probe.Probe.ping_attention`` times."""
    logs = prior.log_lengths
    counts = [0] * len(logs)
    for phase, length, _, seconds, _ in m.attention + m.attention_ping:
        if phase == "forward" and seconds > 0 and length >= prior.attention_tflops[0][0]:
            counts[_nearest(length, logs)] += 1
    return [n for (n, _), c in zip(prior.attention_tflops, counts)
            if c < MIN_SAMPLES and n <= longest]


def _ring_step_seconds(m: Measurements) -> float:
    """A ring step's cost beyond its kernels, per layer and phase (module doc); NaN when
    under ``MIN_SAMPLES`` measurements."""
    per_round = [total / count for total, count in m.ring_rounds if count > 0]
    if len(per_round) >= MIN_SAMPLES:
        return _median(per_round)
    return _median(m.ring_host) if len(m.ring_host) >= MIN_SAMPLES else math.nan


def combine(summaries: Sequence[Sequence[float]]) -> list[float]:
    """Per coefficient, the median over ranks of the ranks that measured it (NaN: none)."""
    return [_median(column) for column in zip(*summaries)]


def _attention_table(rates: Sequence[float], prior: HardwareProfile) -> tuple[float, ...]:
    """FLOP/s per prior length: measured where measured, else the prior scaled by the median
    measured/prior ratio (the prior unchanged when nothing was measured)."""
    base = prior.flops_per_s
    scale = _median([r / b for r, b in zip(rates, base)])
    scale = 1.0 if math.isnan(scale) else scale
    return tuple(r if math.isfinite(r) and r > 0 else b * scale for r, b in zip(rates, base))


def to_profile(coefficients: Sequence[float], prior: HardwareProfile, cost: CostModel,
               note: str = "") -> HardwareProfile:
    """The profile of combined ``coefficients`` (``summarize``'s layout); a coefficient not
    measured (NaN) or not physical (a bandwidth <= 0) keeps ``prior``'s value. ``cost``: the
    model the run trains (its linear FLOPs per token turn seconds per token into TFLOP/s)."""
    n = len(prior.attention_tflops)
    table = _attention_table(coefficients[:n], prior)
    bwd, per_token, *links, host, remap, fixed = coefficients[n:]
    changes: dict = {}
    if any(math.isfinite(c) for c in coefficients[:n]):
        changes["attention_tflops"] = tuple((length, round(f / 1e12, 9)) for (length, _), f
                                            in zip(prior.attention_tflops, table))
    if _usable(bwd):
        changes["attention_bwd_ratio"] = bwd
    if _usable(per_token):
        changes["gemm_tflops"] = FWD_BWD_LINEAR * _linear_flops(cost) / per_token / 1e12
    for tier, (per_byte, latency) in zip(LINK_TIERS, (links[:2], links[2:])):
        if _usable(per_byte):
            rate = 1.0 / per_byte  # bytes per second
            if tier == "intra":
                changes["intra_gbyte_per_s"] = rate / 1e9
            else:
                changes["inter_gbit_per_s"] = rate * 8 / 1e9
            changes[f"{tier}_latency_us"] = max(0.0, latency) * 1e6 if math.isfinite(latency) \
                else 0.0
    if math.isfinite(host):
        changes["ring_step_overhead_us"] = max(0.0, host) * 2e6  # forward + backward
    if math.isfinite(remap):
        changes["remap_overhead_us"] = max(0.0, remap) * REMAP_EXCHANGES * 1e6
    if math.isfinite(fixed) and _usable(per_token):  # the line's two ends go together
        changes["linear_fixed_us"] = max(0.0, fixed) * 1e6
    source = f"fitted during training from {prior.name!r}" + (f": {note}" if note else "")
    return dataclasses.replace(prior, source=source, **changes)


def _usable(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _linear_flops(cost: CostModel) -> float:
    """Forward FLOPs of the linear modules and LM head per token (``linear_time``'s)."""
    m = cost.model
    return cost.linear_flops_per_token() * m.num_layers + 2.0 * m.hidden_size * m.vocab_size / \
        cost.tp


def refit(measurements: Sequence[Measurements], prior: HardwareProfile, cost: CostModel
          ) -> HardwareProfile:
    """Single-process convenience: every rank's measurements -> the combined profile."""
    return to_profile(combine([summarize(m, prior) for m in measurements]), prior, cost)


def save_profile(profile: HardwareProfile, path: str, note: str = "") -> None:
    """Write ``profile`` as a hardware YAML that ``--zeppelin-hardware`` / ``--hardware`` read."""
    write_yaml(profile, path, "Fitted during training by megatron-zeppelin (fit.py)"
               + (f": {note}" if note else ""))
