"""The attention engine's rounds, simulated for every rank at once (numpy over ranks).

Mirrors ``runtime/engine.py`` through ``schedule`` (the engine's round structure, stated once:
which round sends KV or dK/dV, how many rounds and global steps, the LOCAL calls and their
default size): a wave runs in rounds ``r = 0, 1, ...``; in round r a rank
posts the step-r exchange of every ring it is in (INTER and INTRA, async), computes step r of
every ring, then runs LOCAL calls while the round's exchanges are in flight (a call starts only
before they complete, so it may overrun them by one call), then waits for the exchanges; the
LOCAL calls left after the last round run at the end. LOCAL calls are the engine's
(``local_call_groups``: shortest first, short sequences batched), each its sequences' seconds
plus one launch. Forward: a G-ring computes G steps and exchanges KV in rounds 0..G-2.
Backward: G compute steps and G+1 exchanges (KV in rounds 0..G-2, the dKV accumulator in the
accumulator dtype, fp32 for bf16, in rounds 1..G). Times are seconds of one layer.
``Links.local_policy`` ``fill`` (LOCAL work, infinitely divisible, fills exactly the waits: an
idealised engine) and ``share`` (the previous engine: one s^2-balanced LOCAL run per round with
traffic in flight) are there for comparison.

Exchanges: a ring hop p -> p+1 starts when both ranks have started the round and takes
bytes / bandwidth + latency: NVLink inside a node; across nodes, per ``inter_mode``:

* ``ring``: P2P through the static NICs of the two GPUs; all cross-node hops of the same round
  share the NICs (each NIC serves its messages one after the other).
* ``direct`` / ``routed``: the cross-node hops of every INTER ring form one global step per
  round (``runtime/inter.py``). Rings that share no node share no NIC and no proxy, so each
  group of node-connected inter-node rings is timed on its own by ``network.inter_step_time``
  (the router's model); its step starts when every rank of its nodes (sources, destinations,
  proxies) has started the round, and those ranks wait for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from megatron_zeppelin.config import ClusterSpec
from megatron_zeppelin import schedule
from megatron_zeppelin.plan import Tier, local_call_groups
from megatron_zeppelin.schedule import LOCAL_CALL_TOKENS, Phase, sends_dkv, sends_kv
from megatron_zeppelin.sim.network import GpuMap, inter_step_time

INTER_MODES = ("ring", "direct", "routed")
LOCAL_POLICIES = ("engine", "fill", "share")


class RingCosts(NamedTuple):
    """A ring group of a wave: members in ring order, per-step forward compute (seconds, incl.
    one kernel launch; one number, or one per step where a sliding window makes them differ),
    KV bytes each member sends per step and, in KV bytes, the dK/dV
    accumulator it sends (fewer than the KV's whole chunk under a sliding window; None: the
    same as ``kv_bytes``); ``cross[p]``: hop p -> p+1 crosses nodes. ``halo``: a windowed
    group run by halo exchange (``runtime/halo.py``): the rounds of a ring of
    ``schedule.HALO_ROUNDS_SIZE``, each member sending ``kv_bytes`` (``dkv_bytes``) to each
    neighbour, ``step_s`` its two rounds' compute."""

    index: int
    members: np.ndarray
    tier: Tier
    step_s: float | np.ndarray
    kv_bytes: float
    cross: np.ndarray
    dkv_bytes: float | None = None
    halo: bool = False

    @property
    def accumulator_bytes(self) -> float:
        return self.kv_bytes if self.dkv_bytes is None else self.dkv_bytes

    @property
    def rounds_size(self) -> int:
        """The ring size whose rounds it runs (``schedule``)."""
        return schedule.HALO_ROUNDS_SIZE if self.halo else len(self.members)

    @property
    def steps(self) -> int:
        """Rounds with compute: one per step (its own ``step_s`` entries where given)."""
        return len(self.step_s) if np.ndim(self.step_s) else len(self.members)


@dataclass(frozen=True)
class PassSpec:
    """One pass: ``backward`` or not, compute scale (1 or the bwd ratio), accumulator bytes
    per KV byte (dKV travels in the accumulator dtype), seconds of one kernel launch."""

    backward: bool
    compute_scale: float
    acc_per_kv_byte: float
    launch_s: float


