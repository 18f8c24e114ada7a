"""Settings declared once, as typed dataclass fields; flags and YAML keys are generated from them.

A *section* is a frozen dataclass whose fields are declared with ``setting(default, help)``
(the type comes from the annotation: ``int``, ``float``, ``str``, ``bool``, optionally
``| None``; ``choices`` where the value is one of a list). Its ``__post_init__`` validates
ranges and raises ``ConfigError`` as ``"<section>.<field>=<value> is invalid: expected ..."``
(``require``), ``<section>`` being its ``SECTION`` label (default: the class name).

From a section this module generates:

* argparse flags (``add_flags``): ``--<prefix><field-with-dashes>`` unless the field names its
  own ``flag`` (Megatron-LM's names); booleans are ``--x/--no-x``;
* the section from parsed flags (``from_flags``), with validation errors re-worded to name the
  flag the user typed (``--zeppelin-capacity-factor=0.5 is invalid: ...``);
* YAML values for those flags (``yaml_defaults``): keys are flag names (``-`` or ``_``),
  values type-checked against the flag, errors naming the file, the key and what is allowed.

So the ``zeppelin plan`` flags, the ``--zeppelin-*`` training flags (ours and Megatron-LM's
parser through the patch) and the training YAML keys all come from one declaration.
Standard library only.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
import types
import typing
from typing import Any, Iterable, Mapping

from megatron_zeppelin.errors import ConfigError


def setting(default: Any, help: str, *, flag: str | None = None,
            choices: Iterable[Any] | None = None, metavar: str | None = None,
            aliases: Iterable[str] = ()) -> Any:
    """A dataclass field that is also a command-line flag and a YAML key (``aliases``: other
    spellings of the flag, as Megatron-LM accepts them)."""
    meta = {"help": help, "flag": flag, "choices": tuple(choices) if choices else None,
            "metavar": metavar, "aliases": tuple(aliases)}
    return dataclasses.field(default=default, metadata=meta)


def require(cond: bool, what: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError("<what>=<value> is invalid: expected <allowed>")`` unless ``cond``
    (``what``: ``<section>.<field>`` in a section's ``__post_init__``, which ``from_flags``
    rewords to the flag)."""
    if not cond:
        raise ConfigError(f"{what}={value!r} is invalid: expected {allowed}")


def require_positive(what: str, value: Any) -> None:
    """``require`` a finite number (int or float, not bool) > 0."""
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and
            math.isfinite(value), what, value, "a finite positive number")


def require_at_least(what: str, value: Any, minimum: float = 0.0, note: str = "") -> None:
    """``require`` a finite number (int or float, not bool) >= ``minimum`` (``note``: what it
    means, appended to the error)."""
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and
            minimum <= value < math.inf, what, value, f"a finite number >= {minimum:g}{note}")


def require_positive_int(what: str, value: Any) -> None:
    """``require`` an integer (not bool) > 0."""
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
            what, value, "a positive integer")


