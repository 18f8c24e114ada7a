"""The measuring world of ``zeppelin bench decisions`` (``decisions.py``): 4 spawned gloo ranks
build the tiny GPT as ``pretrain_gpt.py`` does, and time every portfolio candidate's plan of
sampled micro-batches as a real training step (forward + backward + the gradient all-reduce of
one micro-batch; the weights never change, the gradients are zeroed after every step)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from megatron_zeppelin.bench.workers import run_spawned, training_rank_env

NAME_OF_STRATEGY = "zeppelin"  # the plans' strategy field
SAME = "/"  # joins the names of candidates that are the same plan


SETUP_TIMEOUT_S = 600.0  # the world's start: model, planner, corpus
ROUND_TIMEOUT_S = 1200.0  # one round of a micro-batch: every candidate's step once


def run_world(argv: list[str], options: dict, out: str) -> None:
    """Spawn the ranks; rank 0 writes ``[decide() keyword arguments, ...]`` to ``out``. A rank
    that fails, or a world past its time (``SETUP_TIMEOUT_S`` plus ``ROUND_TIMEOUT_S`` per
    round), is a RuntimeError naming the rank."""
    from megatron_zeppelin.bench.train import RANKS

    rounds = options["batches"] * (options["warmup"] + options["repeats"])
    run_spawned(_rank, RANKS, (RANKS, argv, options, out),
                timeout_s=SETUP_TIMEOUT_S + ROUND_TIMEOUT_S * rounds, what="bench decisions")


def _rank(rank: int, world: int, argv: list[str], options: dict, out: str) -> None:
    training_rank_env(rank, world, options["port"])
    _measure(rank, world, argv, options, out)


def _measure(rank: int, world: int, argv: list[str], options: dict, out: str) -> None:
    import torch.distributed as dist

    from megatron_zeppelin.megatron.loop import args as train_args, preflight, train

    args = train_args.parse_args(argv)
    layout = train_args.validate_args(args, world, world)
    ready = preflight.check(args)
    train.init_process_group(args)
    train.setup_megatron(args)
    runtime = train.build_pool_runtime(args, layout, train.model_spec(args))
    try:
        model, _ = train.build_training(args, runtime.state, train.model_spec(args))
        results = [measure_batch(i, docs, args, runtime, model, options)
                   for i, docs in sampled(args, ready.source, runtime, options)]
    finally:
        runtime.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def sampled(args, source, runtime, options):
    """(index in the stream, documents) of every ``stride``-th micro-batch, ``batches`` of
    them (the pool's stream of ``pretrain_gpt.py``, same seed)."""
    from megatron_zeppelin.megatron.loop.corpus import MicroBatchSampler

    pool = runtime.pool
    stream = MicroBatchSampler(source, args.micro_batch_size * args.seq_length, args.seed,
                               args.seq_length, args.zeppelin_overlong, pools=pool.layout.dp,
                               pool=pool.index)
    for index in range(options["batches"] * options["stride"]):
        docs = next(stream)
        if index % options["stride"] == options["stride"] - 1:
            yield index, docs


def candidate_plans(lengths: list[int], planner) -> tuple[object, list[tuple[str, object]]]:
    """(the portfolio's plan, [(name, plan) of every candidate]) of one micro-batch; the
    candidates are the Python reference's (``portfolio.candidates``), the pick the configured
    backend's (``Plan.candidate``). Candidates that are the same plan (same tasks and linear
    layout: e.g. hybrid DP and Hydraulis when both keep every sequence local) are measured
    once, under their names joined by ``SAME`` ("/")."""
    from megatron_zeppelin.planner.common import assemble, prepare
    from megatron_zeppelin.planner.portfolio import candidates

    chosen = planner(lengths)
    batch = prepare(lengths, planner.cost.cluster.topology(planner.cost.tp), planner.config)
    same: dict[str, tuple[list[str], object]] = {}
    for c in candidates(batch, planner.cost, planner.config):
        plan = assemble(NAME_OF_STRATEGY, batch, c.tasks, c.linear, candidate=c.name)
        same.setdefault(repr((plan.tasks, plan.linear)), ([], plan))[0].append(c.name)
    return chosen, [(SAME.join(names), plan) for names, plan in same.values()]


def estimated_candidates(lengths: list[int], planner) -> tuple[list[tuple[str, object]],
                                                               list[float], str]:
    """(the candidates' (name, plan), their estimates, the pick's name) of one micro-batch
    (``candidate_plans``; the estimates are the portfolio plan's, per merged name its first)."""
    chosen, plans = candidate_plans(lengths, planner)
    estimates = {merged: dict(chosen.estimates).get(merged.split(SAME)[0])
                 for merged, _ in plans}
    pick = next(m for m, _ in plans if chosen.candidate in m.split(SAME))
    missing = [name for name, value in estimates.items() if value is None]
    if missing:
        raise RuntimeError(f"candidates {missing} have no estimate in the portfolio's plan "
                           f"(its candidates: {list(estimates)})")
    return plans, list(estimates.values()), pick


def measure_batch(index: int, docs, args, runtime, model, options: dict) -> dict:
    """``decide()``'s keyword arguments for one micro-batch: every candidate timed
    round-robin (module doc), its repeats kept."""
    lengths = [d.numel() for d in docs]
    plans, estimates, pick = estimated_candidates(lengths, runtime.planner)
    times: dict[str, list[float]] = {name: [] for name, _ in plans}
    for repeat in range(options["warmup"] + options["repeats"]):
        for name, plan in plans:
            seconds = timed_step(plan, docs, args, runtime, model)
            if repeat >= options["warmup"]:
                times[name].append(seconds)
    names = [name for name, _ in plans]
    noise = statistics.median((max(t) - min(t)) / statistics.median(t) for t in times.values())
    return {"index": index, "lengths": lengths, "names": names, "estimated": estimates,
            "measured": [statistics.median(times[n]) for n in names], "pick": pick,
            "noise": noise, "repeats": [times[n] for n in names]}


def timed_step(plan, docs, args, runtime, model) -> float:
    """Seconds of one training step of ``plan`` on the slowest rank (the attention runtime is
    prepared before, as the data iterator does ahead of the step)."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_zeppelin.megatron.common.data import slice_rank
    from megatron_zeppelin.megatron.loop.train import forward_step

    runtime.state.prepare(plan)
    batch = slice_rank(plan, runtime.pool.rank, docs, "cpu", args.seq_length)
    model.zero_grad_buffer()
    dist.barrier()
    started = time.perf_counter()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]),
                                model=[model], num_microbatches=1, seq_length=0,
                                micro_batch_size=1, forward_only=False)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())
