"""The C++ twins (``megatron_zeppelin._<name>_cpp``, built from ``csrc/`` by ``pip install -e
.``) and the one policy that picks between a twin and its pure-Python reference: ``python``
always, ``cpp`` only when built (else an error naming the variable), ``auto`` the twin when
built. The router and the planner each keep their switch point and call this."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable


def load_twin(name: str) -> ModuleType | None:
    """``megatron_zeppelin._<name>_cpp``, or None when it was not built."""
    try:
        return importlib.import_module(f"megatron_zeppelin._{name}_cpp")
    except ImportError:
        return None


def twin_backend(choice: str, load: Callable[[], ModuleType | None], name: str,
                 variable: str) -> str:
    """``"cpp"`` or ``"python"`` for ``choice`` (``auto``, ``cpp`` or ``python``, the value of
    environment ``variable``); ``load`` returns the twin or None. Raises ImportError when
    ``cpp`` is required but not built."""
    if choice == "python":
        return "python"
    if load() is not None:
        return "cpp"
    if choice == "cpp":
        raise ImportError(f"{variable}=cpp but the C++ {name} megatron_zeppelin._{name}_cpp is "
                          "not built: reinstall with `pip install -e .` (setup.py compiles "
                          f"csrc/) or set {variable}=python")
    return "python"
