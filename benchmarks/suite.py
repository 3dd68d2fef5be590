"""The benchmark suite: the papers' model shapes at their device counts, with layers (not
widths) scaled down so that a row compiles in about a minute on a 2-core CPU.

Widths, heads, experts, sequence lengths, vocabularies and image sizes are the published
ones (see /work/shared/BENCHMARKS.md). What is scaled, per family:

* layers: GPT 2 of 24/32, MoE 2 of 16 (one dense + one MoE layer: the GShard pair),
  ViT 2 of 12/24/32, Wide-ResNet one bottleneck block per stage (14 of 50 layers);
* batch: 8 sequences/images per device (32/64/128 on 4/8/16 devices) instead of the
  global batch of 1024-1536 that the papers split into micro-batches with gradient
  accumulation (the train step here has none); one row is one micro-batch step.

GPT-3 175B is searched only (no compile), at 8/16/24/48/96 of its 96 layers, on a 64-device
``{"data": 8, "model": 8}`` mesh (an AbstractMesh: more than the simulated devices), at
batch 8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp

from autopar.examples.models import gpt, moe, vit
from autopar.examples.models import wide_resnet as wrn

MESHES = {
    4: {"data": 2, "model": 2},
    8: {"data": 2, "model": 4},
    16: {"data": 4, "model": 4},
}
PER_DEVICE_BATCH = 8


@dataclass(frozen=True)
class Row:
    name: str
    family: str  # gpt | moe | vit | wrn
    module: Any
    config: Any
    devices: int
    full_layers: int
    layers: int
    params_label: str
    quick: bool = False
    ilp: bool = False
    mesh: dict[str, int] = field(default_factory=dict)
    compile: bool = True

    @property
    def mesh_shape(self) -> dict[str, int]:
        return self.mesh or MESHES[self.devices]

    @property
    def dtype(self):
        return self.config.dtype


def _gpt(name, hidden, heads, full, devices, quick=False, ilp=False, layers=2) -> Row:
    cfg = gpt.GPTConfig(
        vocab=51200,
        seq=1024,
        hidden=hidden,
        layers=layers,
        heads=heads,
        dtype=jnp.bfloat16,
        batch_size=PER_DEVICE_BATCH * devices,
    )
    return Row(f"gpt-{name}", "gpt", gpt, cfg, devices, full, layers, name, quick, ilp)


def _moe(name, hidden, experts, devices, quick=False, ilp=False, layers=2) -> Row:
    # Alpa's MoE benchmark: seq 1024, vocab 32000, 16 heads, top-2, expert group 2048,
    # intermediate size 8 x hidden (which gives its 1.3B/2.4B/10B parameter counts).
    cfg = moe.MoEConfig(
        vocab=32000,
        seq=1024,
        hidden=hidden,
        layers=layers,
        heads=16,
        experts=experts,
        ffn=8 * hidden,
        group_size=2048,
        dtype=jnp.bfloat16,
        batch_size=PER_DEVICE_BATCH * devices,
    )
    return Row(f"moe-{name}", "moe", moe, cfg, devices, 16, layers, name, quick, ilp)


def _wrn(name, filters, width, devices, quick=False, ilp=False) -> Row:
    cfg = wrn.WideResNetConfig(
        image=224,
        channels=3,
        filters=filters,
        width=width,
        stage_sizes=(1, 1, 1, 1),
        classes=1024,
        batch_size=PER_DEVICE_BATCH * devices,
        dtype=jnp.bfloat16,
    )
    return Row(f"wrn-{name}", "wrn", wrn, cfg, devices, 50, cfg.depth, name, quick, ilp)


def _vit(name, hidden, mlp, heads, patch, full, devices, quick=False, ilp=False) -> Row:
    cfg = vit.ViTConfig(
        image=224,
        patch=patch,
        channels=3,
        hidden=hidden,
        layers=2,
        heads=heads,
        mlp=mlp,
        classes=1000,
        dtype=jnp.bfloat16,
        batch_size=PER_DEVICE_BATCH * devices,
    )
    return Row(f"vit-{name}", "vit", vit, cfg, devices, full, 2, name, quick, ilp)


ROWS: list[Row] = [
    _gpt("1.3b", 2048, 32, 24, 4, quick=True, ilp=True),
    _gpt("2.6b", 2560, 32, 32, 8),
    _gpt("6.7b", 4096, 32, 32, 16),
    _moe("1.3b", 768, 16, 4, quick=True, ilp=True),
    _moe("2.4b", 1024, 16, 8),
    _moe("10b", 1536, 32, 16),
    _wrn("1b", 320, 2, 4),
    _wrn("2b", 448, 2, 8),
    _wrn("4b", 640, 2, 16),
    _vit("b16", 768, 3072, 12, 16, 12, 4, quick=True),
    _vit("l16", 1024, 4096, 16, 16, 24, 8),
    _vit("h14", 1280, 5120, 16, 14, 32, 16),
]

GPT3_MESH = {"data": 8, "model": 8}
# Layers -> engines searched. The whole 96 layers is searched by the fast engines only.
GPT3_FULL = {
    8: ("recursive", "dp", "auto"),
    16: ("recursive", "dp", "auto"),
    24: ("recursive", "dp", "auto"),
    48: ("recursive",),
    96: ("recursive", "dp"),
}
GPT3_QUICK = {8: ("recursive", "dp")}


def gpt3(layers: int) -> Row:
    cfg = gpt.GPTConfig(
        vocab=51200,
        seq=2048,
        hidden=12288,
        layers=layers,
        heads=96,
        dtype=jnp.bfloat16,
        batch_size=8,
    )
    return Row(
        f"gpt3-175b-L{layers}",
        "gpt",
        gpt,
        cfg,
        64,
        96,
        layers,
        "175b",
        mesh=GPT3_MESH,
        compile=False,
    )


def rows(quick: bool) -> list[Row]:
    return [r for r in ROWS if r.quick] if quick else list(ROWS)
