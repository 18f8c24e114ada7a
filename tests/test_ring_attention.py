"""Zigzag varlen ring attention of one group: block structure, a simulated ring, real rings.

The simulated ring runs every position of a group in one process, handing each step's sends
to the next position, so the step logic (unequal chunks, empty chunks, dK/dV travelling back
to the owner) is checked without processes. One spawned gloo world runs the autograd Function
on real rings.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from attention_reference import make_batch, reference_grads
from distributed import run_world
from megatron_zeppelin.plan import zigzag_segments
from megatron_zeppelin.runtime.attention import RingGroupRun, recv_like, ring_attention
from megatron_zeppelin.runtime.halo import HaloGroupRun
from megatron_zeppelin.runtime.zigzag import ZigzagLayout
from megatron_zeppelin.runtime.ring_comm import RingComm
from megatron_zeppelin.schedule import Phase

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def held_tokens(lengths, ring_size, position):
    """Global (seq, token) of each row of a position's buffer (the Plan.attention order)."""
    return [(s, t) for s, n in enumerate(lengths)
            for _, a, b in zigzag_segments(s, n, ring_size, position) for t in range(a, b)]


def visible(x: int, y: int, offset: int, block) -> bool:
    """Whether row ``x`` sees key ``y`` of a piece in ``block`` (END-aligned band)."""
    left, right = block.window if block.window is not None else (-1, 0 if block.causal else -1)
    return (right < 0 or y <= x + offset + right) and (left < 0 or y >= x + offset - left)


def attended_pairs(layout: ZigzagLayout):
    """Every (query token, key token) some block of some step computes, with multiplicity."""
    lengths, size, p = layout.lengths, layout.ring_size, layout.position
    q_tokens, pairs = held_tokens(lengths, size, p), []
    for step in range(size):
        k_tokens = held_tokens(lengths, size, layout.source(step))
        relayed = layout.held_rows(layout.source(step), step)  # a window relays fewer rows
        k_tokens = k_tokens if relayed is None else [k_tokens[r] for r in relayed]
        for block in layout.blocks(step):
            q_rows = block.q_rows.tolist() if block.q_rows is not None else range(len(q_tokens))
            k_rows = block.k_rows.tolist() if block.k_rows is not None else range(len(k_tokens))
            q_rows, k_rows = list(q_rows), list(k_rows)
            cu_q, cu_k = block.pieces.cu_q, block.pieces.cu_k
            for i in range(len(cu_q) - 1):
                qs = [q_tokens[r] for r in q_rows[cu_q[i]:cu_q[i + 1]]]
                ks = [k_tokens[r] for r in k_rows[cu_k[i]:cu_k[i + 1]]]
                offset = len(ks) - len(qs)
                pairs += [(a, b) for x, a in enumerate(qs) for y, b in enumerate(ks)
                          if visible(x, y, offset, block)]
    return pairs


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("lengths", [[1], [2, 9, 16], [37, 1, 5, 64, 3], [7, 7, 7, 100]])
def test_blocks_cover_exactly_the_causal_pairs(ring_size, lengths):
    for position in range(ring_size):
        layout = ZigzagLayout(lengths, ring_size, position)
        got = attended_pairs(layout)
        want = [((s, t), (s, c)) for s, t in held_tokens(lengths, ring_size, position)
                for c in range(t + 1)]
        assert len(got) == len(set(got)), f"a pair computed twice at position {position}"
        assert sorted(got) == sorted(want), f"position {position}: wrong causal pairs"
        for step in range(ring_size):  # causal blocks: only the diagonal chunks of step 0
            for block in layout.blocks(step):
                assert not block.causal or (step == 0 and block.pieces.cu_q == block.pieces.cu_k)


