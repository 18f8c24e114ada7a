"""The engine's tensor code runs without ``__torch_function__`` handling (``plain_ops``).

Its ops are plain ops on plain tensors it made or was handed (activations), on their own
device: no handler has anything to change there. A function mode active around them costs a
Python call per op, and the ring loop makes thousands per step: on CPU, ``megatron/common/cpu.py``
runs the whole training step under ``CudaToCpuMode`` (CUDA device arguments -> CPU), where it
was the largest host cost of a ring-heavy step after the kernels (``zeppelin bench overhead``).
"""
from __future__ import annotations

import torch


def plain_ops():
    """A context in which torch calls skip every ``__torch_function__`` mode and subclass
    handler (``torch._C.DisableTorchFunction``); the ops and their results are unchanged."""
    return torch._C.DisableTorchFunction()
