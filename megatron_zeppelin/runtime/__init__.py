"""Runtime over torch.distributed: ring attention engine, remapping layer, routed P2P."""

from megatron_zeppelin.runtime.attention import ZigzagLayout, ring_attention
from megatron_zeppelin.runtime.engine import AttentionEngine
from megatron_zeppelin.runtime.kernels import block_backward, block_forward
from megatron_zeppelin.runtime.utils import RingComm, merge_lse

__all__ = ["AttentionEngine", "RingComm", "ZigzagLayout", "block_backward", "block_forward",
           "merge_lse", "ring_attention"]
