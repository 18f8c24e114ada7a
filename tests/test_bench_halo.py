"""``zeppelin bench halo``: both runs of a windowed ring group measured side by side."""
from __future__ import annotations

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench.window import ring_figures


def test_bench_halo_measures_the_halo_exchange_against_the_ring(capsys):
    assert cli.main(["bench", "halo", "--ranks", "3", "--lengths", "600,60,20", "--windows",
                     "8", "--iters", "1", "--warmup", "0", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "8", "--split"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("one ring group of 3 gloo ranks")
    window, by_halo, *_ = out[2].split()
    # 600 // 6 and 60 // 6 >= 8 go by halo, 20 // 6 < 8 round the ring (so every ring round
    # is still made); rows: 4 x 8 per halo sequence, once, and the short one's relayed rows
    assert (window, by_halo) == ("8", "2/3") and "2/4, 2/4" in out[2]
    relayed = ring_figures([20], 3, 8)["sent"]
    assert out[2].split()[-2:] == [f"{2 * 4 * 8 + relayed},",
                                   str(ring_figures([600, 60, 20], 3, 8)["sent"])]


@pytest.mark.parametrize("argv, said", [
    (["--windows", "5000"], "--windows 5000 is invalid with --ranks 4"),
    (["--ranks", "2"], "argument --ranks: 2 is invalid"),
    (["--ranks", "17"], "--ranks=17 is invalid: expected at most 16"),
    (["--lengths", "10,,3"], "argument --lengths"),
    (["--kv-heads", "3"], "--kv-heads=3 is invalid"),
    (["--nodes", "3"], "--nodes=3 is invalid with --ranks 4"),
    (["--inter-mode", "routed"], "--inter-mode=routed is invalid with --nodes 1"),
    (["--nodes", "2", "--inter-mode", "nic"], "argument --inter-mode: invalid choice"),
    (["--lengths", "8192,4096", "--windows", "64", "--split"],
     "--split is invalid with --lengths 8192,4096 --windows 64: every sequence holds every "
     "window"),
])
def test_bench_halo_refuses_what_it_cannot_compare(argv, said, capsys):
    assert cli.main(["bench", "halo", *argv]) == 2
    _, err = capsys.readouterr()
    assert said in err and err.count("\n") == 1


def test_bench_halo_on_cpu_keeps_a_group_that_only_partly_fits_round_the_ring(capsys):
    assert cli.main(["bench", "halo", "--ranks", "3", "--lengths", "600,20", "--windows", "8",
                     "--iters", "1", "--warmup", "0", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "8"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    sent = ring_figures([600, 20], 3, 8)["sent"]
    assert row[1] == "0/2" and row[-2:] == [f"{sent},", str(sent)]


def test_bench_halo_counts_one_exchange_round_forward_and_two_backward(capsys):
    assert cli.main(["bench", "halo", "--ranks", "4", "--lengths", "600,80", "--windows", "8",
                     "--iters", "1", "--warmup", "0", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "8"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.split()[1] == "2/2" and "1/2, 3/5" in row  # the ring: G - 1 and G + 1


@pytest.mark.parametrize("mode", ["routed", "direct"])
def test_bench_halo_across_nodes_in_the_global_steps(mode, capsys):
    """An INTER ring over 2 emulated nodes whose hops across nodes travel in the global
    inter-node steps: the halo exchange runs there too (both ways), against the relay."""
    assert cli.main(["bench", "halo", "--ranks", "4", "--nodes", "2", "--inter-mode", mode,
                     "--lengths", "600,80", "--windows", "8", "--iters", "1", "--warmup", "0",
                     "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"INTER over 2 nodes, hops across nodes {mode} global steps" in out[0]
    assert out[2].split()[1] == "2/2" and "1/2, 3/5" in out[2]
