"""The simulator's own step model: one ``Plan`` (a micro-batch) on one pool -> seconds, from the
simulator's profile (``profile.py``), with its own formulas. It shares no time formula with the
planner's estimate (``estimate.py``, the ``CostModel`` time functions): it takes only counts
from ``cost_model.py`` (FLOPs, bytes per token) and the engine's round structure
(``rounds.py`` through ``schedule``), so that it can disagree with the estimate.

Per micro-batch, per rank (seconds; ``n`` its linear-layout tokens, ``L`` layers):

* the training loop's host work per token (``token_host_ns``);
* GEMMs: ``L (4 + 8)`` calls and ``3 n L f`` FLOPs (``f`` the layer's forward GEMM FLOPs per
  token: QKV, projection, MLP), plus the logits GEMM (``3 n 2 h V``, 3 calls), at the
  profile's GEMM rate and per-call host cost;
* non-GEMM kernels of every layer (norms, SwiGLU, rotary, residual adds) and the head
  (embedding, final norm, loss), forward + backward: the profile's measured lines, scaled by
  hidden size (layers) and vocabulary (head);
* tensor parallelism: 2 all-reduces forward and 2 backward per layer of ``n h`` activations
  inside the node (``tp`` > 1);
* attention: the engine's rounds (``rounds.simulate_pass``) with the profile's forward rate at
  each call's query length, the backward at the profile's backward / forward ratio *at that
  length*, a host cost per kernel call and per ring step, and the profile's links; in routed
  mode an intra-node hop in a round with a global step shares NVLink with the routing legs
  (``nvlink_contention``);
* remap (when ``plan.remaps``): 4 all-to-alls per layer (q, k, v there and
  the output back, forward; the gradients, backward), the busiest rank's link setting each.

Shared cores (``profile.shared_cores`` > 0, the emulated CPU cluster): each wave's compute
(linear + attention, per rank) runs under processor sharing (``sharing.py``: a rank computing
while ``k`` ranks compute advances at ``min(1, cores / k)``), all ranks starting at once, then
the rank's other time (host work, communication, waits priced at one core per rank) follows;
a remap plan shares each synchronised phase (linear, each wave's attention) alike, and the
optimizer step runs at the fair share. The attention engine's host work per call and per ring
step is part of the attention compute (it takes a core); the training loop's host terms do
not. Not modelled: busy-polling waits taking a core, compute overlapping waits inside a pass.
No sharing: every rank on its own device.

A micro-batch ends when its slowest rank does (ring and remap traffic synchronise the ranks);
an iteration is its micro-batches back to back, then the gradient all-reduce (exposed unless
``overlap_grad_reduce``: then only what outlasts the last micro-batch's backward), the
optimizer step, and the training loop's host work per step and per micro-batch. Not modelled: pipeline parallelism, the planner process's CPU use, memory.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple, Sequence

import numpy as np

from megatron_zeppelin.config import ClusterSpec, ModelSpec
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.schedule import HALO_SPLIT
from megatron_zeppelin.sim.network import GpuMap
from megatron_zeppelin.sim.profile import SimProfile
from megatron_zeppelin.sim.rounds import Links, PassSpec, RingCosts, simulate_pass
from megatron_zeppelin.sim.sharing import shared_finish
from megatron_zeppelin.sim.ulysses import ulysses_pass_times
from megatron_zeppelin import zigzag_window
from megatron_zeppelin.zigzag_window import halo_rows, relay_rows, step_pairs

GEMM_CALLS_FWD = 4  # QKV, projection, MLP in, MLP out
GEMM_CALLS_BWD = 8  # data and weight gradients of each


@dataclass(frozen=True)
class StepOptions:
    """inter_mode: ``ring`` / ``direct`` / ``routed`` (as the engine's); router: ``auto`` or
    ``analytic`` (``network.inter_step_time``); dkv_dtype: ``accumulator`` (fp32 dK/dV, the
    zeppelin engine) or ``kv`` (the KV dtype, Transformer Engine); overlap_grad_reduce: the
    gradient all-reduce overlaps the last backward (Megatron ``--overlap-grad-reduce``);
    local_policy: the LOCAL queue policy of ``rounds.py`` (``engine`` is the engine's);
    device: the engine's device type, whose ``schedule.HALO_SPLIT`` applies."""

    inter_mode: str = "ring"
    router: str = "auto"
    dkv_dtype: str = "accumulator"
    overlap_grad_reduce: bool = False
    local_policy: str = "engine"
    device: str = "cuda"


@dataclass(frozen=True)
class MicroBatchTime:
    """One micro-batch: seconds along its critical path and its parts (slowest rank)."""

    seconds: float
    linear_s: float
    attention_s: float
    remap_s: float
    last_backward_s: float
    ring_s: float = 0.0  # waits for ring traffic along the critical path


@dataclass(frozen=True)
class StepTime:
    """One iteration: micro-batches back to back, exposed gradient sync, optimizer step
    (``optimizer_s`` includes the training loop's host work per step and micro-batch)."""

    seconds: float
    micro_batches: tuple[MicroBatchTime, ...]
    grad_sync_s: float
    optimizer_s: float
    ranks: tuple["RankTimes", ...] = ()


def sim_cluster(cluster: ClusterSpec, profile: SimProfile) -> ClusterSpec:
    """The cluster with the profile's links (intra -> NVLink, inter -> NIC)."""
    return replace(cluster, nvlink_gbyte_per_s=profile.intra_gbyte_per_s,
                   nvlink_latency_us=profile.intra_latency_us,
                   nic_gbit_per_s=profile.inter_gbyte_per_s * 8.0,
                   nic_latency_us=profile.inter_latency_us)


def allreduce_s(nbytes: float, ranks: int, latency_us: float, gbyte_per_s: float) -> float:
    """A ring all-reduce of ``nbytes`` per rank over ``ranks`` ranks: 2 (W-1) steps of
    ``latency_us``, 2 (W-1)/W of the bytes at the bus bandwidth ``gbyte_per_s``."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency_us * 1e-6 + steps / ranks * nbytes / (gbyte_per_s * 1e9)


def linear_seconds(tokens: np.ndarray, cost: CostModel, profile: SimProfile) -> np.ndarray:
    """Per rank: GEMMs, non-GEMM kernels, head and TP collectives of ``tokens`` tokens
    (``[ranks]``), all layers, forward + backward (see the module doc)."""
    return linear_parts(tokens, cost, profile)[0]


def linear_parts(tokens: np.ndarray, cost: CostModel, profile: SimProfile
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``linear_seconds`` and its compute part (what takes a core), per rank."""
    m, layers, tp = cost.model, cost.model.num_layers, cost.tp
    tokens = np.asarray(tokens, dtype=np.float64)
    flops = 3.0 * tokens * (cost.linear_flops_per_token() * layers
                            + 2.0 * m.hidden_size * m.vocab_size / tp)
    calls = (GEMM_CALLS_FWD + GEMM_CALLS_BWD) * layers + 3
    gemm = flops / (profile.gemm_tflops * 1e12) + calls * profile.gemm_call_us * 1e-6
    hidden = m.hidden_size / tp / (profile.measured_hidden or m.hidden_size)
    vocab = m.vocab_size / tp / (profile.measured_vocab or m.vocab_size)
    nongemm = layers * (profile.nongemm_layer_us * 1e-6
                        + tokens * hidden * profile.nongemm_ns_per_token * 1e-9)
    head = profile.head_us * 1e-6 + tokens * vocab * profile.head_ns_per_token * 1e-9
    host = tokens * profile.token_host_ns * 1e-9  # wall time, measured on the shared cores
    tp_comm = np.zeros_like(tokens)
    if tp > 1:  # 2 all-reduces forward, 2 backward per layer, inside the node
        tp_comm = 4.0 * layers * np.asarray(
            [allreduce_s(n * m.hidden_size * m.bytes_per_element, tp,
                         profile.intra_latency_us, profile.intra_gbyte_per_s) for n in tokens])
    compute = (gemm + nongemm + head) * profile.compute_scale
    return compute + host + tp_comm, compute


def shared_ends(ends: np.ndarray, compute: np.ndarray, profile: SimProfile) -> np.ndarray:
    """Per rank, the end of a phase that takes ``ends`` seconds of which ``compute`` on a core
    (``[ranks]``, both priced at one core per rank), when the ranks share ``shared_cores``
    cores: every rank's compute starts at once and runs under processor sharing
    (``sharing.shared_finish``: a rank whose compute is done, or that waits, takes no core),
    then its other time (host work, communication, waits) follows. ``ends`` itself with no
    sharing (``shared_cores`` 0 or at least the ranks)."""
    ends = np.asarray(ends, dtype=np.float64)
    if profile.fair_share(len(ends)) == 1.0:
        return ends
    compute = np.asarray(compute, dtype=np.float64)
    finish = shared_finish(np.zeros(len(ends)), compute, profile.shared_cores)
    return np.asarray(finish) + (ends - compute)


class _Work(NamedTuple):
    """One wave, one pass: ring groups (per-step seconds incl. host work per call and per ring
    step) and per rank the LOCAL queue as (s^2, seconds) per sequence."""

    rings: list[RingCosts]
    local: list[list[tuple[float, float]]]


def build_work(plan: Plan, cost: CostModel, profile: SimProfile, split: bool = True,
               halo: bool = True) -> list[tuple[_Work, _Work]]:
    """Per wave, the (forward, backward) work of every ring group and LOCAL queue: a G-rank
    ring step computes 1/G^2 of each sequence's causal work at query length s/G. In a layer
    whose every layer is windowed, a group's sequences whose chunks hold the window run by
    halo exchange where the engine does (``halo_sequences``, ``split`` and ``halo`` as there;
    an INTER ring's hops across nodes both ways in the global steps): a second ring over
    the same members, ahead of the one of its other sequences (``runtime.waves.windowed``)."""
    groups, world, gpn = plan.ring_groups, plan.topology.world_size, plan.topology.gpus_per_node
    owner = np.repeat(np.arange(len(groups)), [len(g.seqs) for g in groups])
    s = np.asarray([plan.seqlens[q] for g in groups for q in g.seqs], dtype=np.float64)
    g = np.asarray([len(groups[i].ring) for i in owner], dtype=np.float64)
    halo = halo_sequences(plan, cost.model, split, halo)
    part, parts = 2 * owner + ~halo, [group for group in groups for _ in range(2)]
    flops = cost.attention_flops(s)  # vectorised; the model's sliding window included
    fwd = profile.attention_forward_s(flops / (g * g), s / g) * profile.compute_scale
    bwd = fwd * profile.backward_ratio(s / g)
    extra = profile.attention_call_us * 1e-6 * profile.compute_scale + \
        profile.ring_step_us * 1e-6
    step_f = np.bincount(part, fwd, len(parts)) + extra
    step_b = np.bincount(part, bwd, len(parts)) + extra
    if cost.model.window_share > 0.0:  # windowed layers compute unevenly across the steps
        weights = step_weights(s, g, cost.model)
        step_f = [steps + extra for steps in _group_steps(fwd * g, weights, part, parts)]
        step_b = [steps + extra for steps in _group_steps(bwd * g, weights, part, parts)]
    kv_rows, dkv_rows = relayed_rows(s, g, cost.model, halo)
    chunk_kv = np.bincount(part, kv_rows, len(parts)) * cost.kv_bytes(1)
    chunk_dkv = np.bincount(part, dkv_rows, len(parts)) * cost.kv_bytes(1)
    held = np.bincount(part, minlength=len(parts))
    out = [(_Work([], [[] for _ in range(world)]), _Work([], [[] for _ in range(world)]))
           for _ in range(plan.num_waves)]
    for index, group in enumerate(groups):
        f_work, b_work = out[group.wave]
        if len(group.ring) == 1:
            mine = owner == index
            squares = (s[mine] ** 2).tolist()
            f_work.local[group.ring[0]].extend(zip(squares, fwd[mine].tolist()))
            b_work.local[group.ring[0]].extend(zip(squares, bwd[mine].tolist()))
            continue
        nodes = np.asarray(group.ring, dtype=np.int64) // gpn
        for i in [j for j in (2 * index, 2 * index + 1) if held[j]]:  # halo part, the rest
            for work, steps in ((f_work, step_f[i]), (b_work, step_b[i])):
                if i % 2 == 0:  # step 0 in round 0, its two neighbours' blocks in round 1
                    steps = np.asarray([steps[0], steps[1:].sum() - (len(steps) - 3) * extra])
                work.rings.append(RingCosts(index, np.asarray(group.ring, dtype=np.int64),
                                            group.tier, _step(steps), float(chunk_kv[i]),
                                            nodes != np.roll(nodes, -1), float(chunk_dkv[i]),
                                            i % 2 == 0))
    return out


def halo_sequences(plan: Plan, model: ModelSpec, split: bool = True,
                   halo: bool = True) -> np.ndarray:
    """Per sequence of the plan's ring groups (in group order), whether the engine runs it
    by halo exchange in a layer of ``model`` whose every layer is windowed: as the engine
    decides it (``zigzag_window.halo_sequences``; ``split`` False: only a group whose every
    sequence fits, ``schedule.HALO_SPLIT``; ``halo`` False: none, as
    ``AttentionEngine(halo=False)``)."""
    out = []
    for group in plan.ring_groups:
        out += zigzag_window.halo_sequences([plan.seqlens[q] for q in group.seqs],
                                            len(group.ring), model.window_size, split) \
            if halo and model.window_share >= 1.0 else [False] * len(group.seqs)
    return np.asarray(out, dtype=bool)


def _step(seconds) -> float | np.ndarray:
    """A ring's per-step seconds: one number (every step alike) or one per step."""
    return seconds if isinstance(seconds, np.ndarray) else float(seconds)


def step_weights(s: np.ndarray, g: np.ndarray, model: ModelSpec) -> list[np.ndarray | None]:
    """Per sequence of a ring group (lengths ``s``, ring sizes ``g``), the share of its
    attention work each ring step computes, mean over positions and over the model's layers:
    each layer's pairs as they fall on the zigzag geometry, dense or windowed
    (``zigzag_window.step_pairs``: the band of each chunk with itself at step 0, the rest at
    the steps holding its neighbours). None for a sequence on one rank."""
    share, window, out = model.window_share, model.window_size, []
    for n, k in zip(s.tolist(), g.tolist()):
        if k == 1:
            out.append(None)
            continue
        dense = np.asarray(step_pairs(int(n), int(k), int(n)))  # a window past the start
        mixed = (1.0 - share) * dense + share * np.asarray(step_pairs(int(n), int(k), window))
        out.append(mixed / mixed.sum())
    return out


def _group_steps(total: np.ndarray, weights: list, owner: np.ndarray, groups
                 ) -> list[np.ndarray | float]:
    """Per ring group, the seconds each step computes: its sequences' ``total`` (all
    steps) spread by their ``weights``, summed in sequence order (0.0 for a LOCAL group)."""
    out = [np.zeros(len(group.ring)) if len(group.ring) > 1 else 0.0 for group in groups]
    for i, group in enumerate(owner.tolist()):
        if weights[i] is not None:
            out[group] = out[group] + total[i] * weights[i]
    return out


def relayed_rows(s: np.ndarray, g: np.ndarray, model: ModelSpec,
                 halo: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence of a ring group (lengths ``s``, ring sizes ``g``; ``halo``: its group
    runs by halo exchange): the KV rows and dK/dV accumulator rows one hop carries, mean over
    the model's layers. A windowed layer's hops carry what the engine sends
    (``zigzag_window.relay_rows``, counted on the zigzag geometry; in a halo exchange each
    way to a neighbour half of ``halo_rows``), the others the whole chunk ``s / g``."""
    chunk = s / g
    share = model.window_share
    if share <= 0.0:
        return chunk, chunk
    halo = np.zeros(len(s), dtype=bool) if halo is None else halo
    rows = np.asarray([np.asarray(halo_rows(int(n), int(k), model.window_size)) / 2 if h else
                       relay_rows(int(n), int(k), model.window_size)
                       for n, k, h in zip(s, g, halo)], dtype=np.float64).reshape(-1, 2)
    return (1.0 - share) * chunk + share * rows[:, 0], (1.0 - share) * chunk + share * rows[:, 1]


class PassEnds(NamedTuple):
    """One wave, one layer, per rank: forward and backward attention end times and the
    attention compute inside them (both passes)."""

    fwd: np.ndarray
    bwd: np.ndarray
    compute: np.ndarray


def attention_ends(plan: Plan, cost: CostModel, profile: SimProfile, options: StepOptions
                   ) -> list[PassEnds]:
    """Per wave: one layer's attention (``PassEnds``), the engine's rounds or Ulysses."""
    if plan.attention_kind == "ulysses":
        fwd, compute, a2a = ulysses_pass_times(plan, cost, profile)
        bwd_compute = compute * profile.backward_ratio(_ulysses_lengths(plan))
        return [PassEnds(fwd, bwd_compute + a2a, compute + bwd_compute)]
    cluster = sim_cluster(cost.cluster, profile)
    links = Links(GpuMap(cluster, cost.tp), options.inter_mode, options.router,
                  options.local_policy, profile.nvlink_contention)
    bpe = cost.model.bytes_per_element
    acc = bpe if options.dkv_dtype == "kv" else (8 if bpe > 4 else 4)
    call = profile.attention_call_us * 1e-6 * profile.compute_scale
    out = None
    for weight, kind in layer_kinds(cost):
        waves = []
        for works in build_work(plan, kind, profile, HALO_SPLIT[options.device]):
            ends = [simulate_pass(work.rings, work.local, plan.topology.world_size,
                                  PassSpec(backward, 1.0, acc / bpe, call), links)
                    for backward, work in zip((False, True), works)]
            waves.append(PassEnds(weight * ends[0][0], weight * ends[1][0],
                                  weight * (ends[0][1] + ends[1][1])))
        out = waves if out is None else [PassEnds(*(a + b for a, b in zip(x, y)))
                                         for x, y in zip(out, waves)]
    return out


def layer_kinds(cost: CostModel) -> list[tuple[float, CostModel]]:
    """(share of the layers, the cost model of those layers): a model with a sliding window
    on some of its layers runs two kinds of layers, simulated apart (a windowed layer's hops
    are not hidden behind a dense layer's compute) and weighted by their shares."""
    share = cost.model.window_share
    if share <= 0.0 or share >= 1.0:
        return [(1.0, cost)]
    return [(1.0 - share, _kind(cost, 0)), (share, _kind(cost, cost.model.num_layers))]


@lru_cache(maxsize=64)
def _kind(cost: CostModel, window_layers: int) -> CostModel:
    """``cost`` with the window on ``window_layers`` layers."""
    return CostModel(replace(cost.model, window_layers=window_layers), cost.cluster,
                     cost.hardware, cost.tp)


def _ulysses_lengths(plan: Plan) -> np.ndarray:
    """Per rank, the longest sequence of its Ulysses groups (sets the backward ratio)."""
    out = np.ones(plan.topology.world_size)
    for group in plan.ring_groups:
        longest = max(plan.seqlens[q] for q in group.seqs)
        out[list(group.ring)] = np.maximum(out[list(group.ring)], longest)
    return out


def remap_a2a_s(plan: Plan, cost: CostModel, profile: SimProfile) -> float:
    """One all-to-all of the remap (q, k, v and the output per moved token): per rank, its
    intra-node bytes over the intra link and its cross-node bytes through its node's NICs
    (shared by the node's ranks); the busiest rank sets the time."""
    matrix = np.asarray(plan.remap_matrix(), dtype=np.float64) * cost.qkvo_bytes(1)
    if not matrix.any():
        return 0.0
    gpn = plan.topology.gpus_per_node
    node = np.arange(matrix.shape[0]) // gpn
    same = node[:, None] == node[None, :]
    intra = np.maximum((matrix * same).sum(1), (matrix * same).sum(0))
    cross_out = np.bincount(node, (matrix * ~same).sum(1))
    cross_in = np.bincount(node, (matrix * ~same).sum(0))
    nics = cost.cluster.nics_per_node
    seconds = intra.max() / (profile.intra_gbyte_per_s * 1e9) + profile.intra_latency_us * 1e-6
    if cross_out.any():
        cross = max(cross_out.max(), cross_in.max()) / nics
        seconds = max(seconds, cross / (profile.inter_gbyte_per_s * 1e9)
                      + profile.inter_latency_us * 1e-6)
    return float(seconds)


def _shared_pass(e: PassEnds, profile: SimProfile) -> np.ndarray:
    """One wave's attention (forward + backward, one layer) per rank, under sharing; the
    forward and backward ends with no sharing."""
    if profile.fair_share(len(e.fwd)) == 1.0:
        return e.fwd.max() + e.bwd.max()
    return shared_ends(e.fwd + e.bwd, e.compute, profile)


class RankTimes(NamedTuple):
    """One micro-batch per rank: linear seconds, attention compute, waits inside attention."""

    linear: np.ndarray
    attention: np.ndarray
    wait: np.ndarray


def micro_batch_time(plan: Plan, cost: CostModel, profile: SimProfile,
                     options: StepOptions = StepOptions()) -> MicroBatchTime:
    """Seconds of one micro-batch of ``plan`` on its pool (module doc)."""
    return micro_batch_detail(plan, cost, profile, options)[0]


def micro_batch_detail(plan: Plan, cost: CostModel, profile: SimProfile,
                       options: StepOptions = StepOptions()
                       ) -> tuple[MicroBatchTime, RankTimes]:
    """``micro_batch_time`` and the per-rank times behind it."""
    layers, world = cost.model.num_layers, plan.topology.world_size
    ends = attention_ends(plan, cost, profile, options)
    compute = layers * sum(e.compute for e in ends)
    waits = layers * sum(e.fwd + e.bwd - e.compute for e in ends)
    if plan.remaps:  # every attention phase synchronises
        lin, lin_compute = linear_parts(np.asarray(plan.linear_tokens(), dtype=np.float64),
                                        cost, profile)
        lin = shared_ends(lin, lin_compute, profile)
        attention = layers * sum(float(_shared_pass(e, profile).max()) for e in ends)
        busiest = layers * sum(float(e.compute.max()) for e in ends)
        remap = 4.0 * layers * remap_a2a_s(plan, cost, profile)
        last_bwd = float(lin.max()) * 2 / 3 + layers * float(ends[-1].bwd.max())
        return (MicroBatchTime(float(lin.max()) + attention + remap, float(lin.max()),
                               attention, remap, last_bwd, max(0.0, attention - busiest)),
                RankTimes(lin, compute, waits))
    tokens = np.zeros((plan.num_waves, world))
    for group in plan.ring_groups:
        tokens[group.wave, list(group.ring)] += sum(plan.seqlens[q] for q in group.seqs) \
            / len(group.ring)
    total = linear = attention = ring = last_bwd = 0.0
    rank_lin = np.zeros(world)
    for wave, e in enumerate(ends):
        lin, lin_compute = linear_parts(tokens[wave], cost, profile)
        rank_lin += lin
        per_rank = shared_ends(lin + layers * (e.fwd + e.bwd), lin_compute + layers * e.compute,
                               profile)
        r = int(per_rank.argmax())
        total += float(per_rank[r])
        linear += float(lin[r])
        attention += layers * float(e.fwd[r] + e.bwd[r])
        ring += layers * float(e.fwd[r] + e.bwd[r] - e.compute[r])
        last_bwd = float(lin[r]) * 2 / 3 + layers * float(e.bwd[r])
    return (MicroBatchTime(total, linear, attention, 0.0, last_bwd, ring),
            RankTimes(rank_lin, compute, waits))


def step_time(plans: Sequence[Plan], cost: CostModel, profile: SimProfile,
              options: StepOptions = StepOptions()) -> StepTime:
    """One iteration of ``plans`` (its micro-batches, in order) on one pool: micro-batches back
    to back, the gradient all-reduce over the pool's ranks, the optimizer step."""
    details = [micro_batch_detail(p, cost, profile, options) for p in plans]
    micro = tuple(d[0] for d in details)
    params = cost.model.parameter_count() / cost.tp
    ranks = plans[0].topology.world_size if plans else 1
    sync = allreduce_s(params * cost.model.bytes_per_element, ranks,
                       profile.allreduce_latency_us, profile.allreduce_gbyte_per_s) + \
        allreduce_s(4.0, ranks, profile.allreduce_latency_us, profile.allreduce_gbyte_per_s)
    if options.overlap_grad_reduce and micro:
        sync = max(0.0, sync - micro[-1].last_backward_s)
    optimizer = (profile.optimizer_us * 1e-6 + params * profile.optimizer_ns_per_param * 1e-9) \
        * profile.compute_scale
    if profile.fair_share(ranks) != 1.0:  # every rank steps its optimizer at once
        optimizer *= profile.fair_share(ranks)
    host = profile.step_host_us * 1e-6 + len(plans) * profile.micro_batch_host_us * 1e-6
    return StepTime(sum(m.seconds for m in micro) + sync + optimizer + host, micro, sync,
                    optimizer + host,
                    tuple(d[1] for d in details))
