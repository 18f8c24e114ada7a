"""Per-iteration training logs: loss, tokens/s, attention imbalance, bytes remapped, plan time.

The loss is the per-token mean over the whole global batch (all ranks). The attention
imbalance is the cost model's estimate for the iteration's plans (max over mean of per-rank
attention time); bytes remapped count q, k, v and the attention output moved between ranks by
the remapping layer, forward and backward, all layers. TensorBoard is optional
(``--tensorboard-dir``; ``pip install 'megatron-zeppelin[tensorboard]'``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.cost_model import CostModel
from megatron_zeppelin.estimate import estimate_plan
from megatron_zeppelin.megatron.args import pool_size
from megatron_zeppelin.megatron.data import DocumentStats


@dataclass(frozen=True)
class StepLog:
    iteration: int
    loss: float
    tokens_per_s: float
    attention_imbalance: float
    remapped_bytes: float
    plan_ms: float
    grad_norm: float
    seconds: float

    def line(self, total: int) -> str:
        return (f"iteration {self.iteration:>5}/{total} | loss {self.loss:.4f} | "
                f"tokens/s {self.tokens_per_s:,.0f} | attention imbalance "
                f"{self.attention_imbalance:.2f} (est.) | remapped "
                f"{self.remapped_bytes / 2**20:.2f} MiB | plan {self.plan_ms:.1f} ms | "
                f"grad norm {self.grad_norm:.3f} | {self.seconds:.2f} s")


class Logger:
    """Collects the plans of an iteration and prints/records one ``StepLog`` per iteration."""

    def __init__(self, args: argparse.Namespace, cost: CostModel, printing: bool,
                 documents: DocumentStats) -> None:
        self.args, self.cost, self.printing, self.documents = args, cost, printing, documents
        self.pools = dist.get_world_size() // (args.tensor_model_parallel_size * pool_size(args))
        self.plans = []
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

    def step(self, iteration: int, stored: list[dict], grad_norm, seconds: float
             ) -> StepLog | None:
        """Every rank joins the loss all-reduce; only the printing rank estimates the plans
        and records the ``StepLog`` (None elsewhere)."""
        sums = torch.stack([d["lm loss"] for d in stored]).sum(0) if stored else torch.zeros(2)
        dist.all_reduce(sums)
        if not self.printing:
            return None
        estimates = [estimate_plan(p, self.cost) for p in self.plans]
        imbalance = max((max(e.attention_s) / (sum(e.attention_s) / len(e.attention_s))
                         for e in estimates), default=1.0)
        tokens = sum(sum(p.seqlens) for p in self.plans) * self.pools
        log = StepLog(iteration, (sums[0] / sums[1].clamp(min=1)).item(), tokens / seconds,
                      imbalance, sum(e.remap_bytes for e in estimates) * self.pools,
                      sum(p.plan_time_s for p in self.plans) * 1e3,
                      float(grad_norm or 0.0), seconds)
        self.history.append(log)
        if iteration % self.args.log_interval == 0:
            print(log.line(self.args.train_iters), flush=True)
        if self.args.log_json:
            with open(self.args.log_json, "a") as f:
                f.write(json.dumps(dataclasses.asdict(log)) + "\n")
        if self.writer is not None:
            for key in ("loss", "tokens_per_s", "attention_imbalance", "remapped_bytes",
                        "plan_ms", "grad_norm"):
                self.writer.add_scalar(f"zeppelin/{key}", getattr(log, key), iteration)
        return log

    def close(self) -> None:
        d = self.documents
        if self.printing and (d.split_sequences or d.dropped_sequences):
            print(f"documents read: {d.documents}; longer than --seq-length "
                  f"{self.args.seq_length}: {d.split_sequences} split into {d.split_pieces} "
                  f"pieces, {d.dropped_sequences} dropped ({d.dropped_tokens} tokens)",
                  flush=True)
        if self.writer is not None:
            self.writer.close()