def simulate_ring(lengths, ring_size, heads, kv_heads, head_dim=8, seed=0,
                  dtype=torch.float32, backend=None, window=None, v_head_dim=None, halo=False):
    """Forward and backward of every position of a group in one process (``halo``: by halo
    exchange, ``runtime.halo``, else by the ring)."""
    batch = make_batch(lengths, heads, kv_heads, head_dim, seed, v_head_dim)
    scale = head_dim ** -0.5

    def local(name, p):
        return torch.cat([batch[name][s][a:b] for s, n in enumerate(lengths)
                          for _, a, b in zigzag_segments(s, n, ring_size, p)]).to(dtype)

    batch = {name: [t.to(dtype).double() for t in ts] for name, ts in batch.items()}
    runs = [(HaloGroupRun if halo else RingGroupRun)(
        ZigzagLayout(lengths, ring_size, p, window), scale, backend) for p in range(ring_size)]
    run_rounds = drive_halo if halo else drive
    for p, run in enumerate(runs):
        run.begin_forward(local("q", p), local("k", p), local("v", p))
    run_rounds(runs, Phase.FORWARD)
    results = [run.end_forward() for run in runs]
    for p, run in enumerate(runs):
        run.begin_backward(local("dout", p), local("q", p), local("k", p), local("v", p),
                           *results[p])
    run_rounds(runs, Phase.BACKWARD)
    grads = [run.end_backward() for run in runs]
    ref = reference_grads(batch, range(len(lengths)), scale, window)
    errors = []
    for p in range(ring_size):
        want = [torch.cat([ref[s][name][a:b] for s, n in enumerate(lengths)
                           for _, a, b in zigzag_segments(s, n, ring_size, p)])
                for name in ("out", "q", "k", "v")]
        for got, expected in zip((results[p][0], *grads[p]), want):
            if expected.numel():
                errors.append((got.double() - expected).abs().max().item())
    return max(errors)


def drive(runs, phase):
    """Run the rounds of every position; position p receives what p-1 sent, checked against
    what p expects (``recv_like``)."""
    size = len(runs)
    for step in range(runs[0].steps(phase)):
        sends = [[t.clone() for t in run.sends(phase, step)] for run in runs]
        for p, run in enumerate(runs):
            like = recv_like(run.layout, step, phase, tuple(run.kv.shape[1:]), run.kv.dtype)
            got = [(tuple(t.shape), t.dtype) for t in sends[(p - 1) % size]]
            assert got == [(tuple(s), d) for s, d in like], f"{phase} step {step} position {p}"
        for run in runs:
            run.compute(phase, step)
        for p, run in enumerate(runs):
            run.receive(phase, step, sends[(p - 1) % size] if size > 1 else [])


def drive_halo(runs, phase):
    """Run the halo rounds of every position: position p receives what p - 1 sent towards
    the next position and what p + 1 sent towards the previous one, checked against what p
    expects (``recv_like``)."""
    size = len(runs)
    for step in range(runs[0].steps(phase)):
        sends = [[[t.clone() for t in way] for way in run.sends(phase, step)] for run in runs]
        arriving = [sends[(p - 1) % size][0] + sends[(p + 1) % size][1] for p in range(size)]
        for p, run in enumerate(runs):
            like = [x for way in run.recv_like(phase, step) for x in way]
            got = [(tuple(t.shape), t.dtype) for t in arriving[p]]
            assert got == [(tuple(s), d) for s, d in like], f"{phase} step {step} position {p}"
            run.compute(phase, step)
        for p, run in enumerate(runs):
            run.receive(phase, step, arriving[p])


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_simulated_ring_is_exact(ring_size, heads, kv_heads):
    lengths = [1, 5, 2 * ring_size + 3, 64, 13, 4 * ring_size]  # most not divisible by 2G
    assert simulate_ring(lengths, ring_size, heads, kv_heads) < 1e-5


@pytest.mark.parametrize("ring_size", [1, 3, 4])
def test_simulated_ring_through_the_native_backend(ring_size, monkeypatch):
    """bf16 rings through the native backend's code path (kernel stand-in): within bf16
    rounding of float64."""
    from flash_standin import install

    standin = install(monkeypatch)
    lengths = [1, 5, 2 * ring_size + 3, 64, 13, 4 * ring_size]
    assert simulate_ring(lengths, ring_size, 4, 2, dtype=torch.bfloat16, backend="native") < 5e-2
    assert standin.calls["forward"] > 0 and standin.calls["backward"] > 0


def test_layout_and_ring_argument_errors():
    with pytest.raises(ValueError, match="position=3 is invalid: expected in \\[0, 3\\)"):
        ZigzagLayout([4], 3, 3)
    with pytest.raises(ValueError, match="ring_size=0 is invalid"):
        ZigzagLayout([4], 0, 0)
    with pytest.raises(ValueError, match=r"sequence lengths \[-1\] are invalid"):
        ZigzagLayout([4, -1], 2, 0)
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="a ring of 2 ranks needs a RingComm"):
        ring_attention(q, q, q, ZigzagLayout([8], 2, 0))
    run = RingGroupRun(ZigzagLayout([8], 2, 0), 0.5)
    with pytest.raises(ValueError, match="expected 4 for ring position 0"):
        run.begin_forward(torch.zeros(5, 2, 8), torch.zeros(5, 2, 8), torch.zeros(5, 2, 8))


# ----------------------------------------------------------------------------- real rings

