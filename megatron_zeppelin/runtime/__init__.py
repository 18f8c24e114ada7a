"""Runtime over torch.distributed: ring attention engine, remapping layer, routed P2P.

One module per piece: ``kernels/`` (kernel backends behind one protocol), ``attention``
(zigzag ring of one group), ``engine`` (three queues, overlapped; ``waves``: its
waves, rings and LOCAL calls of a plan), ``lanes`` (CPU order vs CUDA
streams), ``ring_comm`` (the P2P ring helper), ``transport`` (direct or host-staged
communication; ``ordered``: NCCL's order matching checked on gloo, for tests), ``inter`` and
``routed_p2p`` (global inter-node steps), ``remap`` (linear <-> attention layout), ``merge``
(the LSE merge), ``device_index`` (plan indices moved once), ``ulysses`` (all-to-all
head-parallel attention of FlexSP's plans, behind the engine).
"""

from megatron_zeppelin.runtime.attention import ring_attention
from megatron_zeppelin.runtime.zigzag import ZigzagLayout
from megatron_zeppelin.runtime.engine import AttentionEngine
from megatron_zeppelin.runtime.kernels import block_backward, block_forward
from megatron_zeppelin.runtime.merge import merge_lse
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.runtime import ordered  # noqa: F401 (registers the "ordered" transport)

__all__ = ["AttentionEngine", "RingComm", "ZigzagLayout", "block_backward", "block_forward",
           "merge_lse", "ring_attention"]
