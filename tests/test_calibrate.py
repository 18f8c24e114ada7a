"""Calibration: fitting, profile/cluster YAMLs the loaders accept, one small P2P smoke test."""
import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.config import ConfigError, load_cluster, load_hardware
from megatron_zeppelin.bench.calibrate import (CalibrateOptions, ComputeSample, P2PSample,
                                             build_cluster, build_profile, fit_line, measure_p2p,
                                             time_attention, write_yaml)
from megatron_zeppelin.bench.fidelity import FidelityOptions, FidelityRow, fidelity_cost


def test_fit_line_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e5, 1e6, 1e7]
    times = [20e-6 + n / 2e9 for n in sizes]
    latency, per_byte = fit_line(sizes, times)
    assert latency == pytest.approx(20e-6) and 1 / per_byte == pytest.approx(2e9)
    with pytest.raises(RuntimeError, match="do not grow with message size"):
        fit_line(sizes, [1e-3, 1e-3, 9e-4, 8e-4])


def sample() -> ComputeSample:
    return ComputeSample((128, 1024, 4096), (1e-4, 4e-3, 5e-2), (2.5e-4, 1e-2, 1.4e-1),
                         0.05, 2e-5)


def test_profile_uses_the_cost_models_flop_count(tmp_path):
    opts = CalibrateOptions(heads=4, head_dim=64)
    p2p = P2PSample((1024, 1 << 20), (1e-4, 5e-4), 2.5, 70.0)
    profile = build_profile("cpu-test", sample(), p2p, opts)
    assert profile.attention_tflops[1] == (1024, pytest.approx(2 * 4 * 64 * 1024 ** 2 / 4e-3
                                                               / 1e12, rel=1e-4))
    assert profile.attention_bwd_ratio == pytest.approx(2.65, abs=0.01)  # median of >= 1K
    slowed = ComputeSample((128, 1024, 4096), (1e-4, 8e-3, 5e-2), (2.5e-4, 2e-2, 1.4e-1),
                           0.05, 2e-5)  # the 1K point was slowed by another job
    table = build_profile("cpu-test", slowed, p2p, opts).attention_tflops
    assert table[1][1] == table[0][1] and table[2][1] > table[1][1]
    assert profile.kernel_overhead_us == 20.0 and profile.p2p_gbyte_per_s == 2.5
    loaded = load_hardware(write_yaml(profile, tmp_path / "hw.yaml", "test profile"))
    assert loaded == profile
    cluster = build_cluster("cpu-test", "cpu-test", p2p)
    again = load_cluster(write_yaml(cluster, tmp_path / "cl.yaml", "test cluster"))
    assert again == cluster and again.nic_gbit_per_s == pytest.approx(20.0)
    assert (again.gpus_per_node, again.nics_per_node, again.nodes) == (2, 1, 2)


def test_shipped_cpu_configs_load():
    cluster = load_cluster("cpu-2x2")
    hardware = load_hardware(cluster.hardware)
    assert cluster.world_size == 4 and hardware.gemm_tflops > 0
    assert "zeppelin calibrate" in hardware.source
    cost = fidelity_cost(FidelityOptions())
    assert cost.heads == 4 and cost.model.head_dim == 64


def test_attention_timer_returns_positive_times():
    fwd, bwd = time_attention(64, CalibrateOptions(min_time_s=0.0, max_repeats=2))
    assert fwd > 0 and bwd > 0


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="heads=0 is invalid"):
        CalibrateOptions(heads=0)
    with pytest.raises(ValueError, match="device='tpu' is invalid"):
        CalibrateOptions(device="tpu")
    with pytest.raises(ValueError, match="lengths"):
        CalibrateOptions(lengths=(8,))
    with pytest.raises(ValueError, match="tokens=0 is invalid"):
        FidelityOptions(tokens=0)
    with pytest.raises(ConfigError):
        load_hardware("no-such-profile")


def test_fidelity_error_is_relative_to_the_measurement():
    assert FidelityRow("zeppelin", 0, 2.0, 2.5).error == pytest.approx(0.25)
    assert FidelityRow("zeppelin", 0, 2.0, 1.0).error == pytest.approx(-0.5)


def test_calibrate_cli_rejects_a_bad_device(capsys):
    assert cli.main(["calibrate", "--device", "tpu"]) == 2
    assert "device='tpu' is invalid" in capsys.readouterr().err


def test_p2p_between_two_gloo_processes():
    """The one multi-process test: a small ping-pong between 2 forked gloo ranks."""
    result = measure_p2p((1 << 12, 1 << 18, 1 << 22), repeats=5)  # fastest of 5: robust to load
    assert result.gbyte_per_s > 0 and result.latency_us >= 0
    assert len(result.one_way_s) == 3 and result.one_way_s[-1] > result.one_way_s[0]
