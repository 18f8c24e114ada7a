"""Public API: zeppelin context parallelism in your own Megatron-Core training loop.

What ``scripts/pretrain_gpt.py`` (``megatron/loop/train.py``) and the Megatron-LM glue
(``megatron/lm/glue.py``) use, in one place (``docs/api.md`` shows a whole loop):

* ``pool_runtime(layout, model, seq_length=...)``: the process groups of the pools
  (``PoolLayout``: a pool = the CP ranks of one data-parallel replica and TP rank), the
  planner's cost model, the attention state core attention runs on and the planner
  (document lengths -> ``Plan``); ``process_groups(layout)`` alone gives the groups;
* ``layer_spec(runtime)`` / ``swap_core_attention(spec, runtime)``: Megatron's GPT layer spec
  (or any spec of yours) with every self-attention's core attention swapped for zeppelin's;
* ``planned_micro_batches(batches, runtime)``: wraps an iterator of micro-batches (lists of
  1-D token tensors, one per document, the same on every rank of a pool) into this rank's
  planned ``MicroBatch``es (tokens, labels, loss mask, positions, packed params), planning the
  next micro-batch while the current one trains;
* ``loss_func(batch)``: the loss function a Megatron ``forward_step_func`` returns: the sum
  of per-token losses and the token count of this rank's share. With
  ``TransformerConfig(calculate_per_token_loss=True)`` Megatron's schedules and DDP divide
  gradients by the tokens of the whole global batch (ranks of a pool hold different token
  counts, so a per-rank mean would be wrong); ``global_mean_loss(stored)`` is the logged mean;
* ``watchdog(timeout_s)``: a context around the loop in which a rank that dies, freezes or
  raises is named by every other rank, which then exit instead of waiting in a collective;
* ``online_fit(runtime, batches, interval=)``: the planner's hardware profile refitted to the
  run's measurements every ``interval`` iterations, the same on every rank.

Model layouts: tokens / labels / positions ``[1, tokens]`` int64, loss mask ``[1, tokens]``
float32 (Megatron's layout, batch 1; every rank holds its ``Plan.linear[rank]`` pieces).
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_zeppelin.api_checks import (
    check_batches, check_flag, check_layout, check_layout_model, check_names, check_sections,
    check_online_fit, check_watchdog, decided_elsewhere, defaults, model_flags, same, show,
    who_decides, windowed_model)
from megatron_zeppelin.config import ModelSpec
from megatron_zeppelin.megatron.common.data import MicroBatch, ZeppelinDataIterator
from megatron_zeppelin.megatron.common.groups import Pool, new_pool_groups
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.runtime.transport import collective_device

MODES = ("zeppelin", "static")
DEVICES = ("cuda", "cpu")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")


def process_groups(layout: PoolLayout) -> Pool:
    """Every pool's process groups (every rank calls it, in the same order); this rank's
    ``Pool`` (``.group``: ring P2P and remap all-to-all, ``.rank``: rank in the pool,
    ``.index``: data-parallel replica). A ``layout`` not a ``PoolLayout``: ValueError."""
    check_layout(layout)
    return new_pool_groups(layout)


def runtime_options(seq_length: int, mode: str = "zeppelin", device: str = "cuda",
                    **flags: Any) -> argparse.Namespace:
    """The options ``pool_runtime`` reads, as ``scripts/pretrain_gpt.py`` would parse them:
    defaults of every flag, then ``flags`` by destination name (``zeppelin_cluster=``,
    ``zeppelin_attention_backend=``, ``zeppelin_capacity_tokens_per_gpu=``, ``bf16=``...).

    Refused (ValueError naming it): an unknown name; a flag set by an argument (``mode``,
    ``device``, ``seq_length``); a flag the ``PoolLayout`` (parallel sizes) or the
    ``ModelSpec`` (the model's shape: ``num_layers``, ``hidden_size``...) decides, which
    ``pool_runtime``/``pool_runtime_from_args`` take from them; a flag the pool runtime
    does not read (``lr``, ``zeppelin_planner_process``...: the training loop's, yours here);
    a value of the wrong type or range; a cluster or hardware file that does not load;
    ``window_attn_skip_freq`` without ``window_size``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {list(MODES)}")
    if not (isinstance(seq_length, int) and not isinstance(seq_length, bool) and
            seq_length >= 2):
        raise ValueError(f"seq_length={seq_length!r} is invalid: expected an integer >= 2 (the "
                         "longest document, Megatron's --seq-length)")
    options = defaults()
    check_names(flags, options)
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is invalid: expected one of {list(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid here: torch.cuda.is_available() is False")
    options.update(flags, seq_length=seq_length, context_parallel_mode=mode, device=device)
    args = argparse.Namespace(**options)
    check_sections(args)
    return args


def pool_runtime(layout: PoolLayout, model: ModelSpec, *, seq_length: int,
                 mode: str = "zeppelin", device: str = "cuda", **flags: Any):
    """This rank's ``PoolRuntime`` (``.pool``, ``.cost``, ``.state``, ``.planner``;
    ``.close()`` when done): groups -> cost model -> attention state -> planner, built
    collectively. ``model``: the planner's view of the model (layers, hidden size, heads;
    it also gives the layer count a ``window_attn_skip_freq`` pattern needs, and takes the
    window the flags run when it has none: ``windowed_model``); ``flags``: as
    ``runtime_options``, except that a flag the layout or the model decides
    (``num_layers=``, ``pipeline_model_parallel_size=``...) may be given with the value they
    give it. Refused (ValueError): a layout or model of the wrong type, such a flag with
    another value (naming the one the layout or model gives), what ``runtime_options``
    refuses."""
    from megatron_zeppelin.megatron.loop.sections import skip_freq

    check_layout_model(layout, model)
    decided = [flag for flag in decided_elsewhere(defaults()) if flag in flags]
    for flag in decided:
        who, expected = who_decides(flag, layout, model)
        if not same(flags[flag], expected):
            raise ValueError(f"{flag}={flags[flag]!r} is invalid here: {who}")
    rest = {name: value for name, value in flags.items() if name not in decided}
    args = runtime_options(seq_length, mode, device, **rest)
    skip_freq(args.window_attn_skip_freq, model.num_layers, "window_attn_skip_freq")
    return pool_runtime_from_args(args, layout, windowed_model(args, model))


def pool_runtime_from_args(args: argparse.Namespace, layout: PoolLayout, model: ModelSpec):
    """``pool_runtime`` from a parsed namespace (ours, or Megatron-LM's with ``device``);
    a model-shape flag the namespace leaves None (``runtime_options`` leaves them all) is the
    ModelSpec's. Refused (ValueError): arguments of the wrong type."""
    from megatron_zeppelin.megatron.loop.train import build_pool_runtime

    if not isinstance(args, argparse.Namespace):
        raise ValueError(f"args={show(args)} is invalid: expected an argparse.Namespace "
                         "(runtime_options or Megatron-LM's args)")
    check_layout_model(layout, model)
    filled = {flag: getattr(model, flag) for flag in model_flags(vars(args))
              if getattr(args, flag, None) is None and getattr(model, flag) is not None}
    return build_pool_runtime(argparse.Namespace(**{**vars(args), **filled}), layout, model)


def _state(runtime: Any):
    """The attention state of ``runtime`` (a ``PoolRuntime`` or the state itself)."""
    from megatron_zeppelin.megatron.common.core_attention import ZeppelinAttentionState

    state = getattr(runtime, "state", runtime)
    if not isinstance(state, ZeppelinAttentionState):
        raise ValueError(f"runtime={show(runtime)} is invalid: expected the object "
                         "pool_runtime returned (or its .state)")
    return state


def layer_spec(runtime: Any, *, use_te: bool | None = None, normalization: str = "RMSNorm",
               qk_layernorm: bool = False, multi_latent_attention: bool = False):
    """Megatron's GPT layer spec (TE when ``use_te`` or importable, else local) with zeppelin
    core attention (multi-latent attention's self-attention with ``multi_latent_attention``);
    ``runtime``: a ``PoolRuntime`` or its attention state. Refused (ValueError): another
    ``runtime``, ``use_te`` not None/True/False, ``normalization`` not RMSNorm/LayerNorm,
    ``qk_layernorm``/``multi_latent_attention`` not True/False."""
    from megatron_zeppelin.megatron.common.spec import get_gpt_layer_zeppelin_spec

    state = _state(runtime)
    check_flag("use_te", use_te, (None, True, False), "None (TE when importable), True or False")
    check_flag("normalization", normalization, NORMALIZATIONS, f"one of {list(NORMALIZATIONS)}")
    check_flag("qk_layernorm", qk_layernorm, (True, False), "True or False")
    check_flag("multi_latent_attention", multi_latent_attention, (True, False), "True or False")
    return get_gpt_layer_zeppelin_spec(state, use_te=use_te,
                                       normalization=normalization, qk_layernorm=qk_layernorm,
                                       multi_latent_attention=multi_latent_attention)


def swap_core_attention(spec: Any, runtime: Any, where: str = "the layer spec"):
    """A copy of any Megatron layer or block spec with zeppelin core attention. Refused
    (ValueError): a ``spec`` that is neither a layer ``ModuleSpec`` nor a block spec
    (``layer_specs``: ``TransformerBlockSubmodules``, MTP's block), another ``runtime`` than
    ``layer_spec`` takes, a ``where`` not a string."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_zeppelin.megatron.common.spec import swap_core_attention as swap

    state = _state(runtime)
    block = isinstance(getattr(spec, "layer_specs", None), (list, tuple))
    if not (isinstance(spec, ModuleSpec) or block):
        raise ValueError(f"spec={show(spec)} is invalid: expected a Megatron layer ModuleSpec "
                         "or a block spec with layer_specs (TransformerBlockSubmodules, "
                         "MultiTokenPredictionBlockSubmodules)")
    if not isinstance(where, str):
        raise ValueError(f"where={show(where)} is invalid: expected a string (the spec's "
                         "origin, for errors)")
    return swap(spec, state, where)


def planned_micro_batches(batches: Iterator[list[torch.Tensor]], runtime: Any,
                          device: torch.device | str = "cpu", *,
                          max_position: int | None = None, prefetch: bool = True,
                          planner: Any = None) -> ZeppelinDataIterator:
    """This rank's planned micro-batches from ``batches`` (lists of 1-D int64 documents, the
    same on every rank of the pool); ``close()`` when done. ``max_position``: the RoPE table
    length (the model's ``max_sequence_length``); ``planner``: another lengths -> ``Plan``
    callable or ``PlannerService`` than ``runtime.planner``. Refused (ValueError): a
    ``runtime`` not ``pool_runtime``'s, ``batches`` not an iterator, a bad ``device``,
    ``max_position`` not None or >= 1, ``prefetch`` not True/False, another ``planner``."""
    if max_position is not None and not (isinstance(max_position, int) and
                                         not isinstance(max_position, bool) and max_position >= 1):
        raise ValueError(f"max_position={max_position!r} is invalid: expected None or an "
                         "integer >= 1 (the RoPE table length)")
    check_batches(batches, runtime, device, prefetch, planner)
    return ZeppelinDataIterator(batches, planner or runtime.planner, runtime.pool.rank,
                                device=device, prefetch=prefetch,
                                prepare=_state(runtime).prepare, max_position=max_position)


def loss_func(batch: MicroBatch):
    """Megatron's loss function for ``batch``: ``output [1, tokens]`` per-token losses ->
    (sum over the rank's labelled tokens, token count, ``{"lm loss": [sum, count]}``), the
    per-token form megatron-core normalises over the global batch. Refused (ValueError): a
    ``batch`` without a ``loss_mask`` tensor (not a ``MicroBatch``)."""
    if not isinstance(getattr(batch, "loss_mask", None), torch.Tensor):
        raise ValueError(f"batch={show(batch)} is invalid: expected the MicroBatch "
                         "planned_micro_batches yields (with a loss_mask tensor)")

    def per_token_loss(output: torch.Tensor):
        total = (output.float() * batch.loss_mask).sum()
        count = batch.loss_mask.sum().to(torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return per_token_loss


def global_mean_loss(stored: list[dict], group: dist.ProcessGroup | None = None) -> float:
    """The iteration's mean loss per token over every rank of ``group`` (default: the world;
    use the DP x CP group with TP or pipelines) from what the schedule returned. Refused
    (ValueError): ``stored`` not a list of ``loss_func``'s dicts (``{"lm loss": tensor([sum,
    count])}``), a ``group`` not None or a ProcessGroup."""
    if not isinstance(stored, (list, tuple)):
        raise ValueError(f"stored={show(stored)} is invalid: expected the list the schedule "
                         "returned (loss_func's dicts)")
    for i, entry in enumerate(stored):
        loss = entry.get("lm loss") if isinstance(entry, dict) else None
        if not (isinstance(loss, torch.Tensor) and loss.shape == (2,)):
            raise ValueError(f"stored[{i}]={show(entry)} is invalid: expected loss_func's "
                             "dict {'lm loss': tensor([sum, count])}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group={show(group)} is invalid: expected None (the world) or a "
                         "torch.distributed ProcessGroup")
    sums = torch.stack([d["lm loss"] for d in stored]).sum(0) if stored else \
        torch.zeros(2, device=collective_device(group))  # a stage before the last: nothing
    dist.all_reduce(sums, group=group)
    return (sums[0] / sums[1].clamp(min=1)).item()


__all__ = ["MicroBatch", "Pool", "PoolLayout", "ModelSpec", "process_groups",
           "runtime_options", "pool_runtime", "pool_runtime_from_args", "layer_spec",
           "swap_core_attention", "planned_micro_batches", "loss_func", "global_mean_loss"]


@contextlib.contextmanager
def watchdog(timeout_s: float = 20.0, prog: str | None = None) -> Iterator[str]:
    """Zeppelin's heartbeat watchdog around your loop (``--zeppelin-watchdog-timeout`` of
    ``scripts/pretrain_gpt.py``; ``megatron/loop/watchdog.py``). Collective: every rank
    enters it from its main thread, after ``init_process_group``, under torchrun (its
    rendezvous store at MASTER_ADDR:MASTER_PORT carries the heartbeats). A rank that dies,
    freezes for ``timeout_s`` seconds or raises is named by every other rank within
    ``timeout_s`` + 2 s: each prints ``<prog>: error: rank R: rank F (pid, host) died`` (or
    ``stopped responding``, ``failed: <its error>``) and exits with status 1, instead of
    waiting in a collective. An exception leaving the block is handed to it first (a
    communication error waits for the verdict naming the peer behind it; another is this
    rank's failure, published) and re-raised. Yields the banner line (``off (...)`` for
    ``timeout_s`` 0 or without a store). ``prog``: the script's name (default: argv[0]'s).
    Refused (ValueError): ``timeout_s`` not 0 or seconds >= 1 (and fewer than
    ``ZEPPELIN_P2P_TIMEOUT_S``), no process group, another thread than the main one."""
    import functools
    import os
    import signal
    import sys

    from megatron_zeppelin.megatron.loop import fatal
    from megatron_zeppelin.megatron.loop.watchdog import start_watchdog, watched

    check_watchdog(timeout_s, prog)
    name = prog or os.path.basename(sys.argv[0]) or "python"
    dog, line = start_watchdog(float(timeout_s), functools.partial(fatal.fault, prog=name),
                               "api.watchdog's timeout_s")
    if dog is None:
        yield line
        return
    previous = signal.getsignal(signal.SIGTERM)
    fatal.take_sigterm_in_python()  # torchrun stops the others when a rank dies
    try:
        with watched(dog):
            yield line
    finally:
        fatal.off_sigterm()
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class _FitOff:
    """``online_fit`` with ``interval`` 0: the loop's calls change nothing."""

    switches: list = []

    def watch(self, batches: Iterator) -> Iterator:
        return batches

    def finish(self) -> None:
        pass

    def step(self, iteration: int) -> None:
        pass