RING_CASES = [  # (ring of world ranks in ring order, lengths, heads, kv_heads)
    ((2, 0, 1), [37, 1, 64, 6], 4, 2),
    ((1, 2), [1, 2, 3, 50], 4, 1),
    ((0, 2, 1), [12], 4, 4),
]


def _ring_worker(rank: int, world: int) -> list:
    """Each case: the group's rows of this rank, ring_attention forward + backward, errors."""
    errors = []
    for index, (ring, lengths, heads, kv_heads) in enumerate(RING_CASES):
        if rank not in ring:
            errors.append(None)
            continue
        position, size = ring.index(rank), len(ring)
        batch = make_batch(lengths, heads, kv_heads, 8, seed=index)
        segments = [seg for s, n in enumerate(lengths)
                    for seg in zigzag_segments(s, n, size, position)]
        q, k, v, dout = (torch.cat([batch[name][s][a:b] for s, a, b in segments]).float()
                         for name in ("q", "k", "v", "dout"))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        comm = RingComm(ring, rank, dist.group.WORLD, tag=index, timeout_s=30)
        out = ring_attention(q, k, v, ZigzagLayout(lengths, size, position), comm)
        out.backward(dout)
        ref = reference_grads(batch, range(len(lengths)), 8 ** -0.5)
        want = {name: torch.cat([ref[s][name][a:b] for s, a, b in segments])
                for name in ("out", "q", "k", "v")}
        got = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        errors.append({name: (got[name].double() - want[name]).abs().max().item()
                       for name in got})
    return errors


@pytest.mark.distributed
def test_ring_attention_on_real_rings_is_exact():
    results = run_world(_ring_worker, 3, timeout_s=60)
    for rank, errors in enumerate(results):
        for case, err in zip(RING_CASES, errors):
            if rank not in case[0]:
                assert err is None
                continue
            assert max(err.values()) < 1e-5, f"rank {rank}, ring {case[0]}: errors {err}"


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [0, 1, 3, 10, 40])
def test_windowed_blocks_cover_exactly_the_window_pairs(ring_size, window):
    """Sliding window L: every (query, key) with ``q - L <= k <= q`` of one document is
    computed exactly once, and no other pair."""
    lengths = [37, 1, 5, 64, 3, 7]
    for position in range(ring_size):
        layout = ZigzagLayout(lengths, ring_size, position, window)
        got = attended_pairs(layout)
        want = [((s, t), (s, c)) for s, t in held_tokens(lengths, ring_size, position)
                for c in range(max(0, t - window), t + 1)]
        assert len(got) == len(set(got)), f"a pair computed twice at position {position}"
        assert sorted(got) == sorted(want), f"position {position}: wrong window pairs"


def test_a_step_wholly_outside_the_window_computes_nothing():
    """With a window shorter than a chunk, the middle steps of a ring hold KV no query of the
    position sees: they have no blocks (their compute is skipped)."""
    layout = ZigzagLayout([800], 4, 1, window=20)  # chunks of 100 tokens
    assert [len(layout.blocks(step)) > 0 for step in range(4)] == [True, True, False, True]
    with pytest.raises(ValueError, match="window=-1"):
        ZigzagLayout([8], 2, 0, window=-1)


@pytest.mark.parametrize("ring_size", [1, 3, 4])
@pytest.mark.parametrize("window,v_head_dim", [(None, 4), (5, None), (17, 12), (0, None)])
def test_simulated_ring_with_window_and_value_head_dim_is_exact(ring_size, window, v_head_dim):
    lengths = [1, 5, 2 * ring_size + 3, 64, 13, 4 * ring_size]
    assert simulate_ring(lengths, ring_size, 4, 2, window=window, v_head_dim=v_head_dim) < 1e-5


@pytest.mark.parametrize("window,v_head_dim", [(None, 4), (6, None), (9, 16)])
def test_simulated_ring_with_window_and_value_head_dim_through_the_native_backend(
        window, v_head_dim, monkeypatch):
    """The native backend pads a different value head dim and passes the window to the
    kernel (stand-in): within bf16 rounding of float64."""
    from flash_standin import install

    standin = install(monkeypatch)
    lengths = [1, 5, 9, 64, 13, 12]
    assert simulate_ring(lengths, 3, 4, 2, dtype=torch.bfloat16, backend="native",
                         window=window, v_head_dim=v_head_dim) < 5e-2
    assert standin.calls["forward"] > 0 and standin.calls["backward"] > 0


