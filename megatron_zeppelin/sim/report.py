"""Tables (plain text and Markdown) and PNG plots of simulated sweeps.

Speedups are iteration time of the baseline / iteration time of the variant, from the means
over the sampled batches; the gap is iteration time / the lower bound (perfectly balanced
compute, no exposed communication).
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Sequence

from megatron_zeppelin.sim.simulator import SimResult
from megatron_zeppelin.sim.sweep import SettingResult, VariantResult

BASELINE = "static-cp"


def _fmt(value: float | None, unit: str = "x", digits: int = 2) -> str:
    """A number with its unit, or ``-`` when missing."""
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _table(rows: list[list[str]], markdown: bool) -> str:
    """Aligned plain-text columns, or a Markdown pipe table."""
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |",
                 "|" + "|".join("---" for _ in rows[0]) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def describe_setting(result: SettingResult) -> str:
    """One line: the setting, its size, its batches and the lower bound (seconds)."""
    s = result.setting
    ranks = result.gpus // s.tp
    return (f"{s.label()}: {result.gpus} GPUs ({ranks} ranks), {result.documents:.0f} documents, "
            f"{result.tokens / 2**20:.2f}M tokens per batch (mean of {s.batches}), "
            f"lower bound {result.lower_bound_s:.3f} s")


def format_setting(result: SettingResult, baseline: str = BASELINE,
                   markdown: bool = False) -> str:
    """One row per variant: iteration time, speedup over ``baseline``, gap, breakdown."""
    rows = [["strategy", "iteration s", f"vs {baseline}", "gap to bound", "ring exposed s",
             "remap s", "plan ms", "plan"]]
    base = result.get(baseline)
    for r in result.results:
        speedup = base.iteration_s / r.iteration_s if base else None
        rows.append([r.label, f"{r.iteration_s:.3f}", _fmt(speedup), _fmt(r.iteration_s /
                     r.lower_bound_s), f"{r.first.ring_exposed_s:.3f}", f"{r.first.remap_s:.3f}",
                     f"{r.plan_ms:.0f}", r.note])
    for label, reason in result.skipped:
        rows.append([label, "skipped", "-", "-", "-", "-", "-", reason])
    if markdown:
        return f"**{describe_setting(result)}**\n\n{_table(rows, markdown)}"
    return describe_setting(result) + "\n" + _table(rows, markdown)


def format_summary(results: Sequence[SettingResult], baseline: str = BASELINE,
                   others: Sequence[str] = ("megatron-hybrid-cp-tuned", "hybrid-dp-tuned"),
                   markdown: bool = False) -> str:
    """One row per setting: zeppelin's time, its speedup over the baseline and others, gap."""
    rows = [["setting", "GPUs", "zeppelin s", f"vs {baseline}",
             *[f"vs {o}" for o in others], "gap to bound"]]
    for res in results:
        zep = res.get("zeppelin")
        rows.append([res.setting.label(), str(res.gpus), _fmt(zep.iteration_s if zep else None,
                     "", 3), _fmt(res.speedup("zeppelin", baseline)),
                     *[_fmt(res.speedup("zeppelin", o)) for o in others],
                     _fmt(zep.iteration_s / zep.lower_bound_s if zep else None)])
    return _table(rows, markdown)


def speedups(results: Sequence[SettingResult], over: str, label: str = "zeppelin"
             ) -> list[float]:
    """``label``'s speedup over ``over`` in every setting where both ran."""
    return [v for r in results if (v := r.speedup(label, over)) is not None]


def geomean_speedup(results: Sequence[SettingResult], over: str, label: str = "zeppelin"
                    ) -> float | None:
    """Geometric mean over settings of ``label``'s speedup over ``over`` (None if none)."""
    return geomean(speedups(results, over, label))


def median_speedup(results: Sequence[SettingResult], over: str, label: str = "zeppelin"
                   ) -> float | None:
    """Median over settings of ``label``'s speedup over ``over`` (None if none)."""
    values = speedups(results, over, label)
    return statistics.median(values) if values else None


def batch_speedups(results: Sequence[SettingResult], over: str, label: str = "zeppelin"
                   ) -> list[float]:
    """Per batch (every batch of every setting where both ran): ``over``'s simulated iteration
    / ``label``'s (above 1: ``label`` is faster on that batch)."""
    out = []
    for res in results:
        mine, other = res.get(label), res.get(over)
        if mine and other:
            out += [b / a for a, b in zip(mine.batch_s, other.batch_s)]
    return out


