"""Flag types and checks shared by the ``zeppelin bench`` targets and ``calibrate``: bad input
is refused before any work, in one line naming the flag, its value and what is allowed (the
argparse ``type``s raise ``ArgumentTypeError``: the ``options.Parser`` line; the checks
``ConfigError``: exit status 2)."""
from __future__ import annotations

import argparse
import sys
import typing
from typing import Any, Mapping

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.options import Parser, given, integer

MAX_PORT = 65535


def port_number(free: bool = False):
    """An argparse ``type`` for a rendezvous port, 1..65535 (0 too when ``free``: the command
    picks a free one)."""
    low = 0 if free else 1

    def parse(text: str) -> int:
        try:
            value = integer(text)
        except ValueError:
            value = -1
        if not low <= value <= MAX_PORT:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: expected a TCP port {low}..{MAX_PORT}"
                + (" (0: a free one)" if free else ""))
        return value

    parse.__name__ = "port"
    return parse


def check_ports(flag: str, first: int | None, count: int) -> None:
    """ConfigError naming ``flag`` unless the ``count`` consecutive ports from ``first`` (one
    per spawned world) are all ports (``first`` None or 0: free ports are picked)."""
    if count > MAX_PORT:
        raise ConfigError(f"the runs would take {count} consecutive ports from {flag}, more than "
                          f"the {MAX_PORT} there are: run fewer rounds or repeats")
    if first and first + count - 1 > MAX_PORT:
        raise ConfigError(f"{flag}={first} is invalid: expected at most {MAX_PORT - count + 1} "
                          f"(the runs take {count} consecutive ports from it)")


def int_list(minimum: int, what: str = "integers"):
    """An argparse ``type`` for comma-separated integers ``>= minimum`` (at least one): the
    tuple of them."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(integer(x) for x in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected comma-separated "
                                             f"{what} >= {minimum}, e.g. "
                                             f"{minimum},{2 * max(minimum, 1)}")
        return values

    parse.__name__ = "integer list"
    return parse


# a micro-benchmark's shapes: beyond these a run only fails in the allocator
MAX_HEADS, MAX_HEAD_DIM, MAX_CALL_TOKENS = 1024, 1024, 1 << 24


def check_shape(parser: argparse.ArgumentParser, args: argparse.Namespace,
                token_flags: tuple[str, ...] = ()) -> None:
    """``parser.error`` naming a flag of ``args`` beyond the benchmarks' shapes: ``--heads``,
    ``--kv-heads`` (at most ``MAX_HEADS``, dividing ``--heads``), ``--head-dim`` and each
    flag of ``token_flags`` (an integer or a list of them, at most ``MAX_CALL_TOKENS``)."""
    for flag, bound in (("heads", MAX_HEADS), ("kv_heads", MAX_HEADS),
                        ("head_dim", MAX_HEAD_DIM), *((t, MAX_CALL_TOKENS) for t in token_flags)):
        value = getattr(args, flag)
        values = value if isinstance(value, (list, tuple)) else [value]
        if max(values) > bound:
            parser.error(f"--{flag.replace('_', '-')}={value} is invalid: expected at most "
                         f"{bound}")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads={args.kv_heads} is invalid: expected a divisor of "
                     f"--heads={args.heads}")


def refuse_given(args: argparse.Namespace, defaults: Mapping[str, Any], unless: str) -> None:
    """ConfigError naming the first flag of ``defaults`` (``--flag``: its default) given on
    the command line (``options.given``; even at its default value): it would be ignored
    (``unless`` says why)."""
    for flag, default in defaults.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if given(args, flag, default):
            raise ConfigError(f"{flag}={value!r} is invalid {unless}: it would be ignored "
                              "(drop it)")


class ExitParser(Parser):
    """A parser of a bench module run on its own argv: an error is one line on stderr and
    ``SystemExit(2)`` (no usage block), whether or not ``zeppelin``'s entry point is above."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"zeppelin: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
