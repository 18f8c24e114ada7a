"""Sequence-length workloads: published distributions, parametric long tails, a real corpus.

A workload draws document lengths; ``sample_batch`` fills one global batch up to a token
budget. Every published mix cites where its numbers come from (see ``published.py``);
``stdlib`` is a real corpus present on every machine: the token lengths (bytes / 4) of the
Python standard library's source files. ``read_lengths`` takes a user's own file.
"""
from __future__ import annotations

import math
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from megatron_zeppelin.config_yaml import read_text
from megatron_zeppelin.options import integer
from megatron_zeppelin.sim import published

Sampler = Callable[[random.Random], int]


@dataclass(frozen=True)
class Workload:
    """A named length distribution; ``draw(rng)`` returns one document length (tokens)."""

    name: str
    description: str
    source: str
    draw: Sampler
    max_len: int


def _bucket_sampler(buckets: tuple[published.Bucket, ...], by_tokens: bool) -> Sampler:
    """Draw a bucket by its share (of documents, or of tokens), then a log-uniform length in it."""
    weights = []
    for b in buckets:
        mean = (b.hi - b.lo) / math.log(b.hi / b.lo) if b.hi > b.lo else b.lo
        weights.append(b.share / mean if by_tokens else b.share)
    cum = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)

    def draw(rng: random.Random) -> int:
        x = rng.random() * total
        b = buckets[next(i for i, c in enumerate(cum) if x <= c)]
        return max(1, int(math.exp(rng.uniform(math.log(b.lo), math.log(b.hi)))))

    return draw


def _longtail_sampler(mu: float, sigma: float, tail: float, tail_lo: int, max_len: int
                      ) -> Sampler:
    """Log-normal body with a Pareto (alpha = 1) tail of probability ``tail`` above ``tail_lo``."""
    def draw(rng: random.Random) -> int:
        if rng.random() < tail:
            length = tail_lo / max(1e-9, 1.0 - rng.random() * (1.0 - tail_lo / max_len))
        else:
            length = rng.lognormvariate(mu, sigma)
        return max(1, min(max_len, int(length)))

    return draw


def _lognormal_sampler(mu: float, sigma: float, lo: int, hi: int) -> Sampler:
    def draw(rng: random.Random) -> int:
        return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))

    return draw


@lru_cache(maxsize=1)
def stdlib_files() -> tuple[str, ...]:
    """The Python standard library's .py files (site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".py"))
    if not files:
        raise RuntimeError(f"no .py files found under the standard library folder {root}")
    return tuple(files)


@lru_cache(maxsize=1)
def stdlib_lengths() -> tuple[int, ...]:
    """Token lengths (bytes / 4) of the Python standard library's source files."""
    return tuple(max(1, os.path.getsize(path) // 4) for path in stdlib_files())


def _stdlib_sampler() -> Sampler:
    def draw(rng: random.Random) -> int:
        return rng.choice(stdlib_lengths())

    return draw


def _registry() -> dict[str, Workload]:
    out = {w.name: Workload(w.name, w.description, w.source,
                            _bucket_sampler(w.buckets, w.shares_are_tokens), w.max_len)
           for w in published.MIXES}
    out["stdlib"] = Workload("stdlib", "Python standard library source files (bytes/4)",
                             "this machine's Python stdlib", _stdlib_sampler(), 1 << 20)
    out["arxiv"] = Workload(
        "arxiv", "papers: log-normal, median 12K tokens, clipped to [512, 128K]",
        "parametric: the Zeppelin paper's ArXiv length statistics are not published in text",
        _lognormal_sampler(math.log(12288), 0.8, 512, 131072), 131072)
    out["longtail"] = Workload(
        "longtail", "log-normal body (median ~1.6K tokens) with a 2% Pareto tail to 256K",
        "parametric", _longtail_sampler(7.4, 1.2, 0.02, 16384, 262144), 262144)
    out["uniform-short"] = Workload(
        "uniform-short", "only short documents, 128-4K tokens log-uniform (no long tail)",
        "parametric", _bucket_sampler((published.Bucket(128, 4096, 1.0),), False), 4096)
    return out


WORKLOADS: dict[str, Workload] = _registry()


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: expected one of {sorted(WORKLOADS)} "
                         "(or pass --lengths FILE)")
    return WORKLOADS[name]


def parse_tokens(text: str | int) -> int:
    """'2M', '512K', '1.5G' or a plain integer -> tokens (K = 1024, M = 1024^2, G = 1024^3)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*", str(text))
        if not m:
            raise ValueError(f"token count {text!r} is invalid: expected an integer or a number "
                             "with K/M/G, e.g. 2M")
        scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"token count {text!r} is invalid: expected a positive number of tokens")
    return value


MAX_TOKENS = 1 << 30  # 1G tokens: 16x the largest global batches trained (16M-64M tokens)


def token_count(text: str) -> int:
    """An argparse ``type`` for a token-count flag (``parse_tokens``, at most ``MAX_TOKENS``):
    a bad value is argparse's one-line error naming the flag."""
    import argparse

    try:
        value = parse_tokens(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("token count ", "", 1)) from None
    if value > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected at most 1G tokens")
    return value


def sample_batch(workload: Workload | str, global_batch_tokens: int, rng: random.Random,
                 max_len: int | None = None) -> list[int]:
    """Documents drawn until the next one would overflow ``global_batch_tokens``.

    Documents longer than ``max_len`` (default: the workload's own) are clipped to it; a draw
    longer than the whole budget is clipped to the budget, so a batch is never empty.
    """
    if isinstance(workload, str):
        workload = get_workload(workload)
    if global_batch_tokens <= 0:
        raise ValueError(f"global batch tokens {global_batch_tokens} is invalid: expected > 0")
    cap = min(max_len or workload.max_len, global_batch_tokens)
    lengths, total = [], 0
    while True:
        length = min(cap, workload.draw(rng))
        if total + length > global_batch_tokens:
            return lengths or [length]
        lengths.append(length)
        total += length


def read_lengths(path: str | os.PathLike, what: str = "--lengths") -> list[int]:
    """One positive integer length per line (blank lines and # comments skipped); ``what``:
    the flag that named the file, for errors about it."""
    lengths = []
    for lineno, line in enumerate(read_text(path, what).splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = integer(text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: {text!r} is not an integer length") from None
        if value <= 0:
            raise ValueError(f"{path}:{lineno}: length {value} is invalid: expected >= 1")
        lengths.append(value)
    if not lengths:
        raise ValueError(f"{path}: no lengths found (expected one integer per line)")
    return lengths
