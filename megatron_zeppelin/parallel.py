"""``PoolLayout``: how the world's ranks form zeppelin pools, validated once, used everywhere.

Megatron's rank order (``tp-cp-ep-dp-pp``, tensor parallelism innermost, pipeline outermost):
global rank ``g = ((s * dp + d) * cp + p) * tp + t`` for pipeline stage ``s``, data-parallel
replica ``d``, pool position ``p`` (a rank of the plan) and TP rank ``t``. Megatron itself runs
with its CP at 1, so its data-parallel index is ``d * cp + p`` (our CP folded into its DP).
A *pool* is the ``cp`` ranks (``--context-parallel-size``) of one replica, one TP rank and one
pipeline stage; the planner places each micro-batch on it (every stage of a pipeline plans the
same micro-batch from the same lengths, so its pools run the same plan), and the ``tp`` TP ranks of a pool position hold the same
tokens and their own heads. Nodes hold ``gpus_per_node`` consecutive GPUs, so a pool spans
``cp * tp / gpus_per_node`` nodes with ``gpus_per_node / tp`` pool ranks each: the planner's
``Topology``.

Training (``megatron/loop/train.py``), the Megatron-LM glue (``megatron/lm/glue.py``) and the tests
derive every group, topology and count from one ``PoolLayout`` (``megatron/common/groups.py`` builds
the process groups). Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.plan import Topology


@dataclass(frozen=True)
class PoolLayout:
    """world_size: ranks in all; tp: tensor-parallel size; cp: ranks of a pool (the CP size a
    user asks for); gpus_per_node: GPUs of one node (the emulated node size on CPU); pp:
    pipeline stages (``--pipeline-model-parallel-size``)."""

    world_size: int
    tp: int
    cp: int
    gpus_per_node: int
    pp: int = 1

    def __post_init__(self) -> None:
        world, tp, cp, gpn, pp = self.world_size, self.tp, self.cp, self.gpus_per_node, self.pp
        for flag, value in (("world size", world), ("--tensor-model-parallel-size", tp),
                            ("--context-parallel-size", cp),
                            ("--zeppelin-gpus-per-node", gpn),
                            ("--pipeline-model-parallel-size", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{flag}={value!r} is invalid: expected an integer >= 1")
        if world % tp:
            raise ConfigError(f"--tensor-model-parallel-size={tp} is invalid: expected a divisor "
                              f"of the world size {world}")
        if world % (tp * pp):
            raise ConfigError(f"--pipeline-model-parallel-size={pp} is invalid: expected a "
                              f"divisor of world size / TP = {world // tp}")
        if world % (tp * cp * pp):
            raise ConfigError(f"--context-parallel-size={cp} is invalid: expected a divisor of "
                              f"world size / (TP x PP) = {world // (tp * pp)}")
        if gpn % tp or (cp * tp) % gpn:
            raise ConfigError(f"--context-parallel-size={cp} does not match the topology: CP x TP"
                              f" = {cp * tp} GPUs must be whole nodes of --zeppelin-gpus-per-node"
                              f"={gpn} GPUs (a multiple of TP={tp})")

    @classmethod
    def resolve(cls, world_size: int, tp: int, cp: int, gpus_per_node: int | None,
                local_world_size: int | None, pp: int = 1) -> "PoolLayout":
        """The layout for these flags; ``gpus_per_node`` defaults to torchrun's local world size
        (processes on this node), capped at one pool (``cp * tp``)."""
        if gpus_per_node is None:
            gpus_per_node = min(cp * tp, local_world_size or cp * tp)
        return cls(world_size, tp, cp, gpus_per_node, pp)

    # ------------------------------------------------------------------ derived sizes
    @property
    def dp(self) -> int:
        """Pools per TP rank and pipeline stage: the data-parallel replicas (Megatron's
        data-parallel size is ``dp * cp``: CP folded in)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def nodes(self) -> int:
        """Nodes one pool spans."""
        return self.cp * self.tp // self.gpus_per_node

    @property
    def ranks_per_node(self) -> int:
        """Pool ranks (TP groups) per node."""
        return self.gpus_per_node // self.tp

    @property
    def topology(self) -> Topology:
        """The planner's view of one pool."""
        return Topology(nodes=self.nodes, gpus_per_node=self.ranks_per_node)

    # ------------------------------------------------------------------ ranks
    def pool_ranks(self, replica: int, tp_rank: int, stage: int = 0) -> list[int]:
        """Global ranks of the pool of data-parallel ``replica``, TP rank ``tp_rank`` and
        pipeline ``stage``, in pool (plan) order."""
        return [((stage * self.dp + replica) * self.cp + p) * self.tp + tp_rank
                for p in range(self.cp)]

    def pools(self) -> list[tuple[int, int, list[int]]]:
        """Every pool as ``(replica, tp_rank, global ranks)``, in creation order (stage by
        stage)."""
        return [(d, t, self.pool_ranks(d, t, s)) for s in range(self.pp)
                for d in range(self.dp) for t in range(self.tp)]

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Global ranks of ``rank``'s pipeline, stage by stage (Megatron's PP group)."""
        stride = self.world_size // self.pp
        return [rank % stride + s * stride for s in range(self.pp)]

    def tp_groups(self) -> list[list[int]]:
        """Every TP group's global ranks (consecutive: TP is innermost), in rank order."""
        return [list(range(start, start + self.tp))
                for start in range(0, self.world_size, self.tp)]

    def position(self, rank: int) -> tuple[int, int, int]:
        """``(replica, pool rank, tp rank)`` of global ``rank`` (its stage: ``stage``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is invalid: expected in [0, {self.world_size})")
        return rank // (self.tp * self.cp) % self.dp, rank // self.tp % self.cp, rank % self.tp

    def stage(self, rank: int) -> int:
        """Pipeline stage of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is invalid: expected in [0, {self.world_size})")
        return rank // (self.world_size // self.pp)

    def micro_batches(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches per iteration and pool: global batch / (micro-batch x replicas)."""
        per_step = micro_batch_size * self.dp
        if micro_batch_size < 1 or global_batch_size < per_step or global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size={global_batch_size} must be a multiple of "
                              f"--micro-batch-size x data-parallel size = "
                              f"{micro_batch_size} x {self.dp}")
        return global_batch_size // per_step
