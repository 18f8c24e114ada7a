"""Argument checks of the public API (``api.py``): which ``scripts/pretrain_gpt.py`` flags
``runtime_options`` / ``pool_runtime`` take, which the ``PoolLayout`` or the ``ModelSpec``
decide instead, which the pool runtime never reads (the training loop's), and the checks of
every other public function's arguments. Each refusal is one ``ValueError`` naming the
argument, its value and what is allowed."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megatron_zeppelin.config import (ConfigError, ModelSpec, ZeppelinConfig, load_cluster,
                                      load_hardware)
from megatron_zeppelin.parallel import PoolLayout

# flags ``runtime_options`` takes from its own arguments
ARGUMENT_FLAGS = {"context_parallel_mode": "mode", "device": "device",
                  "seq_length": "seq_length"}
# flags the ``PoolLayout`` decides: flag -> (its field, what it is)
LAYOUT_FLAGS = {"tensor_model_parallel_size": ("tp", "TP size"),
                "context_parallel_size": ("cp", "CP size"),
                "pipeline_model_parallel_size": ("pp", "pipeline stages"),
                "zeppelin_gpus_per_node": ("gpus_per_node", "node size")}
VIRTUAL_STAGES = "num_layers_per_virtual_pipeline_stage"
# the ModelSpec decides every flag named as one of its fields (``model_flags``) except the
# window: the flag is the attention's pattern ('L,0'), the field the planner's view of it
WINDOW_FLAGS = ("window_size", "window_attn_skip_freq")
# the ``--zeppelin-*`` runtime flags the pool runtime reads (``build_pool_runtime``); the
# others (planner process, watchdog, online fit) are the training loop's
RUNTIME_FLAGS = ("strategy", "cluster", "hardware", "attention_backend", "validate_plan")
# where a training-loop flag's job is done with this API instead
FIT = "use fit = api.online_fit(runtime, batches, interval=, profile_out=) in your loop"
LOOP_FLAGS = {"zeppelin_planner_process": "pass planned_micro_batches(..., planner="
                                          "PlannerService(runtime.planner)) to plan in a "
                                          "process (megatron_zeppelin.planner.service)",
              "zeppelin_watchdog_timeout": "wrap your loop in api.watchdog(timeout_s)",
              "zeppelin_fit_interval": FIT, "zeppelin_profile_out": FIT}


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_layout(layout: Any) -> None:
    if not isinstance(layout, PoolLayout):
        raise ValueError(f"layout={show(layout)} is invalid: expected a PoolLayout")


def check_layout_model(layout: Any, model: Any) -> None:
    check_layout(layout)
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model={show(model)} is invalid: expected a ModelSpec (layers, hidden "
                         "size, heads: config.load_model or ModelSpec(...))")


def model_flags(options: Any) -> list[str]:
    """The flags among ``options`` the ModelSpec decides (the model's shape)."""
    return sorted(f.name for f in dataclasses.fields(ModelSpec)
                  if f.name in options and f.name not in WINDOW_FLAGS)


def who_decides(flag: str, layout: PoolLayout | None, model: ModelSpec | None
                ) -> tuple[str, Any]:
    """(who decides ``flag`` instead, the value it gives) for a flag of ``decided_elsewhere``;
    without the layout and model, the reason names where they give it."""
    if flag in LAYOUT_FLAGS:
        field, what = LAYOUT_FLAGS[flag]
        value = None if layout is None else getattr(layout, field)
        where = f"layout.{field}" if layout is None else f"layout.{field}={value!r}"
        return f"the PoolLayout gives the {what} ({where})", value
    if flag == VIRTUAL_STAGES:
        return ("the PoolLayout gives the pipeline stages and pool_runtime builds no model "
                "chunks (virtual stages are the model's you build): expected None"), None
    value = None if model is None else getattr(model, flag)
    where = f"model.{flag}" if model is None else f"{flag}={value!r}"
    return f"the ModelSpec gives the model's shape ({where})", value


def defaults() -> dict:
    """Every flag destination of ``scripts/pretrain_gpt.py`` with its default."""
    from megatron_zeppelin.megatron.loop import args as train_args

    return vars(train_args.build_parser().parse_args([]))


def decided_elsewhere(options: dict) -> list[str]:
    """Every flag decided by the layout or the model, not by ``runtime_options``' flags."""
    return [*LAYOUT_FLAGS, VIRTUAL_STAGES, *model_flags(options)]


def read_flags() -> set[str]:
    """The flags ``pool_runtime`` reads besides its arguments' and those the layout or the
    model decide: the planner settings and strategy options, ``RUNTIME_FLAGS``, the window,
    the softmax type (a sink: refused with Ulysses plans) and the dtype (``bf16``)."""
    from megatron_zeppelin.megatron.loop import args as train_args
    from megatron_zeppelin.options import dest_of
    from megatron_zeppelin.planner.registry import option_dests

    prefix = train_args.ZEPPELIN_PREFIX
    sections = [(f, ZeppelinConfig) for f in dataclasses.fields(ZeppelinConfig)
                if f.name != "max_seqlen"]
    sections += [(f, train_args.ZeppelinRuntimeArgs)
                 for f in dataclasses.fields(train_args.ZeppelinRuntimeArgs)
                 if f.name in RUNTIME_FLAGS]
    return {*(dest_of(f, prefix) for f, _ in sections), *option_dests(prefix), *WINDOW_FLAGS,
            "softmax_type", "bf16"}


def check_names(flags: dict, options: dict) -> None:
    """Refuse unknown flags, flags set by an argument and flags the layout or model decide."""
    unknown = sorted(set(flags) - set(options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}: expected flag destinations of "
                         "scripts/pretrain_gpt.py (e.g. zeppelin_cluster)")
    given = sorted(set(flags) & set(ARGUMENT_FLAGS))
    elsewhere = sorted(set(flags) & set(decided_elsewhere(options)))
    if given or elsewhere:
        reasons = [f"pass {ARGUMENT_FLAGS[g]}=" for g in given]
        reasons += dict.fromkeys(who_decides(g, None, None)[0] for g in elsewhere)
        raise ValueError(f"option(s) {given + elsewhere} are invalid here: "
                         f"{'; '.join(reasons)}")
    unread = sorted(set(flags) - read_flags())
    if unread:
        hints = "".join(f"; {flag}: {LOOP_FLAGS[flag]}" for flag in unread if flag in LOOP_FLAGS)
        raise ValueError(f"option(s) {unread} are invalid here: the pool runtime does not read "
                         "them (flags of scripts/pretrain_gpt.py's training loop: your loop "
                         f"decides them){hints}; it reads {sorted(read_flags())}")


def check_sections(args: argparse.Namespace) -> None:
    """The values of the sections ``pool_runtime`` reads, checked as the flags would be."""
    from megatron_zeppelin.megatron.loop import args as train_args
    from megatron_zeppelin.options import check_types, from_flags

    for section, fixed in ((train_args.ZeppelinRuntimeArgs, {}),
                           (train_args.ZeppelinConfig, {"max_seqlen": None})):
        check_types(from_flags(section, args, train_args.ZEPPELIN_PREFIX, **fixed))
    from_flags(train_args.AttentionArgs, args)  # --window-size, --window-attn-skip-freq
    for flag, load in (("zeppelin_cluster", load_cluster), ("zeppelin_hardware", load_hardware)):
        name = getattr(args, flag)
        if name is not None:
            try:
                load(name)
            except ConfigError as exc:
                raise ValueError(f"{flag}={show(name)} is invalid: {exc}") from None
    if args.window_attn_skip_freq is not None and args.window_size is None:
        raise ValueError(f"window_attn_skip_freq={args.window_attn_skip_freq!r} without "
                         "window_size: pass the window ('L,0') it applies (as "
                         "scripts/pretrain_gpt.py refuses --window-attn-skip-freq alone)")


def same(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected


def windowed_model(args: argparse.Namespace, model: ModelSpec) -> ModelSpec:
    """``model`` with the sliding window the attention runs (``window_size`` and
    ``window_attn_skip_freq`` flags) when it gives none, so that the planner prices the
    layers that run; ValueError when it gives another window (or one the flags do not run)."""
    from megatron_zeppelin.megatron.common.model import windowed_layers
    from megatron_zeppelin.megatron.loop import args as train_args

    fields = train_args.AttentionArgs.from_namespace(args).config_fields(model.num_layers)
    window, layers = windowed_layers(fields.get("window_size"),
                                     fields.get("window_attn_skip_freq"), model.num_layers)
    if model.window_size is None and window is not None:
        return dataclasses.replace(model, window_size=window, window_layers=layers)
    given = (model.window_size, model.num_layers if model.window_layers is None
             else model.window_layers) if model.window_size is not None else (None, None)
    if given != (window, layers):
        runs = f"a window of {window} on {layers} layers" if window is not None else "none"
        raise ValueError(f"model.window_size={model.window_size!r}, window_layers="
                         f"{model.window_layers!r} is invalid with the window the attention "
                         f"runs (window_size={args.window_size!r}, window_attn_skip_freq="
                         f"{args.window_attn_skip_freq!r}: {runs}): the planner would price "
                         "other layers than run (give the ModelSpec no window, or the same)")
    return model


def check_flag(name: str, value: Any, allowed: tuple, what: str) -> None:
    if not any(same(value, a) for a in allowed):
        raise ValueError(f"{name}={show(value)} is invalid: expected {what}")


def check_runtime(runtime: Any) -> None:
    if not (hasattr(runtime, "planner") and hasattr(runtime, "pool")):
        raise ValueError(f"runtime={show(runtime)} is invalid: expected the PoolRuntime of "
                         "pool_runtime")


def check_batches(batches: Any, runtime: Any, device: Any, prefetch: Any, planner: Any
                  ) -> None:
    from megatron_zeppelin.planner.service import PlannerService

    check_runtime(runtime)
    if not hasattr(batches, "__next__"):
        raise ValueError(f"batches={show(batches)} is invalid: expected an iterator of "
                         "micro-batches (lists of 1-D token tensors; e.g. iter(a_list))")
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={show(device)} is invalid: expected a torch.device or "
                         "a device string ('cpu', 'cuda')") from None
    check_flag("prefetch", prefetch, (True, False), "True or False")
    if not (planner is None or callable(planner) or isinstance(planner, PlannerService)):
        raise ValueError(f"planner={show(planner)} is invalid: expected None, a lengths -> "
                         "Plan callable or a PlannerService")


def check_watchdog(timeout_s: Any, prog: Any) -> None:
    import threading

    from megatron_zeppelin.megatron.loop.watchdog import check_timeout

    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and
            (timeout_s == 0 or 1.0 <= timeout_s < float("inf"))):
        raise ValueError(f"timeout_s={show(timeout_s)} is invalid: expected 0 (off) or "
                         "seconds >= 1")
    check_timeout(timeout_s, "timeout_s")
    if not (prog is None or isinstance(prog, str)):
        raise ValueError(f"prog={show(prog)} is invalid: expected None or a string")
    if not dist.is_initialized():
        raise ValueError("watchdog() is invalid here: no process group (call "
                         "torch.distributed.init_process_group first)")
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("watchdog() is invalid here: enter it from the main thread (it "
                         "takes SIGTERM, which only the main thread can)")