def online_fit(runtime: Any, batches: Any, *, interval: int, profile_out: str | None = None):
    """The hardware profile fitted during training (``--zeppelin-fit-interval`` of
    ``scripts/pretrain_gpt.py``; ``megatron/common/online_fit.py``): the engine measures
    every micro-batch, and every ``interval`` iterations each rank fits the planner's cost
    model to its measurements, rank 0 combines them and every rank's planner switches to it
    at the same micro-batch (``runtime.planner`` becomes the refitted one); ``profile_out``
    gets the profile after every refit (for ``zeppelin_hardware=`` of the next run).
    In the loop, every rank: ``data_iterator=fit.watch(batches)`` (each micro-batch's span
    timed), ``fit.finish()`` after the forward-backward pass, ``fit.step(iteration)`` after
    the optimizer step (a collective every ``interval`` iterations; iterations from 1).
    ``interval`` 0: off (the calls change nothing). Refused (ValueError): a ``runtime`` not
    ``pool_runtime``'s, ``batches`` not its ``planned_micro_batches`` (or planned by another
    planner), ``interval`` not an integer >= 0, ``profile_out`` not a writable file."""
    from megatron_zeppelin.megatron.common.online_fit import FitSettings, OnlineFit

    check_online_fit(runtime, batches, interval, profile_out)
    if not interval:
        return _FitOff()

    def switch(planner) -> int:
        runtime.planner = planner
        return batches.replan(planner)

    settings = FitSettings(interval, profile_out, runtime.planner.config.max_seqlen,
                           "online_fit's profile_out")
    return OnlineFit(settings, runtime.pool, runtime.state, runtime.planner, switch,
                     str(torch.device(batches.device).type))
