"""``zeppelin bench train``: per-step time of every strategy training the tiny GPT on CPU.

Every strategy runs ``scripts/pretrain_gpt.py``'s training loop (``train.main``) on 4 gloo ranks
(laid out by the flags: by default ``gpt-tiny-cpu.yaml``'s 2 emulated nodes x 2, CP 4; the header
line states the layout) with the same flags and seed, so they read the same documents in the
same micro-batches; only the plan of each micro-batch differs (``--zeppelin-strategy``;
``static`` is static mode, TE/Megatron CP over the whole CP group). Rounds are interleaved:
each round trains every strategy ``--iterations`` steps in turn, so that a drift in the
machine's load hits every strategy alike; the first ``--warmup`` steps of each run are dropped.
Printed per strategy: the median step time over all rounds, tokens/s, the final loss and the
step time's ratio to zeppelin's (> 1: zeppelin is faster), as medians and paired step by step
(``paired.py``: each step's time over zeppelin's time of the same step, by round, with the
rounds' 95% confidence interval; the medians mix batches of unequal cost, the pairs cancel
them). ``--control`` measures zeppelin a second time as one more entry (an A/A test): its
ratio to zeppelin, which only the machine's noise moves, says how far apart two strategies
must be to be told apart. Every strategy must end on the same loss (same model, same data;
fp32 tolerance ``--loss-rtol``): checked, exit status 1 if not.

A strategy is ``NAME`` or ``NAME:FLAG=VALUE[:FLAG=VALUE]`` with its own training flags (no
dashes): ``hybrid-dp:max-seqlen-per-dp-cp-rank=2048``, ``static-cp:zeppelin-cp-size=2``.
``--tune`` tunes each peer's own knob as its users do, by measurement, before the rounds: the
per-rank cap of hybrid DP / Megatron hybrid and dynamic CP (``--max-seqlen-per-dp-cp-rank``:
--seq-length / 2^i down to --seq-length / CP size) and static CP's size (every divisor of the
CP size); each candidate trains ``--iterations`` steps, the fastest median is kept and stated.
A strategy that cannot run (``flexsp`` until the engine runs Ulysses plans) is reported with
its one-line reason and left out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_zeppelin.bench.flags import check_ports, port_number
from megatron_zeppelin.bench.paired import paired
from megatron_zeppelin.bench.workers import run_spawned, training_rank_env
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.options import int_at_least, number_at_least
from megatron_zeppelin.output_paths import output_file

if TYPE_CHECKING:
    from megatron_zeppelin.parallel import PoolLayout

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "configs" / "train" / "gpt-tiny-cpu.yaml"
STATIC = "static"  # static mode: TE/Megatron CP over the whole CP group
CAP_FLAG = "max-seqlen-per-dp-cp-rank"
CAPPED = ("hybrid-dp", "megatron-hybrid-cp", "megatron-dynamic-cp")
RANKS = 4  # gloo ranks of the benchmarks' training world on this machine
CONTROL = "(A/A control)"  # the label of --control's second zeppelin entry
RUN_TIMEOUT_S = 3600.0  # per training run of a world (generous: loaded machines); then stopped


@dataclass
class Entry:
    """One strategy as measured: its name, its flags (``FLAG=VALUE``), the tuning stated, and
    what the runs gave."""

    name: str
    options: dict[str, str] = field(default_factory=dict)
    tuning: str = ""
    steps_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    final_loss: float | None = None
    tiers: list[int] = field(default_factory=lambda: [0, 0, 0])  # sequences local/intra/inter
    refused: str = ""
    control: bool = False  # zeppelin measured again (--control): the A/A noise floor

    @property
    def label(self) -> str:
        name = f"{self.name} {CONTROL}" if self.control else self.name
        return ":".join([name, *(f"{k}={v}" for k, v in self.options.items())])

    def flags(self) -> list[str]:
        mode = ["--context-parallel-mode", "static"] if self.name == STATIC else \
            ["--context-parallel-mode", "zeppelin", "--zeppelin-strategy", self.name]
        return mode + [item for k, v in self.options.items() for item in (f"--{k}", v)]

    def median(self) -> float:
        """Median step seconds of every run after the warm-up."""
        return statistics.median(self.steps_s)


def parse_entry(text: str) -> Entry:
    """``NAME[:FLAG=VALUE...]`` -> Entry; ValueError naming a malformed option."""
    name, *items = text.strip().split(":")
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or not value or key.startswith("-"):
            raise ValueError(f"--strategies {text!r}: option {item!r} is not FLAG=VALUE (a "
                             "training flag without its dashes, e.g. "
                             f"hybrid-dp:{CAP_FLAG}=2048)")
        if f"--{key}" in OWNED:
            raise ValueError(f"--strategies {text!r}: option {key} is invalid: the benchmark "
                             f"sets --{key} on every run ({OWNED[f'--{key}']})")
        options[key] = value
    if not name:
        raise ValueError(f"--strategies {text!r}: no strategy name")
    return Entry(name, options)


def parse_entries(text: str) -> list[Entry]:
    """``--strategies`` -> its entries: at least one, each a known strategy, none twice
    (ValueError naming the flag)."""
    from megatron_zeppelin.planner import dynamic_cp
    from megatron_zeppelin.planner.registry import STRATEGIES

    entries = [parse_entry(s) for s in text.split(",") if s.strip()]
    if not entries:
        raise ValueError(f"--strategies={text!r} is invalid: expected at least one strategy")
    known = [STATIC, *STRATEGIES, dynamic_cp.NAME]
    labels = [e.label for e in entries]
    for e in entries:
        if e.name not in known:
            raise ValueError(f"--strategies: unknown strategy {e.name!r}: expected some of "
                             f"{list(dict.fromkeys(known))}")
        if labels.count(e.label) > 1:
            raise ValueError(f"--strategies={text!r} is invalid: {e.label!r} is given twice")
    return entries


def _rank(rank: int, world: int, port: int, runs: list[list[str]], out: str) -> None:
    """One rank of the benchmark's world: every run of ``runs`` (pretrain_gpt.py flags) in
    order, inside one gloo world (as ``train.main`` does, minus the watchdog); rank 0 writes
    ``[{"logs": [...]} or {"refused": reason}, ...]`` to ``out``."""
    training_rank_env(rank, world, port)
    import dataclasses

    import torch.distributed as dist

    from megatron_zeppelin.megatron.loop import args as train_args, train

    train.init_process_group(train_args.parse_args(runs[0]))
    results = []
    for argv in runs:
        logs, refused = train_in_world(argv, world)
        results.append({"refused": refused} if refused else
                       {"logs": [dataclasses.asdict(log) for log in logs]})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def train_in_world(argv: list[str], world: int) -> tuple[list, str]:
    """One training run of ``argv`` (pretrain_gpt.py flags) in this process's gloo world of
    ``world`` ranks, checked as ``train.main`` checks it (minus the watchdog): (its per-step
    logs, '') or ([], the one-line reason it was refused, the same on every rank). Ends with a
    barrier, so that every rank starts the next run together."""
    import torch.distributed as dist

    from megatron_zeppelin.config import ConfigError
    from megatron_zeppelin.megatron.loop import args as train_args, preflight, train

    try:
        args = train_args.parse_args(argv)
        layout = train_args.validate_args(args, world, world)
        ready = preflight.check(args)
        train.setup_megatron(args)
        result = (train.train(args, layout, ready), "")
    except ConfigError as exc:
        result = ([], str(exc))
    dist.barrier()
    release_groups()
    return result


def rotated(entries: list, round_: int) -> list:
    """``entries`` starting at ``round_`` modulo their count: over rounds each runs in every
    position of a world (a later run of a world is not quite a fresh process), so no strategy
    always runs first."""
    k = round_ % max(1, len(entries))
    return entries[k:] + entries[:k]


def release_groups() -> None:
    """Destroy every process group but the world's (after a run, on every rank: the next run
    creates its own). A run's groups (megatron-core's, the pools') are otherwise kept, each
    with its gloo threads, and later runs in the same world slow down (measured: the 6th of 6
    identical runs 16% slower than the 1st, ~57 more threads per rank per run)."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for group in list(c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    gc.collect()