def check_online_fit(runtime: Any, batches: Any, interval: Any, profile_out: Any) -> None:
    """``api.online_fit``'s arguments: the pool runtime, its planned micro-batches (planned
    by ``runtime.planner`` or a planner process on it: a refit replaces that planner), an
    interval >= 0 and a writable profile file (only with an interval)."""
    from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator
    from megatron_zeppelin.output_paths import writable_file

    check_runtime(runtime)
    if not isinstance(batches, ZeppelinDataIterator):
        raise ValueError(f"batches={show(batches)} is invalid: expected what "
                         "planned_micro_batches returned for this runtime")
    if batches.service is None and batches.planner is not runtime.planner:
        raise ValueError("batches is invalid here: its micro-batches are planned by another "
                         "planner than runtime.planner, which a refit would replace (plan "
                         "with runtime.planner, or PlannerService(runtime.planner))")
    if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 0):
        raise ValueError(f"interval={show(interval)} is invalid: expected an integer >= 0 "
                         "(iterations between refits; 0: off)")
    if profile_out is not None and not (interval and isinstance(profile_out, str) and
                                        writable_file(profile_out)):
        raise ValueError(f"profile_out={show(profile_out)} is invalid: expected None or a "
                         "file in an existing, writable folder, with interval > 0")
