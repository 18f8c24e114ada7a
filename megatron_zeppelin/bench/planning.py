"""``zeppelin bench planning``: a CPU training step with planning running alongside, vs the
same step with its plans precomputed.

The data side is the real one: ``megatron.data.ZeppelinDataIterator`` slices rank 0's
micro-batch out of a global batch planned for a large pool (default: LLaMA-7B on 128 nodes of
h200-8nic, 1024 GPUs, github-shaped batches of 4096 documents; documents are views of one
buffer, so building them costs nothing). The step is a CPU stand-in for a GPU step: a stack of
small layers forward + backward + SGD on one thread, hundreds of Python-dispatched ops like the
kernel launches of a GPU step, on a fixed number of rank 0's tokens. Three ways to get the plans,
measured in alternating blocks of steps (a round is a block of each way, each way first in
turn; the first step of a block is not counted, so that the previous way's background planning
has ended) so that other load on the machine hits them alike; the figure is, over rounds,
the median of each way's median step time in the round over the precomputed one's in the same
round:

* ``precomputed``: every plan made before the run (no planning during the steps);
* ``process``: ``planner.service.PlannerService``, planning the next micro-batch in its own
  process while this one trains (what training uses);
* ``thread``: the previous way, the planner on a worker thread of the training process.
"""
from __future__ import annotations

import random
import statistics
import time

from megatron_zeppelin.config import ZeppelinConfig, load_setup
from megatron_zeppelin.cost_model import CostModel

WAYS = ("precomputed", "process", "thread")


def _cost(args) -> CostModel:
    setup = load_setup(args.model, args.cluster, nodes=args.nodes)
    return CostModel(setup.model, setup.cluster, setup.hardware)


def _batches(args, seed: int):
    """Endless global batches: lists of documents, views of one zero buffer."""
    import torch

    from megatron_zeppelin.sim.workloads import get_workload

    workload, rng = get_workload(args.workload), random.Random(seed)
    buffer = torch.zeros(workload.max_len, dtype=torch.int64)
    while True:
        yield [buffer[:workload.draw(rng)] for _ in range(args.documents)]


class _Step:
    """The CPU stand-in for a training step (module doc), on ``tokens`` of rank 0's batch."""

    def __init__(self, layers: int, hidden: int, tokens: int) -> None:
        import torch

        torch.manual_seed(0)
        self.tokens, self.hidden = tokens, hidden
        self.embed = torch.nn.Embedding(512, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        params = list(self.embed.parameters()) + list(self.layers.parameters())
        self.optim = torch.optim.SGD(params, lr=1e-3)

    def __call__(self, batch) -> None:
        import torch

        ids = batch.tokens[0, :self.tokens] % 512
        x = self.embed(torch.nn.functional.pad(ids, (0, self.tokens - ids.numel())))
        for layer in self.layers:
            x = x + torch.nn.functional.gelu(layer(torch.nn.functional.layer_norm(
                x, (self.hidden,))))
        loss = x.float().pow(2).mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()


def _iterator(way: str, args, cost: CostModel, config: ZeppelinConfig, plans: list):
    from megatron_zeppelin.megatron.common.data import ZeppelinDataIterator
    from megatron_zeppelin.planner.service import PlanFunction, PlannerService

    plan_fn = PlanFunction("zeppelin", cost, config)
    if way == "precomputed":
        ready = iter(plans)
        return ZeppelinDataIterator(_batches(args, args.seed), lambda _: next(ready), 0,
                                    prefetch=False)
    planner = PlannerService(plan_fn) if way == "process" else plan_fn
    return ZeppelinDataIterator(_batches(args, args.seed), planner, 0)


def run(args) -> dict[str, list[float]]:
    """Seconds of each measured step, per way."""
    import torch

    from megatron_zeppelin.planner.service import PlanFunction

    torch.set_num_threads(1)
    cost, config = _cost(args), ZeppelinConfig()
    rounds = -(-args.steps // args.block)
    steps = rounds * (args.block + 1)
    source = _batches(args, args.seed)
    plan_fn = PlanFunction("zeppelin", cost, config)
    plans, plan_times = [], []
    for _ in range(steps + 2):
        lengths = [d.numel() for d in next(source)]
        started = time.perf_counter()
        plans.append(plan_fn(lengths))
        plan_times.append(time.perf_counter() - started)
    plan_s = statistics.median(plan_times)
    step = _Step(args.layers, args.hidden, args.tokens)
    iters = {way: _iterator(way, args, cost, config, plans) for way in WAYS}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for r in range(rounds):
            for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:  # each way first in turn
                for i in range(args.block + 1):
                    t0 = time.perf_counter()
                    step(next(iters[way]))
                    if i:
                        times[way].append(time.perf_counter() - t0)
    finally:
        for it in iters.values():
            it.close()
    times["plan"] = [plan_s]
    return times


def paired_ratio(times: dict[str, list[float]], way: str, block: int) -> float:
    """Median over rounds of ``way``'s median step in the round over precomputed's median in
    the same round: load that drifts from one round to the next cancels out."""
    base, steps = times["precomputed"], times[way]
    return statistics.median(
        statistics.median(steps[i:i + block]) / statistics.median(base[i:i + block])
        for i in range(0, len(base), block))


def format_result(times: dict[str, list[float]], args) -> str:
    lines = [f"{args.documents} {args.workload} documents per batch on {args.nodes} nodes of "
             f"{args.cluster}; one plan takes {times['plan'][0] * 1e3:.1f} ms in-process "
             f"(median); step: {args.layers} layers x {args.hidden} on {args.tokens} tokens, "
             "one thread; "
             f"{len(times['precomputed'])} steps per way in rounds of one block of "
             f"{args.block} per way",
             f"{'way':<12} {'median step ms':>15} {'vs precomputed (median of rounds)':>34}"]
    for way in WAYS:
        ratio = paired_ratio(times, way, args.block)
        lines.append(f"{way:<12} {statistics.median(times[way]) * 1e3:>15.1f} {ratio:>33.3f}x")
    return "\n".join(lines)


def _command(args) -> int:
    _cost(args)  # a bad --model, --cluster or --nodes is refused before the plans are made
    print(format_result(run(args), args))
    return 0


def register(targets) -> None:
    p = targets.add_parser("planning", help="CPU training step with planning alongside (planner "
                           "process, worker thread) vs plans precomputed")
    from megatron_zeppelin.options import int_at_least
    from megatron_zeppelin.sim.workloads import WORKLOADS

    count = int_at_least(1)
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--cluster", default="h200-8nic")
    p.add_argument("--nodes", type=count, default=128)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="github")
    p.add_argument("--documents", type=count, default=4096, help="documents per global batch")
    p.add_argument("--steps", type=count, default=30, help="measured steps per way")
    p.add_argument("--block", type=count, default=5, help="measured steps per block")
    p.add_argument("--layers", type=count, default=48)
    p.add_argument("--hidden", type=count, default=256)
    p.add_argument("--tokens", type=count, default=2048,
                   help="tokens of rank 0 the step runs on")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.set_defaults(func=_command)