def test_window_bench_counts_the_engine_blocks():
    """``zeppelin bench window``'s figures: pairs are the blocks' pairs (brute force), middle
    steps of a short window are skipped, and the engine relays exactly the rows later
    positions read (counted independently from their blocks), fewer than whole blocks."""
    from megatron_zeppelin.bench.window import block_pairs, ring_figures

    lengths, size = [800, 37, 5], 4
    for window in (None, 20, 300):
        figures = ring_figures(lengths, size, window)
        brute = sum(len(attended_pairs(ZigzagLayout(lengths, size, p, window)))
                    for p in range(size))
        assert figures["pairs"] == brute
        assert figures["whole"] == 3 * sum(lengths)  # 3 hops of every block
        if window is None:  # no window: whole blocks travel (causal zigzag reads them all)
            assert figures["sent"] == figures["whole"]
            assert figures["dkv_sent"] == figures["dkv_whole"] == 4 * sum(lengths)
        else:
            assert figures["needed"] == figures["sent"] < figures["whole"]
            assert figures["dkv_sent"] < figures["dkv_whole"]
        assert sum(block_pairs(b) for b in ZigzagLayout([9], 1, 0, window).blocks(0)) == \
            sum(min(t, window if window is not None else t) + 1 for t in range(9))
    assert ring_figures([800], 4, 20)["skipped"] == 6  # of 12 steps after the first
    assert ring_figures([800], 4, None)["skipped"] == 0
    assert ring_figures([800], 4, 20)["sent"] < ring_figures([800], 4, None)["sent"] // 4
    # by halo exchange where the chunks hold the window (800 // 8 >= 20, not 37 or 5): the
    # 20 rows each neighbour reads, once; the short sequences round the ring as before
    halo = ring_figures(lengths, size, 20, halo_ok=True)
    ring = ring_figures([37, 5], size, 20)
    assert (halo["halo"], halo["seqs"]) == (1, 3) and halo["pairs"] == \
        ring_figures(lengths, size, 20)["pairs"]
    assert halo["sent"] - ring["sent"] == halo["dkv_sent"] - ring["dkv_sent"] == 6 * 20
    assert halo["steps"] == ring["steps"] and halo["skipped"] == ring["skipped"]


# halo exchange (runtime/halo.py): windowed rings whose window fits in every chunk
@pytest.mark.parametrize("ring_size", [3, 4, 5])
@pytest.mark.parametrize("window", [0, 1, 4, 7])
def test_halo_fits_exactly_when_positions_read_only_their_neighbours(ring_size, window):
    """``halo_fits`` holds iff no position reads a KV row of a position other than itself and
    its two neighbours (checked on every pair), and then ``halo_rows`` counts what is sent."""
    from megatron_zeppelin.zigzag_window import halo_fits, halo_rows

    for lengths in ([8 * ring_size], [2 * ring_size * window + 1, 50], [3, 40], [97]):
        layout = ZigzagLayout(lengths, ring_size, 0, window)
        far = [(q, s) for q in range(ring_size) for s in range(ring_size)
               if (q - s) % ring_size not in (0, 1, ring_size - 1) and layout.read_rows(q, s)]
        fits = all(n // (2 * ring_size) >= window for n in lengths)
        assert halo_fits(lengths, ring_size, window) == fits
        if fits:
            assert far == [], (lengths, far)
            for n in lengths:
                one = ZigzagLayout([n], ring_size, 0, window)
                sent = sum(len(one.read_rows((p + d) % ring_size, p))
                           for p in range(ring_size) for d in (1, -1))
                assert halo_rows(n, ring_size, window) == (sent / ring_size,) * 2
    assert not halo_fits([1000], 2, 3) and not halo_fits([1000], 4, None)


@pytest.mark.parametrize("ring_size", [3, 4, 6])
@pytest.mark.parametrize("window,v_head_dim", [(0, None), (1, None), (5, 12), (9, None)])
def test_simulated_halo_exchange_is_exact(ring_size, window, v_head_dim):
    """Forward and backward by halo exchange equal the reference (float64): unequal chunks,
    grouped-query heads, a different value head dim."""
    lengths = [2 * ring_size * max(window, 1) + r for r in (0, 3, 11, 40)]
    assert simulate_ring(lengths, ring_size, 4, 2, window=window, v_head_dim=v_head_dim,
                         halo=True) < 1e-5


def test_halo_exchange_matches_the_ring_and_refuses_a_window_past_a_chunk():
    """A group whose window reaches past a chunk is refused by the halo, not run with
    missing keys."""
    from megatron_zeppelin.runtime.halo import halo_blocks

    lengths, size = [64, 41], 4
    assert simulate_ring(lengths, size, 4, 4, window=5, halo=True) < 1e-5
    with pytest.raises(ValueError, match="every zigzag chunk at least as long as the window"):
        halo_blocks(ZigzagLayout(lengths, size, 1, window=6), "cpu")  # 41 // 8 = 5 < 6
