"""Cluster simulator: one ``Plan`` -> the time of one training iteration, the same model for
every strategy. Round-level and analytic (no packets): on this 2-core machine a 1024-GPU
zeppelin or static-CP plan (64M tokens) simulates in ~0.2-0.3 s; a plan with thousands of
cross-node rings (static CP over 128 ranks) in ~2 s.

What it models (times in seconds, bytes per GPU; ``network.py`` holds the links):

* Linear modules: per rank, ``CostModel.linear_time`` of its linear-layout tokens (forward 1/3,
  backward 2/3). With the remapping layer the linear layout is ``Plan.linear``; without it the
  linear modules run on the attention layout of each wave.
* Attention, per layer, forward then backward: every ring group of a rank is a fused varlen
  call per ring step. A step of a G-rank ring computes 1/G^2 of each sequence's causal work at
  the hardware profile's FLOP/s for the chunk length s/G (+ one kernel launch); the backward
  costs ``attention_bwd_ratio`` x the forward. The rounds of the attention engine
  (``runtime/engine.py``: INTER, INTRA, LOCAL queues, every ring's step-r exchange in flight
  while the rank computes step r of every ring, then LOCAL calls while it waits) are
  simulated in ``rounds.py``, with NIC sharing between concurrent cross-node hops (``ring``
  mode: static GPU->NIC affinity) or the pool-wide global steps of ``direct``/``routed`` mode
  (timed by the router when it imports, else by ``network.py``'s analytic model).
* Remap: per layer, forward (q, k, v there and the output back) and backward (the reverse),
  each one all-to-all of ``qkvo_bytes`` per moved token, on the critical path.
* Ulysses plans (FlexSP: ``Plan.attention_kind == "ulysses"``): all-to-alls around full-length
  attention over 1/G of the heads, not overlapped, groups sharing the NICs (``ulysses.py``).
* Waves (Megatron hybrid CP groups) run back to back with a barrier between them.
* Gradient all-reduce of the parameters over the pool (hierarchical ring). Assumption: it
  overlaps the backward of the last wave (Megatron ``--overlap-grad-reduce``) and only the part
  longer than that backward is exposed; ``overlap_grad_reduce=False`` exposes all of it.
* Pipeline parallelism is priced on top, per micro-batch and stage (``sim/pipeline.py``).
* Not modelled: tensor-parallel collectives, NVLink contention between
  the routing layer's dispatch/combine legs and intra-node rings, host-side overheads of the
  engine (Python per round), memory limits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.estimate import grad_allreduce_seconds
from megatron_zeppelin.sim.network import STEP_TIME_MODELS, GpuMap, remap_time
from megatron_zeppelin.sim.ulysses import ulysses_pass_times
from megatron_zeppelin.sim.rounds import (INTER_MODES, LOCAL_POLICIES, Links, PassSpec,
                                          RingCosts, simulate_pass)


DKV_DTYPES = ("accumulator", "kv")


@dataclass(frozen=True)
class SimOptions:
    """inter_mode: how inter-node ring hops travel, as the engine's ``inter_mode``: ``ring``
    (P2P through the static NICs), ``direct`` (global steps, static NICs) or ``routed``
    (global steps through the routing layer). overlap_grad_reduce: the gradient all-reduce
    overlaps the last backward (see the module doc). router: ``auto`` (the router when
    importable) or ``analytic`` (network.py's model). local_policy: ``engine`` (as
    ``runtime/engine.py``: LOCAL calls start only while a round's exchanges are in flight,
    the rest after the last round), ``share`` (the earlier engine: a fixed LOCAL share per
    round) or ``fill`` (LOCAL work fills the waits exactly: an idealised engine).
    dkv_dtype: what dK/dV travel the rings in: ``accumulator`` (the zeppelin engine's fp32
    accumulators) or ``kv`` (the KV dtype, as Transformer Engine's CP sends them: static CP and
    Megatron's hybrid/dynamic CP, ``Strategy.te_attention``)."""

    inter_mode: str = "ring"
    overlap_grad_reduce: bool = True
    router: str = "auto"
    local_policy: str = "engine"
    dkv_dtype: str = "accumulator"

    def __post_init__(self) -> None:
        if self.local_policy not in LOCAL_POLICIES:
            raise ValueError(f"local_policy={self.local_policy!r} is invalid: expected one of "
                             f"{list(LOCAL_POLICIES)}")
        if self.inter_mode not in INTER_MODES:
            raise ValueError(f"inter_mode={self.inter_mode!r} is invalid: expected one of "
                             f"{list(INTER_MODES)}")
        if self.dkv_dtype not in DKV_DTYPES:
            raise ValueError(f"dkv_dtype={self.dkv_dtype!r} is invalid: expected one of "
                             f"{list(DKV_DTYPES)}")
        if self.router not in STEP_TIME_MODELS:
            raise ValueError(f"router={self.router!r} is invalid: expected one of "
                             f"{list(STEP_TIME_MODELS)}")


@dataclass(frozen=True)
class SimResult:
    """Simulated iteration of one plan (seconds). ``linear_s + attention_s + remap_s +
    grad_sync_s == iteration_s`` along the critical path; ``ring_exposed_s`` is the part of
    ``attention_s`` spent waiting for ring traffic. Per-rank tuples cover all waves and layers:
    linear compute, attention compute, and waits for ring traffic inside attention phases."""

    strategy: str
    iteration_s: float
    lower_bound_s: float
    linear_s: float
    attention_s: float
    ring_exposed_s: float
    remap_s: float
    grad_sync_s: float
    waves: int
    rank_linear_s: tuple[float, ...]
    rank_attention_s: tuple[float, ...]
    rank_wait_s: tuple[float, ...]

    @property
    def gap(self) -> float:
        """Iteration time over the lower bound (>= 1 up to the bound's assumptions)."""
        return self.iteration_s / self.lower_bound_s


class _Phase(NamedTuple):
    """Per rank: end of the attention phase and the compute inside it (one layer, one pass)."""

    end: np.ndarray
    compute: np.ndarray


def attention_flops_per_s(cost: CostModel, chunk: np.ndarray) -> np.ndarray:
    """Achieved attention FLOP/s per query-chunk length (the profile's log interpolation)."""
    table = cost.hardware.attention_tflops
    return np.interp(np.log(np.maximum(chunk, 1.0)), np.log([n for n, _ in table]),
                     [t * 1e12 for _, t in table])


class Work(NamedTuple):
    """Per wave: the ring groups' per-step forward costs (one layer); per rank its LOCAL queue
    as (s^2, forward seconds) per sequence in queue order; attention tokens per rank."""

    rings: list[list[RingCosts]]
    local: list[list[list[tuple[float, float]]]]
    tokens: np.ndarray  # [waves, ranks]


def build_work(plan: Plan, cost: CostModel) -> Work:
    """The per-wave work of ``plan`` (see ``Work``)."""
    groups, topo = plan.ring_groups, plan.topology
    lengths, sizes, owner = [], [], []
    for index, group in enumerate(groups):
        for seq in group.seqs:
            lengths.append(plan.seqlens[seq])
            sizes.append(len(group.ring))
            owner.append(index)
    s = np.asarray(lengths, dtype=np.float64)
    g = np.asarray(sizes, dtype=np.float64)
    seconds = 2.0 * cost.heads * cost.model.head_dim * s * s / (g * g) \
        / attention_flops_per_s(cost, s / g)
    step_s = np.bincount(owner, seconds, len(groups))
    chunk_tokens = np.bincount(owner, s / g, len(groups))
    launch, kv_per_token = cost.hardware.kernel_overhead_us * 1e-6, cost.kv_bytes(1)
    rings: list[list[RingCosts]] = [[] for _ in range(plan.num_waves)]
    local = [[[] for _ in range(topo.world_size)] for _ in range(plan.num_waves)]
    tokens = np.zeros((plan.num_waves, topo.world_size))
    first = 0
    for index, group in enumerate(groups):
        count = len(group.seqs)
        tokens[group.wave, list(group.ring)] += chunk_tokens[index]
        if len(group.ring) == 1:
            local[group.wave][group.ring[0]].extend(
                zip((s[first:first + count] ** 2).tolist(), seconds[first:first + count].tolist()))
        else:
            members = np.asarray(group.ring, dtype=np.int64)
            nodes = members // topo.gpus_per_node
            rings[group.wave].append(RingCosts(
                index, members, group.tier, float(step_s[index]) + launch,
                float(chunk_tokens[index]) * kv_per_token, nodes != np.roll(nodes, -1)))
        first += count
    return Work(rings, local, tokens)


def attention_phase(plan: Plan, rings: list[RingCosts], local, cost: CostModel,
                    spec: PassSpec, options: SimOptions) -> _Phase:
    """Per rank: end time and compute of one layer's attention pass of one wave."""
    links = Links(GpuMap(cost.cluster, cost.tp), options.inter_mode, options.router,
                  options.local_policy)
    end, compute = simulate_pass(rings, local, plan.topology.world_size, spec, links)
    return _Phase(end, compute)


def lower_bound(seqlens: tuple[int, ...] | list[int], cost: CostModel, world: int) -> float:
    """Perfectly balanced compute, no exposed communication: (sum over sequences of their
    attention work at the best FLOP/s any chunk of them reaches + the linear work) / ranks."""
    s = np.asarray(seqlens, dtype=np.float64)
    table = cost.hardware.attention_tflops
    best = attention_flops_per_s(cost, s)
    for length, tflops in table:  # a non-monotone profile: a shorter chunk may run faster
        best = np.where(s >= length, np.maximum(best, tflops * 1e12), best)
    flops = 2.0 * cost.heads * cost.model.head_dim * s * s
    attention = float(np.sum(flops / best)) * (1.0 + cost.hardware.attention_bwd_ratio) \
        * cost.model.num_layers
    return (attention + cost.linear_time(float(s.sum()))) / world


@dataclass(frozen=True)
class _WaveTimes:
    """One wave, per rank, all layers: attention phase ends (forward + backward), compute."""

    fwd_end: list[float]
    bwd_end: list[float]
    compute: list[float]


def simulate_waves(plan: Plan, cost: CostModel, options: SimOptions, work: Work
                   ) -> list[_WaveTimes]:
    """Attention phases of every wave (all layers) for every rank."""
    layers, hw = cost.model.num_layers, cost.hardware
    if plan.attention_kind == "ulysses":  # FlexSP: all-to-alls around full-length attention
        fwd, compute = ulysses_pass_times(plan, cost)
        a2a = fwd - compute
        bwd = compute * hw.attention_bwd_ratio + a2a
        return [_WaveTimes((layers * fwd).tolist(), (layers * bwd).tolist(),
                           (layers * compute * (1.0 + hw.attention_bwd_ratio)).tolist())]
    acc_bytes = cost.model.bytes_per_element if options.dkv_dtype == "kv" else \
        8 if cost.model.bytes_per_element > 4 else 4  # fp32 (fp64) dKV accumulators
    launch = hw.kernel_overhead_us * 1e-6
    fwd_spec = PassSpec(False, 1.0, acc_bytes / cost.model.bytes_per_element, launch)
    bwd_spec = PassSpec(True, hw.attention_bwd_ratio, fwd_spec.acc_per_kv_byte, launch)
    out = []
    for wave in range(plan.num_waves):
        fwd = attention_phase(plan, work.rings[wave], work.local[wave], cost, fwd_spec, options)
        bwd = attention_phase(plan, work.rings[wave], work.local[wave], cost, bwd_spec, options)
        out.append(_WaveTimes((layers * fwd.end).tolist(), (layers * bwd.end).tolist(),
                              (layers * (fwd.compute + bwd.compute)).tolist()))
    return out


def simulate(plan: Plan, cost: CostModel, options: SimOptions = SimOptions(),
             label: str | None = None) -> SimResult:
    """Simulate one iteration of ``plan``; ``label`` names it in results (default: strategy)."""
    world = plan.topology.world_size
    if plan.topology.gpus_per_node != cost.cluster.gpus_per_node // cost.tp or \
            plan.topology.nodes != cost.cluster.nodes:
        raise ValueError(f"plan topology {plan.topology} does not match the cluster "
                         f"({cost.cluster.nodes} nodes x {cost.cluster.gpus_per_node} GPUs, "
                         f"TP={cost.tp})")
    work = build_work(plan, cost)
    waves = simulate_waves(plan, cost, options, work)
    remapped = plan.linear != plan.attention
    lin_tokens = [plan.linear_tokens()] if remapped else work.tokens.tolist()
    lin = [[cost.linear_time(n) for n in per_rank] for per_rank in lin_tokens]
    parts = _assemble(plan, cost, waves, lin, remapped)
    allreduce = grad_allreduce_seconds(cost)
    last_bwd = parts["last_bwd"]
    grad = max(0.0, allreduce - last_bwd) if options.overlap_grad_reduce else allreduce
    rank_lin = [sum(col) for col in zip(*lin)]
    rank_att = [sum(col) for col in zip(*(w.compute for w in waves))]
    rank_wait = [sum(w.fwd_end[r] + w.bwd_end[r] - w.compute[r] for w in waves)
                 for r in range(world)]
    iteration = parts["linear"] + parts["attention"] + parts["remap"] + grad
    return SimResult(label or plan.strategy, iteration, lower_bound(plan.seqlens, cost, world),
                     parts["linear"], parts["attention"], parts["ring"], parts["remap"], grad,
                     plan.num_waves, tuple(rank_lin), tuple(rank_att), tuple(rank_wait))


def _assemble(plan: Plan, cost: CostModel, waves: list[_WaveTimes], lin: list[list[float]],
              remapped: bool) -> dict[str, float]:
    """Critical path: linear, attention (with ring waits), remap; the last wave's backward."""
    bwd_share = (FWD_BWD_LINEAR - 1.0) / FWD_BWD_LINEAR
    if remapped:
        per_a2a = remap_time(plan, cost)
        attention = sum(max(w.fwd_end) + max(w.bwd_end) for w in waves)
        busiest = [max(w.compute) for w in waves]
        last = waves[-1]
        return {"linear": max(lin[0]), "attention": attention,
                "ring": max(0.0, attention - sum(busiest)),
                "remap": 2.0 * cost.model.num_layers * per_a2a,
                "last_bwd": max(lin[0]) * bwd_share + max(last.bwd_end)}
    linear = attention = ring = last_bwd = 0.0
    for w, lin_w in zip(waves, lin):
        totals = [li + f + b for li, f, b in zip(lin_w, w.fwd_end, w.bwd_end)]
        r = max(range(len(totals)), key=totals.__getitem__)
        linear += lin_w[r]
        attention += w.fwd_end[r] + w.bwd_end[r]
        ring += w.fwd_end[r] + w.bwd_end[r] - w.compute[r]
        last_bwd = lin_w[r] * bwd_share + w.bwd_end[r]
    return {"linear": linear, "attention": attention, "ring": ring, "remap": 0.0,
            "last_bwd": last_bwd}


def attention_time(plan: Plan, cost: CostModel, options: SimOptions = SimOptions()) -> float:
    """Seconds of the attention layers alone (all layers): the attention engine forward and
    backward over every wave, with the remap around it when the plan has one (its all-to-alls
    synchronise the ranks between phases). What ``fidelity`` measures on real ranks."""
    waves = simulate_waves(plan, cost, options, build_work(plan, cost))
    if plan.linear != plan.attention:
        per_a2a = remap_time(plan, cost)
        return sum(max(w.fwd_end) + max(w.bwd_end) for w in waves) + \
            2.0 * cost.model.num_layers * per_a2a
    return sum(max(f + b for f, b in zip(w.fwd_end, w.bwd_end)) for w in waves)
