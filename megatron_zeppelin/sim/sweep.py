"""Sweeps: plan and simulate every strategy variant on sampled global batches.

A ``Setting`` is one model on one cluster size with one workload; a ``Variant`` is a strategy
with its routing/remapping switches. ``run_setting`` samples ``batches`` global batches (by
token budget), plans each with every variant, simulates the plans with the same simulator,
and averages. Megatron's ``BalancedCPScheduler`` is skipped (with the reason recorded) above
``max_megatron_sequences`` documents per batch: its run time grows fast with the batch.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple, Sequence, TypeVar

from megatron_zeppelin.config import ZeppelinConfig, load_setup
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.limits import refuse_untrainable
from megatron_zeppelin.planner import STRATEGIES, Strategy
from megatron_zeppelin.planner.baselines import swept_caps
from megatron_zeppelin.planner.common import CapacityError
from megatron_zeppelin.sim.simulator import SimOptions, SimResult, lower_bound, simulate
from megatron_zeppelin.sim.workloads import get_workload, read_lengths, sample_batch

DEFAULT_TOKENS_PER_GPU = 64 * 1024
MAX_MEGATRON_SEQUENCES = 20000


@dataclass(frozen=True)
class Variant:
    """A strategy as simulated: ``strategy`` is a registered planner object with its options;
    ``routing`` switches the routing layer in the planner and the simulator, ``remap`` the
    remapping layer; ``local_policy``: the simulator's LOCAL policy."""

    label: str
    strategy: Strategy
    routing: bool = False
    remap: bool = True
    description: str = ""
    local_policy: str = "engine"
    tune_cap: bool = False  # sweep max_seqlen_per_rank per batch set (``tuned_runs``)


def _variants() -> dict[str, Variant]:
    """Every registered strategy under its own name (routing on for zeppelin), plus the
    ablations and static-CP sizes the reports compare."""
    out = {name: Variant(name, cls(), routing=cls.routed, description=cls.summary)
           for name, cls in STRATEGIES.items()}
    zeppelin, static = STRATEGIES["zeppelin"](), STRATEGIES["static-cp"]
    for v in (
        Variant("zeppelin-fill", zeppelin, True, True, local_policy="fill",
                description="zeppelin on an idealised engine whose LOCAL work fills the waits "
                "for ring traffic exactly (runtime/engine.py runs whole LOCAL calls)"),
        Variant("zeppelin-no-routing", zeppelin, False, True,
                description="zeppelin with the routing layer off (static NIC affinity)"),
        Variant("zeppelin-no-remap", zeppelin, True, False,
                description="zeppelin with the remapping layer off (linear on the attention "
                "layout)"),
        Variant("zeppelin-hierarchical", STRATEGIES["zeppelin"](portfolio=False), True, True,
                description="zeppelin's hierarchical plan alone, with the remap, no portfolio "
                "(the planner before this change: the same plans bit for bit)"),
        Variant("static-cp-2node", static(cp_nodes=2),
                description="TE CP over groups of two nodes (inter-node rings, dK/dV in "
                "bf16): the paper's baseline (Fig. 12), not a peer"),
        Variant("hybrid-dp-tuned", STRATEGIES["hybrid-dp"](), tune_cap=True,
                description="hybrid DP with --max-seqlen-per-dp-cp-rank swept per batch set, "
                "the fastest kept (as its users tune it)"),
        Variant("megatron-hybrid-cp-tuned", STRATEGIES["megatron-hybrid-cp"](), tune_cap=True,
                description="Megatron hybrid CP with --max-seqlen-per-dp-cp-rank swept per "
                "batch set, the fastest kept (as its users tune it)"),
        Variant("static-cp-routed", static(cp_nodes=2), True,
                description="TE CP over two nodes with the routing layer (routing alone)"),
    ):
        out[v.label] = v
    return out


VARIANTS: dict[str, Variant] = _variants()
DEFAULT_VARIANTS = ("zeppelin", "zeppelin-no-routing", "zeppelin-no-remap", "static-cp",
                    "static-cp-best", "hybrid-dp-tuned", "megatron-hybrid-cp-tuned", "flexsp",
                    "hydraulis")


@dataclass(frozen=True)
class Setting:
    """One simulated configuration. ``tokens``: global batch tokens (0: tokens_per_gpu x
    GPUs); ``lengths``: a user's document lengths (replaces sampling from ``workload``)."""

    model: str
    cluster: str
    nodes: int
    workload: str
    tp: int = 1
    tokens: int = 0
    tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU
    batches: int = 1
    seed: int = 0
    lengths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("nodes", "tp", "batches", "tokens_per_gpu"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}={value!r} is invalid: expected an integer >= 1")
        if not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"tokens={self.tokens!r} is invalid: expected a positive number "
                             "of tokens per global batch (or 0 for tokens_per_gpu x GPUs)")
        if not self.lengths:
            get_workload(self.workload)  # raises naming the valid workloads

    def label(self) -> str:
        """``model cluster xNODES [TP=k] workload`` with config paths shortened to their names."""
        tp = f" TP={self.tp}" if self.tp > 1 else ""
        workload = Path(self.workload).name if self.lengths else self.workload
        return f"{self.model_name} {self.cluster_name} x{self.nodes}{tp} {workload}"

    @property
    def model_name(self) -> str:
        return Path(self.model).stem

    @property
    def cluster_name(self) -> str:
        return Path(self.cluster).stem


