"""The training data path's ``--zeppelin-microbatch-order`` on gloo (fp32), PP 2 x CP 2 on 4
ranks: ``balanced`` regroups a global batch (every stage alike, every document kept) and gives
the loss and gradients of arrival order and of one process; the flag's default, YAML and bad
values; the balanced sampler keeps the stream's documents and position and groups the next
global batch off the training thread."""
from __future__ import annotations

import pytest
import torch

from distributed import run_world
from test_training_pipeline import FLAGS, VIRTUAL, global_names, reference_body

pytestmark = pytest.mark.distributed


# a long-tailed corpus: a few documents near --seq-length among many short ones, so the
# packing's micro-batches (512 tokens each) cost very differently
ORDER_LENGTHS = [480, 3, 410, 7, 60, 2, 350, 12, 5, 300, 40, 9, 1, 220, 30, 4, 90, 6, 2, 150,
                 25, 11, 3, 70, 8, 120, 2, 45, 1, 15]


class ListSource:
    """An in-memory ``DocumentSource`` of ``ORDER_LENGTHS`` random-token documents."""

    name = "ORDER_LENGTHS"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.docs = [torch.randint(0, 256, (n,), generator=g) for n in ORDER_LENGTHS]

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> list[int]:
        return list(ORDER_LENGTHS)

    def tokens(self, index: int, start: int, end: int) -> torch.Tensor:
        return self.docs[index][start:end]


