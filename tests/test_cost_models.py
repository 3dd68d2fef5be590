import json
import re
from pathlib import Path

import numpy as np
import pytest

import cost_models
from cost_models import ClusterProfile

GOOD_TOML = """\
name = "custom"
description = "test cluster"

[peak_flops_tflops]
bfloat16 = 100.0
float32 = 10.0

[memory]
hbm_gb = 16.0
hbm_bandwidth_gbps = 1000.0

[network]
devices_per_node = 4
intra_bandwidth_gbps = 100.0
intra_latency_us = 5.0
inter_bandwidth_gbps = 10.0
inter_latency_us = 20.0

[efficiency]
compute = 0.5
hbm = 0.9
intra_link = 1.0
inter_link = 0.7
"""


def write(tmp_path: Path, text: str, name: str = "custom.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_available_lists_bundled_profiles():
    assert cost_models.available() == ["a100-80g", "cpu", "h100-sxm", "h200-sxm"]


@pytest.mark.parametrize("name", ["a100-80g", "cpu", "h100-sxm", "h200-sxm"])
def test_bundled_profiles_are_sane(name):
    p = cost_models.load(name)
    assert p.name == name
    assert p.description
    # a CPU has no TF32 unit: its float32 dots are priced (and said) at float32
    tf32 = {"tfloat32"} if name != "cpu" else set()
    assert set(p.peak_flops) == {"bfloat16", "float16", "float32", "float64"} | tf32
    assert all(1e10 <= v <= 1e16 for v in p.peak_flops.values())  # cpu: a simulated device
    assert p.peak_flops["bfloat16"] >= p.peak_flops["float32"]
    assert 1e10 <= p.hbm_bytes <= 1e12
    assert 1e10 <= p.hbm_bandwidth <= 1e13
    assert p.devices_per_node == 8
    assert p.intra_bandwidth > p.inter_bandwidth > 0
    assert 0 < p.intra_latency < p.inter_latency < 1e-3
    for eff in (
        p.compute_efficiency,
        p.hbm_efficiency,
        p.intra_link_efficiency,
        p.inter_link_efficiency,
    ):
        assert 0 < eff <= 1


def test_reference_figures():
    h100 = cost_models.load("h100-sxm")
    assert h100.peak_flops["bfloat16"] == pytest.approx(989e12)  # dense, not sparse 1979e12
    assert h100.peak_flops["float16"] == pytest.approx(989e12)
    assert h100.peak_flops["tfloat32"] == pytest.approx(494.7e12)
    assert h100.peak_flops["float32"] == pytest.approx(67e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    assert h100.hbm_bytes == pytest.approx(80e9)
    assert h100.intra_bandwidth == pytest.approx(450e9)
    assert h100.inter_bandwidth == pytest.approx(50e9)
    assert h100.intra_latency == pytest.approx(1e-5)
    assert h100.inter_latency == pytest.approx(3e-5)
    assert h100.intra_link_efficiency == pytest.approx(370 / 450, abs=0.01)

    h200 = cost_models.load("h200-sxm")
    assert h200.peak_flops == h100.peak_flops
    assert h200.hbm_bandwidth == pytest.approx(4.8e12)
    assert h200.hbm_bytes == pytest.approx(141e9)

    a100 = cost_models.load("a100-80g")
    assert a100.peak_flops["bfloat16"] == pytest.approx(312e12)
    assert a100.peak_flops["tfloat32"] == pytest.approx(156e12)
    assert a100.peak_flops["float32"] == pytest.approx(19.5e12)
    assert a100.hbm_bandwidth == pytest.approx(2.04e12)
    assert a100.intra_bandwidth == pytest.approx(300e9)
    assert a100.inter_bandwidth == pytest.approx(25e9)

    cpu = cost_models.load("cpu")
    assert cpu.peak_flops["float32"] == pytest.approx(5e10)
    assert cpu.hbm_bandwidth == pytest.approx(10e9)


def test_flops_for_accepts_dtypes_and_names():
    p = cost_models.load("h100-sxm")
    bf16 = p.peak_flops["bfloat16"]
    f32 = p.peak_flops["float32"]
    assert p.flops_for("bfloat16") == bf16
    assert p.flops_for("bf16") == bf16
    assert p.flops_for(np.float32) == f32
    assert p.flops_for(np.dtype("float16")) == p.peak_flops["float16"]
    assert p.flops_for(np.zeros(2, np.float64)) == p.peak_flops["float64"]
    assert p.flops_for("tfloat32") == p.peak_flops["tfloat32"]
    # unknown dtypes fall back to the float32 figure
    assert p.flops_for(np.int32) == f32
    assert p.flops_for("float8_e4m3fn") == f32


def test_flops_for_accepts_jax_dtypes():
    jnp = pytest.importorskip("jax.numpy")
    p = cost_models.load("h100-sxm")
    assert p.flops_for(jnp.bfloat16) == p.peak_flops["bfloat16"]
    assert p.flops_for(jnp.dtype("bfloat16")) == p.peak_flops["bfloat16"]
    assert p.flops_for(jnp.ones(2, jnp.float16)) == p.peak_flops["float16"]
    assert p.flops_for(jnp.float32) == p.peak_flops["float32"]


def test_load_custom_path(tmp_path):
    path = write(tmp_path, GOOD_TOML)
    for spec in (path, str(path)):
        p = cost_models.load(spec)
        assert p.name == "custom"
        assert p.peak_flops == {"bfloat16": 100e12, "float32": 10e12}
        assert p.hbm_bytes == pytest.approx(16e9)
        assert p.hbm_bandwidth == pytest.approx(1e12)
        assert p.devices_per_node == 4
        assert isinstance(p.devices_per_node, int)
        assert p.intra_latency == pytest.approx(5e-6)
        assert p.inter_latency == pytest.approx(2e-5)
        assert p.intra_link_efficiency == 1.0
        assert p.flops_for("float16") == 10e12  # not listed -> float32 figure


def test_load_profile_passthrough():
    p = cost_models.load("cpu")
    assert cost_models.load(p) is p


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match="h100-sxm") as exc:
        cost_models.load("tpu-v9")
    assert "tpu-v9" in str(exc.value)
    assert "a100-80g" in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nope.toml"):
        cost_models.load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("hbm_gb = 16.0\n", "", "memory.hbm_gb"),
        ("inter_latency_us = 20.0\n", "", "network.inter_latency_us"),
        ('name = "custom"\n', "", "name"),
        ("float32 = 10.0\n", "", "peak_flops_tflops.float32"),
        ("bfloat16 = 100.0", "bfloat16 = 0.0", "peak_flops_tflops.bfloat16"),
        ("hbm_bandwidth_gbps = 1000.0", "hbm_bandwidth_gbps = -1.0", "memory.hbm_bandwidth_gbps"),
        ("intra_latency_us = 5.0", "intra_latency_us = 0", "network.intra_latency_us"),
        ("devices_per_node = 4", "devices_per_node = 2.5", "network.devices_per_node"),
        ("devices_per_node = 4", "devices_per_node = 0", "network.devices_per_node"),
        ("compute = 0.5", "compute = 1.5", "efficiency.compute"),
        ("hbm = 0.9", "hbm = 0.0", "efficiency.hbm"),
        ("inter_link = 0.7", 'inter_link = "high"', "efficiency.inter_link"),
        ("hbm_gb = 16.0", "hbm_gb = 16.0\nhbm_gib = 16.0", "memory.hbm_gib"),
        (GOOD_TOML[GOOD_TOML.index("[efficiency]") :], "", "efficiency"),
    ],
)
def test_bad_file_names_file_and_key(tmp_path, old, new, key):
    assert old in GOOD_TOML
    path = write(tmp_path, GOOD_TOML.replace(old, new, 1), "bad.toml")
    with pytest.raises(ValueError) as exc:
        cost_models.load(path)
    msg = str(exc.value)
    assert "\n" not in msg
    assert str(path) in msg
    assert re.search(rf"'{re.escape(key)}'", msg), msg