@dataclass(frozen=True)
class VariantResult:
    """Mean over the batches; ``first`` is the first batch's full result (per-rank loads);
    ``note``: the first batch's plan name (e.g. the static CP size chosen); ``candidates``:
    every batch's winning candidate (zeppelin's portfolio; empty for other strategies);
    ``batch_s``: every batch's simulated iteration (per-batch wins and losses)."""

    label: str
    iteration_s: float
    lower_bound_s: float
    plan_ms: float
    first: SimResult
    note: str = ""
    candidates: tuple[str, ...] = ()
    batch_s: tuple[float, ...] = ()  # every batch's simulated iteration, in batch order


@dataclass(frozen=True)
class SettingResult:
    setting: Setting
    gpus: int
    documents: float  # mean documents per batch
    tokens: float  # mean tokens per batch
    lower_bound_s: float
    results: tuple[VariantResult, ...]
    skipped: tuple[tuple[str, str], ...]  # (variant, reason)

    def get(self, label: str) -> VariantResult | None:
        """The result of variant ``label`` (None when it was skipped or not run)."""
        return next((r for r in self.results if r.label == label), None)

    def speedup(self, label: str, over: str) -> float | None:
        """Iteration time of ``over`` / that of ``label`` (None when either is missing)."""
        a, b = self.get(label), self.get(over)
        return b.iteration_s / a.iteration_s if a and b else None


def resolve_variants(names: Sequence[str]) -> list[Variant]:
    """Variants by label; raises naming an unknown one and the valid labels."""
    out = []
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"unknown strategy {name!r}: expected one of {list(VARIANTS)} "
                             f"(planner strategies: {list(STRATEGIES)})")
        out.append(VARIANTS[name])
    return out


def setting_cost(setting: Setting) -> CostModel:
    """The cost model of a setting (shipped names or YAML paths)."""
    setup = load_setup(setting.model, setting.cluster, setting.nodes, tp=setting.tp)
    return CostModel(setup.model, setup.cluster, setup.hardware, setting.tp)


def sample_batches(setting: Setting, cost: CostModel) -> list[list[int]]:
    """The setting's global batches: the user's lengths once, or sampled by token budget."""
    if setting.lengths:
        return [list(setting.lengths)]
    budget = setting.tokens or setting.tokens_per_gpu * cost.cluster.world_size
    rng = random.Random(setting.seed)
    return [sample_batch(setting.workload, budget, rng) for _ in range(setting.batches)]


class Run(NamedTuple):
    """One variant on one batch: the simulated result, plan time (ms), the plan's strategy and,
    where a portfolio chose it, its ``Plan.name`` (the candidate, without ``+remap`` when it
    remaps nothing)."""

    result: SimResult
    plan_ms: float
    plan_name: str
    candidate: str = ""


def plan_and_simulate(variant: Variant, lengths: list[int], cost: CostModel,
                      config: ZeppelinConfig) -> Run:
    """Plan one batch with ``variant`` and simulate the plan."""
    config = replace(config, routing=variant.routing, remap=variant.remap)
    options = SimOptions(inter_mode="routed" if variant.routing else "ring",
                         local_policy=variant.local_policy,
                         dkv_dtype="kv" if variant.strategy.te_attention else "accumulator")
    started = time.perf_counter()
    plan = variant.strategy.plan(lengths, cost, config)
    plan_ms = (time.perf_counter() - started) * 1e3
    return Run(simulate(plan, cost, options, variant.label), plan_ms, plan.strategy,
               plan.name if plan.candidate else "")


def variant_runs(variant: Variant, batches: list[list[int]], cost: CostModel,
                 config: ZeppelinConfig) -> list[Run]:
    return [plan_and_simulate(variant, lengths, cost, config) for lengths in batches]


def cap_candidates(batches: list[list[int]], ranks: int) -> list[int]:
    """--max-seqlen-per-dp-cp-rank values a user sweeps over ``batches``
    (``baselines.swept_caps`` of their longest document)."""
    return swept_caps(max(max(b) for b in batches), ranks)