def win_loss(results: Sequence[SettingResult], over: str, label: str = "zeppelin",
             tie: float = 0.01) -> tuple[int, int, int]:
    """(wins, ties, losses) of ``label`` against ``over`` over every batch: a batch within
    ``tie`` (1%) either way is a tie."""
    values = batch_speedups(results, over, label)
    wins = sum(v > 1 + tie for v in values)
    losses = sum(v < 1 / (1 + tie) for v in values)
    return wins, len(values) - wins - losses, losses


def format_win_loss(results: Sequence[SettingResult], label: str = "zeppelin",
                    markdown: bool = False) -> str:
    """Per peer, over every batch of every setting (the batches are the seeds' samples):
    ``label``'s wins / ties / losses (1% tie band), geomean and median of its per-batch
    speedup, and the worst and best batch."""
    peers = list(dict.fromkeys(r.label for res in results for r in res.results
                               if r.label != label))
    rows = [["vs", "batches", "wins / ties / losses", "geomean", "median", "worst", "best"]]
    for peer in peers:
        values = batch_speedups(results, peer, label)
        if not values:
            continue
        wins, ties, losses = win_loss(results, peer, label)
        rows.append([peer, str(len(values)), f"{wins} / {ties} / {losses}",
                     _fmt(geomean(values)), _fmt(statistics.median(values)),
                     _fmt(min(values)), _fmt(max(values))])
    return _table(rows, markdown)


def describe_profiles(results: Sequence[SettingResult]) -> str:
    """One line per cluster: the simulator profile that judged it and what it leaves
    unmeasured."""
    from megatron_zeppelin.sim.profile import profile_of
    from megatron_zeppelin.sim.sweep import setting_cost

    lines, seen = [], set()
    for res in results:
        cost = setting_cost(res.setting)
        if cost.cluster.name in seen:
            continue
        seen.add(cost.cluster.name)
        profile = profile_of(cost)
        lines.append(f"simulator profile for {cost.cluster.name}: {profile.source}" +
                     (f"; unmeasured (0): {', '.join(profile.unmeasured)}"
                      if profile.unmeasured else ""))
    return "\n".join(lines)


def geomean_gap(results: Sequence[SettingResult], label: str = "zeppelin") -> float | None:
    """Geometric mean over settings of ``label``'s iteration time / the lower bound."""
    return geomean([r.get(label).iteration_s / r.lower_bound_s for r in results
                    if r.get(label)])


def geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def best_of(result: SettingResult, labels: Sequence[str]) -> VariantResult | None:
    """The fastest of ``labels`` in a setting (None if none ran)."""
    mine = [r for r in result.results if r.label in labels]
    return min(mine, key=lambda r: r.iteration_s) if mine else None


def speedup_over_best(result: SettingResult, label: str, peers: Sequence[str]) -> float | None:
    """The best peer's iteration time / ``label``'s (above 1: ``label`` is faster)."""
    best, mine = best_of(result, peers), result.get(label)
    return best.iteration_s / mine.iteration_s if best and mine else None


def fastest_table(results: Sequence[SettingResult], labels: Sequence[str], label: str,
                  peers: Sequence[str]) -> str:
    """Per setting: the fastest strategy of ``labels``, by how much over the runner-up, and
    ``label`` against the best of ``peers``."""
    rows = [["setting", "fastest", "over the runner-up", "runner-up",
             f"{label} vs best peer", "best peer"]]
    for res in results:
        mine = sorted((r for r in res.results if r.label in labels),
                      key=lambda r: r.iteration_s)
        if len(mine) < 2:
            continue
        best = best_of(res, peers)
        rows.append([res.setting.label(), mine[0].label,
                     _fmt(mine[1].iteration_s / mine[0].iteration_s), mine[1].label,
                     _fmt(speedup_over_best(res, label, peers)), best.label if best else "-"])
    return _table(rows, markdown=True)