@dataclass(frozen=True)
class Links:
    """What the rounds need of the cluster and the engine: GPU placement, link speeds, the
    inter mode, the router backend, and the LOCAL policy (``engine``: LOCAL calls while the
    round's traffic is in flight, as ``runtime/engine.py``; ``fill``: LOCAL work fills exactly
    the waits for traffic, an idealised engine; ``share``: the previous engine, one
    s^2-balanced LOCAL run per round); see the module docstring."""

    gpus: GpuMap
    inter_mode: str
    router: str
    local_policy: str = "engine"
    nvlink_contention: float = 1.0  # intra hop time factor in rounds with a routed global step

    @property
    def cluster(self) -> ClusterSpec:
        return self.gpus.cluster


def _phase(spec: PassSpec) -> Phase:
    return Phase.BACKWARD if spec.backward else Phase.FORWARD


def exchange_rounds(size: int, spec: PassSpec) -> int:
    """Rounds in which a ring of ``size`` ranks has an exchange in flight."""
    return schedule.exchange_rounds(size, _phase(spec))


def round_bytes(sizes: np.ndarray, kv_bytes: np.ndarray, r: int, spec: PassSpec,
                dkv_bytes: np.ndarray | None = None, halo: np.ndarray | bool = False
                ) -> np.ndarray:
    """Bytes each member of each ring sends (per hop) in round ``r`` (KV, plus the dKV
    accumulator in backward); ``sizes`` (``RingCosts.rounds_size``)/``kv_bytes``/``dkv_bytes``
    (the accumulator in KV bytes; None: as ``kv_bytes``)/``halo`` per ring."""
    out = np.where(sends_kv(sizes, r), kv_bytes, 0.0)
    if spec.backward:
        acc = kv_bytes if dkv_bytes is None else dkv_bytes
        out = out + np.where(sends_dkv(sizes, r, halo), acc * spec.acc_per_kv_byte, 0.0)
    return out


def local_call_seconds(work: list[tuple[float, float]], launch_s: float,
                       min_tokens: int = LOCAL_CALL_TOKENS) -> list[float]:
    """Seconds of each of the engine's LOCAL calls in run order: ``work`` = (s^2, seconds) per
    sequence in queue order; a call costs its sequences' seconds plus one launch."""
    calls = local_call_groups([sq for sq, _ in work], min_tokens)
    return [sum(work[i][1] for i in call) + launch_s for call in calls]


def local_parts(work: list[tuple[float, float]], rounds: int, launch_s: float) -> list[float]:
    """Seconds of each round's LOCAL run of the ``share`` policy: ``work`` = (s^2, seconds)
    per sequence in queue order, cut into at most ``rounds`` consecutive runs of similar s^2."""
    if not work:
        return []
    total = sum(sq for sq, _ in work)
    parts, acc, current = [], 0.0, 0.0
    for sq, seconds in work:
        acc += sq
        current += seconds
        if len(parts) < rounds - 1 and acc * rounds >= total * (len(parts) + 1):
            parts.append(current + launch_s)
            current = 0.0
    if current > 0.0 or len(parts) < 1:
        parts.append(current + launch_s)
    return parts


class _Hops:
    """Every ring hop of a wave, flat; rings ordered by the size whose rounds they run,
    longest first, so the hops of the rings still exchanging in a round are a prefix. Hop h
    goes ``src[h] -> dst[h]``: p -> p+1, and for a halo group also p -> p-1."""

    def __init__(self, rings: list[RingCosts], gpus: GpuMap) -> None:
        self.rings = sorted((g for g in rings if len(g.members) > 1),
                            key=lambda g: -g.rounds_size)
        self.sizes = np.asarray([g.rounds_size for g in self.rings], dtype=np.int64)
        self.halo = np.asarray([g.halo for g in self.rings], dtype=bool)
        self.kv = np.asarray([g.kv_bytes for g in self.rings])
        self.dkv = np.asarray([g.accumulator_bytes for g in self.rings])
        ways = [((g.members, np.roll(g.members, -1), g.cross),) + (
            ((g.members, np.roll(g.members, 1), np.roll(g.cross, 1)),) if g.halo else ())
            for g in self.rings]  # (sources, destinations, crosses nodes) per direction
        hops = [way for ring in ways for way in ring]
        self.src = np.concatenate([w[0] for w in hops]) if hops else np.zeros(0, np.int64)
        self.dst = np.concatenate([w[1] for w in hops]) if hops else self.src
        counts = [sum(len(w[0]) for w in ring) for ring in ways]
        self.ring = np.repeat(np.arange(len(self.rings)), counts)
        self.ends = np.cumsum(counts)
        self.cross = np.concatenate([w[2] for w in hops]) if hops else np.zeros(0, bool)
        self.src_nic = _nic_ids(self.src, gpus)
        self.dst_nic = _nic_ids(self.dst, gpus)
        self.nics = gpus.cluster.nodes * gpus.cluster.nics_per_node

    def active(self, r: int, spec: PassSpec) -> int:
        """Hops of the rings that still exchange in round ``r`` (a prefix)."""
        rounds = schedule.exchange_rounds(self.sizes, _phase(spec))
        k = int(np.count_nonzero(rounds > r))
        return int(self.ends[k - 1]) if k else 0