def int_at_least(minimum: int):
    """An argparse ``type`` for an integer flag of at least ``minimum``: a bad value is
    argparse's one-line error naming the flag (``argument --tp: 0 is invalid: expected an
    integer >= 1``)."""
    def parse(text: str) -> int:
        try:
            value = integer(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer "
                                             f">= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid: expected an integer "
                                             f">= {minimum}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def settings(section: type) -> list[dataclasses.Field]:
    """The fields of ``section`` declared with ``setting`` (others are not flags)."""
    return [f for f in dataclasses.fields(section) if "help" in f.metadata]


def only_with(section, names: tuple[str, ...], enabled: bool, when: str) -> None:
    """Unless ``enabled``, each field of ``names`` keeps its declared default (one that
    differs is refused: it would be ignored; errors say ``<section>.<field>=``, expected
    "given only ``when``", e.g. ``with --mtp-num-layers``)."""
    if enabled:
        return
    for f in settings(type(section)):
        if f.name in names and getattr(section, f.name) != f.default:
            require(False, f"{section.SECTION}.{f.name}", getattr(section, f.name),
                    f"given only {when}")


def flag_of(f: dataclasses.Field, prefix: str = "") -> str:
    return f.metadata["flag"] or "--" + prefix + f.name.replace("_", "-")


def name_flags(message: str, flags: typing.Mapping[str, str]) -> str:
    """``message`` with each setting name of ``flags`` (a whole word) replaced by its flag, so
    that an error from the planner names the flag this entry point takes."""
    for name, flag in flags.items():
        message = re.sub(rf"(?<![\w-]){name}(?![\w-])", flag, message)
    return message


def dest_of(f: dataclasses.Field, prefix: str = "") -> str:
    return flag_of(f, prefix).lstrip("-").replace("-", "_")


@functools.lru_cache(maxsize=None)  # a class's annotations do not change
def base_type(section: type, name: str) -> tuple[type, bool]:
    """(the annotated scalar type of field ``name``, whether None is allowed)."""
    hint = typing.get_type_hints(section)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) != len(typing.get_args(hint))
    return hint, False


def plain_int(section: type, name: str, value: Any) -> Any:
    """``value`` for field ``name`` of the dataclass ``section``: as an ``int`` where the
    field is an integer and ``value`` another integer type (numpy's ``int64``: integral,
    ``__index__``), so that it passes the checks and reaches YAML, JSON and the C++ twin as a
    Python int; otherwise as given."""
    if isinstance(value, int) or not hasattr(value, "__index__") or \
            base_type(section, name)[0] is not int:
        return value
    try:
        return value.__index__()
    except TypeError:  # numpy's bool: refused by the field's check, as given
        return value


