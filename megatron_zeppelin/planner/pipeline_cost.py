"""A global batch priced under pipeline parallelism: what ``zeppelin plan --pp`` prints and
what the simulator's pipeline sweep (``sim/pipeline.py``) uses with its own per-micro-batch
times.

Under ``PipelineSpec(pp, vpp)`` every stage holds ``num_layers / pp`` layers on ``GPUs / pp``
GPUs (Megatron's rank order puts the pipeline dimension outermost: a stage is a contiguous
block of whole nodes, or a divisor of one node). The batch's documents are grouped into
``M`` micro-batches (``split_batch``: ``balance_microbatches`` with the stage's
balanced-compute cost, or arrival order); each micro-batch is planned by the strategy on one
stage's ranks (every stage runs the same plan: it plans from the same lengths) and timed for
that stage (``MicrobatchCost``: forward and backward, the LM head on the last stage, the
activations' transfer to the next stage); Megatron's schedule with those times
(``pipeline.pipeline_step``) gives the step, plus the part of the stage's gradient all-reduce
not hidden behind the first stage's last backward.

Approximations, stated: the forward / backward split of a micro-batch's time is linear 1/3,
attention ``1 / (1 + attention_bwd_ratio)``, remap 1/2; the embedding's compute is ignored
(the LM head's is not) and the gradient all-reduce counts the embeddings on every stage; the
activation transfer is one message of the busiest rank's linear-layout tokens x hidden size
(no sequence parallelism), over the GPU's share of its node's NICs between nodes or NVLink
inside one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

from megatron_zeppelin.config import ConfigError, PipelineSpec, ZeppelinConfig
from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel
from megatron_zeppelin.estimate import estimate_step, grad_allreduce_seconds
from megatron_zeppelin.planner.microbatches import (arrival_microbatches, balance_microbatches,
                                                    work_cost)
from megatron_zeppelin.planner.pipeline import PipelineTimeline, pipeline_step
from megatron_zeppelin.planner.registry import Strategy


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``cost`` is the cost model of its layers on its GPUs; ``ranks`` its
    planner ranks; ``head_share`` the LM head's share of a token's linear seconds;
    ``p2p_byte_per_s`` / ``p2p_latency_s`` the link to the next stage (per GPU)."""

    cost: CostModel
    spec: PipelineSpec
    ranks: int
    head_share: float
    p2p_byte_per_s: float
    p2p_latency_s: float


