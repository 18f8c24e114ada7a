"""Megatron's pipeline schedules with a token count that changes per micro-batch, on any
pipeline size.

Zeppelin's linear layout gives each rank a different number of tokens in every micro-batch,
so stages send ``[tokens, 1, hidden]`` activations of changing length and megatron-core's
``variable_seq_lengths`` sends each shape first (``P2PCommunicator._communicate_shapes``).
megatron-core 0.16.1 posts those shape messages as one batch in the order send-prev,
recv-prev, send-next, recv-next on every rank. With two stages a rank's previous and next
stage are the same rank, and the interleaved schedule sends both ways in one call: rank A's
first message to B (its send-prev: a gradient's shape) then meets B's first receive from A
(its recv-prev: an activation's shape), and the stages exchange wrong shapes (found on gloo:
a stage received 103 tokens for a micro-batch of 109). ``OrderedP2PCommunicator`` sends the
shapes the way megatron-core sends the tensors themselves without batching (``_p2p_ops``:
even stages send first, odd stages receive first, and with two stages one direction goes over
the world group, so the two directions never meet), and ``schedule_kwargs`` turns the
batched tensor path off for the same reason. With virtual stages it also sets
``overlap_p2p_comm`` as Megatron-LM does (one direction per call; Megatron-LM refuses the
interleaved schedule on 2 stages without it, and without it a 2-stage run with 2 micro-batches
deadlocked here).
"""
from __future__ import annotations

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops


class OrderedP2PCommunicator(P2PCommunicator):
    """megatron-core's communicator whose shape exchange cannot mix up the two directions
    (module docstring). Shapes: ``[3]`` int64 on the current device (gloo: the CPU)."""

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        device = torch.cuda.current_device()

        def shape_of(tensor):
            return None if tensor is None else torch.tensor(tensor.size(), device=device,
                                                            dtype=torch.int64)

        def empty(wanted: bool):
            return torch.empty((3,), device=device, dtype=torch.int64) if wanted else None

        recv_prev_shape, recv_next_shape = empty(recv_prev), empty(recv_next)
        reqs = _p2p_ops(tensor_send_prev=shape_of(tensor_send_prev),
                        tensor_recv_prev=recv_prev_shape,
                        tensor_send_next=shape_of(tensor_send_next),
                        tensor_recv_next=recv_next_shape, group=self.pp_group,
                        prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank)
        for req in reqs.values():
            req.wait()
        return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
                [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())


def schedule_kwargs(config) -> dict:
    """Extra arguments of ``get_forward_backward_func()(...)`` for a pipelined model (PP > 1):
    the ordered communicator and megatron's process groups; sets ``config.batch_p2p_comm``
    off (tensors go through ``_p2p_ops``, ordered as the shapes) and, with virtual stages,
    ``overlap_p2p_comm`` on. ``{}`` without a pipeline."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if config.pipeline_model_parallel_size == 1:
        return {}
    # Megatron-LM's settings: the interleaved schedule overlaps its P2P, one direction per
    # call (without the overlap, 2 stages would send both ways between the same 2 ranks in
    # one call, which Megatron-LM refuses and which deadlocked here with 2 micro-batches)
    config.overlap_p2p_comm = bool(config.virtual_pipeline_model_parallel_size)
    config.batch_p2p_comm = False
    groups = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "cp", "pp", "embd", "pos_embd", "dp_cp"])
    communicator = OrderedP2PCommunicator(
        pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
    return {"p2p_communicator": communicator, "pg_collection": groups}
