"""Strategies as registered objects: one class per strategy, its options as dataclass fields.

A strategy is a frozen dataclass subclassing ``Strategy`` whose fields are its own options
(``cp_size``, ``max_seqlen_per_rank``, ...), each with ``metadata={"help": ...}``; ``@register``
adds it under its ``name``. Adding a strategy is one module with one registered class (imported
by ``planner/__init__.py``): ``make_plan``, ``zeppelin plan`` (a flag per option field), the
simulator's sweep and the fidelity check find it in ``STRATEGIES``.

Planner-wide settings (capacity, overlong policy, routing, remap) stay in ``ZeppelinConfig``.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.planner.common import with_derived_capacity


@dataclass(frozen=True)
class Strategy:
    """Base of every planning strategy: ``plan(seqlens, cost, config) -> Plan``.

    name: the registry key (``zeppelin plan --strategy NAME``); summary: one line for help
    texts and reports; attention: ``ring`` when the attention engine (``runtime/engine.py``)
    executes its plans, ``ulysses`` for plans whose attention is all-to-all head parallelism
    (FlexSP), which only the simulator models; routed: whether the strategy sends its
    inter-node ring traffic through the routing layer (zeppelin) or the static NICs.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    attention: ClassVar[str] = "ring"
    routed: ClassVar[bool] = False  # runs its inter-node rings through the routing layer

    def plan(self, seqlens: Sequence[int], cost: CostModel,
             config: ZeppelinConfig = ZeppelinConfig()) -> Plan:
        """Plan one global batch (``seqlens``: tokens per document). A derived capacity
        (``config.capacity_tokens_per_gpu`` unset) grows when a greedy placement cannot meet
        it (``common.with_derived_capacity``)."""
        return with_derived_capacity(self.place, seqlens, cost, config)

    def place(self, seqlens: Sequence[int], cost: CostModel, config: ZeppelinConfig) -> Plan:
        """The strategy itself, at the capacity ``config`` gives."""
        raise NotImplementedError(f"strategy {self.name!r} does not implement place()")

    @property
    def runs_on_engine(self) -> bool:
        """Whether the attention engine can execute this strategy's plans."""
        return self.attention == "ring"

    def label(self) -> str:
        """The name, with the options that differ from their defaults: ``static-cp(cp_size=16)``."""
        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"{self.name}({', '.join(changed)})" if changed else self.name


STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: add a ``Strategy`` subclass to ``STRATEGIES`` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy) and cls.name):
        raise TypeError(f"{cls!r} is not a named Strategy subclass")
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise ValueError(f"strategy name {cls.name!r} is registered twice")
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"option {cls.name}.{f.name} has no metadata help text")
    STRATEGIES[cls.name] = cls
    return cls


def option_fields(name: str) -> tuple[dataclasses.Field, ...]:
    """The option fields of strategy ``name``."""
    return dataclasses.fields(strategy_class(name))


def option_type(cls: type[Strategy], field: dataclasses.Field) -> type:
    """The plain type of an option (``int | None`` -> ``int``)."""
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: expected one of {list(STRATEGIES)}")
    return STRATEGIES[name]


def get_strategy(name: str, **options: Any) -> Strategy:
    """The strategy ``name`` with ``options`` (its option fields); raises naming an unknown
    strategy or option and the valid ones."""
    cls = strategy_class(name)
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"strategy {name!r} has no option(s) {unknown}: valid options "
                         f"{valid or 'none'}")
    return cls(**options)


def make_plan(strategy: str | Strategy, seqlens: Sequence[int], cost: CostModel,
              config: ZeppelinConfig = ZeppelinConfig(), **options: Any) -> Plan:
    """Plan one global batch with ``strategy`` (a registered name with its ``options``, or a
    ``Strategy`` object)."""
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(f"options {sorted(options)} given with a Strategy object: set them "
                             "on the object")
        return strategy.plan(seqlens, cost, config)
    return get_strategy(strategy, **options).plan(seqlens, cost, config)
