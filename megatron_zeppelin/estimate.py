"""Step-time estimate of a plan: the score planners compare candidate plans by, and the
figures ``zeppelin plan`` prints. Cost-model layer (no planner, no simulator imports).

The estimate follows what the simulator (``sim/simulator.py``) models, in closed form, from the
cost kernel's per-task times (``CostKernel``; the C++ planner twin evaluates the same
expressions in the same order, so the portfolio picks the same candidate in both backends):

* per wave w and rank r: ``ring`` = the compute of its ring groups (tasks sharing a ring run
  as one fused call per step, G > 1) plus the engine's host work per ring step
  (``CostKernel.ring_step_s``, G per group), ``exposed`` = each group's exchange per step (the KV of
  all its sequences, ``CostKernel.comm``) not hidden behind that step's compute, G - 1 times
  (with a sliding window, behind each step's own compute: ``CostKernel.ring_exposed``), and
  the backward's last dK/dV return (``CostKernel.dkv_tail``);
  ``local`` = the compute of its LOCAL tasks; the engine runs LOCAL work while ring traffic is
  in flight, so the rank's attention time is ``ring + max(local, exposed)``. A Ulysses group
  (FlexSP) costs its compute at the full lengths over 1/G of the heads plus its all-to-alls
  (``CostKernel.ulysses_compute``, ``ulysses_comm``), not overlapped.
* linear: ``linear_per_token`` x the rank's tokens: its linear-layout tokens with the remap,
  else its attention tokens of each wave (s / G of each ring task, as the simulator counts);
  tasks sharing a ring are summed first, then added to each member (one pass per ring);
* remap: one all-to-all per layer forward and backward (q, k, v there, the output back;
  the reverse in backward) over NVLink inside nodes and the static NICs across, the busiest
  link setting its time (``remap_a2a_seconds``), plus, when any token moves, the second
  exchange's latency and the remap's host work (``CostKernel.remap_step_s``, the
  profile's ``remap_overhead_us``): ``remap_fixed_seconds``;
* step: with the remap ``max linear + sum over waves of max attention + remap``; without it
  ``sum over waves of max (linear + attention)``; plus the gradient all-reduce time not hidden
  behind the last backward (``grad_allreduce_seconds``). Each max over ranks is
  ``shared_peak``: where ranks share a device's compute (``HardwareProfile.shared_by`` > 1,
  CPU ranks on fewer cores), the ranks' work under fair sharing: a rank runs faster once its
  peers are done or wait.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from megatron_zeppelin.twin_arithmetic import add_up
from megatron_zeppelin.cost_model import FWD_BWD_LINEAR, CostModel, RingWindow
from megatron_zeppelin.plan import AttentionTask, Plan, Tier, Topology


class Move(NamedTuple):
    """``tokens`` of the remap: held by ``src`` for the linear modules, attended on ``dst``."""

    src: int
    dst: int
    tokens: int


@dataclass(frozen=True)
class StepEstimate:
    """The estimate of one plan (seconds per training step): ``step_s`` and its parts, and the
    per-rank attention and linear seconds summed over waves."""

    step_s: float
    linear_s: float
    attention_s: float
    remap_s: float
    grad_s: float
    rank_attention_s: tuple[float, ...]
    rank_linear_s: tuple[float, ...]


def estimate_tasks(tasks: Sequence[AttentionTask], seqlens: Sequence[int], topology: Topology,
                   cost: CostModel, routed: bool, linear_tokens: Sequence[int] | None = None,
                   moves: Iterable[Move] = (), attention_kind: str = "ring") -> StepEstimate:
    """The estimate (module doc) of ``tasks`` (one per sequence); ``linear_tokens``: the linear
    layout's tokens per rank when the plan remaps (None: linear on the attention layout);
    ``moves``: the remap's transfers."""
    kernel, world = cost.kernel, topology.world_size
    waves = 1 + max((t.wave for t in tasks), default=0)
    ring = [[0.0] * world for _ in range(waves)]
    exposed = [[0.0] * world for _ in range(waves)]
    local = [[0.0] * world for _ in range(waves)]
    tokens = [[0.0] * world for _ in range(waves)]
    groups: dict[tuple[int, tuple[int, ...]], list] = {}  # (wave, ring): [compute, tokens]
    ulysses = attention_kind == "ulysses"
    windowed = kernel.window_share > 0.0 and not ulysses
    for task in tasks:
        s, g, w = seqlens[task.seq], len(task.ring), task.wave
        if g == 1:
            local[w][task.ring[0]] += kernel.compute(s, 1)
            tokens[w][task.ring[0]] += s
            continue
        sums = groups.setdefault((w, task.ring), [0.0, 0.0, task.tier, 0.0, None])
        sums[0] += kernel.ulysses_compute(s, g) if ulysses else kernel.compute(s, g)
        sums[1] += s / g
        if windowed:  # dense layers' work, the windowed layers' steps and trimmed rows
            sums[3] += kernel.dense_compute(s, g)
            if sums[4] is None:
                sums[4] = RingWindow(g)
            sums[4].add(kernel.window_parts(s, g))
    paced: list[list[tuple[tuple[int, ...], int, float]]] = [[] for _ in range(waves)]
    for (w, members), (compute, share, tier, dense, window) in groups.items():
        g = len(members)
        if ulysses:
            compute, hidden = compute + kernel.ulysses_comm(share, g, tier), 0.0
        else:
            compute = compute + g * kernel.ring_step_s  # the engine's host work per step
            if window is not None:  # as the engine runs the group (HALO_SPLIT)
                window.settle(kernel.halo_split)
            hidden = _ring_hidden(kernel, compute, share, g, tier, routed, dense, window)
        for r in members:
            ring[w][r] += compute
            exposed[w][r] += hidden
            tokens[w][r] += share
        paced[w].append((members, g, (compute + hidden) / g))
    att = [_pace([ring[w][r] + max(local[w][r], exposed[w][r]) for r in range(world)],
                 paced[w]) for w in range(waves)]
    return _step(att, tokens, linear_tokens, moves, topology, cost)


