"""The ``te`` backend against a CPU stand-in of each Transformer Engine version's fused
attention (``te_standin``: TE 2.9-2.11, 2.12-2.14, 2.15-2.18 signatures, cuDNN 9.5-9.8, packed
or padded softmax stats): exact against the float64 math path, forward and backward, for the
bands each version runs; refused, naming the band or the flags, where it cannot."""
from __future__ import annotations

import types

import pytest
import torch
from te_standin import StandInTE
from test_kernels import against_math_path, assert_like_math_path

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.kernels import te as te_backend

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# (TE version, cuDNN, packed stats: None = cuDNN's rule, False = sm120 from TE 2.14; the
# sliding-window bands it runs, from TE's and cuDNN's sources: all, causal only, or none)
SETUPS = {"te2.11": ((2, 11), (9, 10, 2), None, "causal"),
          "te2.12-cudnn9.6": ((2, 12), (9, 6, 0), None, "none"),
          "te2.12-cudnn9.10.2": ((2, 12), (9, 10, 2), None, "all"),
          "te2.15": ((2, 15), (9, 11, 0), None, "all"),
          "te2.15-cudnn9.14.0": ((2, 15), (9, 14, 0), None, "none"),
          "te2.15-sm120": ((2, 15), (9, 18, 1), False, "all")}
CAUSAL = [(5, 5), (1, 1), (17, 17), (0, 0), (7, 3), (2, 9), (70, 6), (3, 0)]
FULL = [(5, 9), (7, 3), (1, 12), (4, 0), (0, 6), (16, 16)]


@pytest.fixture(params=list(SETUPS))
def standin(request, monkeypatch) -> StandInTE:
    """The stand-in of one TE/cuDNN setup as the ``te`` backend's module."""
    version, cudnn, packed, windows = SETUPS[request.param]
    module = StandInTE(version, cudnn, packed)
    module.windows = windows  # what the backend must run
    monkeypatch.setattr(kernels.get("te"), "load", lambda: module)
    monkeypatch.setattr(te_backend, "cudnn_version", lambda: cudnn)
    monkeypatch.setattr(te_backend, "te_dtype", lambda dtype: ("DType", dtype))
    monkeypatch.setattr(te_backend, "_SEEN_LAYOUT", {})
    return module


def run_both(pieces, causal, window, heads=4, kv_heads=2, v_dim=16, seed=1):
    """``te`` and the float64 math path on one bf16 block (``against_math_path``)."""
    return against_math_path("te", pieces, causal, window, heads, kv_heads, 16, v_dim, seed)


@pytest.mark.parametrize("causal,pieces", [(True, CAUSAL), (False, FULL)],
                         ids=["causal", "full"])
@pytest.mark.parametrize("heads,kv_heads,v_dim", [(4, 4, 16), (4, 2, 16), (4, 1, 8)],
                         ids=["mha", "gqa", "mqa-mla"])
def test_te_runs_causal_and_full_blocks_exactly(standin, causal, pieces, heads, kv_heads,
                                                v_dim):
    """Causal (bottom-right, pieces longer on either side: rows without keys, whose stats
    cuDNN before 9.10 leaves near float's lowest with the mean of the values as output) and
    full blocks, MHA/GQA/MQA and a narrower value head (MLA), on every TE setup; the max lengths
    TE gets are multiples of 64, and kv's at least q's (cuDNN 9.6 takes bottom-right masks
    only so)."""
    got, want = run_both(pieces, causal, None, heads, kv_heads, v_dim)
    assert_like_math_path(got, want, 2e-2)
    assert [c[0] for c in standin.calls] == ["forward", "backward"]
    assert all(c[1] % 64 == 0 and c[2] % 64 == 0 and c[2] >= c[1] for c in standin.calls)
    assert te_backend._SEEN_LAYOUT["packed"] == standin.packed


BANDS = [(3, 0), (0, 0), (2, 3), (-1, 2), (4, -1), (1, 5)]


@pytest.mark.parametrize("window", BANDS, ids=[f"band{b}" for b in BANDS])
@pytest.mark.parametrize("pieces", [[(9, 9), (6, 2), (3, 7)], [(70, 5), (0, 4), (5, 5)]],
                         ids=["mixed", "more-rows-than-keys"])
def test_te_runs_the_bands_its_version_sets_and_refuses_the_rest(standin, window, pieces):
    """A causal band ``(L, 0)`` runs from cuDNN 9.10.2 on every TE; a band with a right
    bound, or a left bound without causal, only from TE 2.12 (both bounds, bottom-right
    aligned), else refused naming the band, before TE would run it top-left aligned without
    its right bound or cuDNN's frontend would refuse it (before 9.10.2, and 9.14.0). Pieces
    with more rows than keys get ``max_seqlen_kv >= max_seqlen_q`` (TE's selection refuses a
    window otherwise)."""
    causal = window[1] == 0
    assert te_backend.bands(standin) == standin.windows
    runs = standin.windows == "all" or (standin.windows == "causal" and causal)
    if not runs:
        with pytest.raises(ValueError, match=rf"backend 'te' cannot run the band "
                                             rf"window=\({window[0]}, {window[1]}\)"):
            run_both(pieces, causal, window)
        assert standin.calls == []
        return
    got, want = run_both(pieces, causal, window)
    assert_like_math_path(got, want, 2e-2)
    assert all(c[2] >= c[1] for c in standin.calls)


