"""What the training run prints: a startup banner and one line per iteration.

Per iteration: the learning rate the iteration used, the loss (per-token mean over the whole
global batch, all ranks), how many planned sequences ran local / in a ring inside a node / in
a ring across nodes (all pools), tokens/s, the attention imbalance the cost model estimates for
the iteration's plans (max over mean of per-rank attention time, rank 0's pool), the bytes the
remapping layer moves (q, k, v and the attention output, forward and backward, all layers;
rank 0's pool times the pools), the plan time, the gradient norm and the step time.
TensorBoard is optional (``--tensorboard-dir``; ``pip install 'megatron-zeppelin[tensorboard]'``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_zeppelin import env
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_plan, iteration_seconds
from megatron_zeppelin.megatron.common import compat
from megatron_zeppelin.megatron.loop.corpus import (DocumentSource, DocumentStats,
                                                    describe_lengths, repeat_note)
from megatron_zeppelin.megatron.loop.microbatch_order import resolve
from megatron_zeppelin.parallel import PoolLayout
from megatron_zeppelin.runtime.transport import collective_device

TIERS = ("local", "intra", "inter")


@dataclass(frozen=True)
class StepLog:
    iteration: int
    lr: float
    loss: float
    local: int
    intra: int
    inter: int
    tokens_per_s: float
    attention_imbalance: float
    remapped_bytes: float
    plan_ms: float
    grad_norm: float
    seconds: float
    chosen: str = ""  # the plans' names (``Plan.name``: zeppelin's portfolio picks one per
    # micro-batch, "+remap" only on a plan that remaps)
    estimated_s: float = 0.0  # the iteration's estimate (estimate.iteration_seconds, in force)
    seqlens: tuple = ()  # per micro-batch, the planned sequence lengths (replayable)
    mtp_losses: tuple[float, ...] = ()  # Megatron's "mtp_1 loss", ... (--mtp-num-layers)
    plan_names: tuple[str, ...] = ()  # per micro-batch, in order, its plan's ``Plan.name``

    def line(self, total: int) -> str:
        mtp = "".join(f" | mtp_{i + 1} loss {v:.4f}" for i, v in enumerate(self.mtp_losses))
        return (f"iteration {self.iteration:>5}/{total} | lr {self.lr:.3e} | loss "
                f"{self.loss:.4f}{mtp} | sequences local/intra/inter {self.local}/{self.intra}/"
                f"{self.inter} | tokens/s {self.tokens_per_s:,.0f} | attention imbalance "
                f"{self.attention_imbalance:.2f} (est.) | remapped "
                f"{self.remapped_bytes / 2**20:.2f} MiB | plan {self.chosen} "
                f"{self.plan_ms:.1f} ms | "
                f"grad norm {self.grad_norm:.3f} | {self.seconds:.2f} s (est. "
                f"{self.estimated_s:.2f} s)")


class Logger:
    """Collects the plans of an iteration and prints/records one ``StepLog`` per iteration.

    printing: this rank prints (rank 0); counts_plans: this rank adds its plans' sequence and
    token counts to the all-reduce (one rank per pool: pool rank 0 of TP rank 0)."""

    def __init__(self, args: argparse.Namespace, cost: CostModel, printing: bool,
                 documents: DocumentStats, counts_plans: bool, pools: int,
                 order=None, per_pass: int = 0) -> None:
        """order: the balanced micro-batch order's ``Regrouper`` (its tally ends the run's
        summary), None in arrival order; per_pass: the documents one pass over the corpus
        reads (``corpus.documents_per_pass``; 0: not reported)."""
        self.args, self.cost, self.printing, self.documents = args, cost, printing, documents
        self.per_pass = per_pass
        self.order = order
        self.counts_plans, self.pools = counts_plans, pools
        self.plans = []
        self.ran: dict[str, int] = {}  # Plan.name -> micro-batches, over the run (rank 0's pool)
        self.history: list[StepLog] = []
        self.writer = self._writer() if printing and args.tensorboard_dir else None

    def _writer(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("--tensorboard-dir needs TensorBoard: pip install "
                              "'megatron-zeppelin[tensorboard]'") from exc
        return SummaryWriter(self.args.tensorboard_dir)

    def watch(self, data: Iterator) -> Iterator:
        """The data iterator, remembering the plan of every micro-batch it hands out."""
        self.plans = []

        def batches():
            for batch in data:
                self.plans.append(batch.plan)
                yield batch

        return batches()

    def _totals(self, stored: list[dict]) -> torch.Tensor:
        """[loss sum, loss tokens, tokens, local, intra, inter] over all ranks."""
        sums = torch.stack([d["lm loss"] for d in stored]).sum(0) if stored else \
            torch.zeros(2, device=collective_device())  # a stage before the last: nothing
        counts = [0.0] * 4
        if self.counts_plans:
            for plan in self.plans:
                tiers = plan.tier_counts()
                counts[0] += sum(plan.seqlens)
                for i, tier in enumerate(TIERS):
                    counts[1 + i] += tiers[tier]
        totals = torch.cat([sums.detach().float(), torch.tensor(counts, device=sums.device)])
        dist.all_reduce(totals)
        return totals.cpu()

    def step(self, iteration: int, stored: list[dict], grad_norm, seconds: float, lr: float
             ) -> StepLog | None:
        """Every rank joins the all-reduce; only the printing rank estimates the plans and
        records the ``StepLog`` (None elsewhere). Iterations that nothing records (not a
        --log-interval multiple nor the last, no --log-json, no TensorBoard) skip it all: no
        collective, no host wait for the device."""
        args = self.args
        if self.printing:
            count_names(self.plans, self.ran)
        if iteration % args.log_interval and iteration != args.train_iters \
                and not args.log_json and not args.tensorboard_dir:
            mtp_losses(args, stored, None, iteration, logged=False)
            return None
        totals = self._totals(stored)
        mtp = mtp_losses(args, stored, self.writer, iteration, logged=True)
        if not self.printing:
            return None
        estimates = [estimate_plan(p, self.cost) for p in self.plans]
        imbalance = max((max(e.attention_s) / (sum(e.attention_s) / len(e.attention_s))
                         for e in estimates), default=1.0)
        log = StepLog(iteration, lr, (totals[0] / totals[1].clamp(min=1)).item(),
                      *(int(x) for x in totals[3:6].tolist()), totals[2].item() / seconds,
                      imbalance, sum(e.remap_bytes for e in estimates) * self.pools,
                      sum(p.plan_time_s for p in self.plans) * 1e3, float(grad_norm or 0.0),
                      seconds, chosen_candidates(self.plans),
                      iteration_seconds(estimates, self.cost),
                      tuple(tuple(p.seqlens) for p in self.plans), mtp,
                      tuple(p.name for p in self.plans))
        self.history.append(log)
        if iteration % self.args.log_interval == 0:
            print(log.line(self.args.train_iters), flush=True)
        if self.args.log_json:
            with open(self.args.log_json, "a") as f:
                f.write(json.dumps(dataclasses.asdict(log)) + "\n")
        if self.writer is not None:
            for key in ("lr", "loss", "tokens_per_s", "attention_imbalance", "remapped_bytes",
                        "plan_ms", "grad_norm", *TIERS):
                self.writer.add_scalar(f"zeppelin/{key}", getattr(log, key), iteration)
        return log

    def close(self) -> None:
        d = self.documents
        if self.printing:
            passes = f" ({d.documents / self.per_pass:.2f} passes over the corpus's " \
                f"{self.per_pass:,} non-empty documents)" if self.per_pass else ""
            print(f"documents read: {d.documents:,}{passes}; longer than --seq-length "
                  f"{self.args.seq_length:,}: {d.split_sequences:,} split into "
                  f"{d.split_pieces:,} pieces, {d.dropped_sequences:,} dropped "
                  f"({d.dropped_tokens:,} tokens)", flush=True)
            if self.ran:
                print(f"plans run (rank 0's pool): {names_line(self.ran)}", flush=True)
            if self.order is not None:
                print(self.order.tally.line(), flush=True)
        if self.writer is not None:
            self.writer.close()


def mtp_losses(args: argparse.Namespace, stored: list[dict], writer, iteration: int,
               logged: bool) -> tuple[float, ...]:
    """The iteration's multi-token prediction losses as Megatron-LM logs them
    (``MTPLossLoggingHelper.track_mtp_metrics``: each depth's loss per micro-batch, averaged
    over the data-parallel x context-parallel ranks and the micro-batches; ``writer``:
    TensorBoard's ``mtp_1 loss``...). Every rank calls it every iteration: the losses are
    reduced (a collective) when ``logged``, else only cleared."""
    if not getattr(args, "mtp_num_layers", None):
        return ()
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    pipelined = getattr(args, "pipeline_model_parallel_size", 1) > 1
    tracker = compat.mtp_tracker(MTPLossLoggingHelper)
    if tracker.key not in MTPLossLoggingHelper.tracker and not (logged and pipelined):
        return ()
    if not logged:
        tracker.clean()
        return ()
    found: dict = {}
    MTPLossLoggingHelper.track_mtp_metrics(1 / max(1, len(stored)), iteration, writer,
                                           total_loss_dict=found)
    values = [float(found.get(f"mtp_{i + 1} loss", 0.0)) for i in range(args.mtp_num_layers)]
    if pipelined:  # only the last stage holds them: every stage gets them (a sum over stages)
        from megatron.core import parallel_state

        pooled = torch.tensor(values, device="cuda" if getattr(args, "device", "cpu") == "cuda"
                              else "cpu")  # NCCL reduces device tensors only
        dist.all_reduce(pooled, group=parallel_state.get_pipeline_model_parallel_group())
        values = pooled.tolist()
        if writer is not None:  # rank 0, on the first stage: track_mtp_metrics wrote nothing
            for i, value in enumerate(values):
                writer.add_scalar(f"mtp_{i + 1} loss", value, iteration)
    return tuple(values)


def count_names(plans, counts: dict[str, int]) -> dict[str, int]:
    """``counts`` plus one per plan under its name (``Plan.name``), in order of first use."""
    for plan in plans:
        counts[plan.name] = counts.get(plan.name, 0) + 1
    return counts


def names_line(counts: dict[str, int]) -> str:
    return ", ".join(name + (f" x{n}" if n > 1 else "") for name, n in counts.items())


def chosen_candidates(plans) -> str:
    """``hierarchical x2, static-cp(cp=2)``: what plan each micro-batch ran, by ``Plan.name``
    (the portfolio's candidate, "+remap" only where the plan remaps; a strategy without
    candidates under its own name), in order of first use."""
    return names_line(count_names(plans, {}))


def order_of(args: argparse.Namespace, layout: PoolLayout) -> str:
    """The micro-batch order the run uses, and why when ``auto`` chose it."""
    order = resolve(args.zeppelin_microbatch_order, layout.pp)
    if args.zeppelin_microbatch_order != "auto":
        return order
    return f"{order} (--zeppelin-microbatch-order auto: balanced when PP > 1)"


def parameter_count(module: torch.nn.Module, tp: int) -> int:
    """Parameters of the whole model: tensor-parallel shards count ``tp`` times."""
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in module.parameters())


def banner(args: argparse.Namespace, layout: PoolLayout, modules: list[torch.nn.Module],
           source: DocumentSource, watchdog: str) -> str:
    """The startup banner: mode, sizes, pool topology, model, corpus, batch, schedule,
    checkpoints, watchdog. ``modules``: this rank's model chunks (pipeline stage 0's with PP)."""
    local = env.local_world_size() or layout.gpus_per_node
    emulated = ("emulated nodes of CPU processes" if args.device == "cpu" else
                "nodes emulated inside real ones" if layout.gpus_per_node < local else
                "real nodes")
    sample = args.micro_batch_size * args.seq_length
    decay = args.lr_decay_iters or args.train_iters
    repeats = repeat_note(source.lengths(), args.seq_length, args.zeppelin_overlong,
                          args.global_batch_size * args.seq_length)
    data = (f"{source.name}{f' ({args.data_note})' if args.data_note else ''}: "
            f"{describe_lengths(source.lengths(), args.seq_length)}; --zeppelin-overlong "
            f"{args.zeppelin_overlong}{repeats}")
    unused = f"; --save-interval {args.save_interval} unused" if args.save_interval else ""
    save = (f"to {args.save}" + (f" every {args.save_interval} iterations" if
                                 args.save_interval else "") + " and at the end"
            if args.save else f"not saved (no --save{unused})")
    kv = args.num_query_groups or args.num_attention_heads
    pipe = f" x PP {layout.pp}" if layout.pp > 1 else ""
    if len(modules) > 1:
        pipe += f" ({len(modules)} virtual stages each)"
    lines = [
        f"mode: {args.context_parallel_mode} | world {layout.world_size} = TP {layout.tp} x "
        f"CP {layout.cp} x DP {layout.dp}{pipe} | a pool spans {layout.nodes} node(s) x "
        f"{layout.ranks_per_node} rank(s) ({emulated}; --zeppelin-gpus-per-node "
        f"{layout.gpus_per_node}) | device {args.device}",
        f"model: GPT, {args.num_layers} layers, hidden {args.hidden_size}, heads "
        f"{args.num_attention_heads} (KV {kv}), vocab {args.vocab_size}: "
        f"{sum(parameter_count(m, layout.tp) for m in modules):,} parameters"
        f"{' on pipeline stage 0' if layout.pp > 1 else ''}",
        f"corpus: {data}",
        f"batch: {args.global_batch_size} samples x {args.seq_length:,} tokens per iteration, "
        f"{layout.micro_batches(args.global_batch_size, args.micro_batch_size)} micro-batch(es) "
        f"of {sample:,} tokens per pool, order {order_of(args, layout)}",
        f"lr: {args.lr:g}, warmup {args.lr_warmup_iters} iterations, {args.lr_decay_style} "
        f"decay to {args.min_lr:g} at iteration {decay}",
        f"checkpoints: {save}; resume: " + (args.load or "no (--load)"),
        f"watchdog: {watchdog}",
    ]
    return "\n".join(lines)
