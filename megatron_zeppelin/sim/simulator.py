"""Cluster simulator: one ``Plan`` -> the time of one training iteration, the same model for
every strategy, judged by the simulator's own step model (``step_model.py``) and profile
(``profile.py``, ``configs/sim/``), never by the planner's estimate: it shares no time formula
with ``estimate.py`` / the ``CostModel`` time functions (``tests/test_sim_independent.py``
checks the imports), so it can tell where the estimate is wrong. Round-level and analytic
(no packets): a 1024-GPU plan simulates in well under a second on this 2-core machine.

What it models (times in seconds; ``step_model.py`` has the formulas):

* Linear modules per rank: GEMM FLOPs at the profile's GEMM rate plus host work per GEMM call,
  the non-GEMM kernels (norms, activations, rotary, residuals), the head (embedding, loss) and
  tensor-parallel all-reduces. With the remapping layer the linear layout is ``Plan.linear``;
  without it the linear modules run on the attention layout of each wave.
* Attention, per layer, forward then backward: the engine's rounds (``rounds.py``: INTER, INTRA
  and LOCAL queues, every ring's step-r exchange in flight while the rank computes step r, then
  LOCAL calls while it waits), each call at the profile's rate for its query length, the
  backward at the profile's backward / forward ratio for that length, host work per call and
  per ring step; NIC sharing between concurrent cross-node hops (``ring`` mode) or the
  pool-wide global steps of ``direct``/``routed`` mode (the router's schedule when it imports,
  else ``network.py``'s analytic model), with NVLink contention of the routing legs.
* Remap: 4 all-to-alls per layer of q, k, v / output (and their gradients).
* Ulysses plans (FlexSP): all-to-alls around full-length attention over 1/G of the heads
  (``ulysses.py``), not overlapped.
* Waves (Megatron hybrid CP groups) run back to back.
* Gradient all-reduce over the pool (ring; exposed, or with ``overlap_grad_reduce`` only the
  part longer than the last backward) and the optimizer step.
* Pipeline parallelism is priced on top, per micro-batch and stage (``sim/pipeline.py``).
* Not modelled: memory limits, the planner process's CPU use.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.sim.network import STEP_TIME_MODELS
from megatron_zeppelin.sim.profile import SimProfile, profile_of
from megatron_zeppelin.sim.rounds import INTER_MODES, LOCAL_POLICIES
from megatron_zeppelin.sim import step_model
from megatron_zeppelin.sim.step_model import StepOptions


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
        for key, allowed in (("local_policy", LOCAL_POLICIES), ("inter_mode", INTER_MODES),
                             ("dkv_dtype", DKV_DTYPES), ("router", STEP_TIME_MODELS)):
            value = getattr(self, key)
            if value not in allowed:
                raise ValueError(f"{key}={value!r} is invalid: expected one of "
                                 f"{list(allowed)}")


@dataclass(frozen=True)
class SimResult:
    """Simulated iteration of one plan (seconds). ``linear_s + attention_s + remap_s +
    grad_sync_s + optimizer_s == iteration_s`` along the critical path; ``ring_exposed_s`` is the part of
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
    optimizer_s: float = 0.0

    @property
    def gap(self) -> float:
        """Iteration time over the lower bound (>= 1 up to the bound's assumptions)."""
        return self.iteration_s / self.lower_bound_s


def step_options(options: SimOptions) -> StepOptions:
    """The step model's options of ``options``."""
    return StepOptions(options.inter_mode, options.router, options.dkv_dtype,
                       options.overlap_grad_reduce, options.local_policy)


def lower_bound(seqlens, cost: CostModel, world: int, profile: SimProfile | None = None
                ) -> float:
    """Perfectly balanced compute, no communication, no host work beyond one rank's fixed
    costs: (every sequence's attention forward + backward at the best rate any chunk of it
    reaches + the linear modules' per-token compute) / ranks (x the fair share of
    ``shared_cores``, every rank computing at once) + their per-token work that takes no
    core (the host's wall time) / ranks + one rank's fixed linear costs."""
    profile = profile or profile_of(cost)
    s = np.asarray(seqlens, dtype=np.float64)
    flops = cost.attention_flops(s)  # elementwise on the array
    forward = flops / (profile.best_tflops_up_to(s) * 1e12) * profile.compute_scale
    attention = float(np.sum(forward * (1.0 + profile.least_ratio_up_to(s)))) * \
        cost.model.num_layers
    (fixed, fixed_compute), (whole, compute) = (
        (float(a[0]), float(c[0])) for a, c in (
            step_model.linear_parts(np.asarray([n]), cost, profile) for n in (0.0, s.sum())))
    compute -= fixed_compute
    other = whole - fixed - compute
    return (attention + compute) / world * profile.fair_share(world) + other / world + fixed


def simulate(plan: Plan, cost: CostModel, options: SimOptions = SimOptions(),
             label: str | None = None, profile: SimProfile | None = None) -> SimResult:
    """Simulate one iteration of ``plan`` (one micro-batch, the gradient sync and the optimizer
    step) with ``profile`` (default: the cluster's, ``profile.profile_of``); ``label`` names
    it in results (default: strategy)."""
    if plan.topology.gpus_per_node != cost.cluster.gpus_per_node // cost.tp or \
            plan.topology.nodes != cost.cluster.nodes:
        raise ValueError(f"plan topology {plan.topology} does not match the cluster "
                         f"({cost.cluster.nodes} nodes x {cost.cluster.gpus_per_node} GPUs, "
                         f"TP={cost.tp})")
    profile = profile or profile_of(cost)
    step = step_model.step_time([plan], cost, profile, step_options(options))
    mb, ranks = step.micro_batches[0], step.ranks[0]
    world = plan.topology.world_size
    return SimResult(label or plan.strategy, step.seconds,
                     lower_bound(plan.seqlens, cost, world, profile), mb.linear_s,
                     mb.attention_s, mb.ring_s, mb.remap_s, step.grad_sync_s, plan.num_waves,
                     tuple(ranks.linear.tolist()), tuple(ranks.attention.tolist()),
                     tuple(ranks.wait.tolist()), step.optimizer_s)


def attention_time(plan: Plan, cost: CostModel, options: SimOptions = SimOptions(),
                   profile: SimProfile | None = None) -> float:
    """Seconds of the attention layers alone (all layers): the attention engine forward and
    backward over every wave, with the remap around it when the plan has one (its all-to-alls
    synchronise the ranks between phases). What ``fidelity --engine`` measures on real
    ranks."""
    profile = profile or profile_of(cost)
    mb = step_model.micro_batch_time(plan, cost, profile, step_options(options))
    return mb.attention_s + mb.remap_s
