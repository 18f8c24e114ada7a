"""NIC-aware routing of inter-node ring traffic: the one switch point between the backends.

``route(topology, flows, align)`` computes a ``RouteSchedule`` with the C++ twin
(``megatron_zeppelin._router_cpp``, built from ``csrc/`` by ``pip install -e .``) when it is
built, else with the pure-Python reference; both return the same schedule bit for bit.
``ZEPPELIN_ROUTER_BACKEND`` (read by ``env.router_backend()``): ``auto`` (default), ``cpp``
(require the C++ twin) or ``python``.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Sequence

from megatron_zeppelin import env
from megatron_zeppelin.twins import load_twin, twin_backend
from megatron_zeppelin.router import reference
from megatron_zeppelin.router.model import (DEFAULT_MAX_CHUNKS, DEFAULT_MIN_CHUNK_BYTES,
                                            chunk_span)
from megatron_zeppelin.router.reference import RouteCost, direct, evaluate
from megatron_zeppelin.router.schedule import (Flow, RouterTopology, RouteSchedule, Slice,
                                               build_schedule, validate_chunking,
                                               validate_flows)

__all__ = ["Flow", "RouteCost", "RouteSchedule", "RouterTopology", "Slice", "backend_name",
           "chunk_span", "direct", "evaluate", "route", "get_route_raw"]


def load_cpp() -> ModuleType | None:
    """The compiled twin, or None when it was not built."""
    return load_twin("router")


def backend_name() -> str:
    """``"cpp"`` or ``"python"``: the backend ``route`` uses now (raises like ``route``)."""
    return twin_backend(env.router_backend(), load_cpp, "router", "ZEPPELIN_ROUTER_BACKEND")


def get_route_raw(backend: str | None = None) -> Callable[..., tuple]:
    """The ``route_raw`` of ``backend`` (``"cpp"``/``"python"``; None: ``backend_name()``)."""
    backend = backend or backend_name()
    if backend == "python":
        return reference.route_raw
    if backend == "cpp":
        module = load_cpp()
        if module is None:
            raise ImportError("the C++ router megatron_zeppelin._router_cpp is not built: "
                              "reinstall with `pip install -e .` (setup.py compiles csrc/)")
        return module.route_raw
    raise ValueError(f"router backend={backend!r} is invalid: expected 'cpp' or 'python'")


def route(topology: RouterTopology, flows: Sequence[Flow], align: int = 1,
          backend: str | None = None, *, max_chunks: int = DEFAULT_MAX_CHUNKS,
          min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES) -> RouteSchedule:
    """Route one ring step's inter-node ``flows`` (see ``reference`` for the algorithm).

    align: byte granularity of every slice (e.g. the element size in bytes); every flow's
    nbytes must be a multiple of it. backend: None follows ``ZEPPELIN_ROUTER_BACKEND``.
    max_chunks / min_chunk_bytes: the pipeline's chunk rule (``model``): the schedule's chunk
    count is at most ``max_chunks`` (<= 16) and keeps the largest slice's chunks at least
    ``min_chunk_bytes`` bytes. Raises ValueError naming a bad flow or chunk setting;
    ImportError when the C++ twin is required but absent.
    """
    validate_chunking(max_chunks, min_chunk_bytes)
    validate_flows(topology, flows, align, max_chunks)
    args = reference.make_raw_arguments(topology, flows, align, max_chunks, min_chunk_bytes)
    return build_schedule(topology, flows, align, get_route_raw(backend)(*args))
