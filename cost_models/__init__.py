"""Cluster profiles for autopar's cost model.

A profile describes one kind of device and how devices are linked: dense peak
FLOP/s per dtype, HBM size and bandwidth, intra-node (NVLink) and inter-node
(network) bandwidth and latency, and achieved/peak efficiency factors.

Bundled profiles live next to this file as ``<name>.toml``; see ``available()``.
The TOML files use human units (TFLOP/s, GB, GB/s, microseconds; G = 1e9);
``ClusterProfile`` holds SI units (FLOP/s, bytes, bytes/s, seconds).

File layout::

    name = "h100-sxm"
    description = "..."
    [peak_flops_tflops]   # dtype name -> dense TFLOP/s; `float32` is required
    bfloat16 = 989.0
    float32 = 67.0
    [memory]
    hbm_gb = 80.0
    hbm_bandwidth_gbps = 3350.0
    [network]
    devices_per_node = 8
    intra_bandwidth_gbps = 450.0
    intra_latency_us = 10.0
    inter_bandwidth_gbps = 50.0
    inter_latency_us = 30.0
    [efficiency]          # each in (0, 1]
    compute = 0.6
    hbm = 0.8
    intra_link = 0.82
    inter_link = 0.8

autopar prices float32 matmuls at the ``tfloat32`` figure where a profile has one
(JAX's default matmul precision runs float32 dots as TF32 on tensor cores), at
``float32`` under precision HIGHEST or ``jax_default_matmul_precision="highest"``, and
at ``float32`` on profiles without a ``tfloat32`` entry; see
``autopar.cost.model.rate_dtype``. Other float32 math is priced at ``float32``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["ClusterProfile", "available", "load"]

_G = 1e9
_T = 1e12
_US = 1e-6

# Spellings accepted by `flops_for` besides numpy's canonical dtype names.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "tf32": "tfloat32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "single": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}

# Scalar fields of ClusterProfile: (field, toml table, toml key, scale to SI, kind).
_SCALARS: tuple[tuple[str, str, str, float, str], ...] = (
    ("hbm_bytes", "memory", "hbm_gb", _G, "positive"),
    ("hbm_bandwidth", "memory", "hbm_bandwidth_gbps", _G, "positive"),
    ("devices_per_node", "network", "devices_per_node", 1, "count"),
    ("intra_bandwidth", "network", "intra_bandwidth_gbps", _G, "positive"),
    ("intra_latency", "network", "intra_latency_us", _US, "positive"),
    ("inter_bandwidth", "network", "inter_bandwidth_gbps", _G, "positive"),
    ("inter_latency", "network", "inter_latency_us", _US, "positive"),
    ("compute_efficiency", "efficiency", "compute", 1, "efficiency"),
    ("hbm_efficiency", "efficiency", "hbm", 1, "efficiency"),
    ("intra_link_efficiency", "efficiency", "intra_link", 1, "efficiency"),
    ("inter_link_efficiency", "efficiency", "inter_link", 1, "efficiency"),
)
_TOML_TABLES = {
    "peak_flops_tflops": None,  # any dtype name
    "memory": {"hbm_gb", "hbm_bandwidth_gbps"},
    "network": {
        "devices_per_node",
        "intra_bandwidth_gbps",
        "intra_latency_us",
        "inter_bandwidth_gbps",
        "inter_latency_us",
    },
    "efficiency": {"compute", "hbm", "intra_link", "inter_link"},
}


def _err(source: str, key: str, msg: str) -> ValueError:
    return ValueError(f"cost profile {source}: key '{key}' {msg}")


def _check_number(source: str, key: str, value: Any, kind: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _err(source, key, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise _err(source, key, f"must be a positive number, got {value!r}")
    if kind == "count":
        if value != int(value):
            raise _err(source, key, f"must be a positive integer, got {value!r}")
        return int(value)
    if kind == "efficiency" and value > 1:
        raise _err(source, key, f"must be in (0, 1], got {value!r}")
    return float(value)


def _check_str(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _err(source, key, f"must be a non-empty string, got {value!r}")
    return value


def _check_peaks(source: str, key: str, value: Any, scale: float) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise _err(source, key, f"must be a table of dtype -> FLOP/s, got {value!r}")
    if "float32" not in value:
        raise _err(source, f"{key}.float32", "is missing (it is the fallback for unknown dtypes)")
    return {
        str(k): _check_number(source, f"{key}.{k}", v, "positive") * scale for k, v in value.items()
    }


def _dtype_name(dtype: Any) -> str:
    """Canonical name of a numpy/jax dtype, scalar type, array or string."""
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        return _DTYPE_ALIASES.get(name, name)
    inner = None if isinstance(dtype, type) else getattr(dtype, "dtype", None)
    if inner is not None and inner is not dtype:  # arrays, ShapeDtypeStruct, jnp scalar types
        return _dtype_name(inner)
    try:
        import numpy as np

        return np.dtype(dtype).name
    except Exception:
        pass
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
    return _dtype_name(name) if isinstance(name, str) else str(dtype)


@dataclass(frozen=True)
class ClusterProfile:
    """One device type and its interconnect, in SI units."""

    name: str
    description: str
    peak_flops: Mapping[str, float] = field(hash=False)  # dtype -> dense FLOP/s per device
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    devices_per_node: int
    intra_bandwidth: float  # bytes/s per direction per device (NVLink)
    intra_latency: float  # s
    inter_bandwidth: float  # bytes/s per device (network)
    inter_latency: float  # s
    compute_efficiency: float
    hbm_efficiency: float
    intra_link_efficiency: float
    inter_link_efficiency: float

    def __post_init__(self) -> None:
        source = f"'{self.name}'"
        _check_str(source, "name", self.name)
        if not isinstance(self.description, str):
            raise _err(source, "description", f"must be a string, got {self.description!r}")
        peaks = _check_peaks(source, "peak_flops", self.peak_flops, 1.0)
        object.__setattr__(self, "peak_flops", types.MappingProxyType(peaks))
        for fname, _table, _key, _scale, kind in _SCALARS:
            value = _check_number(source, fname, getattr(self, fname), kind)
            object.__setattr__(self, fname, value)

    def flops_for(self, dtype: Any) -> float:
        """Dense peak FLOP/s per device for `dtype` (a numpy/jax dtype, type or name).

        Dtypes without an entry (integers, fp8, ...) get the float32 figure.
        """
        return self.peak_flops.get(_dtype_name(dtype), self.peak_flops["float32"])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict in SI units, keyed by field name."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["peak_flops"] = dict(self.peak_flops)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterProfile:
        """Inverse of `to_dict`. Raises ValueError naming a missing or unknown key."""
        source = f"'{d.get('name', '<dict>')}'"
        names = [f.name for f in dataclasses.fields(cls)]
        for key in names:
            if key not in d:
                raise _err(source, key, "is missing")
        for key in d:
            if key not in names:
                raise _err(source, key, "is not a profile field")
        return cls(**{key: d[key] for key in names})


def _from_toml(data: Mapping[str, Any], source: str) -> ClusterProfile:
    for key in data:
        if key not in ("name", "description") and key not in _TOML_TABLES:
            raise _err(source, key, "is not a known key")
    for key in ("name", "description"):
        if key not in data:
            raise _err(source, key, "is missing")
    name = _check_str(source, "name", data["name"])
    description = data["description"]
    if not isinstance(description, str):
        raise _err(source, "description", f"must be a string, got {description!r}")
    for table, keys in _TOML_TABLES.items():
        if table not in data:
            raise _err(source, table, "is missing (a [table])")
        if not isinstance(data[table], Mapping):
            raise _err(source, table, "must be a [table]")
        if keys is not None:
            for key in data[table]:
                if key not in keys:
                    raise _err(source, f"{table}.{key}", "is not a known key")
    values: dict[str, Any] = {
        "name": name,
        "description": description,
        "peak_flops": _check_peaks(source, "peak_flops_tflops", data["peak_flops_tflops"], _T),
    }
    for fname, table, key, scale, kind in _SCALARS:
        if key not in data[table]:
            raise _err(source, f"{table}.{key}", "is missing")
        value = _check_number(source, f"{table}.{key}", data[table][key], kind)
        values[fname] = value if kind == "count" else value * scale
    return ClusterProfile(**values)


def _load_file(path: Path) -> ClusterProfile:
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cost profile {source}: cannot read file ({e.strerror or e})") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"cost profile {source}: invalid TOML ({e})") from e
    return _from_toml(data, source)


def available() -> list[str]:
    """Names of the bundled profiles, sorted."""
    root = resources.files(__name__)
    return sorted(
        p.name[: -len(".toml")] for p in root.iterdir() if p.is_file() and p.name.endswith(".toml")
    )


def load(name_or_path: str | os.PathLike[str] | ClusterProfile) -> ClusterProfile:
    """A bundled profile by name ("h100-sxm"), a .toml file by path, or a profile as is."""
    if isinstance(name_or_path, ClusterProfile):
        return name_or_path
    if isinstance(name_or_path, os.PathLike):
        return _load_file(Path(name_or_path))
    if not isinstance(name_or_path, str):
        raise TypeError(f"expected a profile name, path or ClusterProfile, got {name_or_path!r}")
    spec = name_or_path
    if spec.endswith(".toml") or os.sep in spec or (os.altsep and os.altsep in spec):
        return _load_file(Path(spec))
    names = available()
    if spec not in names:
        raise ValueError(
            f"unknown cost profile {spec!r}{_did_you_mean(spec, names)}; available: "
            f"{', '.join(names)} (or a path to a .toml)"
        )
    resource = resources.files(__name__).joinpath(f"{spec}.toml")
    data = tomllib.loads(resource.read_text(encoding="utf-8"))
    return _from_toml(data, f"{spec}.toml (bundled)")


def _did_you_mean(name: str, choices) -> str:
    """` (did you mean 'h100-sxm'?)` for a near miss, else "" (as `autopar.errors.did_you_mean`;
    inlined: cost_models imports nothing from autopar)."""
    import difflib

    lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(name).lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""
