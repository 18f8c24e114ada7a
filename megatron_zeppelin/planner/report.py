"""Summaries of plans for people (a table) and scripts (JSON)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import PlanEstimate, estimate_plan
from megatron_zeppelin.plan import Plan


@dataclass(frozen=True)
class Stat:
    """max / mean / min of a per-rank quantity and its imbalance (max / mean)."""

    max: float
    mean: float
    min: float
    imbalance: float

    @classmethod
    def of(cls, values) -> "Stat":
        values = list(values)
        mean = sum(values) / len(values)
        return cls(max(values), mean, min(values), max(values) / mean if mean > 0 else 1.0)


@dataclass(frozen=True)
class PlanSummary:
    """What ``zeppelin plan`` prints for one strategy (times in seconds per step)."""

    strategy: str
    candidate: str
    ranks: int
    sequences: int
    tokens: int
    local: int
    intra: int
    inter: int
    waves: int
    attention_s: Stat
    linear_s: Stat
    attention_tokens: Stat
    linear_tokens: Stat
    est_step_s: float
    ring_cross_node_gb: float
    remap_cross_node_gb: float
    plan_ms: float
    dropped_sequences: int
    dropped_tokens: int
    split_sequences: int

    def to_dict(self) -> dict:
        return asdict(self)


def plan_label(plan: Plan, name: str | None = None) -> str | None:
    """What the plan says beyond the strategy ``name`` asked for: its portfolio winner or
    solver (``candidate``), else its own label where it differs (``static-cp(cp=8)``)."""
    return plan.candidate or (plan.strategy if name and plan.strategy != name else None)


def summarize(plan: Plan, cost: CostModel, routed: bool = True,
              name: str | None = None) -> PlanSummary:
    """``name``: the strategy asked for (default the plan's own label); ``plan_label`` is
    then the ``candidate``."""
    est: PlanEstimate = estimate_plan(plan, cost, routed)
    tiers = plan.tier_counts()
    return PlanSummary(
        strategy=name or plan.strategy, candidate=plan_label(plan, name) or "-",
        ranks=plan.topology.world_size,
        sequences=len(plan.seqlens),
        tokens=sum(plan.seqlens), local=tiers["local"], intra=tiers["intra"],
        inter=tiers["inter"], waves=plan.num_waves, attention_s=Stat.of(est.attention_s),
        linear_s=Stat.of(est.linear_s), attention_tokens=Stat.of(plan.attention_tokens()),
        linear_tokens=Stat.of(plan.linear_tokens()), est_step_s=est.step_s,
        ring_cross_node_gb=est.ring_cross_node_bytes / 1e9,
        remap_cross_node_gb=est.remap_cross_node_bytes / 1e9, plan_ms=plan.plan_time_s * 1e3,
        dropped_sequences=plan.overlong.dropped_sequences,
        dropped_tokens=plan.overlong.dropped_tokens,
        split_sequences=plan.overlong.split_sequences)


_ROWS = [
    ("plan (its size, portfolio winner, solver)", lambda s: s.candidate),
    ("sequences local / intra / inter", lambda s: f"{s.local} / {s.intra} / {s.inter}"),
    ("waves (barrier-separated groups)", lambda s: f"{s.waves}"),
    ("attention time per rank max/mean (s)",
     lambda s: f"{s.attention_s.max:.3f} / {s.attention_s.mean:.3f} "
               f"({s.attention_s.imbalance:.2f}x)"),
    ("linear time per rank max/mean (s)",
     lambda s: f"{s.linear_s.max:.3f} / {s.linear_s.mean:.3f} ({s.linear_s.imbalance:.2f}x)"),
    ("attention-layout tokens max/mean",
     lambda s: f"{s.attention_tokens.max:.0f} / {s.attention_tokens.mean:.0f}"),
    ("linear-layout tokens max/mean",
     lambda s: f"{s.linear_tokens.max:.0f} / {s.linear_tokens.mean:.0f}"),
    ("estimated step time (s)", lambda s: f"{s.est_step_s:.3f}"),
    ("cross-node GB ring / remap",
     lambda s: f"{s.ring_cross_node_gb:.1f} / {s.remap_cross_node_gb:.1f}"),
    ("plan time (ms)", lambda s: f"{s.plan_ms:.1f}"),
    ("overlong dropped seqs / tokens / split",
     lambda s: f"{s.dropped_sequences} / {s.dropped_tokens} / {s.split_sequences}"),
]


def format_table(summaries: list[PlanSummary]) -> str:
    """One column per strategy, one row per figure."""
    head = ["", *[s.strategy for s in summaries]]
    rows = [head] + [[name, *[fmt(s) for s in summaries]] for name, fmt in _ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