def stage_of(cost: CostModel, spec: PipelineSpec) -> Stage:
    """The stage of ``cost``'s model and cluster under ``spec``; ``ConfigError`` naming the
    flag when layers, ranks or nodes do not split evenly."""
    model, cluster, tp = cost.model, cost.cluster, cost.tp
    spec.check(model, cluster.world_size // tp)
    gpus, per_node = cluster.world_size // spec.pp, cluster.gpus_per_node
    if gpus % per_node == 0:
        stage_cluster, across = cluster.with_nodes(gpus // per_node), spec.pp > 1
    elif per_node % gpus == 0:
        stage_cluster, across = cluster.with_topology(1, gpus), cluster.nodes > 1
    else:
        raise ConfigError(f"--pp={spec.pp} is invalid: expected stages of whole nodes or of a "
                          f"divisor of a node's {per_node} GPUs ({gpus} GPUs per stage)")
    stage_cost = CostModel(replace(model, num_layers=model.num_layers // spec.pp),
                           stage_cluster, cost.hardware, tp)
    head = 2.0 * model.hidden_size * model.vocab_size / tp
    body = stage_cost.linear_flops_per_token() * stage_cost.model.num_layers
    if across:
        link = cluster.nic_byte_per_s * cluster.nics_per_node / per_node
        latency = cluster.nic_latency_us * 1e-6
    else:
        link, latency = cluster.nvlink_byte_per_s, cluster.nvlink_latency_us * 1e-6
    return Stage(stage_cost, spec, cluster.world_size // tp // spec.pp, head / (head + body),
                 link, latency)


class MicrobatchCost(NamedTuple):
    """One micro-batch on one stage (seconds): forward / backward of the stage's layers, the
    LM head's forward / backward (last stage only), the activations' transfer."""

    forward_s: float
    backward_s: float
    head_forward_s: float
    head_backward_s: float
    p2p_s: float


def microbatch_cost(stage: Stage, body_s: float, linear_s: float, attention_s: float,
                    remap_s: float, busiest_tokens: int) -> MicrobatchCost:
    """A micro-batch's ``MicrobatchCost`` from its stage step without the gradient all-reduce
    (``body_s``) and that step's linear / attention / remap parts (module doc)."""
    head = linear_s * stage.head_share
    ratio = stage.cost.hardware.attention_bwd_ratio
    forward = (linear_s - head) / FWD_BWD_LINEAR + attention_s / (1.0 + ratio) + remap_s / 2.0
    backward = max(0.0, body_s - head - forward)
    nbytes = busiest_tokens * stage.cost.model.hidden_size * stage.cost.model.bytes_per_element
    p2p = nbytes / stage.p2p_byte_per_s + stage.p2p_latency_s if stage.spec.pp > 1 else 0.0
    return MicrobatchCost(forward, backward, head / FWD_BWD_LINEAR,
                          head * (FWD_BWD_LINEAR - 1.0) / FWD_BWD_LINEAR, p2p)


@dataclass(frozen=True)
class PipelineResult:
    """One global batch under the pipeline: ``step_s`` = the schedule's end + ``grad_s`` (the
    exposed gradient all-reduce); ``microbatches``: document indices, in run order."""

    step_s: float
    grad_s: float
    timeline: PipelineTimeline
    microbatches: tuple[tuple[int, ...], ...]
    costs: tuple[MicrobatchCost, ...]

    @property
    def bubble(self) -> float:
        return self.timeline.bubble


def split_batch(lengths: Sequence[int], stage: Stage) -> list[list[int]]:
    """The micro-batches of ``lengths`` (document indices) by ``stage.spec.microbatch_order``:
    balanced with the stage's balanced-compute cost (``work_cost``), or arrival order."""
    spec, cost = stage.spec, stage.cost
    if spec.microbatch_order == "arrival":
        return arrival_microbatches(lengths, spec.num_microbatches)
    return balance_microbatches(lengths, spec.num_microbatches,
                                microbatch_work_cost(cost, stage.ranks), pp=spec.pp,
                                vpp=spec.vpp, backward_ratio=FWD_BWD_LINEAR - 1.0)


def microbatch_work_cost(cost: CostModel, ranks: int) -> Callable[[Sequence[int]], float]:
    """The cost ``balance_microbatches`` balances by: a micro-batch's balanced-compute seconds
    on ``ranks`` ranks of ``cost`` (every layer's attention of each document + the linear
    modules of all its tokens, over the ranks); strategy-agnostic, cheap, and the same on
    every rank that holds the same cost model."""
    layers = cost.model.num_layers
    attention = functools.lru_cache(maxsize=None)(lambda n: cost.attention_time(n) * layers)
    return work_cost(attention, cost.linear_time, ranks)  # one attention price per length


def price(stage: Stage, groups: Sequence[Sequence[int]], costs: Sequence[MicrobatchCost]
          ) -> PipelineResult:
    """Megatron's schedule over the micro-batches' costs (each stage's time split evenly over
    its ``vpp`` chunks, the LM head on the last virtual stage) and the exposed all-reduce."""
    pp, vpp = stage.spec.pp, stage.spec.vpp
    n = pp * vpp
    fwd = [[c.forward_s / vpp] * (n - 1) + [c.forward_s / vpp + c.head_forward_s] for c in costs]
    bwd = [[c.backward_s / vpp] * (n - 1) + [c.backward_s / vpp + c.head_backward_s]
           for c in costs]
    timeline = pipeline_step(fwd, bwd, pp, vpp, [c.p2p_s for c in costs])
    last = max((s for s in timeline.steps if s.stage == 0), key=lambda s: s.end)
    grad = max(0.0, grad_allreduce_seconds(stage.cost) - (last.end - last.start))
    return PipelineResult(timeline.step_s + grad, grad, timeline,
                          tuple(tuple(g) for g in groups), tuple(costs))


def estimate_pipeline(lengths: Sequence[int], strategy: Strategy, cost: CostModel,
                      config: ZeppelinConfig, spec: PipelineSpec) -> PipelineResult:
    """The planner's estimate of one global batch under ``spec``: each micro-batch planned by
    ``strategy`` on a stage and scored by ``estimate_step``."""
    stage = stage_of(cost, spec)
    groups = split_batch(lengths, stage)
    routed = config.routing and strategy.routed
    costs = []
    for group in groups:
        plan = strategy.plan([lengths[i] for i in group], stage.cost, config)
        est = estimate_step(plan, stage.cost, routed)
        costs.append(microbatch_cost(stage, est.step_s - est.grad_s, est.linear_s,
                                     est.attention_s, est.remap_s, max(plan.linear_tokens())))
    return price(stage, groups, costs)