def _ring_hidden(kernel, compute: float, share: float, g: int, tier: Tier, routed: bool,
                 dense: float, window: RingWindow | None) -> float:
    """A ring group's traffic not hidden: one fused exchange per ring step behind that step's
    compute and host work (``compute``, all steps), or with a sliding window behind each step's
    own work (``dense``, ``window``: ``CostKernel.ring_exposed``), and the backward's last
    dK/dV return."""
    if window is None:
        return (g - 1) * max(0.0, kernel.comm(share, tier, routed) - compute / g) + \
            kernel.dkv_tail(share, tier, routed)
    return kernel.ring_exposed(dense, window, share, tier, routed) + \
        kernel.dkv_tail(kernel.accumulator_rows(share, window), tier, routed)


def _pace(att: list[float], groups: list[tuple[tuple[int, ...], int, float]]) -> list[float]:
    """Ring members advance together: round r of a ring starts once every member has done
    its previous round, so a ring of G rounds ends no earlier than its busiest member's work
    in those rounds (``work(m, G)``: each of m's rings contributes its per-round time for the
    rounds it shares with G); a rank then still runs its own rounds beyond G. ``groups``: per
    ring group (members, G, per-round seconds of one member)."""
    if not groups:
        return att
    rings_of: dict[int, list[int]] = {}
    for index, (members, _, _) in enumerate(groups):
        for r in members:
            rings_of.setdefault(r, []).append(index)
    work: dict[tuple[int, int], float] = {}

    def rounds(rank: int, size: int, after: bool) -> float:
        total = 0.0
        for h in rings_of[rank]:
            _, g, per_round = groups[h]
            total += per_round * (max(0, g - size) if after else min(g, size))
        return total

    out = list(att)
    for members, size, _ in groups:
        pace = 0.0
        for m in members:
            if (m, size) not in work:
                work[(m, size)] = rounds(m, size, False)
            pace = max(pace, work[(m, size)])
        for r in members:
            out[r] = max(out[r], pace + rounds(r, size, True))
    return out