def tuned_runs(variant: Variant, batches: list[list[int]], cost: CostModel,
               config: ZeppelinConfig) -> tuple[list[Run], str]:
    """The runs of ``variant`` at the cap (``max_seqlen_per_rank``) with the least mean
    simulated iteration over the batch set, and a note stating it and the sweep
    (``best_cap``'s rule)."""
    def evaluate(tuned: Variant) -> tuple[list[Run], float]:
        runs = variant_runs(tuned, batches, cost, config)
        return runs, sum(r.result.iteration_s for r in runs) / len(runs)

    return best_cap(variant, cap_candidates(batches, cost.cluster.world_size // cost.tp),
                    evaluate)


T = TypeVar("T")


def best_cap(variant: Variant, caps: Sequence[int],
             evaluate: Callable[[Variant], tuple[T, float]]) -> tuple[T, str]:
    """``variant`` with each cap of ``caps`` (largest first) as ``max_seqlen_per_rank``,
    scored by ``evaluate`` (its result and seconds: less is better): the best result and a
    note stating the cap and the sweep. The sweep stops after two caps slower than the best
    with none faster between them (caps as fast as the best, a plateau, do not count); a
    cap that cannot place the batches (``CapacityError``) is noted and passed."""
    tried: dict[int, tuple[T, float] | None] = {}
    best, worse = None, 0
    for cap in caps:
        tuned = replace(variant, strategy=replace(variant.strategy, max_seqlen_per_rank=cap))
        try:
            tried[cap] = evaluate(tuned)
        except CapacityError:
            tried[cap] = None
            continue
        if best is None or tried[cap][1] < tried[best][1]:
            best, worse = cap, 0
        elif tried[cap][1] > tried[best][1]:  # a tie (a plateau) is not slower: go on
            worse += 1
            if worse == 2:
                break
    if best is None:
        raise CapacityError(f"{variant.label}: no --max-seqlen-per-dp-cp-rank of "
                            f"{sorted(tried)} places the batches")
    swept = ", ".join(f"{cap}: {got[1]:.3g} s" if got else f"{cap}: no fit"
                      for cap, got in tried.items())
    return tried[best][0], f"cap {best} (swept {swept})"


def run_setting(setting: Setting, variants: Sequence[Variant],
                config: ZeppelinConfig = ZeppelinConfig(),
                max_megatron_sequences: int = MAX_MEGATRON_SEQUENCES,
                tick: Callable[[], None] | None = None) -> SettingResult:
    """Plan + simulate every variant on every batch of ``setting``; ``tick`` after each."""
    cost = setting_cost(setting)
    batches = sample_batches(setting, cost)
    world = cost.cluster.world_size // cost.tp
    bounds = [lower_bound(b, cost, world) for b in batches]
    results, skipped = [], []
    for variant in variants:
        longest = max(len(b) for b in batches)
        if variant.strategy.name == "megatron-hybrid-cp" and longest > max_megatron_sequences:
            skipped.append((variant.label, f"{longest} documents per batch > "
                            f"{max_megatron_sequences}: BalancedCPScheduler too slow"))
            if tick:
                tick()
            continue
        try:
            runs, note = tuned_runs(variant, batches, cost, config) if variant.tune_cap else \
                (variant_runs(variant, batches, cost, config), "")
        except CapacityError as exc:  # this strategy cannot place the batch: say so
            skipped.append((variant.label, f"cannot place the batch: {exc}"))
            continue
        finally:
            if tick:
                tick()
        results.append(VariantResult(
            variant.label, sum(r.result.iteration_s for r in runs) / len(runs),
            sum(bounds) / len(bounds), sum(r.plan_ms for r in runs) / len(runs),
            runs[0].result, note or runs[0].candidate or runs[0].plan_name,
            tuple(r.candidate for r in runs if r.candidate),
            tuple(r.result.iteration_s for r in runs)))
    return SettingResult(setting, cost.cluster.world_size, sum(map(len, batches)) / len(batches),
                         sum(map(sum, batches)) / len(batches), sum(bounds) / len(bounds),
                         tuple(results), tuple(skipped))


def settings_from_args(model: str, cluster: str, nodes: Sequence[int], workloads: Sequence[str],
                       tp: int, tokens: int, tokens_per_gpu: int, batches: int, seed: int,
                       lengths_file: str | None) -> list[Setting]:
    """The cross product of nodes x workloads (``lengths_file``: one setting per node count)."""
    for n in nodes:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"--nodes {n!r} is invalid: expected integers >= 1")
    # a bad model, cluster, --tp or --nodes is refused here, before any simulation starts
    setups = {n: load_setup(model, cluster, n, tp=tp) for n in nodes}
    if lengths_file is not None:
        lengths = tuple(read_lengths(lengths_file))
        for n in nodes:  # as ``zeppelin plan`` refuses them
            refuse_untrainable(lengths, setups[n].model, setups[n].cluster, lengths_file)
        return [Setting(model, cluster, n, f"file:{lengths_file}", tp, tokens, tokens_per_gpu,
                        1, seed, lengths) for n in nodes]
    return [Setting(model, cluster, n, w, tp, tokens, tokens_per_gpu, batches, seed)
            for n in nodes for w in workloads]
