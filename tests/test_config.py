"""Config dataclasses and strict YAML loading."""
import re
from pathlib import Path

import pytest

from megatron_zeppelin.config import (ClusterSpec, ConfigError, ModelSpec, ZeppelinConfig,
                                      load_cluster, load_hardware, load_model, load_setup)
from megatron_zeppelin.config_yaml import configs_dir
from megatron_zeppelin.hardware_profile import HardwareProfile

CONFIGS = configs_dir()


@pytest.mark.parametrize("path", sorted((CONFIGS / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_model_loads(path):
    model = load_model(path)
    assert model.name == path.stem
    assert model.num_attention_heads % model.kv_heads == 0


@pytest.mark.parametrize("path", sorted((CONFIGS / "clusters").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_shipped_cluster_loads_with_its_hardware(path):
    cluster = load_cluster(path)
    assert cluster.name == path.stem
    assert len(cluster.gpu_to_nic) == cluster.gpus_per_node
    load_hardware(cluster.hardware)


def test_paper_clusters_have_the_papers_nics():
    assert load_cluster("a800-4nic").nics_per_node == 4
    assert load_cluster("a800-4nic").nic_gbit_per_s == 200
    assert load_cluster("h800-8nic").nics_per_node == 8
    assert load_cluster("h200-8nic").nic_byte_per_s == 50e9


def test_unknown_key_names_the_key_and_the_valid_ones(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nhiden: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['hiden'\].*valid keys"):
        load_model(path)


def test_wrong_type_names_key_and_value(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: x\nnum_layers: two\nhidden_size: 64\nnum_attention_heads: 4\n")
    with pytest.raises(ConfigError, match=r"ModelSpec.num_layers='two'.*integer"):
        load_model(path)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=0), r"model.num_layers=0"),
    (dict(num_query_groups=3), r"num_query_groups=3.*divisor of num_attention_heads=4"),
    (dict(hidden_size=66), r"hidden_size=66.*multiple of num_attention_heads=4"),
])
def test_model_rejects_bad_values(kwargs, match):
    base = dict(name="m", num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ConfigError, match=match):
        ModelSpec(**{**base, **kwargs})


def test_cluster_rejects_bad_affinity():
    with pytest.raises(ConfigError, match=r"gpu_to_nic=\[0, 1\].*4 NIC indices"):
        ClusterSpec("c", 4, 2, 100, 200, gpu_to_nic=(0, 1))
    with pytest.raises(ConfigError, match=r"NIC indices in \[0, 2\)"):
        ClusterSpec("c", 2, 2, 100, 200, gpu_to_nic=(0, 5))
    assert ClusterSpec("c", 8, 4, 100, 200).gpu_to_nic == (0, 0, 1, 1, 2, 2, 3, 3)


def test_missing_required_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: c\ngpus_per_node: 8\n")
    with pytest.raises(ConfigError, match="missing required key"):
        load_cluster(path)


def test_unknown_name_lists_shipped_configs():
    with pytest.raises(ConfigError, match=r"unknown models config 'llama-9b'.*llama-7b"):
        load_model("llama-9b")
    with pytest.raises(ConfigError, match="does not exist"):
        load_model("/nonexistent/x.yaml")


def test_zeppelin_config_validation():
    with pytest.raises(ConfigError,
                       match=r"zeppelin.overlong='truncate'.*\['error', 'split', 'drop'\]"):
        ZeppelinConfig(overlong="truncate")
    with pytest.raises(ConfigError, match="capacity_tokens_per_gpu=0"):
        ZeppelinConfig(capacity_tokens_per_gpu=0)
    with pytest.raises(ConfigError, match="capacity_factor=0.5"):
        ZeppelinConfig(capacity_factor=0.5)


def test_hardware_interpolates_on_log_length_and_clamps():
    hw = HardwareProfile("h", 100, {1024: 100.0, 4096: 300.0}, kernel="fa2")
    assert hw.attention_flops_per_s(10) == 100e12
    assert hw.attention_flops_per_s(1 << 20) == 300e12
    assert hw.attention_flops_per_s(2048) == pytest.approx(200e12)
    with pytest.raises(ConfigError, match="attention_tflops"):
        HardwareProfile("h", 100, {}, kernel="fa2")


@pytest.mark.parametrize("table", [[1, 2, 3], {"abc": 50}, {128: "fast"}, [[128, 50, 7]],
                                   {128: float("inf")}, {True: 50}, {128.7: 50},
                                   [[128, 50], [128, 200]], {-4: 10}, "fast"])
def test_a_bad_attention_table_is_refused_by_name(table):
    """Every malformed ``attention_tflops`` (scalars, strings, triples, inf, bool or
    fractional lengths, a length twice) is one ConfigError naming the key, never a
    TypeError/ValueError from the conversion."""
    with pytest.raises(ConfigError, match=r"^hardware.attention_tflops=.* is invalid: "
                                          r"expected a non-empty map \{length: TFLOP/s\}"):
        HardwareProfile("h", 100, table, kernel="fa2")


def test_an_infinite_capacity_factor_is_refused():
    with pytest.raises(ConfigError, match=r"capacity_factor=inf is invalid: expected a finite"):
        ZeppelinConfig(capacity_factor=float("inf"))


@pytest.mark.parametrize("tp", [3, 0, -2])
def test_setup_rejects_tp_not_dividing_node(tp):
    with pytest.raises(ConfigError, match=rf"tensor_model_parallel_size={tp} is invalid: "
                       "expected a positive divisor of gpus_per_node=8"):
        load_setup("llama-7b", "h200-8nic", tp=tp)


def test_nodes_override():
    assert load_cluster("h200-8nic", nodes=16).world_size == 128
    assert Path(configs_dir()).name == "configs"


MODEL = "name: x\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"


@pytest.mark.parametrize("text,match", [
    (MODEL + "num_layers: 3\n", r"m.yaml is not valid YAML: key 'num_layers' is given twice "
                                r"\(line 5"),
    (MODEL + "vocab_size: [2\n", r"m.yaml is not valid YAML: .*\(line \d+, column \d+\)"),
    (MODEL.replace("hidden_size: 64", "hidden_size: 64.5"),
     r"m.yaml: ModelSpec.hidden_size=64.5 is invalid: expected an integer"),
])
def test_yaml_mistakes_are_one_line_naming_the_file(tmp_path, text, match):
    """A key given twice (PyYAML keeps the last silently), a syntax error (with its line)
    and a wrong type all name the file."""
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_infinite_numbers_and_folders_are_refused(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text(re.sub(r"(?m)^gemm_tflops: .*$", "gemm_tflops: .inf",
                           (CONFIGS / "hardware" / "cpu.yaml").read_text()))
    with pytest.raises(ConfigError, match=r"h.yaml: HardwareProfile.gemm_tflops=inf is invalid: "
                                          "expected a finite number"):
        load_hardware(path)
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"config file '.*d.yaml' cannot be read"):
        load_model(tmp_path / "d.yaml")


def test_a_clusters_hardware_path_is_read_beside_it(tmp_path):
    (tmp_path / "hw.yaml").write_text((CONFIGS / "hardware" / "cpu.yaml").read_text())
    text = (CONFIGS / "clusters" / "cpu-2x2.yaml").read_text()
    (tmp_path / "c.yaml").write_text(text.replace("hardware: cpu", "hardware: hw.yaml"))
    assert load_hardware(load_cluster(tmp_path / "c.yaml").hardware).name == \
        load_hardware("cpu").name
    (tmp_path / "bad.yaml").write_text(text.replace("hardware: cpu", "hardware: nope.yaml"))
    with pytest.raises(ConfigError, match=r"bad.yaml: hardware=nope.yaml: hardware config file "
                                          "'nope.yaml' does not exist"):
        load_cluster(tmp_path / "bad.yaml")
