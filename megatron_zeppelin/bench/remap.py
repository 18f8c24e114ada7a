"""``zeppelin bench remap``: when the remapping layer pays, measured by training the tiny GPT.

Per setting (a corpus whose micro-batches are built to a pattern, a model shape, a topology),
three runs of ``scripts/pretrain_gpt.py``'s loop (``bench/train.py``'s runner: 4 gloo ranks,
same documents and seed) differ only in the plan of each micro-batch:

* ``remap``: zeppelin's attention-balanced hierarchical placement with the remap (linear
  modules on the token-balanced layout; ``--no-zeppelin-portfolio --zeppelin-remap``), the
  paper's design;
* ``no-remap``: the same placement, linear modules on the attention layout
  (``--no-zeppelin-portfolio --no-zeppelin-remap``), the paper's ablation;
* ``zeppelin``: the default portfolio (every candidate scored by the estimate, the remap
  among them); its picks are counted per micro-batch.

Rounds are interleaved (each round runs every setting's three runs in turn, the order
rotated each round) so that the shared machine's load drifts over all alike; the first
``--warmup`` steps of a run are dropped. Printed per setting: the token imbalance the
attention-balanced layout leaves without the remap (max / mean tokens per rank, median over
the micro-batches, replayed through the same planner), the tokens the remap moves per
micro-batch, the remap's exchanges per step measured alone (the forward pair, q, k, v there
and the output back, timed on 4 gloo ranks as the runtime runs it, slowest rank, x 2 for the
backward, x layers; also by point-to-point pairs, ``ZEPPELIN_REMAP_EXCHANGE=pairs``) against
what the estimate charges for them (``StepEstimate.remap_s``), the median step of each run
and its spread (min-max of the per-round medians), remap / no-remap and remap / zeppelin, and
the portfolio's picks. The final losses of the three runs must agree (same model, same data:
the remap is exact), else exit status 1. The training runs use the exchange that
``ZEPPELIN_REMAP_EXCHANGE`` selects (default ``all-to-all``): run the target under each to
compare them in training.

The corpora are written to a temporary folder: documents of stdlib text whose order after
the stream's shuffle (``--seed``) is the designed one, so that every micro-batch is exactly
the pattern (``corpus.DocumentStream``, ``MicroBatchSampler``: packed until the next
document would overflow ``--micro-batch-size x --seq-length``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_zeppelin.bench.flags import check_ports, port_number
from megatron_zeppelin.bench.train import RANKS, YAML, Entry, run_entries, training_shape
from megatron_zeppelin.options import int_at_least, number_at_least
from megatron_zeppelin.output_paths import output_file
from megatron_zeppelin.bench.workers import run_spawned

SEQ, MICRO = 4096, 4 * 4096  # the YAML's --seq-length and one micro-batch's tokens
WIDE = ["--hidden-size", "256", "--ffn-hidden-size", "1024"]  # linear-heavy: 8x the FLOPs/token


def one_long(rng: random.Random) -> list[int]:
    """One document of --seq-length tokens and short ones (16-128 tokens) filling the rest."""
    out = [SEQ]
    while sum(out) < MICRO:
        out.append(min(rng.randint(16, 128), MICRO - sum(out)))
    return out


def medium(rng: random.Random) -> list[int]:
    """Documents of 512-4096 tokens (log-uniform), the last cut to fill the micro-batch."""
    out: list[int] = []
    while sum(out) < MICRO:
        out.append(min(int(512 * 8 ** rng.random()), MICRO - sum(out)))
    return out


def two_long(rng: random.Random) -> list[int]:
    """Two documents of 3072 and 2048 tokens and short ones (16-128) filling the rest."""
    out = [3072, 2048]
    while sum(out) < MICRO:
        out.append(min(rng.randint(16, 128), MICRO - sum(out)))
    rng.shuffle(out)
    return out


PATTERNS = {"one-long": one_long, "medium": medium, "two-long": two_long}


@dataclass
class Setting:
    """One corpus x model x topology; ``flags``: the training flags it adds."""

    name: str
    pattern: str | None  # None: the built-in long-tail corpus (--mock-data), the main job
    flags: list[str]
    runs: dict[str, Entry] = field(default_factory=dict)
    per_round: dict[str, list[float]] = field(default_factory=dict)


SETTINGS = {
    "longtail-tiny-2x2": (None, []),
    "one-long-tiny-2x2": ("one-long", []),
    "one-long-wide-2x2": ("one-long", WIDE),
    "two-long-wide-2x2": ("two-long", WIDE),
    "medium-wide-2x2": ("medium", WIDE),
    "one-long-wide-1x4": ("one-long", WIDE + ["--zeppelin-gpus-per-node", "4"]),
    "medium-wide-1x4": ("medium", WIDE + ["--zeppelin-gpus-per-node", "4"]),
}
VARIANTS = {"remap": ["--no-zeppelin-portfolio", "--zeppelin-remap"],
            "no-remap": ["--no-zeppelin-portfolio", "--no-zeppelin-remap"],
            "zeppelin": []}


class _Run(Entry):
    """A zeppelin run with switch flags (``--no-x`` flags have no value, unlike Entry's)."""

    def __init__(self, label: str, switches: list[str]) -> None:
        super().__init__("zeppelin")
        self.run_label, self.switches = label, switches
        self.picks = ""  # the candidates its plans ran, as the log names them

    def flags(self) -> list[str]:
        return super().flags() + self.switches


def designed_lengths(pattern: str, micro_batches: int, seed: int) -> list[int]:
    """Document lengths that the stream (shuffled with ``seed``, epoch 0) hands out as
    ``micro_batches`` micro-batches of ``PATTERNS[pattern]``, in order."""
    rng = random.Random(f"bench-remap-{pattern}")
    stream = [n for _ in range(micro_batches) for n in PATTERNS[pattern](rng)]
    order = list(range(len(stream)))
    random.Random(seed * 1000003).shuffle(order)  # corpus.DocumentStream's epoch-0 order
    lengths = [0] * len(stream)
    for position, doc in enumerate(order):
        lengths[doc] = stream[position]
    return lengths


def micro_batches(flags: list[str], count: int) -> list[list[int]]:
    """The first ``count`` micro-batches' lengths of a run with ``flags``, as it packs them."""
    from megatron_zeppelin.megatron.loop import args as train_args
    from megatron_zeppelin.megatron.loop.corpus import MicroBatchSampler, open_source

    args = train_args.parse_args(flags)
    sampler = MicroBatchSampler(open_source(args.mock_data, args.data_path),
                                args.micro_batch_size * args.seq_length, args.seed,
                                args.seq_length, args.zeppelin_overlong)
    return [[end - start for _, start, end in sampler._pack()] for _ in range(count)]


def replay(flags: list[str], batches: list[list[int]]) -> dict:
    """The planner on ``batches`` as the runs plan them: the attention-balanced layout's token
    imbalance (max / mean per rank), the tokens the remap moves, the portfolio's picks and
    the estimate's remap / no-remap ratio."""
    from megatron_zeppelin.estimate import estimate_step
    from megatron_zeppelin.megatron.loop import args as train_args, train

    out = {"token_imbalance": [], "moved_tokens": [], "estimate_ratio": [], "picks": {}}
    plan_of = {}
    for variant, switches in VARIANTS.items():
        args = train_args.parse_args(flags + switches)
        layout = train_args.validate_args(args, RANKS, RANKS)
        cost = train.make_cost_model(args, train.model_spec(args), layout)
        planner = train.make_planner(args, cost, layout)
        plan_of[variant] = ([planner(b) for b in batches], cost)
    (remapped, cost), (plain, _) = plan_of["remap"], plan_of["no-remap"]
    out["remap_plans"], out["cost"] = remapped, cost
    for r, p, z in zip(remapped, plain, plan_of["zeppelin"][0]):
        tokens = p.attention_tokens()
        out["token_imbalance"].append(max(tokens) / (sum(tokens) / len(tokens)))
        out["moved_tokens"].append(sum(t.end - t.start for t in r.transfers if t.src != t.dst))
        out["estimate_ratio"].append(estimate_step(r, cost).step_s /
                                     estimate_step(p, cost).step_s)
        name = z.candidate or z.strategy
        out["picks"][name] = out["picks"].get(name, 0) + 1
    return out


def _exchange_rank(rank: int, world: int, port: int, cases: list, reps: int, out: str) -> None:
    """One rank timing the remap's forward exchanges of each plan of ``cases`` (q, k, v
    ``[linear tokens, width]`` there, the output back), as the runtime runs them; rank 0
    writes each case's slowest rank's median seconds to ``out``."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from megatron_zeppelin.runtime.remap import (build_remap_index, to_attention_layout,
                                                 to_linear_layout)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    medians = []
    for plan, qkv_width, out_width, exchange in cases:
        idx = build_remap_index(plan, rank, exchange=exchange)
        qkv = torch.randn(idx.linear_rows, qkv_width)
        attn_out = torch.randn(idx.attention_rows, out_width)
        times = []
        for _ in range(reps + 2):  # the first two warm up
            dist.barrier()
            start = time.perf_counter()
            to_attention_layout(qkv, idx)
            to_linear_layout(attn_out, idx)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times[2:]))
    slowest = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps(slowest.tolist()))
    dist.destroy_process_group()


def exchange_costs(replayed: dict, port: int, reps: int, plans: int = 4) -> dict:
    """Per setting: the remap's exchanges per step as measured (the forward pair, slowest
    rank, x 2 for the backward's reversed pair, x layers; median over the first ``plans``
    remapping plans), by all-to-all (``measured``) and by point-to-point between the ranks
    that move rows (``measured_pairs``, ``ZEPPELIN_REMAP_EXCHANGE=pairs``), and as the
    estimate charges them (``StepEstimate.remap_s``)."""
    from megatron_zeppelin.estimate import estimate_step

    cases, owners = [], []
    for name, rep in replayed.items():
        cost = rep["cost"]
        m = cost.model
        widths = (cost.heads * m.qk_dim + cost.kv_heads * m.pair_dim, cost.heads * m.v_dim)
        chosen = [p for p in rep["remap_plans"] if p.remaps][:plans]
        for exchange, key in (("all-to-all", "measured"), ("pairs", "measured_pairs")):
            cases += [(p, *widths, exchange) for p in chosen]
            owners += [(name, key, p, cost) for p in chosen]
    if not cases:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "exchange.json")
        run_spawned(_exchange_rank, RANKS, (RANKS, port, cases, reps, out), timeout_s=1800.0,
                    what="bench remap exchange")
        seconds = json.loads(Path(out).read_text())
    found: dict[str, dict[str, list[float]]] = {}
    for (name, key, plan, cost), pair in zip(owners, seconds):
        entry = found.setdefault(name, {"measured": [], "measured_pairs": [], "estimated": []})
        entry[key].append(pair * 2 * cost.model.num_layers)
        if key == "measured":
            entry["estimated"].append(estimate_step(plan, cost).remap_s)
    return {name: {k: statistics.median(v) for k, v in e.items()} for name, e in found.items()}


def prepare(settings: list[Setting], folder: Path, count: int, seed: int) -> None:
    """Write each patterned setting's corpus (``count`` micro-batches) under ``folder`` and
    point its flags at it; the long-tail setting trains on the built-in corpus."""
    import importlib.util

    path = Path(YAML).resolve().parents[2] / "scripts" / "make_corpora.py"
    spec = importlib.util.spec_from_file_location("make_corpora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written: dict[str, Path] = {}
    for s in settings:
        if s.pattern is None:
            continue
        if s.pattern not in written:
            written[s.pattern] = folder / s.pattern
            module.write_corpus(written[s.pattern], designed_lengths(s.pattern, count, seed))
        s.flags = ["--data-path", str(written[s.pattern]), *s.flags]


def measure(settings: list[Setting], args: argparse.Namespace, port: int, turn: int) -> int:
    """Round ``turn``: every setting's three runs in one spawned world each, in an order
    rotated by ``turn`` (the first run of a world also pays its warm-up)."""
    names = list(VARIANTS)
    names = names[turn % len(names):] + names[:turn % len(names)]
    for s in settings:
        runs = [s.runs.setdefault(v, _Run(v, s.flags + VARIANTS[v])) for v in names]
        results = run_entries(runs, args.iterations, ["--seed", str(args.seed)], port)
        port += 1
        for run, (logs, refused) in zip(runs, results):
            if refused:
                raise ValueError(f"setting {s.name}, {run.run_label}: {refused}")
            steps = [r["seconds"] for r in logs[args.warmup:]]
            run.steps_s += steps
            run.final_loss = logs[-1]["loss"]
            s.per_round.setdefault(run.run_label, []).append(statistics.median(steps))
            run.picks = ", ".join(sorted({r["chosen"] for r in logs}))
    return port


def summary(s: Setting, replayed: dict, exchange: dict | None, rtol: float) -> dict:
    """The figures of one setting (module doc); ``exchange``: ``exchange_costs``' entry."""
    med = {v: statistics.median(s.runs[v].steps_s) for v in VARIANTS}
    ref = s.runs["no-remap"].final_loss
    agree = all(abs(r.final_loss - ref) <= rtol * abs(ref) for r in s.runs.values())
    return {"setting": s.name, "flags": s.flags,
            "token_imbalance_no_remap": statistics.median(replayed["token_imbalance"]),
            "remap_moved_tokens": statistics.median(replayed["moved_tokens"]),
            "estimate_remap_over_no_remap": statistics.median(replayed["estimate_ratio"]),
            "median_step_s": med,
            "spread_s": {v: [min(x), max(x)] for v, x in s.per_round.items()},
            "remap_over_no_remap": med["remap"] / med["no-remap"],
            "remap_over_zeppelin": med["remap"] / med["zeppelin"],
            "remap_exchange_s_per_step": exchange or {},
            "planner_picks": replayed["picks"], "logged_picks": s.runs["zeppelin"].picks,
            "final_losses": {v: r.final_loss for v, r in s.runs.items()},
            "losses_agree": agree}


