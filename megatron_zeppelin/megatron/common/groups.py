"""Process groups of the zeppelin pools, derived from one ``PoolLayout`` (``parallel.py``)."""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.runtime.lanes import comm_options


@dataclasses.dataclass
class Pool:
    """This rank's pool: its process groups, data-parallel replica and rank inside the pool.

    group: the pool's ranks in plan order (ring P2P, remap all-to-all); route_group: a second
    group over the same ranks for the engine's global inter-node steps."""

    layout: PoolLayout
    group: dist.ProcessGroup
    route_group: dist.ProcessGroup
    index: int
    rank: int

    @property
    def size(self) -> int:
        return self.layout.cp


def new_pool_groups(layout: PoolLayout) -> Pool:
    """Create every pool's groups (torch.distributed needs every rank to create every group, in
    the same order) and return this rank's pool."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, the pool layout "
                         f"{layout.world_size}")
    me, mine = dist.get_rank(), None
    # a lost peer ends a wait on NCCL after the pool's P2P timeout (ZEPPELIN_P2P_TIMEOUT_S), as
    # on gloo, not after torch's default for new groups
    timeout = datetime.timedelta(seconds=env.p2p_timeout_s())
    for replica, _, ranks in layout.pools():
        # NCCL's streams of both at high priority (lanes.comm_options; gloo ignores it)
        group, route = (dist.new_group(ranks, timeout=timeout, pg_options=comm_options())
                        for _ in range(2))
        if me in ranks:
            mine = Pool(layout, group, route, replica, ranks.index(me))
    return mine


def new_tp_host_group(layout: PoolLayout) -> dist.ProcessGroup | None:
    """A gloo group over this rank's TP ranks (None with TP 1), for host-side facts TP rank 0
    shares without a device copy (e.g. a micro-batch's sequence lengths); every rank creates
    every TP group, in the same order."""
    if layout.tp == 1:
        return None
    me, mine = dist.get_rank(), None
    for ranks in layout.tp_groups():
        group = dist.new_group(ranks, backend="gloo")
        if me in ranks:
            mine = group
    return mine