def _step(att: list[list[float]], tokens: list[list[float]], linear_tokens: Sequence[int] | None,
          moves: Iterable[Move], topology: Topology, cost: CostModel) -> StepEstimate:
    """Combine per-wave attention and tokens into the step (module doc)."""
    kernel, world = cost.kernel, topology.world_size
    per_token = kernel.linear_per_token
    bwd_att = cost.hardware.attention_bwd_ratio / (1.0 + cost.hardware.attention_bwd_ratio)
    bwd_lin = (FWD_BWD_LINEAR - 1.0) / FWD_BWD_LINEAR
    shared = cost.hardware.shared_by
    if linear_tokens is not None:
        lin = [per_token * n for n in linear_tokens]
        linear = shared_peak(lin, shared)
        peaks = [shared_peak(a, shared) for a in att]
        attention = add_up(peaks)
        moves = list(moves)
        remap = remap_a2a_seconds(moves, topology, cost) * 2.0 * kernel.layers + \
            remap_fixed_seconds(moves, topology, cost)
        last_bwd = linear * bwd_lin + peaks[-1] * bwd_att
        rank_lin = tuple(lin)
    else:
        linear = attention = last_bwd = remap = 0.0
        for a, n in zip(att, tokens):
            totals = [a[r] + per_token * n[r] for r in range(world)]
            crit = max(range(world), key=totals.__getitem__)
            # the critical rank's parts, scaled to the wave's time on shared devices
            scale = shared_peak(totals, shared) / totals[crit] if totals[crit] > 0.0 else 1.0
            linear += per_token * n[crit] * scale
            attention += a[crit] * scale
            last_bwd = (per_token * n[crit] * bwd_lin + a[crit] * bwd_att) * scale
        rank_lin = tuple(per_token * add_up(n[r] for n in tokens) for r in range(world))
    grad = max(0.0, grad_allreduce_seconds(cost) - last_bwd)
    return StepEstimate(linear + attention + remap + grad, linear, attention, remap, grad,
                        tuple(add_up(a[r] for a in att) for r in range(world)), rank_lin)


def shared_peak(seconds: Sequence[float], shared_by: float) -> float:
    """The time ranks take for per-rank work ``seconds`` (timed while all of them compute) when
    ``shared_by`` ranks share one device's compute (``HardwareProfile.shared_by``), under fair
    sharing (Linux's scheduler: each of ``k`` busy ranks gets ``min(1, n / (shared_by k))`` of
    a device, a rank that is done or waits takes none): over the work sorted ascending, each
    increment ``s_i - s_(i-1)`` runs while ``k = n - i`` ranks are busy (0-based ``i``), at
    ``max(1 / shared_by, k / n)`` of its timed seconds. The busiest rank sets the tail, the
    others the start (``zeppelin bench sharing`` measured this against the best schedule,
    ``max(peak / shared_by, mean)``). ``max`` when 1."""
    peak = max(seconds)
    if shared_by == 1.0:
        return peak
    n, alone = len(seconds), 1.0 / shared_by
    total = previous = 0.0
    for i, s in enumerate(sorted(seconds)):
        total += (s - previous) * max(alone, (n - i) / n)
        previous = s
    return total


def plan_moves(plan: Plan) -> list[Move]:
    """The remap's transfers of ``plan`` as moves (linear holder -> attention holder)."""
    return [Move(t.src, t.dst, t.end - t.start) for t in plan.transfers if t.src != t.dst]


def estimate_step(plan: Plan, cost: CostModel, routed: bool = True) -> StepEstimate:
    """The estimate of a whole ``Plan`` (module doc)."""
    remapped = plan.remaps
    return estimate_tasks(plan.tasks, plan.seqlens, plan.topology, cost, routed,
                          plan.linear_tokens() if remapped else None,
                          plan_moves(plan) if remapped else (), plan.attention_kind)


@dataclass(frozen=True)
class PlanEstimate:
    """``estimate_step`` per rank, with the bytes the plan moves (forward + backward, all
    layers): attention_s / linear_s per rank summed over waves; step_s the estimate."""

    attention_s: tuple[float, ...]
    linear_s: tuple[float, ...]
    step_s: float
    ring_cross_node_bytes: float
    remap_cross_node_bytes: float
    remap_bytes: float
    remap_s: float = 0.0


def estimate_plan(plan: Plan, cost: CostModel, routed: bool = True) -> PlanEstimate:
    """Per-rank attention and linear time of ``plan``, its step estimate and the bytes it
    moves across nodes."""
    est = estimate_step(plan, cost, routed)
    per_token = 2.0 * cost.qkvo_bytes(1) * cost.model.num_layers  # forward and backward
    moved = sum(t.end - t.start for t in plan.transfers if t.src != t.dst)
    return PlanEstimate(est.rank_attention_s, est.rank_linear_s, est.step_s,
                        ring_cross_node_bytes(plan, cost),
                        plan.remap_cross_node_tokens() * per_token, moved * per_token,
                        est.remap_s)


def iteration_seconds(estimates: Sequence[PlanEstimate], cost: CostModel) -> float:
    """An iteration's estimate from its micro-batches' (``estimate_plan`` on ``cost``): their
    step estimates plus, per micro-batch, the model's fixed time
    (``HardwareProfile.linear_fixed_us``: the same in every plan, so the planner scores plans
    without it). What the training logs print as ``est.``."""
    if not estimates:
        return 0.0
    fixed = cost.hardware.linear_fixed_us * 1e-6
    return sum(e.step_s + fixed for e in estimates)