def _nic_ids(ranks: np.ndarray, gpus: GpuMap) -> np.ndarray:
    """[hops, tp]: global NIC index (node * nics + nic) of each GPU of each rank."""
    cluster, tp = gpus.cluster, gpus.tp
    affinity = np.asarray(cluster.gpu_to_nic, dtype=np.int64).reshape(gpus.ranks_per_node, tp)
    node, local = np.divmod(ranks, gpus.ranks_per_node)
    return affinity[local] + (node * cluster.nics_per_node)[:, None]


class _RoundState:
    """Per-round start times and exchange completions of every rank; the caches of a pass."""

    def __init__(self, world: int) -> None:
        self.start = np.zeros(world)
        self.arrive = np.full(world, -np.inf)  # the round's last exchange completes
        self.step_cache: dict[tuple, float] = {}


class _LocalQueue:
    """Every rank's LOCAL work under a policy (``share``'s is in the compute matrix).

    ``engine``: the calls as padded prefix sums, ``prefix[rank, j]`` = seconds of the rank's
    first j calls (+inf past its last call; a rank with no traffic in the wave, ``quiet``, runs
    one fused call); ``done[rank]``: calls run so far. ``fill``: ``left[rank]`` seconds,
    infinitely divisible, one launch per rank.
    """

    def __init__(self, local: list[list[tuple[float, float]]], spec: PassSpec, policy: str,
                 quiet: np.ndarray) -> None:
        self.policy, world = policy, len(local)
        calls = [([] if policy != "engine" or not w else
                  [sum(t for _, t in w) + spec.launch_s] if quiet[rank] else
                  local_call_seconds(w, spec.launch_s)) for rank, w in enumerate(local)]
        self.count = np.asarray([len(c) for c in calls], dtype=np.int64)
        self.prefix = np.full((world, int(self.count.max(initial=0)) + 2), np.inf)
        self.prefix[:, 0] = 0.0
        for rank, seconds in enumerate(calls):
            self.prefix[rank, 1:len(seconds) + 1] = np.cumsum(seconds) * spec.compute_scale
        self.done = np.zeros(world, dtype=np.int64)
        self.rows = np.arange(world)
        self.left = np.asarray([(sum(t for _, t in w) + spec.launch_s) * spec.compute_scale
                                if w and policy == "fill" else 0.0 for w in local])
        self.total = self.prefix[self.rows, self.count] + self.left

    def fill(self, ready: np.ndarray, arrive: np.ndarray) -> np.ndarray:
        """Per rank, when its LOCAL work of the round ends: from ``ready`` (its ring steps
        done) while the round's exchanges are in flight (until ``arrive``)."""
        if self.policy == "fill":
            used = np.minimum(self.left, np.maximum(arrive - ready, 0.0))
            self.left -= used
            return ready + used
        if self.policy == "share":
            return ready
        # a call starts while ready + (its predecessors of the round) < arrive
        base = ready - self.prefix[self.rows, self.done]
        cols = np.arange(self.prefix.shape[1])
        stop = (base[:, None] + self.prefix >= arrive[:, None]) & \
            (cols[None, :] >= self.done[:, None])
        self.done = np.minimum(stop.argmax(axis=1), self.count)
        return base + self.prefix[self.rows, self.done]

    def rest(self) -> np.ndarray:
        """Seconds of the LOCAL work left after the last round."""
        return self.prefix[self.rows, self.count] - self.prefix[self.rows, self.done] + self.left