def run_entries(entries: list[Entry], iterations: int, extra: list[str], port: int
                ) -> list[tuple[list[dict], str]]:
    """Train ``iterations`` steps of every entry in turn on 4 spawned ranks (one world):
    per entry, (rank 0's per-step logs, the one-line reason it was refused, or ''). A rank
    that fails, or a world still running after ``RUN_TIMEOUT_S`` per entry, is a
    RuntimeError naming the rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        runs = [run_flags(e, iterations, extra) + ["--log-json", os.path.join(tmp, f"{i}.jsonl")]
                for i, e in enumerate(entries)]  # every step recorded, none printed
        run_spawned(_rank, RANKS, (RANKS, port, runs, out),
                    timeout_s=RUN_TIMEOUT_S * len(runs), what="bench train")
        results = json.loads(Path(out).read_text())
        return [(r.get("logs", []), r.get("refused", "")) for r in results]


def check_flags(entries: list[Entry], iterations: int, extra: list[str]
                ) -> tuple[int, "PoolLayout"]:
    """The flags every run shares first (``training_shape``, whose result this returns), then
    every entry's, parsed and validated before any rank is spawned, as each run will: an
    unknown flag, a malformed value or an option the strategy does not take is one
    ConfigError naming the entry. A strategy this megatron-core lacks (megatron-dynamic-cp
    without its scheduler) is marked not run (``refused``), not an error."""
    from megatron_zeppelin.megatron.loop import args as train_args
    from megatron_zeppelin.planner import dynamic_cp

    shape = training_shape(extra, iterations)
    for entry in entries:
        try:
            args = train_args.parse_args(run_flags(entry, iterations, extra))
            train_args.validate_args(args, RANKS, RANKS)
        except ConfigError as exc:
            if entry.name == dynamic_cp.NAME and not dynamic_cp.available():
                entry.refused = str(exc)
                continue
            raise ConfigError(f"--strategies {entry.label!r}: {exc}") from None
    return shape


def run_flags(entry: Entry, iterations: int, extra: list[str]) -> list[str]:
    """pretrain_gpt.py's flags of one run of ``entry``."""
    return ["--yaml-cfg", str(YAML), "--train-iters", str(iterations), "--log-interval",
            str(iterations + 1), *extra, *entry.flags()]