def ordered_step(mode: str, order: str, extra: list[str]) -> dict:
    """One forward-backward of the first global batch of ``ListSource`` through the training
    data path (``train.make_data``) in ``--zeppelin-microbatch-order order``: loss, plans,
    the regrouping's tally, weights and gradients (one-process names)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_zeppelin.megatron.common.pipeline_p2p import schedule_kwargs
    from megatron_zeppelin.megatron.loop import args as train_args, pipeline, train

    args = train_args.parse_args(FLAGS + ["--context-parallel-mode", mode,
                                          "--zeppelin-microbatch-order", order,
                                          "--no-zeppelin-planner-process", *extra])
    layout = train_args.validate_args(args, 4, None)
    train.setup_megatron(args)
    spec = train.model_spec(args)
    runtime = train.build_pool_runtime(args, layout, spec)
    chunks, _ = train.build_stage(args, runtime.state, spec)
    runtime.state.keep_used = pipeline.runtimes_in_flight(layout, len(chunks))
    data, sampler = train.make_data(args, ListSource(), runtime, "cpu", None)
    plans = []

    def watched():
        for batch in data:
            plans.append(batch.plan)
            yield batch

    micro = layout.micro_batches(args.global_batch_size, args.micro_batch_size)
    stored = get_forward_backward_func()(
        forward_step_func=train.forward_step,
        data_iterator=pipeline.data_iterators(watched(), len(chunks)), model=chunks,
        num_microbatches=micro, seq_length=args.seq_length, micro_batch_size=1,
        forward_only=False, **schedule_kwargs(chunks[0].config))
    data.close()
    runtime.close()
    sums = torch.stack([d["lm loss"] for d in stored]).sum(0) if stored else torch.zeros(2)
    dist.all_reduce(sums)
    named = {k: v for chunk in chunks for k, v in global_names(chunk).items()}
    regroup = getattr(sampler, "regroup", None)
    return {"loss": (sums[0] / sums[1]).item(), "stage": layout.stage(dist.get_rank()),
            "plans": [(p.linear, p.attention, p.tasks, p.seqlens) for p in plans[:micro]],
            "tally": regroup.tally if regroup else None,
            "weights": {k: p.detach().clone() for k, p in named.items()},
            "grads": {k: p.main_grad.clone() for k, p in named.items()}}


def orders_body(rank: int, world: int, extra: list[str]) -> dict:
    """zeppelin mode in arrival and balanced order, static mode balanced; every stage's plans
    (so its micro-batches) equal; the global batch's documents (arrival packing) for the
    reference."""
    import torch.distributed as dist

    from megatron_zeppelin.megatron.loop.corpus import MicroBatchSampler

    runs = {(mode, order): ordered_step(mode, order, extra)
            for mode, order in (("zeppelin", "arrival"), ("zeppelin", "balanced"),
                                ("static", "balanced"))}
    for key, result in runs.items():
        plans = [None] * world
        dist.all_gather_object(plans, result["plans"])
        assert plans[rank] == plans[(rank + 2) % world], (key, rank)  # the other stage
    sampler = MicroBatchSampler(ListSource(), 512, 7, 512, "error")
    return {"runs": runs, "docs": [next(sampler) for _ in range(4)] if rank == 0 else None}


@pytest.mark.parametrize("extra", [[], VIRTUAL], ids=["1f1b", "interleaved"])
def test_balanced_order_regroups_without_changing_loss_or_gradients(extra):
    ranks = run_world(orders_body, 4, extra, start_method="spawn", timeout_s=600)
    docs = ranks[0]["docs"]
    weights = {}
    for result in ranks:
        weights.update(result["runs"][("zeppelin", "arrival")]["weights"])
    (ref_loss, ref_grads), = run_world(reference_body, 1, weights, docs, start_method="spawn")
    groups = {}
    for result in ranks:
        for key, got in result["runs"].items():
            assert all(torch.equal(weights[n], w) for n, w in got["weights"].items()), key
            assert abs(got["loss"] - ref_loss) < 1e-5, (key, got["loss"], ref_loss)
            for name, grad in got["grads"].items():
                worst = (grad - ref_grads[name]).abs().max().item()
                assert worst < 1e-5, (key, got["stage"], name, worst)
            groups[key] = [sorted(plan[3]) for plan in got["plans"]]
    arrival, balanced = groups[("zeppelin", "arrival")], groups[("zeppelin", "balanced")]
    assert arrival == [sorted(d.numel() for d in batch) for batch in docs]
    assert balanced == groups[("static", "balanced")]
    # the same documents, none dropped, regrouped (the test would not see a regrouping else)
    assert sorted(sum(balanced, [])) == sorted(sum(arrival, [])) and balanced != arrival
    assert all(sum(batch) <= 512 for batch in balanced)
    tally = ranks[0]["runs"][("zeppelin", "balanced")]["tally"]
    # two global batches grouped: the data iterator plans one micro-batch ahead
    assert tally.batches == 2 and tally.documents > len(sum(arrival, [])) and tally.moved > 0


def test_microbatch_order_flag_default_yaml_and_bad_values(tmp_path):
    import argparse

    from megatron_zeppelin.config import ConfigError
    from megatron_zeppelin.megatron.loop import args as train_args
    from megatron_zeppelin.megatron.loop.microbatch_order import resolve

    assert train_args.parse_args(FLAGS).zeppelin_microbatch_order == "auto"
    assert (resolve("auto", 2), resolve("auto", 1), resolve("arrival", 2)) == \
        ("balanced", "arrival", "arrival")
    config = tmp_path / "order.yaml"
    config.write_text("zeppelin_microbatch_order: arrival\n")
    assert train_args.parse_args(FLAGS + ["--yaml-cfg", str(config)]) \
        .zeppelin_microbatch_order == "arrival"
    with pytest.raises(ConfigError, match=r"--zeppelin-microbatch-order: invalid choice: "
                       r"'sorted' \(choose from 'auto', 'balanced', 'arrival'\)"):
        train_args.parse_args(FLAGS + ["--zeppelin-microbatch-order", "sorted"])
    config.write_text("zeppelin_microbatch_order: sorted\n")
    with pytest.raises(ConfigError, match=r"order.yaml: zeppelin_microbatch_order='sorted' is "
                       r"invalid: expected one of \['auto', 'balanced', 'arrival'\]"):
        train_args.parse_args(FLAGS + ["--yaml-cfg", str(config)])
    # Megatron-LM's parser (through the patch) does not get it: its own data loader makes
    # the micro-batches, so the flag would be ignored there
    megatron_lm = argparse.ArgumentParser()
    train_args.add_zeppelin_args(megatron_lm)
    assert "zeppelin_microbatch_order" not in {a.dest for a in megatron_lm._actions}


def test_balanced_sampler_keeps_the_streams_documents_and_position():
    """Over global batches (across an epoch of ``ListSource``), 1 and 2 pools: the balanced
    sampler hands out the documents the packing would (none lost or repeated, within the
    capacity), leaves the stream where the packing does, and its position while a global
    batch is being handed out is that batch's start (a restart reads it again)."""
    from megatron_zeppelin.megatron.loop import args as train_args, train
    from megatron_zeppelin.megatron.loop.corpus import MicroBatchSampler
    from megatron_zeppelin.megatron.loop.microbatch_order import BalancedSampler, Regrouper

    args = train_args.parse_args(FLAGS)
    layout = train_args.validate_args(args, 4, None)
    cost = train.make_cost_model(args, train.model_spec(args), layout)

    def balanced(pools: int, pool: int) -> BalancedSampler:
        return BalancedSampler(ListSource(), 512, 7, 512, "error",
                               Regrouper(cost, 2, 2, pools, 512, 2, 1), pools, pool)

    for pools in (1, 2):
        arrival = [MicroBatchSampler(ListSource(), 512, 7, 512, "error", pools, p)
                   for p in range(pools)]
        ours = [balanced(pools, p) for p in range(pools)]
        for _ in range(3):
            packed = sorted(d.numel() for s in arrival for _ in range(2) for d in next(s))
            got = [next(s) for s in ours for _ in range(2)]
            assert sorted(d.numel() for batch in got for d in batch) == packed
            assert all(sum(d.numel() for d in batch) <= 512 for batch in got)
            assert [s.state_dict() for s in ours] == [s.state_dict() for s in arrival]
        start = ours[0].state_dict()
        first = next(ours[0])
        assert ours[0].state_dict() == start
        again = balanced(pools, 0)
        assert again.load_state_dict(start) is None
        assert [d.tolist() for d in next(again)] == [d.tolist() for d in first]
    assert ours[0].regroup.tally.moved > 0