def simulate_pass(rings: list[RingCosts], local: list[list[tuple[float, float]]],
                  world: int, spec: PassSpec, links: Links) -> tuple[np.ndarray, np.ndarray]:
    """(end time, compute seconds) per rank of one attention pass of one wave, one layer."""
    inter = [g for g in rings if g.tier == Tier.INTER]
    global_mode = links.inter_mode != "ring" and bool(inter)
    global_steps = 0
    if global_mode:
        global_steps = schedule.wave_global_steps(((len(g.members), g.halo) for g in inter),
                                                  _phase(spec))
    share = links.local_policy == "share"
    compute = _compute_matrix(rings, local if share else [[] for _ in local], world, spec,
                              global_steps)
    quiet = np.full(world, global_steps == 0)
    for ring in rings:
        quiet[ring.members] = False
    queue = _LocalQueue(local, spec, links.local_policy, quiet)
    components = _node_components(inter, links.gpus) if global_mode else []
    hops = _Hops(rings, links.gpus)
    state = _RoundState(world)
    for r in range(compute.shape[0]):
        state.arrive = np.full(world, -np.inf)
        _ring_exchanges(hops, r, spec, links, state, skip_cross=global_mode,
                        contended=links.inter_mode == "routed" and r < global_steps)
        for rings_c, ranks_c in (components if r < global_steps else ()):
            seconds = _global_step(rings_c, r, spec, links, state)
            if seconds > 0:
                finish = state.start[ranks_c].max() + seconds
                state.arrive[ranks_c] = np.maximum(state.arrive[ranks_c], finish)
        state.start = np.maximum(queue.fill(state.start + compute[r], state.arrive),
                                 state.arrive)
    return state.start + queue.rest(), compute.sum(axis=0) + queue.total


def _compute_matrix(rings: list[RingCosts], local: list[list[tuple[float, float]]],
                    world: int, spec: PassSpec, global_steps: int) -> np.ndarray:
    """compute[r, rank]: seconds of ring steps and the LOCAL share each rank runs in round r."""
    busy = np.full(world, global_steps, dtype=np.int64)
    for ring in rings:
        busy[ring.members] = np.maximum(busy[ring.members],
                                        exchange_rounds(ring.rounds_size, spec))
    parts = [local_parts(work, max(1, int(b)), spec.launch_s) if work else []
             for work, b in zip(local, busy)]
    rounds = max([global_steps, 1, *(len(p) for p in parts),
                  *(exchange_rounds(g.rounds_size, spec) for g in rings),
                  *(g.steps for g in rings)])
    compute = np.zeros((rounds + 1, world))  # a ring adds its step to rows [0, G): diffs
    even = [g for g in rings if np.ndim(g.step_s) == 0]
    if even:
        members = np.concatenate([g.members for g in even])
        sizes = np.repeat([len(g.members) for g in even], [len(g.members) for g in even])
        steps = np.repeat([g.step_s * spec.compute_scale for g in even],
                          [len(g.members) for g in even])
        np.add.at(compute[0], members, steps)
        np.add.at(compute, (sizes, members), -steps)
    compute = np.cumsum(compute, axis=0)[:rounds]
    for ring in rings:  # per-step seconds (sliding windows): step r in round r
        if np.ndim(ring.step_s):
            compute[:ring.steps, ring.members] += \
                np.asarray(ring.step_s)[:, None] * spec.compute_scale
    for rank, seconds in enumerate(parts):
        if seconds:
            compute[:len(seconds), rank] += np.asarray(seconds) * spec.compute_scale
    return compute


