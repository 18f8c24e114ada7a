"""Index tensors of a plan moved to the device once, ahead of the step.

The engine's per-step loop only reads tensors built here: every block's row indices and
int32 offsets, built on the host from the plan, then moved together (one pinned host buffer and
one asynchronous copy per dtype on CUDA), so the hot path does no host-device transfer, no
allocation of index tensors and no host sync.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(tensors: Sequence[torch.Tensor | None], device: torch.device | str
              ) -> list[torch.Tensor | None]:
    """Host tensors on ``device`` (None stays None), same shapes, as views of one buffer per
    dtype; tensors already there (and everything for a CPU ``device``) are returned as they
    are."""
    device = torch.device(device)
    out = list(tensors)
    if device.type == "cpu":
        return out
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if tensor is not None and tensor.device != device:
            by_dtype.setdefault(tensor.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        if device.type == "cuda":
            flat = flat.pin_memory()
        moved = flat.to(device, non_blocking=True)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = moved[offset:offset + n].view(tensors[i].shape)
            offset += n
    return out