def remap_a2a_seconds(moves: Iterable[Move], topology: Topology, cost: CostModel) -> float:
    """One all-to-all of the remap (``qkvo_bytes`` per token and GPU): inside a node over the
    GPUs' NVLink, across nodes through the sending and receiving GPUs' own NICs (static
    affinity; a rank's ``tp`` GPUs each move their heads); the busiest link sets the time."""
    cluster, tp, gpn = cost.cluster, cost.tp, topology.gpus_per_node
    nv_out: dict[int, int] = {}
    nv_in: dict[int, int] = {}
    nic_out: dict[tuple[int, int], int] = {}
    nic_in: dict[tuple[int, int], int] = {}
    for src, dst, n in moves:
        if src // gpn == dst // gpn:
            nv_out[src] = nv_out.get(src, 0) + n
            nv_in[dst] = nv_in.get(dst, 0) + n
            continue
        for i in range(tp):
            a = (src // gpn, cluster.gpu_to_nic[(src % gpn) * tp + i])
            b = (dst // gpn, cluster.gpu_to_nic[(dst % gpn) * tp + i])
            nic_out[a] = nic_out.get(a, 0) + n
            nic_in[b] = nic_in.get(b, 0) + n
    per_token = cost.qkvo_bytes(1)
    nvlink = max([0, *nv_out.values(), *nv_in.values()]) * per_token
    nic = max([0, *nic_out.values(), *nic_in.values()]) * per_token
    times = [0.0]
    if nvlink:
        times.append(nvlink / cluster.nvlink_byte_per_s + cluster.nvlink_latency_us * 1e-6)
    if nic:
        times.append(nic / cluster.nic_byte_per_s + cluster.nic_latency_us * 1e-6)
    return max(times)


def remap_fixed_seconds(moves: Sequence[Move], topology: Topology, cost: CostModel) -> float:
    """What one step's remap pays besides ``remap_a2a_seconds`` x 2 x layers (0 when no token
    moves): per layer and direction the remap is two exchanges (q, k, v there, the output
    back, attention between them), and ``remap_a2a_seconds`` prices their bytes with one link
    latency, so the second one's latency (of the slowest link the moves use); and the remap's
    host work, all layers, forward and backward (``CostKernel.remap_step_s``: the hardware
    profile's ``remap_overhead_us``, measured by the runtime's probe)."""
    moves = [m for m in moves if m.tokens > 0 and m.src != m.dst]
    if not moves:
        return 0.0
    kernel, gpn = cost.kernel, topology.gpus_per_node
    cross = any(m.src // gpn != m.dst // gpn for m in moves)
    inside = any(m.src // gpn == m.dst // gpn for m in moves)
    latency = max(kernel.nic_latency_s if cross else 0.0,
                  kernel.nvlink_latency_s if inside else 0.0)
    return 2.0 * kernel.layers * latency + kernel.remap_step_s


def grad_allreduce_seconds(cost: CostModel) -> float:
    """Seconds of the gradient all-reduce over the pool (grads in the model's dtype).

    Hierarchical ring: reduce-scatter inside the node over NVLink, all-reduce across nodes of
    each GPU's 1/g slice (all GPUs of a node share its NICs), all-gather inside the node:
    2 (g-1)/g S / nvlink + 2 (n-1)/n S_node / (NICs x NIC bandwidth), S = bytes per GPU,
    g = ranks per node.
    """
    cluster, tp, nodes = cost.cluster, cost.tp, cost.cluster.nodes
    per_gpu = cost.model.parameter_count() * cost.model.bytes_per_element / tp
    g = cluster.gpus_per_node // tp
    intra = 2.0 * (g - 1) / g * per_gpu / cluster.nvlink_byte_per_s if g > 1 else 0.0
    nics = len(set(cluster.gpu_to_nic))
    node_bytes = per_gpu * tp  # every TP shard of the node's ranks crosses the NICs
    inter = 2.0 * (nodes - 1) / nodes * node_bytes / (nics * cluster.nic_byte_per_s) \
        if nodes > 1 else 0.0
    return intra + inter


def ring_cross_node_bytes(plan: Plan, cost: CostModel) -> float:
    """Bytes the plan's rings send between nodes (forward + backward, all layers)."""
    node = plan.topology.node_of
    total = 0.0
    for task in plan.tasks:
        if task.tier != Tier.INTER:
            continue
        ring = task.ring
        hops = sum(node(a) != node(b) for a, b in zip(ring, ring[1:] + ring[:1]))
        total += hops * cost.ring_bytes(plan.seqlens[task.seq], len(ring))
    return total
