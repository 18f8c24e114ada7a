"""Calibration: fitting, profile/cluster YAMLs the loaders accept, one small P2P smoke test."""
import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.config import ConfigError, load_cluster, load_hardware
from megatron_zeppelin.bench.calibrate import (CalibrateOptions, ComputeSample, P2PSample,
                                             build_cluster, build_profile, fit_line, measure_p2p,
                                             model_gemms, time_attention, time_gemm, write_yaml)
from megatron_zeppelin.config import load_model
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
    assert profile.kernel == "cpu" and "backend torch (kernel cpu)" in profile.source
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
    cluster = build_cluster("cpu-test", str(tmp_path / "hw.yaml"), p2p)  # the written profile
    again = load_cluster(write_yaml(cluster, tmp_path / "cl.yaml", "test cluster"))
    assert again == cluster and again.nic_gbit_per_s == pytest.approx(20.0)
    assert (again.gpus_per_node, again.nics_per_node, again.nodes) == (2, 1, 2)


def test_shipped_cpu_configs_load():
    cluster = load_cluster("cpu-2x2")
    hardware = load_hardware(cluster.hardware)
    assert cluster.world_size == 4 and hardware.gemm_tflops > 0
    assert "zeppelin calibrate" in hardware.source
    cost = fidelity_cost(FidelityOptions())  # the tiny GPT's heads, as configs/sim/cpu-2x2
    assert cost.heads == 4 and cost.model.head_dim == 16


def test_attention_timer_runs_the_engines_block_call(monkeypatch):
    """The timer calls the selected backend's forward/backward (what the engine's LOCAL call
    runs) on a block of documents of one length."""
    from megatron_zeppelin.runtime.kernels import torch_math

    calls = []
    original = torch_math.TorchMath.forward

    def forward(self, q, k, v, pieces, causal, scale, window=None):
        calls.append((q.shape[0], pieces.cu_q, causal))
        return original(self, q, k, v, pieces, causal, scale, window)

    monkeypatch.setattr(torch_math.TorchMath, "forward", forward)
    opts = CalibrateOptions(min_time_s=0.0, max_repeats=2, tokens_per_call=192, kv_heads=2)
    fwd, bwd = time_attention(64, opts)
    assert fwd > 0 and bwd > 0 and opts.documents(64) == 3
    assert calls and all(c == (192, (0, 64, 128, 192), True) for c in calls)


def test_gemm_timer_uses_the_models_layer_shapes():
    model = load_model("gpt-tiny")
    shapes = model_gemms(model, 128)
    h, d, heads, kv = model.hidden_size, model.head_dim, model.num_attention_heads, model.kv_heads
    assert (128, h, (heads + 2 * kv) * d) in shapes and (h, 128, (heads + 2 * kv) * d) in shapes
    assert len(shapes) == 12  # 4 linears x (forward, data gradient, weight gradient)
    opts = CalibrateOptions(model=model, gemm_tokens=128, min_time_s=0.0, max_repeats=1)
    assert (opts.heads, opts.kv_heads, opts.head_dim) == (heads, kv, d)
    assert time_gemm(opts) > 0


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


def test_calibrate_cli_rejects_a_bad_device(capsys, tmp_path):
    assert cli.main(["calibrate", "--device", "tpu", "--output", str(tmp_path / "x.yaml")]) == 2
    assert "device='tpu' is invalid" in capsys.readouterr().err


def test_calibrate_never_writes_a_shipped_config(capsys, tmp_path):
    """The shipped profiles are documented measurements: calibration refuses to write into
    configs/ and over an existing file without --force, before measuring anything."""
    from megatron_zeppelin.config_yaml import configs_dir

    assert cli.main(["calibrate", "--output", str(configs_dir() / "hardware" / "cpu.yaml")]) == 2
    assert "inside the shipped configs folder" in capsys.readouterr().err
    existing = tmp_path / "mine.yaml"
    existing.write_text("keep me")
    assert cli.main(["calibrate", "--output", str(existing)]) == 2
    assert "exists: pass --force" in capsys.readouterr().err
    assert existing.read_text() == "keep me"


def test_p2p_between_two_gloo_processes():
    """The one multi-process test: a small ping-pong between 2 forked gloo ranks. The sizes lie
    4096x apart (16 MiB takes ~6 ms one way here, 4 KiB ~0.1 ms): a load spike on the small
    message (1.6 ms seen once in CI with 4 MiB as the largest) cannot reverse their order."""
    result = measure_p2p((1 << 12, 1 << 20, 1 << 24), repeats=5)  # fastest of 5: robust to load
    assert result.gbyte_per_s > 0 and result.latency_us >= 0
    assert len(result.one_way_s) == 3 and result.one_way_s[-1] > result.one_way_s[0]


def test_shipped_profiles_say_which_kernel_and_clusters_resolve_the_one_that_runs():
    """Every profile names its kernel; a GPU cluster's own profile describes the native
    kernel (what runs by default), measured (GPU-FACTS), and the FA3 figures live apart."""
    from megatron_zeppelin.config import hardware_for
    from megatron_zeppelin.config_yaml import configs_dir
    from megatron_zeppelin.hardware_profile import ATTENTION_KERNELS

    for path in sorted((configs_dir() / "hardware").glob("*.yaml")):
        assert load_hardware(path).kernel in ATTENTION_KERNELS, path
    h100 = load_hardware("h100")
    assert h100.kernel == "fa2" and max(t for _, t in h100.attention_tflops) < 350
    assert "GPU-FACTS measurements, 2026-11-22, H100 80GB, torch 2.11+cu130" in h100.source
    assert load_hardware("h100-fa3").kernel == "fa3"
    for name in ("h200-8nic", "h800-8nic", "a800-4nic"):
        cluster = load_cluster(name)
        assert hardware_for(cluster).kernel == "fa2" == hardware_for(cluster, "fa2").kernel
    assert hardware_for(load_cluster("h200-8nic"), "fa3").name == "h200-fa3"
    with pytest.raises(ConfigError, match="no hardware profile describes attention kernel "
                                          "'cudnn'.*zeppelin calibrate"):
        hardware_for(load_cluster("h200-8nic"), "cudnn")
    with pytest.raises(ConfigError, match="hardware.kernel='fa9' is invalid"):
        from megatron_zeppelin.hardware_profile import HardwareProfile

        HardwareProfile("x", 1.0, {128: 1.0}, kernel="fa9")


def test_training_plans_with_the_profile_of_the_kernel_that_runs():
    import torch

    from megatron_zeppelin.megatron.common.core_attention import planning_hardware

    cpu = planning_hardware(load_cluster("cpu-2x2"), "auto", "cpu", torch.float32, 64)
    assert cpu.kernel == "cpu"
    with pytest.warns(RuntimeWarning, match="no hardware profile describes attention kernel "
                                            "'cpu'.*planning with the cluster's profile 'h200'"):
        assert planning_hardware(load_cluster("h200-8nic"), "torch", "cpu", torch.float32,
                                 64).name == "h200"
    with pytest.raises(ConfigError, match="--zeppelin-attention-backend=native: attention "
                                          "backend 'native' cannot run this block: needs CUDA"):
        planning_hardware(load_cluster("cpu-2x2"), "native", "cpu", torch.bfloat16, 64)