def candidate_counts(results: Sequence[SettingResult], label: str = "zeppelin"
                     ) -> dict[str, int]:
    """How often each portfolio plan (by ``Plan.name``) won, over every batch of every
    setting."""
    counts: dict[str, int] = {}
    for res in results:
        mine = res.get(label)
        for candidate in (mine.candidates if mine else ()):
            counts[candidate] = counts.get(candidate, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def _pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedups(results: Sequence[SettingResult], path: str | Path,
                  baseline: str = BASELINE, title: str = "") -> Path:
    """Grouped bars: speedup of every variant over ``baseline``, one panel per workload,
    one group per cluster size. Returns the PNG path."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r.setting.workload for r in results))
    labels = [v.label for v in results[0].results if v.label != baseline]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in results if r.setting.workload == workload]
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            values = [r.speedup(label, baseline) or 0.0 for r in mine]
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(mine))]
            ax.bar(xs, values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(mine)), [f"{r.gpus} GPUs" for r in mine])
        ax.set_title(workload)
        ax.set_ylabel(f"speedup over {baseline}")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center right", fontsize=8)
    first = results[0].setting
    tp = f", TP={first.tp}" if first.tp > 1 else ""
    fig.suptitle(title or f"{first.model_name} on {first.cluster_name}{tp}")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return _save(fig, plt, path)


def plot_rank_loads(result: SettingResult, path: str | Path,
                    labels: Sequence[str] | None = None) -> Path:
    """Per-rank load of the first batch, one panel per variant: linear compute, attention
    compute, ring waits and the (pool-wide) remap + exposed gradient sync stacked; the line is
    the simulated iteration time (the rest up to it is idle: barriers, waiting for peers)."""
    plt = _pyplot()
    chosen: list[VariantResult] = [r for r in result.results if labels is None or
                                   r.label in labels]
    cols = min(3, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.2 * rows), squeeze=False)
    for ax, r in zip([a for row in axes for a in row], chosen):
        sim = r.first
        ranks = range(len(sim.rank_linear_s))
        att_bottom = list(sim.rank_linear_s)
        wait_bottom = [a + b for a, b in zip(sim.rank_linear_s, sim.rank_attention_s)]
        comm_bottom = [a + b for a, b in zip(wait_bottom, sim.rank_wait_s)]
        ax.bar(ranks, sim.rank_linear_s, 1.0, label="linear", color="tab:blue")
        ax.bar(ranks, sim.rank_attention_s, 1.0, bottom=att_bottom, label="attention",
               color="tab:orange")
        ax.bar(ranks, sim.rank_wait_s, 1.0, bottom=wait_bottom, label="ring wait",
               color="tab:red")
        ax.bar(ranks, [sim.remap_s + sim.grad_sync_s] * len(ranks), 1.0, bottom=comm_bottom,
               label="remap + grad sync", color="tab:gray")
        ax.axhline(sim.iteration_s, color="black", linewidth=0.8, label="iteration")
        ax.set_title(f"{r.label}: {sim.iteration_s:.2f} s", fontsize=9)
        ax.set_xlabel("rank")
        ax.set_ylabel("seconds")
    for ax in [a for row in axes for a in row][len(chosen):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"per-rank load, one batch: {result.setting.label()}", fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_timelines(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """One batch as ranks x time, one panel per strategy side by side (shared time axis): each
    rank's linear modules, attention compute, and communication it waits for (ring traffic
    not hidden, the remap, the exposed gradient all-reduce); the line is the iteration."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 5.5), squeeze=False,
                             sharex=True)
    for ax, sim in zip(axes[0], results):
        ranks = range(len(sim.rank_linear_s))
        comm = [w + sim.remap_s + sim.grad_sync_s for w in sim.rank_wait_s]
        attention_start = list(sim.rank_linear_s)
        comm_start = [a + b for a, b in zip(sim.rank_linear_s, sim.rank_attention_s)]
        height = 1.0 if len(ranks) > 64 else 0.8
        ax.barh(ranks, sim.rank_linear_s, height, color="tab:blue", label="linear")
        ax.barh(ranks, sim.rank_attention_s, height, left=attention_start, color="tab:orange",
                label="attention")
        ax.barh(ranks, comm, height, left=comm_start, color="tab:red",
                label="exposed communication")
        ax.axvline(sim.iteration_s, color="black", linewidth=0.8)
        ax.set_title(f"{sim.strategy}\n{sim.iteration_s:.2f} s "
                     f"({sim.iteration_s / sim.lower_bound_s:.2f}x the bound)", fontsize=9)
        ax.set_xlabel("seconds")
        ax.invert_yaxis()
    axes[0][0].set_ylabel("rank")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title or "one batch, ranks x time (simulated)", fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (creating the folder) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
