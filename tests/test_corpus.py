"""The training corpus and its data position: the built-in corpus has a long tail; the stream
resumes at the same piece; micro-batches are dealt to pools so that a position saved with one
number of pools continues with another; the overlong policy counts what it does."""
from __future__ import annotations

import statistics

import pytest
import torch

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.megatron.loop.corpus import (BuiltinCorpus, DocumentStream, MicroBatchSampler,
                                               check_overlong)


class Lengths:
    """A source of documents of given lengths whose tokens encode (document, position)."""

    name = "lengths"

    def __init__(self, lengths: list[int]) -> None:
        self._lengths = lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> list[int]:
        return self._lengths

    def tokens(self, index: int, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end) + 1000 * index


SOURCE = Lengths([5, 300, 17, 64, 1, 900, 33, 250, 128, 7, 2000, 45] * 3)


def take(sampler: MicroBatchSampler, n: int) -> list[list[torch.Tensor]]:
    return [next(sampler) for _ in range(n)]


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


def test_the_builtin_corpus_has_a_long_tail_of_real_text():
    corpus = BuiltinCorpus()
    lengths = corpus.lengths()
    mean = statistics.mean(lengths)
    assert len(lengths) == 16384 and lengths == BuiltinCorpus().lengths()  # fixed
    assert statistics.median(lengths) < mean / 2  # many short documents
    assert max(lengths) > 50 * mean  # a few far longer than the mean
    assert sum(n > 4096 for n in lengths) > 20
    text = corpus.tokens(3, 0, 200)
    assert text.dtype == torch.int64 and 0 <= int(text.min()) and int(text.max()) < 256
    assert bytes(text.tolist()).isascii()  # Python source


def test_a_restored_stream_continues_with_the_same_micro_batches():
    sampler = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    take(sampler, 5)
    state = sampler.state_dict()
    expected = take(sampler, 30)  # more than an epoch: the position crosses epochs
    restored = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    assert restored.load_state_dict(state) is None
    assert same(take(restored, 30), expected)
    assert restored.stats == sampler.stats


def test_micro_batches_are_dealt_round_robin_and_resume_with_another_pool_count():
    one = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    sequence = take(one, 8)
    pools = [MicroBatchSampler(SOURCE, 1024, 3, 512, "split", pools=2, pool=i) for i in (0, 1)]
    dealt = [take(p, 2) for p in pools]
    assert same(dealt[0], [sequence[0], sequence[2]])
    assert same(dealt[1], [sequence[1], sequence[3]])
    assert pools[0].state_dict() == pools[1].state_dict()  # one global position
    resumed = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    resumed.load_state_dict(pools[0].state_dict())
    assert same(take(resumed, 4), sequence[4:])  # 2 pools saved it, 1 pool continues


def test_a_position_of_another_stream_is_not_applied():
    sampler = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    take(sampler, 2)
    other = MicroBatchSampler(SOURCE, 1024, seed=4, max_len=256, overlong="split")
    why = other.load_state_dict(sampler.state_dict())
    assert why.startswith("the stream changed: seed 3 -> 4, max_len 512 -> 256")


def epoch_pieces(stream: DocumentStream) -> list[tuple[int, int, int]]:
    """The pieces of the stream's first epoch."""
    pieces = []
    while True:
        piece = stream.peek()
        if stream.epoch:
            return pieces
        pieces.append(piece)
        stream.advance()


def test_overlong_documents_are_split_evenly_or_dropped_and_counted():
    split = DocumentStream([10, 1000, 20], seed=0, max_len=300, overlong="split")
    pieces = epoch_pieces(split)
    assert sorted(end - start for doc, start, end in pieces if doc == 1) == [250] * 4
    assert (split.stats.documents, split.stats.split_sequences,
            split.stats.split_pieces) == (3, 1, 4)
    drop = DocumentStream([10, 1000, 20], seed=0, max_len=300, overlong="drop")
    assert sorted(doc for doc, _, _ in epoch_pieces(drop)) == [0, 2]
    # dropped when the cursor reaches it (the peek past the epoch may reach the next one's)
    dropped = drop.stats.dropped_sequences
    assert dropped >= 1 and drop.stats.dropped_tokens == 1000 * dropped


def test_the_overlong_policy_is_checked_against_the_corpus_up_front():
    with pytest.raises(ConfigError, match=r"--mock-data: document \d+ has 24,132 tokens, more "
                                          r"than --seq-length 4,096; pass --zeppelin-overlong"):
        check_overlong(BuiltinCorpus().lengths(), 4096, "error", "--mock-data")
    with pytest.raises(ConfigError, match="would drop them all"):
        check_overlong([500, 600], 100, "drop", "--data-path 'x'")
    check_overlong([500, 600], 100, "split", "--data-path 'x'")


def test_the_data_iterator_position_excludes_the_micro_batch_planned_ahead():
    from conftest import make_cost

    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator
    from megatron_zeppelin.planner import make_plan

    cost = make_cost("gpt-tiny", "cpu-2x2", nodes=2)
    config = ZeppelinConfig(max_seqlen=512, overlong="split")
    sampler = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    data = ZeppelinDataIterator(sampler, lambda n: make_plan("zeppelin", n, cost, config), 0)
    try:
        positions = [data.state_dict()]
        for _ in range(3):
            next(data)
            positions.append(data.state_dict())
    finally:
        data.close()
    replay = MicroBatchSampler(SOURCE, 1024, seed=3, max_len=512, overlong="split")
    for position in positions:
        assert replay.state_dict() == position  # before micro-batch k: k handed out
        next(replay)
