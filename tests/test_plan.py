"""The Plan contract: zigzag chunking, derived views, validate(), remap transfers."""
import pytest
from hypothesis import given, settings, strategies as st

from megatron_zeppelin.plan import (AttentionTask, Plan, PlanError, Segment, Tier, Topology,
                                    zigzag_bounds, zigzag_segments, zigzag_share,
                                    zigzag_share_bound)
from megatron_zeppelin.planner.linear_layout import balance_linear


def make(seqlens, rings, topo=Topology(2, 2), linear=None, capacity=10 ** 9, waves=None):
    waves = waves or [0] * len(seqlens)
    tasks = tuple(AttentionTask(i, tuple(r), topo.tier_of(tuple(r)), w)
                  for i, (r, w) in enumerate(zip(rings, waves)))
    draft = Plan("t", topo, tuple(seqlens), tuple(Segment(i, 0, s) for i, s in enumerate(seqlens)),
                 tasks, (), capacity)
    return Plan("t", topo, draft.seqlens, draft.sources, tasks,
                draft.attention if linear is None else linear, capacity)


@given(st.integers(1, 5000), st.integers(1, 64))
def test_zigzag_chunks_tile_the_sequence(length, ring):
    b = zigzag_bounds(length, ring)
    assert b[0] == 0 and b[-1] == length and len(b) == 2 * ring + 1
    sizes = [y - x for x, y in zip(b, b[1:])]
    assert max(sizes) - min(sizes) <= 1
    shares = [zigzag_share(length, ring, p) for p in range(ring)]
    assert sum(shares) == length
    assert max(shares) <= zigzag_share_bound(length, ring)
    for p in range(ring):
        segs = zigzag_segments(7, length, ring, p)
        assert sum(s.length for s in segs) == shares[p]


def test_zigzag_pairs_chunk_p_with_its_mirror():
    assert zigzag_segments(0, 16, 4, 0) == (Segment(0, 0, 2), Segment(0, 14, 16))
    assert zigzag_segments(0, 16, 4, 3) == (Segment(0, 6, 8), Segment(0, 8, 10))
    assert zigzag_segments(3, 5, 1, 0) == (Segment(3, 0, 5),)


def test_tiers_follow_the_nodes_a_ring_spans():
    topo = Topology(2, 2)
    assert topo.tier_of((3,)) == Tier.LOCAL
    assert topo.tier_of((2, 3)) == Tier.INTRA
    assert topo.tier_of((1, 2)) == Tier.INTER
    with pytest.raises(ValueError, match=r"world size 8 does not match.*2 nodes x 2"):
        topo.check_world_size(8)
    with pytest.raises(ValueError, match="nodes=0"):
        Topology(0, 2)


def test_ring_groups_fuse_sequences_sharing_a_ring_in_global_order():
    plan = make([8, 8, 3, 8, 5], [(0, 1, 2, 3), (0, 1), (2,), (0, 1, 2, 3), (2,)])
    groups = plan.ring_groups
    assert [g.tier for g in groups] == [Tier.INTER, Tier.INTRA, Tier.LOCAL]
    assert groups[0].seqs == (0, 3) and groups[2].seqs == (2, 4)
    assert [g.ring for g in plan.rank_groups[2]] == [(0, 1, 2, 3), (2,)]
    # rank 2 is ring position 2 of the 4-rank ring: chunks 2 and 5 of each 8-token sequence
    assert plan.attention[2] == (Segment(0, 2, 3), Segment(0, 5, 6), Segment(3, 2, 3),
                                 Segment(3, 5, 6), Segment(2, 0, 3), Segment(4, 0, 5))
    plan.validate()


def test_validate_catches_each_violation():
    good = make([8, 4], [(0, 1), (2,)])
    good.validate()
    with pytest.raises(PlanError, match=r"tokens \[2, 4\) of sequence 1 are missing"):
        make([8, 4], [(0, 1), (2,)],
             linear=((Segment(0, 0, 8),), (Segment(1, 0, 2),), (), ())).validate()
    with pytest.raises(PlanError, match=r"tokens \[0, 2\) of sequence 1 are duplicated"):
        make([8, 4], [(0, 1), (2,)], linear=((Segment(0, 0, 8), Segment(1, 0, 2)),
                                              (Segment(1, 0, 4),), (), ())).validate()
    with pytest.raises(PlanError, match="rank 0 holds 4 attention tokens, over the capacity 3"):
        make([8, 4], [(0, 1), (2,)], capacity=3).validate()
    with pytest.raises(PlanError, match="zigzag needs at least 8 tokens"):
        make([6, 4], [(0, 1, 2, 3), (2,)]).validate()
    with pytest.raises(PlanError, match=r"ring \(0, 0\)"):
        make([8, 4], [(0, 0), (2,)]).validate()
    bad_tier = make([8, 4], [(0, 1), (2,)])
    object.__setattr__(bad_tier, "tasks", (AttentionTask(0, (0, 1), Tier.INTER), bad_tier.tasks[1]))
    with pytest.raises(PlanError, match="is INTRA, task says INTER"):
        bad_tier.validate()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=12), st.integers(0, 10 ** 6))
def test_transfers_map_every_linear_token_to_its_attention_slot(seqlens, seed):
    import random
    rng = random.Random(seed)
    topo = Topology(2, 2)
    rings = []
    for s in seqlens:
        k = rng.choice([k for k in (1, 2, 4) if k == 1 or s >= 2 * k])
        rings.append(tuple(sorted(rng.sample(range(4), k))))
    plan = make(seqlens, rings, topo)
    plan = make(seqlens, rings, topo, linear=balance_linear(plan.attention, topo))
    plan.validate()
    # replay the transfers on token labels: the attention buffers must come out exact
    linear_buf = [[(s.seq, t) for s in segs for t in range(s.start, s.end)] for segs in plan.linear]
    att_buf = [[None] * n for n in plan.attention_tokens()]
    for tr in plan.transfers:
        for i in range(tr.end - tr.start):
            assert linear_buf[tr.src][tr.src_offset + i] == (tr.seq, tr.start + i)
            att_buf[tr.dst][tr.dst_offset + i] = (tr.seq, tr.start + i)
    expected = [[(s.seq, t) for s in segs for t in range(s.start, s.end)]
                for segs in plan.attention]
    assert att_buf == expected
    tokens = plan.linear_tokens()
    assert max(tokens) - min(tokens) <= 1


def test_remap_matrix_and_cross_node_tokens():
    topo = Topology(2, 2)
    plan = make([8, 4], [(0,), (1,)], topo)  # 12 tokens on ranks 0 and 1; targets 3 each
    plan = make([8, 4], [(0,), (1,)], topo, linear=balance_linear(plan.attention, topo))
    m = plan.remap_matrix()  # m[src][dst]: src's linear layout feeds dst's attention layout
    # rank 0 keeps 3 of its 8; node 0 holds 12 tokens for 6 linear slots, so ranks 2 and 3
    # (node 1) run the linear modules of 6 tokens whose attention is on ranks 0 and 1
    assert m[2] == [3, 0, 0, 0] and m[3] == [2, 1, 0, 0]
    assert sum(map(sum, m[:2])) == 0
    assert plan.remap_cross_node_tokens() == 6
