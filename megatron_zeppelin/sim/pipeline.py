"""``zeppelin simulate --pp N [--vpp V]``: every strategy variant under pipeline parallelism,
simulated.

Each global batch of a ``Setting`` is split into micro-batches (``split_batch``: balanced for
the pipeline, or in arrival order); each micro-batch is planned by the variant on one stage
(``stage_of``: ``num_layers / pp`` layers on ``GPUs / pp`` GPUs) and simulated there
(``simulate``: its stage time); Megatron's 1F1B or interleaved schedule over those times
(``pipeline_cost.price``) gives the step. Static CP x PP, zeppelin x PP and every other
variant go through the same path, so only their plans differ. A tuned variant
(``Variant.tune_cap``) gets its cap by ``sweep.best_cap``'s rule, scored by the pipeline's
mean step over the setting's batches, per micro-batch order; the caps tried are
``cap_candidates`` over one stage's ranks, and the strategy's default (per micro-batch) is
kept when it is faster.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from megatron_zeppelin.config import PipelineSpec, ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.planner.common import CapacityError
from megatron_zeppelin.planner.pipeline_cost import (PipelineResult, microbatch_cost, price,
                                                     split_batch, stage_of)
from megatron_zeppelin.sim.report import _fmt, _table, geomean
from megatron_zeppelin.sim.sweep import (MAX_MEGATRON_SEQUENCES, Setting, Variant, best_cap,
                                         cap_candidates, plan_and_simulate, sample_batches,
                                         setting_cost)


def simulate_pipeline(lengths: Sequence[int], variant: Variant, cost: CostModel,
                      config: ZeppelinConfig, spec: PipelineSpec) -> PipelineResult:
    """One global batch of ``variant`` under ``spec``, each micro-batch simulated on a stage."""
    stage = stage_of(cost, spec)
    groups = split_batch(lengths, stage)
    per_token = stage.cost.linear_time(1)
    costs = []
    for group in groups:
        r = plan_and_simulate(variant, [lengths[i] for i in group], stage.cost, config).result
        costs.append(microbatch_cost(stage, r.iteration_s - r.grad_sync_s, r.linear_s,
                                     r.attention_s, r.remap_s,
                                     round(max(r.rank_linear_s) / per_token)))
    return price(stage, groups, costs)


@dataclass(frozen=True)
class PipelineRow:
    """One variant with one micro-batch order: means over the setting's batches; ``note``:
    the cap a tuned variant chose and its sweep (empty otherwise)."""

    label: str
    order: str
    step_s: float
    bubble: float
    note: str = ""


@dataclass(frozen=True)
class PipelineSettingResult:
    setting: Setting
    spec: PipelineSpec
    gpus: int
    rows: tuple[PipelineRow, ...]
    skipped: tuple[tuple[str, str], ...]

    def get(self, label: str, order: str) -> PipelineRow | None:
        return next((r for r in self.rows if r.label == label and r.order == order), None)

    def speedup(self, label: str, over: str, order: str, over_order: str | None = None
                ) -> float | None:
        """``over``'s step (in ``over_order``, default ``order``) / ``label``'s."""
        a, b = self.get(label, order), self.get(over, over_order or order)
        return b.step_s / a.step_s if a and b else None


def run_pipeline_setting(setting: Setting, variants: Sequence[Variant], config: ZeppelinConfig,
                         spec: PipelineSpec, orders: Sequence[str] = ("balanced",),
                         tick: Callable[[], None] | None = None) -> PipelineSettingResult:
    """Every variant x micro-batch order on every batch of ``setting``; ``tick`` after each."""
    cost = setting_cost(setting)
    stage_of(cost, spec)  # refuses a bad --pp / --vpp before any planning
    batches = sample_batches(setting, cost)
    rows, skipped = [], []
    for variant in variants:
        try:
            _check_variant(variant, batches, spec)
        except _Skip as exc:
            skipped.append((variant.label, str(exc)))
            continue
        for order in orders:
            try:
                rows.append(_row(variant, order, batches, cost, config, spec))
            except CapacityError as exc:
                skipped.append((variant.label, f"{order}: cannot place a micro-batch: {exc}"))
            finally:
                if tick:
                    tick()
    return PipelineSettingResult(setting, spec, cost.cluster.world_size, tuple(rows),
                                 tuple(skipped))


class _Skip(Exception):
    """A variant not run under the pipeline, with the reason."""


def _check_variant(variant: Variant, batches: list[list[int]], spec: PipelineSpec) -> None:
    """Raise ``_Skip`` for a variant the pipeline sweep does not run, with the reason."""
    micro = max(len(b) for b in batches) / spec.num_microbatches
    if variant.strategy.name == "megatron-hybrid-cp" and micro > MAX_MEGATRON_SEQUENCES:
        raise _Skip(f"about {micro:.0f} documents per micro-batch > {MAX_MEGATRON_SEQUENCES}: "
                    "BalancedCPScheduler too slow")


def _row(variant: Variant, order: str, batches: list[list[int]], cost: CostModel,
         config: ZeppelinConfig, spec: PipelineSpec) -> PipelineRow:
    """``variant`` in ``order`` over ``batches``; a tuned variant at its best cap."""
    mine = replace(spec, microbatch_order=order)

    def evaluate(chosen: Variant) -> tuple[list[PipelineResult], float]:
        results = [simulate_pipeline(b, chosen, cost, config, mine) for b in batches]
        return results, statistics.fmean(r.step_s for r in results)

    results, note = _tuned(variant, batches, stage_of(cost, spec).ranks, evaluate) \
        if variant.tune_cap else (evaluate(variant)[0], "")
    return PipelineRow(variant.label, order, statistics.fmean(r.step_s for r in results),
                       statistics.fmean(r.bubble for r in results), note)


def _tuned(variant: Variant, batches: list[list[int]], ranks: int,
           evaluate: Callable[[Variant], tuple[list[PipelineResult], float]]
           ) -> tuple[list[PipelineResult], str]:
    """The faster of ``best_cap``'s sweep (one cap for every micro-batch) and the strategy's
    default, derived per micro-batch (at least its mean tokens per rank): one fixed cap must
    hold the fullest micro-batch, so under PP the default can beat every cap swept."""
    try:
        default, default_s = evaluate(variant)
    except CapacityError:
        default, default_s = None, float("inf")
    try:
        swept, note = best_cap(variant, cap_candidates(batches, ranks), evaluate)
    except CapacityError as exc:
        if default is None:
            raise
        return default, f"default cap per micro-batch ({exc})"
    if default_s < statistics.fmean(r.step_s for r in swept):
        return default, f"default cap per micro-batch: {default_s:.3g} s, faster than {note}"
    return swept, note


def format_pipeline_setting(result: PipelineSettingResult, baseline: str,
                            markdown: bool = False) -> str:
    """One row per variant and order: step, bubble, speedup over ``baseline`` (same order),
    what balancing gains over arrival order, and the cap a tuned variant chose."""
    s, spec = result.setting, result.spec
    head = (f"{s.label()} PP={spec.pp}" + (f" VPP={spec.vpp}" if spec.vpp > 1 else "") +
            f": {result.gpus} GPUs, {spec.num_microbatches} micro-batches, mean of "
            f"{s.batches} batches (simulated)")
    rows = [["strategy", "micro-batches", "step s", "bubble", f"vs {baseline}",
             "balanced vs arrival", "note"]]
    for r in result.rows:
        gain = result.speedup(r.label, r.label, "balanced", "arrival") \
            if r.order == "balanced" else None
        rows.append([r.label, r.order, f"{r.step_s:.3f}", f"{r.bubble:.1%}",
                     _fmt(result.speedup(r.label, baseline, r.order)), _fmt(gain),
                     r.note or "-"])
    for label, reason in result.skipped:
        rows.append([label, "skipped", "-", "-", "-", "-", reason])
    if markdown:
        return f"**{head}**\n\n{_table(rows, True)}"
    return head + "\n" + _table(rows, False)


def format_pipeline_summary(results: Sequence[PipelineSettingResult], baseline: str,
                            label: str = "zeppelin", markdown: bool = False) -> str:
    """Geomean and median over settings of ``label``'s speedup over ``baseline`` (balanced
    and arrival order), the settings where it loses, and the gain of balancing."""
    lines = []
    for order in ("balanced", "arrival"):
        values = [v for r in results if (v := r.speedup(label, baseline, order)) is not None]
        if values:
            losses = [r.setting.label() + f" PP={r.spec.pp}" for r in results
                      if (v := r.speedup(label, baseline, order)) is not None and v < 1.0]
            lines.append(f"{label} vs {baseline} x PP ({order} micro-batches): geomean "
                         f"{geomean(values):.2f}x, median {statistics.median(values):.2f}x over "
                         f"{len(values)} settings; slower in: {', '.join(losses) or 'none'}")
    for who in dict.fromkeys((label, baseline)):  # once when they are the same
        gains = [v for r in results if (v := r.speedup(who, who, "balanced", "arrival"))]
        if gains:
            lines.append(f"{who}: balanced over arrival-order micro-batches: geomean "
                         f"{geomean(gains):.2f}x, median {statistics.median(gains):.2f}x")
    return "\n".join(("- " + line) if markdown else line for line in lines)
