"""Every environment variable the package reads, read here and nowhere else.

ZEPPELIN_CONFIGS           folder to resolve bare config names against (default: repo configs/)
ZEPPELIN_ROUTER_BACKEND    ``auto`` (default), ``cpp`` or ``python``: which router implementation
ZEPPELIN_PLANNER_BACKEND   ``auto`` (default), ``cpp`` or ``python``: which planner implementation
ZEPPELIN_PLANNER_TIMEOUT_S seconds training waits for the planner process's plan (default 300)
ZEPPELIN_ATTENTION_BACKEND ``auto`` (default) or a registered kernel backend
                           (``runtime.kernels.choices()``: native, torch, flash_attn, te)
ZEPPELIN_TRANSPORT         ``direct`` (default: tensors go to torch.distributed as they are),
                           ``staged`` (CUDA tensors through host buffers over gloo: several
                           ranks sharing one GPU, for tests and debugging) or ``ordered``
                           (tests on gloo: messages matched by order per rank pair, as NCCL
                           does, a mismatch fails loudly; ``runtime/ordered.py``)
ZEPPELIN_P2P_TIMEOUT_S     seconds a ring/remap exchange may wait on a peer (default 300)
ZEPPELIN_REMAP_EXCHANGE    ``all-to-all`` (default: one all_to_all_single over the pool) or
                           ``pairs`` (point-to-point between the ranks that move rows only;
                           ``runtime/remap.py``)
MEGATRON_LM_PATH           a Megatron-LM checkout, for the patch test and apply script
LOCAL_WORLD_SIZE           set by torchrun: processes on this node (default GPUs per node)
LOCAL_RANK                 set by torchrun: this process's index on its node (its GPU)
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT   set by torchrun (read by torch.distributed,
                           and here before any process group exists)
TORCHELASTIC_ERROR_FILE    set by torchrun: where a failing worker writes its error (shown in
                           torchrun's failure summary)
TORCHELASTIC_USE_AGENT_STORE  set by torchrun: the rendezvous store at MASTER_ADDR:MASTER_PORT
                           lives in the launcher, not in rank 0
"""
from __future__ import annotations

import math
import os

from megatron_zeppelin.errors import ConfigError

ROUTER_BACKENDS = ("auto", "cpp", "python")
TRANSPORTS = ("direct", "staged", "ordered")
PLANNER_BACKENDS = ("auto", "cpp", "python")
REMAP_EXCHANGES = ("all-to-all", "pairs")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip().lower() or default
    if value not in allowed:
        raise ConfigError(f"environment variable {name}={value!r} is invalid: expected one of "
                         f"{list(allowed)}")
    return value


def configs_dir() -> str | None:
    return os.environ.get("ZEPPELIN_CONFIGS") or None


def router_backend() -> str:
    return _choice("ZEPPELIN_ROUTER_BACKEND", "auto", ROUTER_BACKENDS)


def planner_backend() -> str:
    return _choice("ZEPPELIN_PLANNER_BACKEND", "auto", PLANNER_BACKENDS)


def planner_timeout_s() -> float:
    return _positive_seconds("ZEPPELIN_PLANNER_TIMEOUT_S", "300")


def attention_backend(choices: tuple[str, ...]) -> str:
    """``ZEPPELIN_ATTENTION_BACKEND``, one of ``choices`` (the kernel registry's)."""
    return _choice("ZEPPELIN_ATTENTION_BACKEND", "auto", choices)


def transport() -> str:
    """``ZEPPELIN_TRANSPORT``: how tensors reach torch.distributed (``TRANSPORTS``)."""
    return _choice("ZEPPELIN_TRANSPORT", "direct", TRANSPORTS)


def remap_exchange() -> str:
    """``ZEPPELIN_REMAP_EXCHANGE``: how the remap moves rows (``REMAP_EXCHANGES``)."""
    return _choice("ZEPPELIN_REMAP_EXCHANGE", "all-to-all", REMAP_EXCHANGES)


def p2p_timeout_s() -> float:
    return _positive_seconds("ZEPPELIN_P2P_TIMEOUT_S", "300")


def _positive_seconds(name: str, default: str) -> float:
    raw = os.environ.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:  # nan fails too
        raise ConfigError(f"environment variable {name}={raw!r} is invalid: expected a positive "
                         "finite number of seconds")
    return value


def megatron_lm_path() -> str | None:
    return os.environ.get("MEGATRON_LM_PATH") or None


def local_world_size() -> int | None:
    """torchrun's LOCAL_WORLD_SIZE (None when not launched by it); a ConfigError naming it
    when set to anything but a positive integer."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={raw!r} is invalid: expected "
                         "a positive integer (the processes torchrun starts per node)")
    return int(raw)


def local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 when not launched)."""
    return _int("LOCAL_RANK") or 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isascii() and raw.isdigit() else None


def rank() -> int | None:
    """This process's global rank as the launcher set it (None when not launched)."""
    return _int("RANK")


def world_size() -> int | None:
    return _int("WORLD_SIZE")


def master_address() -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT): the rendezvous store, or None when not set."""
    port = _int("MASTER_PORT")
    return (os.environ.get("MASTER_ADDR", "localhost"), port) if port is not None else None


def check_rendezvous() -> None:
    """What torch.distributed's ``env://`` rendezvous reads, checked (torchrun sets it; a
    process started by hand must): WORLD_SIZE >= 1, RANK in [0, WORLD_SIZE), MASTER_ADDR set,
    MASTER_PORT in [1, 65535], LOCAL_WORLD_SIZE (when set) dividing WORLD_SIZE and above
    LOCAL_RANK; a bad one is a ConfigError naming the variable."""
    world = _int("WORLD_SIZE")
    if not world:
        raise ConfigError(f"environment variable WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                         "is invalid: expected an integer >= 1")
    rank = _int("RANK")
    if rank is None or rank >= world:
        raise ConfigError(f"environment variable RANK={os.environ.get('RANK')!r} is invalid: "
                         f"expected an integer in [0, {world}) (WORLD_SIZE={world})")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name, "").strip():
            raise ConfigError(f"environment variable {name} is not set: torchrun sets it; a "
                             "process started by hand must (the rendezvous address)")
    port = _int("MASTER_PORT")
    if port is None or not 1 <= port <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={os.environ['MASTER_PORT']!r} is "
                         "invalid: expected a port number in [1, 65535]")
    local = local_world_size()  # torchrun's; a process started by hand may leave it unset
    if local is not None and (world % local or local_rank() >= local):
        raise ConfigError(f"environment variables LOCAL_WORLD_SIZE={local} and LOCAL_RANK="
                          f"{local_rank()} are invalid with WORLD_SIZE={world}: expected "
                          "LOCAL_WORLD_SIZE dividing WORLD_SIZE and LOCAL_RANK below it")


def store_in_launcher() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def launcher_error_file() -> str | None:
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None