def _node_components(inter: list[RingCosts], gpus: GpuMap
                     ) -> list[tuple[list[RingCosts], np.ndarray]]:
    """Inter-node rings grouped by shared nodes, with every rank of each group's nodes."""
    per_node = gpus.ranks_per_node
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    ring_nodes = [sorted({int(r) // per_node for r in g.members}) for g in inter]
    for nodes in ring_nodes:
        for n in nodes[1:]:
            parent[find(n)] = find(nodes[0])
    groups: dict[int, tuple[list[RingCosts], set[int]]] = {}
    for ring, nodes in zip(inter, ring_nodes):
        rings, members = groups.setdefault(find(nodes[0]), ([], set()))
        rings.append(ring)
        members.update(nodes)
    return [(rings, np.asarray([n * per_node + i for n in sorted(nodes)
                                for i in range(per_node)], dtype=np.int64))
            for rings, nodes in groups.values()]


def _ring_exchanges(hops: _Hops, r: int, spec: PassSpec, links: Links, state: _RoundState,
                    skip_cross: bool, contended: bool = False) -> None:
    """Round ``r``'s ring P2P: a rank waits for its send to the next member and its receive
    from the previous one; a hop starts when both ends have started the round. Cross-node
    hops use the static NICs, shared by all of the round's cross-node hops (``ring`` mode),
    or are skipped (they travel in the global step). ``contended``: the round has a routed
    global step whose dispatch / combine legs share NVLink: intra-node hops take
    ``links.nvlink_contention`` x their time."""
    n = hops.active(r, spec)
    if n == 0:
        return
    nbytes = round_bytes(hops.sizes, hops.kv, r, spec, hops.dkv, hops.halo)[hops.ring[:n]]
    cluster = links.cluster
    times = nbytes / cluster.nvlink_byte_per_s + cluster.nvlink_latency_us * 1e-6
    if contended:
        times = times * links.nvlink_contention
    cross = hops.cross[:n] & (nbytes > 0)
    if cross.any():
        times[cross] = -np.inf if skip_cross else _nic_times(hops, n, cross, nbytes, cluster)
    live = nbytes > 0
    src, dst = hops.src[:n][live], hops.dst[:n][live]
    done = np.maximum(state.start[src], state.start[dst]) + times[live]
    np.maximum.at(state.arrive, src, done)
    np.maximum.at(state.arrive, dst, done)


def _nic_times(hops: _Hops, n: int, cross: np.ndarray, nbytes: np.ndarray,
               cluster: ClusterSpec) -> np.ndarray:
    """Times of the round's cross-node hops when they share the static NICs: each NIC serves
    its messages one after another (bytes / bandwidth + latency each)."""
    per_message = nbytes[cross] / cluster.nic_byte_per_s + cluster.nic_latency_us * 1e-6
    out_nics, in_nics = hops.src_nic[:n][cross], hops.dst_nic[:n][cross]
    weights = np.repeat(per_message, out_nics.shape[1])
    egress = np.bincount(out_nics.ravel(), weights, hops.nics)
    ingress = np.bincount(in_nics.ravel(), weights, hops.nics)
    return np.maximum(egress[out_nics], ingress[in_nics]).max(axis=1)


def _global_step(inter: list[RingCosts], r: int, spec: PassSpec, links: Links,
                 state: _RoundState) -> float:
    """Seconds of global inter-node step ``r`` of node-connected rings ``inter``: each
    ring's hops across nodes, p -> p+1 (and p -> p-1 for a halo group)."""
    sizes = np.asarray([g.rounds_size for g in inter])
    per_ring = round_bytes(sizes, np.asarray([g.kv_bytes for g in inter]), r, spec,
                           np.asarray([g.accumulator_bytes for g in inter]),
                           np.asarray([g.halo for g in inter], dtype=bool))
    key = tuple((g.index, g.halo, float(b)) for g, b in zip(inter, per_ring) if b > 0)
    if key in state.step_cache:
        return state.step_cache[key]
    flows: dict[tuple[int, int], float] = {}
    gpus = links.gpus
    for ring, nbytes in zip(inter, per_ring):
        if nbytes <= 0:
            continue
        members = ring.members
        for p in np.flatnonzero(ring.cross):
            ends = [(members[p], members[(p + 1) % len(members)])]
            for src, dst in ends + [end[::-1] for end in ends if ring.halo]:
                for a, b in zip(gpus.gpus(int(src)), gpus.gpus(int(dst))):
                    flows[(a, b)] = flows.get((a, b), 0.0) + nbytes
    state.step_cache[key] = inter_step_time(links.cluster, flows, links.inter_mode == "routed",
                                            links.router)
    return state.step_cache[key]