def test_invalid_toml_names_file(tmp_path):
    path = write(tmp_path, "name = [unclosed\n", "broken.toml")
    with pytest.raises(ValueError, match="broken.toml"):
        cost_models.load(path)


@pytest.mark.parametrize("name", ["a100-80g", "cpu", "h100-sxm", "h200-sxm"])
def test_dict_round_trip(name):
    p = cost_models.load(name)
    d = p.to_dict()
    d2 = json.loads(json.dumps(d))
    assert d2 == d
    q = ClusterProfile.from_dict(d2)
    assert q == p
    assert hash(q) == hash(p)
    assert q.to_dict() == d


def test_from_dict_validates():
    d = cost_models.load("cpu").to_dict()
    missing = dict(d)
    del missing["hbm_bandwidth"]
    with pytest.raises(ValueError, match="'hbm_bandwidth'"):
        ClusterProfile.from_dict(missing)
    with pytest.raises(ValueError, match="'bogus'"):
        ClusterProfile.from_dict({**d, "bogus": 1})
    with pytest.raises(ValueError, match="'compute_efficiency'"):
        ClusterProfile.from_dict({**d, "compute_efficiency": 2.0})
    with pytest.raises(ValueError, match="'inter_bandwidth'"):
        ClusterProfile.from_dict({**d, "inter_bandwidth": 0})


def test_profile_is_frozen():
    p = cost_models.load("h100-sxm")
    with pytest.raises(AttributeError):
        p.hbm_bytes = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.peak_flops["bfloat16"] = 1.0  # type: ignore[index]
