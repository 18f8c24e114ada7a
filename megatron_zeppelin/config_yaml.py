"""Strict YAML for the configuration dataclasses, and the shipped ``configs/`` folder.

``from_dict`` builds a frozen dataclass from a YAML mapping: an unknown key, a missing required
key or a value of the wrong type raises ``ConfigError`` naming the file, the key, the value and
what is allowed (range checks are the dataclass's own ``__post_init__``). ``write_yaml`` writes
a profile or cluster back in the keys the loaders read. Bare names resolve to
``configs/<kind>/<name>.yaml`` (``resolve_config_path``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Hashable, Mapping

import yaml

from megatron_zeppelin import env
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.options import require


def _coerce(cls_name: str, key: str, hint: Any, value: Any) -> Any:
    """Convert a YAML scalar/list to the annotated type, or raise naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        return _coerce(cls_name, key, hint, value)
    if hint is bool:
        require(isinstance(value, bool), f"{cls_name}.{key}", value, "true or false")
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), f"{cls_name}.{key}",
                value, "an integer")
        return value
    if hint is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value), f"{cls_name}.{key}", value, "a finite number")
        return float(value)
    if hint is str:
        require(isinstance(value, str), f"{cls_name}.{key}", value, "a string")
        return value
    if typing.get_origin(hint) is tuple:
        if isinstance(value, Mapping):
            return tuple(value.items())
        require(isinstance(value, (list, tuple)), f"{cls_name}.{key}", value, "a list")
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names), key=str)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown key(s) {unknown}; valid keys: {names}")
    try:
        kwargs = {k: _coerce(cls.__name__, k, hints[k], v) for k, v in data.items()}
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from None
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in kwargs]
    if missing:
        raise ConfigError(f"{where or cls.__name__}: missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from None


def configs_dir() -> Path:
    """The shipped ``configs/`` folder (``ZEPPELIN_CONFIGS`` overrides)."""
    override = env.configs_dir()
    if override:
        if not Path(override).is_dir():
            raise ConfigError(f"ZEPPELIN_CONFIGS={override!r} is invalid: expected a folder "
                              "laid out as the shipped configs/ (clusters/, hardware/, models/, "
                              "sim/, train/), or unset it")
        return Path(override)
    return Path(__file__).resolve().parent.parent / "configs"


def resolve_config_path(name_or_path: str | os.PathLike, kind: str) -> Path:
    """A path as given, or ``configs/<kind>/<name>.yaml`` for a bare name."""
    if not isinstance(name_or_path, (str, os.PathLike)) or \
            not str(name_or_path).strip():  # Path('') is the working folder
        shipped = sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))
        shown = str(name_or_path) if isinstance(name_or_path, os.PathLike) else name_or_path
        raise ConfigError(f"{kind} config {shown!r} is invalid: expected a shipped "
                          f"name ({shipped}) or a path to a YAML file")
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ConfigError(f"{kind} config file {str(path)!r} does not exist")
        return path
    candidate = configs_dir() / kind / f"{name_or_path}.yaml"
    if not candidate.exists():
        shipped = sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))
        raise ConfigError(f"unknown {kind} config {str(name_or_path)!r}; shipped: {shipped}"
                          " (or give a path to a YAML file)")
    return candidate


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the
    last one silently) and a key that is not a scalar; a merge key (``<<: *anchor``) merges as
    YAML 1.1 says, the mapping's own keys overriding the merged ones."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a scalar, got {key!r}", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: ``3e-3``, ``1E5``, ``5.e-1`` (1.1
# wants a dot and a signed exponent). Tried after PyYAML's own int and float patterns.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(text: str, where: str) -> Any:
    """The YAML document ``text`` (strict: no key twice); a syntax error is a ConfigError
    naming ``where`` (the file or flag), the problem and its line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        line = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{where} is not valid YAML: {problem}{line}") from None


def read_text(path: str | os.PathLike, what: str) -> str:
    """The text of file ``path``; an unreadable one (a folder, no permission, not UTF-8) is
    a ConfigError naming ``what`` (a flag, or the kind of file) and the path."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not a text file (UTF-8): byte "
                          f"{exc.object[exc.start]:#04x} at offset {exc.start}") from None
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {exc.strerror}") from None


def read_yaml(path: Path) -> dict:
    data = load_yaml(read_text(path, "config file"), str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at top level, got "
                          f"{type(data).__name__}")
    return data


def write_yaml(obj, path: str | Path, comment: str) -> Path:
    """A profile or cluster as YAML (the loaders' keys, None left out), with a comment header;
    the loaders read it back."""
    data = {}
    for key, value in obj.__dict__.items():
        if value is None:
            continue
        if key == "attention_tflops":
            value = {int(n): float(t) for n, t in value}
        elif isinstance(value, tuple):
            value = list(value)
        data[key] = value
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=100))
    return path