def test_balanced_sampler_groups_the_next_global_batch_off_the_training_thread():
    """Grouped one global batch ahead on the sampler's worker thread, the micro-batches, the
    positions, the document tally and the balancing tally are those of grouping in place, at
    every step; a restart at a position taken mid-batch or between batches (with a batch
    ahead) reads on exactly as the uninterrupted sampler does."""
    import threading

    from megatron_zeppelin.megatron.loop import args as train_args, train
    from megatron_zeppelin.megatron.loop.microbatch_order import BalancedSampler, Regrouper

    args = train_args.parse_args(FLAGS)
    layout = train_args.validate_args(args, 4, None)
    cost = train.make_cost_model(args, train.model_spec(args), layout)
    threads: list[str] = []

    class Recorded(Regrouper):
        def group(self, arrival):
            threads.append(threading.current_thread().name)
            return super().group(arrival)

    def sampler(ahead: bool, pools: int = 2, pool: int = 1) -> BalancedSampler:
        return BalancedSampler(ListSource(), 512, 7, 512, "error",
                               Recorded(cost, 2, 2, pools, 512, 2, 1), pools, pool, ahead=ahead)

    def tally(s: BalancedSampler) -> dict:
        return {k: v for k, v in vars(s.regroup.tally).items() if k != "seconds"}

    ahead, inplace = sampler(True), sampler(False)
    positions = []
    for step in range(8):  # 4 global batches of 2 micro-batches per pool
        got, want = next(ahead), next(inplace)
        assert [d.tolist() for d in got] == [d.tolist() for d in want]
        assert ahead.state_dict() == inplace.state_dict() and ahead.stats == inplace.stats
        assert tally(ahead) == tally(inplace) and ahead.next is not None
        positions.append(ahead.state_dict())
    ahead.next[2].result()  # the fifth global batch, grouped ahead
    assert threads.count("MainThread") == 4 and len(threads) == 4 + 5  # in place / ahead
    assert all(name.startswith("zeppelin-regroup") for name in threads if name != "MainThread")
    rest = [[d.tolist() for d in next(inplace)] for _ in range(4)]
    # after 4 micro-batches (between batches, one ahead), 5 (mid-batch 3), 6 (between): a
    # restart reads from the start of the batch being handed out, or of the next one
    for step, before in ((3, 4), (4, 4), (5, 2)):
        again = sampler(True)
        assert again.load_state_dict(positions[step]) is None
        read = [[d.tolist() for d in next(again)] for _ in range(before + len(rest))]
        assert read[before:] == rest
        again.close()
    ahead.close()
    inplace.close()