def plain_integers(section: Any) -> None:
    """``plain_int`` on every field of the (frozen) dataclass ``section``, in place."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        plain = plain_int(type(section), f.name, value)
        if plain is not value:
            object.__setattr__(section, f.name, plain)


def check_types(section: Any, max_int: int | None = None) -> None:
    """ConfigError naming a setting of ``section`` (a dataclass of ``setting`` fields, errors
    say ``<SECTION>.<field>=``) whose value is not of its declared type: a bool where an
    integer belongs (or an integer above ``max_int``), a string for a bool, a non-number for
    a number, a value outside its choices. For values given from Python, which no flag
    parser typed."""
    label = getattr(section, "SECTION", type(section).__name__)
    for f in settings(type(section)):
        value = getattr(section, f.name)
        kind, optional = base_type(type(section), f.name)
        if value is None and optional:
            continue
        what, choices = f"{label}.{f.name}", f.metadata.get("choices")
        if choices:
            require(value in choices, what, value, f"one of {list(choices)}")
        if kind is bool:
            require(isinstance(value, bool), what, value, "true or false")
        elif kind is int:
            require(isinstance(value, int) and not isinstance(value, bool) and
                    (max_int is None or value <= max_int), what, value,
                    "an integer" + ("" if max_int is None else f" <= {max_int}"))
        elif kind is float:
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and
                    math.isfinite(value), what, value, "a finite number")
        elif kind is str:
            require(isinstance(value, str), what, value, "a string")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, section: type,
              prefix: str = "", skip: Iterable[str] = (), only: Iterable[str] | None = None,
              defaults: Mapping[str, Any] = {}) -> None:
    """One flag per setting of ``section`` (all, or ``only`` these, minus ``skip``);
    ``defaults`` overrides the declared default of a field for this parser."""
    skip, only = set(skip), None if only is None else set(only)
    for f in settings(section):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        kind, _ = base_type(section, f.name)
        default = defaults.get(f.name, f.default)
        meta = f.metadata
        extra = {"help": _help(meta["help"], default, kind), "dest": dest_of(f, prefix)}
        names = (flag_of(f, prefix), *meta.get("aliases", ()))
        if kind is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction,
                                default=default, **extra)
            continue
        if meta["choices"]:
            extra["choices"] = meta["choices"]
        if meta["metavar"]:
            extra["metavar"] = meta["metavar"]
        if kind is str and default is None:  # an optional name or path: "" is not one
            kind = nonempty
        parser.add_argument(*names, type=CHECKED_TYPES.get(kind, kind),
                            default=default, **extra)


def integer(text: str) -> int:
    """``text`` as an integer: ASCII digits with an optional sign (``int`` alone also takes
    ``1_000`` and full-width or other Unicode digits); ValueError otherwise. The argparse
    ``type`` of an integer setting."""
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


def nonempty(text: str) -> str:
    """An argparse ``type`` for a name or path that must be given (an empty string was read as
    "not given" and silently fell back to the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a non-empty value")
    return text


def finite_float(text: str) -> float:
    """The argparse ``type`` of a float setting: a finite number (``inf``, ``nan`` and
    ``1e400`` are refused in argparse's one line naming the flag)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number")
    return value


# the argparse types that stand for ``int`` and ``float``: ASCII digits (``int`` alone takes
# "1_0" and full-width digits), finite numbers (``float`` takes "inf" and "nan")
CHECKED_TYPES = {int: integer, float: finite_float}


def _help(text: str, default: Any, kind: type) -> str:
    if default is None or default is dataclasses.MISSING:
        return text
    if kind is bool:
        return f"{text} (default: {'on' if default else 'off'})"
    return f"{text} (default: {default})"


def from_flags(section: type, args: argparse.Namespace, prefix: str = "", *,
               given_only: bool = False, **fixed: Any) -> Any:
    """Build ``section`` from parsed flags; ``fixed`` supplies fields that have no flag on this
    parser; ``given_only``: a flag left at None (flags added with ``defaults`` None: not given)
    keeps the field's declared default. A validation error names the flag instead of the
    field."""
    kwargs = {f.name: getattr(args, dest_of(f, prefix)) for f in settings(section)
              if f.name not in fixed}
    if given_only:
        kwargs = {name: value for name, value in kwargs.items() if value is not None}
    try:
        return section(**kwargs, **fixed)
    except ConfigError as exc:
        raise ConfigError(reword(str(exc), section, prefix, skip=fixed)) from None


def reword(message: str, section: type, prefix: str = "", skip: Iterable[str] = ()) -> str:
    """``<section>.<field>`` in ``message`` -> ``--<flag>`` (the name the user typed)."""
    label = getattr(section, "SECTION", section.__name__)
    for f in settings(section):
        if f.name not in skip:
            message = re.sub(rf"(?<![\w.]){re.escape(label)}\.{f.name}(?!\w)",
                             flag_of(f, prefix), message)
    return message


# ----------------------------------------------------------------------------- YAML

def yaml_defaults(parser: argparse.ArgumentParser, data: Any, where: str,
                  ignore: Iterable[str] = ()) -> dict[str, Any]:
    """Type-checked parser defaults from a YAML mapping of flag names to values.

    Keys may use ``-`` or ``_``; an unknown key, a value of the wrong type or outside the
    flag's choices raises ``ConfigError`` naming ``where`` (the file), the key and what is
    allowed. Returns ``{dest: value}`` for ``parser.set_defaults``.
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of flag names to values, got "
                          f"{type(data).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help",) and a.option_strings}
    ignore = set(ignore)
    values = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest in ignore:
            valid = sorted(set(actions) - ignore)
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {valid}")
        if dest in values:
            twin = next(k for k in data if str(k).replace("-", "_") == dest)
            raise ConfigError(f"{where}: keys {twin!r} and {key!r} both set "
                              f"{actions[dest].option_strings[0]}: keep one")
        values[dest] = check_value(actions[dest], value, f"{where}: {key}")
    return values