def line(f: dict) -> str:
    med, spread = f["median_step_s"], f["spread_s"]
    runs = ", ".join(f"{v} {med[v]:.3f} s [{spread[v][0]:.3f}-{spread[v][1]:.3f}]" for v in med)
    picks = ", ".join(f"{k} x{n}" for k, n in f["planner_picks"].items())
    ex = f["remap_exchange_s_per_step"]
    exchange = (f"remap exchanges {ex['measured'] * 1e3:.1f} ms/step measured "
                f"({ex['measured_pairs'] * 1e3:.1f} ms by pairs) vs "
                f"{ex['estimated'] * 1e3:.2f} ms estimated; " if ex else "")
    return (f"{f['setting']}: tokens max/mean without remap {f['token_imbalance_no_remap']:.2f}, "
            f"remap moves {f['remap_moved_tokens']:,.0f} tokens/micro-batch; {exchange}{runs}; "
            "remap / "
            f"no-remap {f['remap_over_no_remap']:.3f} (estimate "
            f"{f['estimate_remap_over_no_remap']:.3f}), remap / zeppelin "
            f"{f['remap_over_zeppelin']:.3f}; planner picked {picks}"
            + ("" if f["losses_agree"] else "; final losses DIFFER"))


def bench_remap(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    if not names or len(set(names)) < len(names):
        raise ValueError(f"--settings={args.settings!r} is invalid: expected some of "
                         f"{list(SETTINGS)}, each once")
    for n in names:
        if n not in SETTINGS:
            raise ValueError(f"--settings: unknown setting {n!r}: expected some of "
                             f"{list(SETTINGS)}")
    for flag, value, low in (("--iterations", args.iterations, 2), ("--rounds", args.rounds, 1),
                             ("--exchange-reps", args.exchange_reps, 1)):
        if value < low:
            raise ValueError(f"{flag}={value} is invalid: expected an integer >= {low}")
    check_ports("--port", args.port, 1 + args.rounds * len(names))  # one world per run
    training_shape(["--seed", str(args.seed)], args.iterations)  # the runs' shared flags
    if not 0 <= args.warmup < args.iterations:
        raise ValueError(f"--warmup={args.warmup} is invalid: expected 0 <= it < --iterations "
                         f"{args.iterations}")
    settings = [Setting(n, *SETTINGS[n]) for n in names]
    batches = 2 * args.iterations  # micro-batches a run trains (the YAML: 2 per iteration)
    print(f"tiny GPT ({YAML.name}), 4 gloo ranks; {args.rounds} interleaved round(s) of "
          f"{args.iterations} steps per run, first {args.warmup} dropped; spread: min-max of "
          "the per-round medians", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        prepare(settings, Path(tmp), batches, args.seed)
        base = ["--yaml-cfg", str(YAML), "--seed", str(args.seed)]
        replayed = {s.name: replay(base + s.flags, micro_batches(base + s.flags, batches))
                    for s in settings}
        exchange = exchange_costs(replayed, args.port, args.exchange_reps)
        port = args.port + 1
        for turn in range(args.rounds):
            port = measure(settings, args, port, turn)
    figures = [summary(s, replayed[s.name], exchange.get(s.name), args.loss_rtol)
               for s in settings]
    print("\n".join(line(f) for f in figures))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": figures, "rounds": args.rounds,
                                               "iterations": args.iterations,
                                               "warmup": args.warmup}, indent=2) + "\n")
    return 0 if all(f["losses_agree"] for f in figures) else 1


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("remap", help="step time with and without the remapping layer over "
                           "settings where it should pay (CPU, 4 ranks)", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, some of {list(SETTINGS)}")
    p.add_argument("--iterations", type=int, default=6, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run dropped")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs per setting")
    p.add_argument("--seed", type=int_at_least(0), default=1234, help="training seed (the "
                   "corpora's order is designed for it)")
    p.add_argument("--loss-rtol", type=number_at_least(0), default=1e-4,
                   help="relative tolerance of the final losses' agreement (fp32)")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the results here")
    p.add_argument("--exchange-reps", type=int, default=20,
                   help="timed remap exchange pairs per plan (module doc)")
    p.add_argument("--port", type=port_number(), default=29711,
                   help="first rendezvous port (one per spawned world, counting up)")
    p.set_defaults(func=bench_remap)
