"""The ``flash_attn3`` backend against a CPU stand-in of FlashAttention-3's two Python
interfaces (2025's plain functions: ``window_size`` pair, ``causal``, every parameter required;
later ``torch.library`` custom ops: ``window_size_left/right``, the backward's ``is_causal``),
built on the varlen kernel stand-in with FlashAttention-3's head-dim rule (``flash_standin``):
exact against the float64 math path, forward and backward; a build before 2025-01 (no
offsets in ``_flash_attn_forward``) is reported unusable."""
from __future__ import annotations

import types

import pytest
import torch
from flash3_standin import StandInFA3
from test_kernels import against_math_path, assert_like_math_path

from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.kernels import flash_attn3

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(params=[("custom_op", True), ("2025", True), ("2025", False)],
                ids=["custom-op", "2025-04", "2025-01"])
def standin(request, monkeypatch) -> StandInFA3:
    module = StandInFA3(*request.param)
    monkeypatch.setattr(kernels.get("flash_attn3"), "load", lambda: module)
    monkeypatch.setattr(kernels.get("flash_attn3"), "split_dims_refused", False)
    monkeypatch.setattr(flash_attn3.base, "device_capability", lambda device: (9, 0))
    return module


PIECES = [(5, 5), (1, 1), (9, 9), (0, 0), (7, 3), (2, 9), (4, 0)]


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, 0)),
                                           (False, (2, 3))],
                         ids=["causal", "full", "band(3,0)", "band(2,3)"])
@pytest.mark.parametrize("heads,kv_heads,d,v_dim", [(4, 4, 16, 16), (4, 2, 16, 16),
                                                    (4, 1, 16, 8), (2, 1, 192, 128),
                                                    (2, 1, 128, 64), (2, 2, 20, 20)],
                         ids=["mha", "gqa", "mqa-small-v", "mla-192-128", "v-unlike-padded",
                              "dims-not-8"])
def test_flash_attn3_runs_blocks_exactly(standin, causal, window, heads, kv_heads, d, v_dim):
    """Causal, full and windowed blocks (rows without keys included), MHA/GQA/MQA, and value
    head dims unlike q/k's: unpadded where FlashAttention-3 trains them (192/128 on Hopper,
    from its 2025-04 build: an older one refuses, and the backend pads from then on), padded
    to one multiple of 8 otherwise; the same results either way."""
    got, want = against_math_path("flash_attn3", PIECES, causal, window, heads, kv_heads, d,
                                  v_dim, seed=3)
    assert_like_math_path(got, want, 3e-2)
    native = flash_attn3.native_dims(d, v_dim, 9) and d % 8 == 0 and v_dim % 8 == 0 and \
        (standin.split_dims or d == v_dim)
    kernel_dims = {(c[1], c[2]) for c in standin.calls}
    if native:
        assert kernel_dims == {(d, v_dim)}  # MLA's 192/128 runs unpadded
    else:
        padded = -(-max(d, v_dim) // 8) * 8
        assert kernel_dims == {(padded, padded)}


def test_flash_attn3_head_dim_rule_and_refusals(monkeypatch):
    """FlashAttention-3 trains q/k 192 with v 128 unpadded on Hopper only, and no head dim
    over 256; below sm80 the backend refuses; not installed, it says how to build it."""
    assert flash_attn3.native_dims(192, 128, 9) and flash_attn3.native_dims(128, 128, 8)
    assert not flash_attn3.native_dims(192, 128, 8) and not flash_attn3.native_dims(128, 64, 9)
    assert not flash_attn3.native_dims(64, 512, 9)  # the forward runs it, the backward not
    backend = kernels.get("flash_attn3")
    big = torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), torch.zeros(1, 1, 320)
    with pytest.raises(ValueError, match=r"backend 'flash_attn3' trains head dims up to 256, "
                                         r"got q/k 64 and v 320"):
        backend._dims(*big)
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0),
                              shape=(8, 4, 128))
    monkeypatch.setattr(flash_attn3.base, "device_capability", lambda device: (7, 5))
    assert backend.refuses(q) == "needs sm80+, got sm75"
    monkeypatch.setattr(flash_attn3.base, "device_capability", lambda device: (9, 0))
    assert backend.refuses(q) is None
    assert backend.refuses(types.SimpleNamespace(**{**vars(q), "shape": (8, 4, 320)})) == \
        "trains head dims up to 256, got 320"
    monkeypatch.setattr(backend, "load", lambda: None)
    assert "hopper/ folder" in backend.unavailable()
    assert backend.kernel == "fa3" and backend.window_limit is None


def test_flash_attn3_before_2025_is_unusable_by_name(monkeypatch):
    """2024's FlashAttention-3 had varlen as another function: its ``_flash_attn_forward``
    takes no offsets, so the backend says which build it needs instead of a TypeError."""
    old = types.SimpleNamespace(
        _flash_attn_forward=lambda q, k, v, softmax_scale, causal, window_size: None)
    backend = kernels.get("flash_attn3")
    monkeypatch.setattr(backend, "load", lambda: old)
    assert backend.unavailable().startswith("needs FlashAttention-3 from 2025-01 or later")
    monkeypatch.setattr(backend, "load", lambda: StandInFA3("custom_op"))
    assert backend.unavailable() is None


@pytest.mark.parametrize("pieces", [[(3, 0), (2, 0)], [(0, 4)]], ids=["no-keys", "no-queries"])
def test_flash_attn3_runs_no_kernel_on_a_block_without_rows(standin, pieces):
    """A block without key (or query) rows: output 0, lse -inf, zero gradients, no call."""
    got, want = against_math_path("flash_attn3", pieces, True, None, 2, 1, 16, 16, seed=4)
    assert_like_math_path(got, want, 3e-2)
    assert standin.calls == []