class Runner:
    """Runs entries (one spawned world per call, fresh port), recording the steps after the
    warm-up into each entry."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.port = args, args.port

    def measure(self, entries: list[Entry]) -> None:
        todo = [e for e in entries if not e.refused]
        if not todo:
            return
        results = run_entries(todo, self.args.iterations, self.args.extra, self.port)
        self.port += 1
        warmup = self.args.warmup
        for entry, (logs, refused) in zip(todo, results):
            entry.refused = refused
            if logs:
                entry.steps_s += [r["seconds"] for r in logs[warmup:]]
                entry.tokens_per_s += [r["tokens_per_s"] for r in logs[warmup:]]
                entry.final_loss = logs[-1]["loss"]
                for i, tier in enumerate(("local", "intra", "inter")):
                    entry.tiers[i] += sum(r[tier] for r in logs)


def training_shape(extra: list[str], iterations: int) -> tuple[int, "PoolLayout"]:
    """(--seq-length, the pool layout) of the runs; the flags every run shares are validated
    here first (a bad one is refused once, before any process starts)."""
    from megatron_zeppelin.megatron.loop import args as train_args

    refuse_owned(extra)
    args = train_args.parse_args(run_flags(Entry(STATIC), iterations, extra))
    warmup = args.lr_warmup_iters
    if args.lr_decay_iters is None and warmup >= iterations:
        if any(t.partition("=")[0] == "--lr-warmup-iters" for t in extra):
            raise ConfigError(f"--lr-warmup-iters={warmup} is invalid: expected < --iterations "
                              f"{iterations} (the steps of each run)")
        raise ConfigError(f"--iterations={iterations} is invalid: expected an integer >= "
                          f"{warmup + 1} (the runs warm the learning rate up over {warmup} "
                          f"iterations: lr_warmup_iters of {YAML.name})")
    return args.seq_length, train_args.validate_args(args, RANKS, RANKS)


# training flags the benchmarks set on every run themselves: given after --, refused
OWNED = {"--train-iters": "pass --iterations",
         "--log-interval": "the benchmark records every step itself",
         "--log-json": "the benchmark records every step itself",
         "--context-parallel-mode": "each run's mode is the benchmark's choice",
         "--zeppelin-strategy": "each run's strategy is the benchmark's choice"}


# ... and the benchmarks of the online fit (online, converge) set its interval on every run
FIT_OWNED = {**OWNED, "--zeppelin-fit-interval": "each run's refit interval is the "
             "benchmark's (--interval)", "--zeppelin-profile-out": "the benchmark writes the "
             "fitted profiles itself"}


def refuse_owned(extra: list[str], owned: dict[str, str] | None = None) -> None:
    """ConfigError naming a flag of ``extra`` that every run sets itself (``owned``, default
    ``OWNED``: flag -> why): it would be ignored."""
    owned = OWNED if owned is None else owned
    for token in extra:
        flag = token.partition("=")[0]
        if flag in owned:
            raise ConfigError(f"{token} after -- is invalid: the benchmark sets {flag} on every "
                              f"run ({owned[flag]})")


def layout_line(layout: "PoolLayout") -> str:
    """The world the runs train on, as their flags lay it out (``--zeppelin-gpus-per-node``,
    the TP, CP and PP sizes): ``4 gloo ranks as 2 emulated nodes x 2 (TP 1, CP 4, PP 1, DP 1)``."""
    nodes = layout.world_size // layout.gpus_per_node
    return (f"{layout.world_size} gloo ranks as {nodes} emulated node{'s' * (nodes > 1)} x "
            f"{layout.gpus_per_node} (TP {layout.tp}, CP {layout.cp}, PP {layout.pp}, "
            f"DP {layout.dp})")


def knob(entry: Entry, seq_length: int, pool: int) -> tuple[str, list[int]] | None:
    """(flag, candidate values) of the knob users tune for this strategy, unless given."""
    if entry.name in CAPPED and CAP_FLAG not in entry.options:
        caps, k = [], 1
        while k <= pool:
            caps.append(-(-seq_length // k))
            k *= 2
        return CAP_FLAG, caps
    if entry.name == "static-cp" and not {"zeppelin-cp-size", "zeppelin-cp-nodes"} & \
            set(entry.options):
        return "zeppelin-cp-size", [d for d in range(1, pool + 1) if pool % d == 0]
    return None


def tune(entries: list[Entry], runner: Runner, seq_length: int, pool: int) -> list[Entry]:
    """Each entry with its knob at the value whose run had the fastest median step (every
    candidate of every entry measured once, in turn, in one world); ``tuning`` states the
    sweep. Entries without a knob to tune come back as they are."""
    knobs = [knob(e, seq_length, pool) for e in entries]
    tried = [[Entry(e.name, {**e.options, found[0]: str(v)}) for v in found[1]] if found else []
             for e, found in zip(entries, knobs)]
    runner.measure([c for candidates in tried for c in candidates])
    return [chosen(e, found[0], candidates) if found else e
            for e, found, candidates in zip(entries, knobs, tried)]


def chosen(entry: Entry, flag: str, tried: list[Entry]) -> Entry:
    """The fastest of ``tried`` (``entry`` at each value of ``--flag``), its sweep stated."""
    ran = [c for c in tried if c.steps_s]
    if not ran:
        return tried[0]  # every value refused: the first one's reason is reported
    best = min(ran, key=Entry.median)
    out = Entry(entry.name, best.options)
    out.tuning = (f"--{flag} {best.options[flag]} (swept: " + ", ".join(
        f"{c.options[flag]}: " + (f"{c.median():.3f} s" if c.steps_s else "refused")
        for c in tried) + ")")
    return out


def report(entries: list[Entry], rtol: float, per_round: int) -> tuple[list[str], bool]:
    """The table lines and whether every final loss agrees within ``rtol``; each entry's
    ratio to the reference both as medians and paired step by step (``paired.py``: rounds of
    ``per_round`` steps)."""
    ran = [e for e in entries if e.steps_s]
    ref = next((e for e in ran if e.name == "zeppelin" and not e.control),
               ran[0] if ran else None)
    lines, agree = [], True
    width = max((len(e.label) for e in entries), default=8)
    for e in entries:
        if not e.steps_s:
            lines.append(f"{e.label:>{width}}: not run: {e.refused}")
            continue
        ratio = e.median() / ref.median()
        same = abs(e.final_loss - ref.final_loss) <= rtol * abs(ref.final_loss)
        agree &= same
        lines.append(f"{e.label:>{width}}: median step {e.median():.3f} s, tokens/s "
                     f"{statistics.median(e.tokens_per_s):,.0f}, final loss "
                     f"{e.final_loss:.6f}{'' if same else ' (DIFFERS)'}, step / "
                     f"{ref.label}'s {ratio:.2f}x" + paired_text(e, ref, per_round) +
                     (f"; tuned: {e.tuning}" if e.tuning else ""))
    if ran:
        lines.append(f"final losses {'agree' if agree else 'DIFFER'} within rtol {rtol:g} "
                     f"({ref.label}: {ref.final_loss:.6f})")
    return lines, agree


def paired_text(entry: Entry, ref: Entry, per_round: int) -> str:
    """``, paired 0.96x (95% CI ...)``: ``entry``'s steps over ``ref``'s, step by step
    (empty for the reference itself, or when a run stopped short)."""
    if entry is ref or len(entry.steps_s) != len(ref.steps_s):
        return ""
    return ", paired " + paired(entry.steps_s, ref.steps_s, per_round).text()


def to_json(entries: list[Entry], args: argparse.Namespace) -> dict:
    """``{"strategies": {NAME: {"median_step_s", "final_loss", "steps_s", ...}}, "refused":
    {NAME: reason}, ...}``; NAME is the strategy's name (with its options where two entries
    share a name)."""
    names = [e.name for e in entries]
    key = {id(e): e.name if names.count(e.name) == 1 else e.label for e in entries}
    strategies = {key[id(e)]: {"median_step_s": e.median(), "final_loss": e.final_loss,
                               "steps_s": e.steps_s,
                               "tokens_per_s": statistics.median(e.tokens_per_s),
                               "options": e.options, "tuning": e.tuning,
                               "sequences_local_intra_inter": e.tiers}
                  for e in entries if e.steps_s}
    return {"strategies": strategies, "refused": {key[id(e)]: e.refused for e in entries
                                                  if not e.steps_s},
            "iterations": args.iterations, "warmup": args.warmup, "rounds": args.rounds,
            "flags": args.extra}


def bench_train(args: argparse.Namespace) -> int:
    entries = parse_entries(args.strategies)
    seq_length, layout = check_flags(entries, args.iterations, args.extra)
    check_ports("--port", args.port, args.rounds + args.tune)  # one world per round, tuning
    if args.tune and not any(knob(e, seq_length, layout.cp) for e in entries):
        raise ValueError(f"--tune is invalid with --strategies {args.strategies}: none of them "
                         "has a knob left to tune (hybrid DP and Megatron's CP modes sweep "
                         f"--{CAP_FLAG}, static CP --zeppelin-cp-size; not when given)")
    if args.warmup >= args.iterations:
        raise ValueError(f"--warmup={args.warmup} is invalid: expected 0 <= it < --iterations "
                         f"{args.iterations}")
    if args.control:
        if not any(e.name == "zeppelin" and not e.options for e in entries):
            raise ValueError(f"--control is invalid with --strategies {args.strategies}: it "
                             "measures zeppelin (no options) twice, so name zeppelin there")
        entries.append(Entry("zeppelin", control=True))
    runner = Runner(args)
    print(f"tiny GPT ({YAML.name} + {' '.join(args.extra) or 'no flags'}), "
          f"{layout_line(layout)}; {args.rounds} interleaved round(s) of {args.iterations} "
          f"steps per strategy, first {args.warmup} of each dropped; same documents and seed "
          "for all", flush=True)
    if args.tune:
        entries = tune(entries, runner, seq_length, layout.cp)
    for round_ in range(args.rounds):  # interleaved: every strategy once per round, in turn
        runner.measure(rotated(entries, round_))
    lines, agree = report(entries, args.loss_rtol, args.iterations - args.warmup)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(entries, args), indent=2) + "\n")
    return 0 if agree and any(e.steps_s for e in entries) else 1


def register(targets: argparse._SubParsersAction) -> None:
    p = targets.add_parser("train", help="tiny GPT step time of every strategy, same data "
                           "(CPU, 4 ranks)", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="static,zeppelin",
                   help="comma-separated NAME[:FLAG=VALUE...]: static (static mode) or "
                        "registered strategies")
    p.add_argument("--iterations", type=int_at_least(1), default=12, help="steps per run")
    p.add_argument("--warmup", type=int_at_least(0), default=2,
                   help="first steps of each run dropped")
    p.add_argument("--rounds", type=int_at_least(1), default=3,
                   help="interleaved runs per strategy")
    p.add_argument("--tune", action="store_true",
                   help="sweep each peer's own knob by measurement first (module doc)")
    p.add_argument("--control", action="store_true",
                   help="measure zeppelin a second time, as one more strategy: its ratio to "
                        "zeppelin is the machine's noise floor (an A/A test)")
    p.add_argument("--loss-rtol", type=number_at_least(0), default=1e-4,
                   help="relative tolerance of the final losses' agreement (fp32)")
    p.add_argument("--json", type=output_file(), default=None, metavar="FILE",
                   help="write the results here")
    p.add_argument("--port", type=port_number(), default=29611,
                   help="first rendezvous port (one per spawned world, counting up)")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    p.set_defaults(func=bench_train)
