#!/usr/bin/env python
"""Write the benchmark corpora as Megatron indexed datasets (PREFIX.bin / PREFIX.idx).

    python scripts/make_corpora.py --output build/corpora            # all three
    python scripts/make_corpora.py --output build/corpora --corpus arxiv --tokens 1M

Each corpus is real text (this machine's Python standard library sources as bytes: vocab 256,
as the built-in ``--mock-data`` corpus) cut into documents whose lengths follow a published
or parametric mix, scaled down by ``--scale`` (default 8, as the built-in corpus) so that the
tiny GPT trains on them on a CPU:

* ``longtail``: the built-in long-tail corpus itself (``--mock-data``: MagiAttention's
  training-set lengths / 8), document for document;
* ``arxiv``: ArXiv-like papers (``sim/workloads.py`` ``arxiv``: log-normal, median 12K tokens,
  [512, 128K]) / scale;
* ``prolong``: ProLong's 64K stage (``sim/published.py`` ``PROLONG64K``: 63% of tokens in 64K
  documents, 37% in 256-8K ones) / scale.

Lengths are drawn with a fixed seed (``--seed``), so every machine writes the same lengths.
Written with megatron-core's ``IndexedDatasetBuilder`` (uint16 tokens, one sequence per
document); ``pretrain_gpt.py --data-path OUTPUT/NAME`` trains on them. The files are build
outputs: keep them out of git.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_zeppelin.errors import ConfigError  # noqa: E402
from megatron_zeppelin.options import Parser, exit_status, int_at_least  # noqa: E402
from megatron_zeppelin.output_paths import make_folder, writable_folder  # noqa: E402

PROG = "make_corpora.py"

CORPORA = {"longtail": None, "arxiv": "arxiv", "prolong": "prolong64k"}  # name -> workload
SCALE = 8


def corpus_lengths(name: str, tokens: int, scale: int, seed: int) -> list[int]:
    """Document lengths of corpus ``name``: the built-in corpus's own, or drawn from its
    workload (divided by ``scale``, at least 1 token) until ``tokens`` are reached."""
    from megatron_zeppelin.megatron.loop.corpus import BuiltinCorpus
    from megatron_zeppelin.sim.workloads import get_workload

    if CORPORA[name] is None:
        return list(BuiltinCorpus().lengths())
    draw, rng = get_workload(CORPORA[name]).draw, random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(max(1, draw(rng) // scale))
    return lengths


def write_corpus(prefix: Path, lengths: list[int]) -> int:
    """Documents of ``lengths`` tokens of stdlib text, consecutive, into PREFIX.bin/.idx;
    returns the tokens written."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_zeppelin.megatron.loop.corpus import _StdlibText

    text, offset = _StdlibText(), 0
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for length in lengths:
        data = torch.frombuffer(bytearray(text.read(offset, length)), dtype=torch.uint8)
        builder.add_item(data.to(torch.int64))
        builder.end_document()
        offset += length
    builder.finalize(str(prefix) + ".idx")
    return offset


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, every value checked before any corpus is drawn (a bad one: ConfigError)."""
    from megatron_zeppelin.sim.workloads import token_count

    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="folder for NAME.bin / NAME.idx")
    p.add_argument("--corpus", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    p.add_argument("--tokens", type=token_count, default=None,
                   help="tokens per drawn corpus (arxiv, prolong; default 4M)")
    p.add_argument("--scale", type=int_at_least(1), default=None,
                   help=f"drawn document lengths divided by this (default {SCALE})")
    p.add_argument("--seed", type=int_at_least(0), default=None,
                   help="seed of the drawn lengths (default 0)")
    args = p.parse_args(argv)
    twice = sorted({name for name in args.corpus if args.corpus.count(name) > 1})
    if twice:
        raise ConfigError(f"--corpus lists {', '.join(twice)} more than once: expected each "
                          "corpus at most once")
    drawn = [name for name in args.corpus if CORPORA[name] is not None]
    for flag in ("tokens", "scale", "seed"):
        if getattr(args, flag) is not None and not drawn:
            raise ConfigError(f"--{flag}={getattr(args, flag)} is invalid with --corpus "
                              f"{' '.join(args.corpus)}: it sets the drawn corpora (arxiv, "
                              "prolong); longtail is the built-in corpus as it is")
    args.tokens = 4 << 20 if args.tokens is None else args.tokens
    args.scale = SCALE if args.scale is None else args.scale
    args.seed = 0 if args.seed is None else args.seed
    return args


def write_all(args: argparse.Namespace, out: Path) -> None:
    for name in args.corpus:
        lengths = corpus_lengths(name, args.tokens, args.scale, args.seed)
        written = write_corpus(out / name, lengths)
        ordered = sorted(lengths)
        print(f"{out / name}: {len(lengths):,} documents, {written:,} tokens; median "
              f"{ordered[len(ordered) // 2]:,}, p99 {ordered[int(0.99 * len(ordered))]:,}, "
              f"max {ordered[-1]:,} tokens per document", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Write the corpora; bad input is one line on stderr and exit status 2, before any."""
    def work() -> None:
        args = parse_args(argv)
        write_all(args, make_folder("--output", writable_folder("--output", args.output)))

    return exit_status(PROG, work)


if __name__ == "__main__":
    sys.exit(main())