@pytest.mark.parametrize("pieces", [[(3, 0), (2, 0)], [(0, 4), (0, 2)]],
                         ids=["no-keys", "no-queries"])
def test_te_runs_no_kernel_on_a_block_without_rows(standin, pieces):
    """A block without key (or query) rows: output 0, lse -inf, zero gradients, and no TE
    call (TE sizes its graph by the log2 of the totals)."""
    got, want = run_both(pieces, True, None)
    assert_like_math_path(got, want, 2e-2)
    assert standin.calls == []


def test_te_window_limit_follows_the_installed_te(standin):
    """A windowed model with ``te`` is refused at set-up, naming the flags and the versions,
    only where this TE/cuDNN cannot run a windowed ring's bands."""
    from megatron_zeppelin.megatron.common.core_attention import (ZeppelinAttentionState,
                                                                  _refuse_window_limit)

    limit = kernels.get("te").window_limit
    if standin.windows == "all":
        assert limit is None
        _refuse_window_limit("te", (None, 128))  # what the state's constructor checks
        return
    assert "from TE 2.12" in limit and f"cuDNN {'.'.join(map(str, standin.cudnn))}" in limit
    with pytest.raises(ConfigError, match=r"--zeppelin-attention-backend=te with a "
                       r"sliding window of 128 tokens \(--window-size\): Transformer Engine"):
        ZeppelinAttentionState(None, backend="te", windows=(None, 128))
    _refuse_window_limit("te", (None, None))  # no window: fine


def test_te_adapts_to_each_signature():
    """What the backend reads from each TE version's signatures."""
    got = {v: te_backend.TeApi.of(StandInTE(v)) for v in ((2, 11), (2, 12), (2, 15))}
    assert got[(2, 11)] == te_backend.TeApi(dqkv_dtype=True, formats=False, diagonal=False)
    assert got[(2, 12)] == te_backend.TeApi(dqkv_dtype=True, formats=False, diagonal=True)
    assert got[(2, 15)] == te_backend.TeApi(dqkv_dtype=False, formats=True, diagonal=True)
    assert kernels.get("native").window_limit is None
    assert kernels.get("flash_attn").window_limit is None


def test_te_without_transformer_engine_says_so_not_the_window(monkeypatch):
    """Not installed: no window verdict (``unavailable`` names the missing package)."""
    monkeypatch.setattr(kernels.get("te"), "load", lambda: None)
    assert kernels.get("te").window_limit is None
    assert "transformer_engine, which is not installed" in kernels.get("te").unavailable()


def test_te_refuses_gpus_and_cudnns_without_thd_causal(monkeypatch):
    """TE's fused attention takes THD from sm90, and THD's bottom-right causal mask and GQA
    from cuDNN 9.6 (9.10.0/9.10.1: no F16 path): refused by name, before TE's own error."""
    def refusal(capability, cudnn):
        monkeypatch.setattr(te_backend.base, "device_capability", lambda device: capability)
        monkeypatch.setattr(te_backend, "cudnn_version", lambda: cudnn)
        q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16,
                                  device=torch.device("cuda", 0))
        return kernels.get("te").refuses(q)

    assert refusal((8, 0), (9, 11, 0)) == "needs sm90+ for THD fused attention, got sm80"
    for cudnn in ((9, 5, 1), (9, 10, 0), (9, 10, 1)):
        assert refusal((9, 0), cudnn) == (
            f"needs cuDNN 9.6.0+ (not 9.10.0/9.10.1) for THD causal and GQA fused attention, "
            f"this process has cuDNN {'.'.join(map(str, cudnn))}")
    assert refusal((9, 0), (9, 6, 0)) is None and refusal((10, 0), (9, 10, 2)) is None


@pytest.mark.parametrize("packed", [True, False])
def test_te_softmax_stats_round_trip(packed, monkeypatch):
    """[heads, tq] lse <-> TE's softmax stats ([tq, h, 1] packed, or [b, h, max_q, 1] with
    the max_q passed to the kernel); the forward reads the layout from the tensor itself."""
    monkeypatch.setattr(te_backend, "stats_packed", lambda: packed)
    pieces = kernels.make_pieces((0, 3, 3, 7), (0, 3, 3, 7))
    lse = torch.randn(4, 7)
    stats = te_backend.lse_to_te(lse, pieces, 64)
    assert stats.shape == ((7, 4, 1) if packed else (3, 4, 64, 1))
    if not packed:
        assert stats[2, 1, 3, 0] == lse[1, 6] and torch.isposinf(stats[0, :, 3]).all()
    torch.testing.assert_close(te_backend.lse_from_te(stats, pieces, 4), lse)
