"""Published document-length statistics, with their sources (see docs/research-notes.md).

Each mix is a tuple of buckets [lo, hi] with a share of documents or of tokens; a length is
drawn log-uniformly inside its bucket. Where a source gives only part of a distribution, the
rest is stated as an assumption next to it.
"""
from __future__ import annotations

import math
from typing import NamedTuple


class Bucket(NamedTuple):
    lo: int
    hi: int
    share: float


class PublishedMix(NamedTuple):
    name: str
    description: str
    source: str
    buckets: tuple[Bucket, ...]
    shares_are_tokens: bool
    max_len: int


def _mean_length(b: Bucket) -> float:
    """Mean of a log-uniform length in [lo, hi]."""
    return b.lo if b.hi == b.lo else (b.hi - b.lo) / math.log(b.hi / b.lo)


def to_token_shares(doc_buckets: tuple[Bucket, ...], total: float = 1.0) -> tuple[Bucket, ...]:
    """Document shares -> token shares (scaled to ``total``), bucket means log-uniform."""
    weights = [b.share * _mean_length(b) for b in doc_buckets]
    scale = total / sum(weights)
    return tuple(Bucket(b.lo, b.hi, w * scale) for b, w in zip(doc_buckets, weights))


# MagiAttention's "representative training dataset" (13,463,214 documents), % of documents:
# SandAI-org/MagiAttention @2c641357, exps/dist_attn/benchmark/datasets/default/
# doc_length_distribution.csv.
MAGI_DOCS = (
    Bucket(1, 100, 8.33), Bucket(101, 200, 10.23), Bucket(201, 500, 28.19),
    Bucket(501, 1024, 24.64), Bucket(1025, 2048, 15.65), Bucket(2049, 4096, 7.34),
    Bucket(4097, 8192, 3.05), Bucket(8193, 16384, 1.29), Bucket(16385, 32768, 0.85),
    Bucket(32769, 65536, 0.14), Bucket(65537, 131072, 0.17), Bucket(131073, 196608, 0.14),
)

# DistCA's WLB-LLM proxy (hao-ai-lab/DistCA @2afd2192, distca/simulator/data/dist_wlbllm.json,
# 99,519 lengths, max 124,913), % of documents per bucket (computed from the file).
WLB_DOCS = (
    Bucket(1, 1024, 15.96), Bucket(1025, 2048, 15.79), Bucket(2049, 4096, 31.95),
    Bucket(4097, 8192, 33.93), Bucket(8193, 16384, 1.04), Bucket(16385, 32768, 0.45),
    Bucket(32769, 65536, 0.35), Bucket(65537, 124913, 0.53),
)

# ByteScale (arXiv 2502.21231) on GitHub code data: 16.2% of tokens come from sequences
# longer than 128K (s.3.1) and 9.8% from sequences longer than 256K (s.8.2). The paper gives
# no shape below 128K; we assume MagiAttention's document shape for the remaining 83.8%, and
# 1M tokens as the longest document.
GITHUB_TAIL = (Bucket(131073, 262144, 0.064), Bucket(262145, 1 << 20, 0.098))
GITHUB = to_token_shares(tuple(b for b in MAGI_DOCS if b.hi <= 131072), 0.838) + GITHUB_TAIL

# ProLong's 64K stage (princeton-nlp/ProLong train_64K.sh): 63% of tokens long data (code repos
# and books concatenated to 64K-token documents, textbooks), 37% short data (FineWeb,
# FineWeb-Edu, StackExchange, Wikipedia, Tulu, ArXiv, OpenWebMath). The short documents'
# lengths are not published there; we assume log-uniform 256-8K tokens.
PROLONG64K = (Bucket(65536, 65536, 0.63), Bucket(256, 8192, 0.37))

MIXES = (
    PublishedMix("github", "code: ByteScale's GitHub long tail (16.2% of tokens > 128K) over "
                 "a MagiAttention-shaped body", "ByteScale s.3.1, s.8.2; MagiAttention CSV",
                 GITHUB, True, 1 << 20),
    PublishedMix("prolong64k", "ProLong 64K stage: 63% of tokens in 64K documents, 37% short",
                 "ProLong train_64K.sh (arXiv 2410.02660)", PROLONG64K, True, 65536),
    PublishedMix("magi", "MagiAttention's representative training dataset (13.5M documents)",
                 "MagiAttention doc_length_distribution.csv", MAGI_DOCS, False, 196608),
    PublishedMix("wlb128k", "WLB-LLM-style 128K job (DistCA's proxy of WLB-LLM's lengths)",
                 "DistCA dist_wlbllm.json", WLB_DOCS, False, 131072),
)