def check_value(action: argparse.Action, value: Any, what: str) -> Any:
    """``value`` as the flag of ``action`` would take it, or ConfigError naming ``what``."""
    if value is None:
        return None
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction,
                           argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{what}={value!r} is invalid: expected true or false")
        return value
    kind = action.type
    if kind in (int, integer) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{what}={value!r} is invalid: expected an integer")
    if kind in (float, finite_float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise ConfigError(f"{what}={value!r} is invalid: expected a finite number")
        value = float(value)
    if kind in (None, str, nonempty) and isinstance(value, list) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = ",".join(str(v) for v in value)  # a YAML list of integers: window_size [L, 0]
    if kind in (None, str, nonempty) and not isinstance(value, str):
        raise ConfigError(f"{what}={value!r} is invalid: expected a string")
    if kind is nonempty and not value.strip():
        raise ConfigError(f"{what}={value!r} is invalid: expected a non-empty value")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{what}={value!r} is invalid: expected one of {list(action.choices)}")
    return value


def number_at_least(minimum: float, exclusive: bool = False):
    """An argparse ``type`` for a finite number ``>= minimum`` (``> minimum`` when
    ``exclusive``): a bad value is argparse's one-line error naming the flag."""
    bound = f"{'>' if exclusive else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a number {bound}")
        return value

    parse.__name__ = "number"
    return parse


def exit_status(prog: str, work: typing.Callable[[], int | None],
                flags: typing.Mapping[str, str] | None = None) -> int:
    """Run an entry point's ``work``; its status (0 for None), or 2 with bad input (a
    ``ConfigError``, ``ValueError`` or ``OSError``) printed as one line on stderr, with the
    setting names of ``flags`` (``{"cp_size": "--cp-size"}``: the planner's words) replaced
    by this entry point's flags."""
    try:
        status = work()
    except (ConfigError, ValueError, OSError) as exc:
        print(f"{prog}: error: {name_flags(str(exc), flags or {})}", file=sys.stderr)
        return 2
    return 0 if status is None else status


GIVEN = "_given_flags"  # the namespace attribute where ``Parser`` records the flags given


class _StoreGiven(argparse._StoreAction):
    """argparse's plain ``store``, also recording the option string in ``GIVEN``; a second
    value of the same option is refused where the parser refuses repeats (``Parser``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, GIVEN, set())
        if option_string is not None and given & set(self.option_strings) and \
                getattr(parser, "refuse_repeats", False) and \
                values != getattr(namespace, self.dest, None):
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r}, "
                         f"then {values!r}): expected it once")
        super().__call__(parser, namespace, values, option_string)
        if option_string is not None:
            given.update(self.option_strings)
            setattr(namespace, GIVEN, given)


def given(args: argparse.Namespace, flag: str, default: Any) -> bool:
    """Whether ``flag`` (``--sim-profile``) was on the command line: recorded by ``Parser``
    (so a flag given at its default value counts); for a namespace built otherwise, whether
    its value differs from ``default``."""
    if hasattr(args, GIVEN):
        return flag in getattr(args, GIVEN)
    return getattr(args, flag.lstrip("-").replace("-", "_")) != default


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one ``ConfigError`` line (no usage dump), so that
    the entry point prints it once and exits with status 2. Each plain ``store`` option given
    on the command line is recorded (``given``). A plain option given twice with different
    values is refused (argparse would keep the last silently), unless ``refuse_repeats`` is
    False: ``pretrain_gpt.py`` keeps Megatron-LM's last-one-wins, on which launch scripts that
    append overrides to a shared flag list rely. Subcommand parsers refuse repeats."""

    def __init__(self, *args: Any, refuse_repeats: bool = True, **kwargs: Any) -> None:
        self.refuse_repeats = refuse_repeats
        super().__init__(*args, **kwargs)
        # every ``type=int`` / ``type=float`` of this parser (its groups and subparsers too)
        for kind, checked in CHECKED_TYPES.items():
            self.register("type", kind, checked)
        self.register("action", None, _StoreGiven)
        self.register("action", "store", _StoreGiven)

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        namespace = argparse.Namespace() if namespace is None else namespace
        if not hasattr(namespace, GIVEN):
            setattr(namespace, GIVEN, set())
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")
