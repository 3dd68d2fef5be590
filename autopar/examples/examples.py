"""Example workloads for the command line: `autopar search autopar/examples/examples.py:gpt_small`.

Every factory returns an `autopar.Workload` whose arguments are
`jax.ShapeDtypeStruct`s (from each model's `abstract_args`), so even the
175B-parameter configuration is planned without allocating anything. The step
is the model's AdamW train step, `step(state, batch) -> (state, {"loss": ...})`,
with the state donated.

Small (fast to plan, for tests and trying things out): `gpt_small`, `mlp_small`,
`cnn_small`, `embedding_small`. GPT suite (the Alpa benchmark shapes, seq 1024,
vocab 51200, global batch 1024, bfloat16): `gpt_1_3b`, `gpt_2_6b`, `gpt_6_7b`;
and `gpt3_175b` (GPT-3: 96 layers, hidden 12288, 96 heads, seq 2048, batch 1536).
`gpt(...)` builds any other GPT: `autopar search 'autopar/examples/examples.py:gpt(hidden=256, layers=4)'`.

The batch is the global batch of one step: the train step has no gradient
accumulation or rematerialization, so at the published batch sizes the
activations of the big configurations need far more than 80 GB per device even
on 64 devices. Plan a micro-batch instead: `autopar.examples:gpt_1_3b(batch=64)`.

MoE, ViT and Wide-ResNet workloads follow the GPT suite at the end of the file.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from autopar.tools.workload import Workload

__all__ = [
    "SUITE",
    "cnn_small",
    "embedding_small",
    "gpt",
    "gpt3_175b",
    "gpt_1_3b",
    "gpt_2_6b",
    "gpt_6_7b",
    "gpt_scan_small",
    "gpt_small",
    "mlp_small",
]


def _dtype(dtype: Any) -> Any:
    return jnp.dtype(dtype) if isinstance(dtype, str) else dtype


def _maker(ts):
    """Concrete `(state, batch)` for a train step, for running what was planned."""
    return lambda seed=0: (ts.init(seed), ts.batch(seed))


def _workload(module, cfg, name: str) -> Workload:
    ts = module.make_train_step(cfg)
    return Workload(
        ts.step, module.abstract_args(cfg), name=name, donate_argnums=(0,), make_args=_maker(ts)
    )


def gpt(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 256,
    batch: int = 8,
    dtype: Any = "float32",
    ffn: int | None = None,
    name: str = "",
    scan_layers: bool = False,
) -> Workload:
    """A GPT-2 style decoder's AdamW train step (`autopar.examples.models.gpt`)."""
    from autopar.examples.models import gpt as m

    cfg = m.GPTConfig(
        vocab=vocab,
        seq=seq,
        hidden=hidden,
        layers=layers,
        heads=heads,
        ffn=ffn,
        dtype=_dtype(dtype),
        batch_size=batch,
        scan_layers=scan_layers,
    )
    ts = m.make_train_step(cfg)
    label = (
        name
        or f"gpt(hidden={hidden}, layers={layers}, heads={heads}, seq={seq}, vocab={vocab}, batch={batch}, {jnp.dtype(cfg.dtype).name})"
    )
    return Workload(
        ts.step, m.abstract_args(cfg), name=label, donate_argnums=(0,), make_args=_maker(ts)
    )


def gpt_small() -> Workload:
    """A 2-layer GPT with hidden 128: about 0.5M parameters, plans in seconds. Planned
    for a GPU profile it is rightly left replicated (every op is faster than one
    collective's latency); `--cluster cpu` plans it for the simulated devices."""
    return gpt(hidden=128, layers=2, heads=4, seq=64, vocab=512, batch=16, name="gpt_small")


def gpt_scan_small() -> Workload:
    """A 4-layer GPT with its layers under `nn.scan`: what `--pipeline-stages`, `--remat`
    and `--grad-accumulation` work on (plan it with `--cluster cpu`)."""
    return gpt(
        hidden=64,
        layers=4,
        heads=4,
        seq=32,
        vocab=256,
        batch=8,
        name="gpt_scan_small",
        scan_layers=True,
    )


def gpt_1_3b(batch: int = 1024) -> Workload:
    """GPT 1.3B: hidden 2048, 24 layers, 32 heads."""
    return gpt(2048, 24, 32, 1024, 51200, batch, "bfloat16", name="gpt_1_3b")


def gpt_2_6b(batch: int = 1024) -> Workload:
    """GPT 2.6B: hidden 2560, 32 layers, 32 heads."""
    return gpt(2560, 32, 32, 1024, 51200, batch, "bfloat16", name="gpt_2_6b")


def gpt_6_7b(batch: int = 1024) -> Workload:
    """GPT 6.7B: hidden 4096, 32 layers, 32 heads."""
    return gpt(4096, 32, 32, 1024, 51200, batch, "bfloat16", name="gpt_6_7b")


def gpt3_175b(batch: int = 1536) -> Workload:
    """GPT-3 175B: hidden 12288, 96 layers, 96 heads, seq 2048."""
    return gpt(12288, 96, 96, 2048, 51200, batch, "bfloat16", name="gpt3_175b")


def mlp_small() -> Workload:
    """A 2-hidden-layer MLP regressor (`autopar.examples.models.mlp` defaults)."""
    from autopar.examples.models import mlp as m

    cfg = m.MLPConfig()
    return _workload(m, cfg, "mlp_small")


def cnn_small() -> Workload:
    """A 2-conv CNN with batch norm and pooling (`autopar.examples.models.cnn` defaults)."""
    from autopar.examples.models import cnn as m

    cfg = m.CNNConfig()
    return _workload(m, cfg, "cnn_small")


def embedding_small() -> Workload:
    """An embedding-bag classifier (`autopar.examples.models.embedding` defaults)."""
    from autopar.examples.models import embedding as m

    cfg = m.EmbeddingConfig()
    return _workload(m, cfg, "embedding_small")


SUITE = {
    "gpt_1_3b": gpt_1_3b,
    "gpt_2_6b": gpt_2_6b,
    "gpt_6_7b": gpt_6_7b,
    "gpt3_175b": gpt3_175b,
}


# ---------------------------------------------------------------------------------------
# MoE, ViT and Wide-ResNet suite workloads (the shapes of Alpa's and ViT's benchmarks).
# As for the GPT suite, `batch` defaults to the published global batch; plan a
# micro-batch with e.g. `autopar.examples:moe_1_3b(batch=32)`.
# ---------------------------------------------------------------------------------------


def moe(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    experts: int = 4,
    seq: int = 32,
    vocab: int = 256,
    batch: int = 8,
    group_size: int = 32,
    ffn: int | None = None,
    dtype: Any = "float32",
    name: str = "",
) -> Workload:
    """A GShard MoE transformer's AdamW train step (`autopar.examples.models.moe`)."""
    from autopar.examples.models import moe as m

    cfg = m.MoEConfig(
        vocab=vocab,
        seq=seq,
        hidden=hidden,
        layers=layers,
        heads=heads,
        experts=experts,
        ffn=ffn,
        group_size=group_size,
        dtype=_dtype(dtype),
        batch_size=batch,
    )
    label = name or (
        f"moe(hidden={hidden}, layers={layers}, experts={experts}, seq={seq}, batch={batch})"
    )
    return _workload(m, cfg, label)


def moe_small() -> Workload:
    """A 2-layer MoE (one dense, one 4-expert top-2 layer), hidden 32."""
    return moe(32, 2, 4, 4, 16, 128, 8, 16, name="moe_small")


def _alpa_moe(hidden: int, experts: int, batch: int, name: str) -> Workload:
    # Alpa's suite: seq 1024, vocab 32000, 16 layers, 16 heads, expert group 2048, FFN 8x.
    return moe(hidden, 16, 16, experts, 1024, 32000, batch, 2048, 8 * hidden, "bfloat16", name)


def moe_1_3b(batch: int = 1024) -> Workload:
    """GShard MoE 1.3B (Alpa): hidden 768, 16 layers, 16 experts."""
    return _alpa_moe(768, 16, batch, "moe_1_3b")


def moe_2_4b(batch: int = 1024) -> Workload:
    """GShard MoE 2.4B (Alpa): hidden 1024, 16 layers, 16 experts."""
    return _alpa_moe(1024, 16, batch, "moe_2_4b")


def moe_10b(batch: int = 1024) -> Workload:
    """GShard MoE 10B (Alpa): hidden 1536, 16 layers, 32 experts."""
    return _alpa_moe(1536, 32, batch, "moe_10b")


def vit(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    mlp: int | None = None,
    image: int = 16,
    patch: int = 4,
    classes: int = 10,
    batch: int = 8,
    dtype: Any = "float32",
    name: str = "",
) -> Workload:
    """A Vision Transformer's AdamW train step (`autopar.examples.models.vit`)."""
    from autopar.examples.models import vit as m

    cfg = m.ViTConfig(
        image=image,
        patch=patch,
        hidden=hidden,
        layers=layers,
        heads=heads,
        mlp=mlp,
        classes=classes,
        dtype=_dtype(dtype),
        batch_size=batch,
    )
    label = (
        name
        or f"vit(hidden={hidden}, layers={layers}, image={image}, patch={patch}, batch={batch})"
    )
    return _workload(m, cfg, label)


def vit_small() -> Workload:
    """A 2-block ViT on 16x16 images, hidden 32."""
    return vit(32, 2, 4, None, 16, 4, 10, 8, name="vit_small")


def vit_b16(batch: int = 4096) -> Workload:
    """ViT-B/16: 12 layers, hidden 768, MLP 3072, 12 heads, 224x224 images."""
    return vit(768, 12, 12, 3072, 224, 16, 1000, batch, "bfloat16", "vit_b16")


def vit_l16(batch: int = 4096) -> Workload:
    """ViT-L/16: 24 layers, hidden 1024, MLP 4096, 16 heads."""
    return vit(1024, 24, 16, 4096, 224, 16, 1000, batch, "bfloat16", "vit_l16")


def vit_h14(batch: int = 4096) -> Workload:
    """ViT-H/14: 32 layers, hidden 1280, MLP 5120, 16 heads, patch 14."""
    return vit(1280, 32, 16, 5120, 224, 14, 1000, batch, "bfloat16", "vit_h14")


def wide_resnet(
    filters: int = 8,
    width: int = 2,
    stage_sizes: tuple[int, ...] = (1, 1),
    image: int = 32,
    classes: int = 10,
    batch: int = 8,
    dtype: Any = "float32",
    name: str = "",
) -> Workload:
    """A Wide-ResNet's AdamW train step (`autopar.examples.models.wide_resnet`)."""
    from autopar.examples.models import wide_resnet as m

    cfg = m.WideResNetConfig(
        image=image,
        filters=filters,
        width=width,
        stage_sizes=tuple(stage_sizes),
        classes=classes,
        batch_size=batch,
        dtype=_dtype(dtype),
    )
    label = name or (
        f"wide_resnet(filters={filters}, width={width}, stages={tuple(stage_sizes)}, batch={batch})"
    )
    return _workload(m, cfg, label)


def wide_resnet_small() -> Workload:
    """A 2-stage Wide-ResNet on 32x32 images, base 8 filters."""
    return wide_resnet(name="wide_resnet_small")


def _alpa_wrn(filters: int, width: int, batch: int, name: str) -> Workload:
    # Alpa's suite: 224x224x3 images, 1024 classes, 50 layers.
    from autopar.examples.models.wide_resnet import STAGES_50

    return wide_resnet(filters, width, STAGES_50, 224, 1024, batch, "bfloat16", name)


def wide_resnet_1b(batch: int = 1536) -> Workload:
    """Wide-ResNet 1B (Alpa): 50 layers, base 320, width 2."""
    return _alpa_wrn(320, 2, batch, "wide_resnet_1b")


def wide_resnet_2b(batch: int = 1536) -> Workload:
    """Wide-ResNet 2B (Alpa): 50 layers, base 448, width 2."""
    return _alpa_wrn(448, 2, batch, "wide_resnet_2b")


def wide_resnet_4b(batch: int = 1536) -> Workload:
    """Wide-ResNet 4B (Alpa): 50 layers, base 640, width 2."""
    return _alpa_wrn(640, 2, batch, "wide_resnet_4b")


SUITE.update(
    {
        "moe_1_3b": moe_1_3b,
        "moe_2_4b": moe_2_4b,
        "moe_10b": moe_10b,
        "wide_resnet_1b": wide_resnet_1b,
        "wide_resnet_2b": wide_resnet_2b,
        "wide_resnet_4b": wide_resnet_4b,
        "vit_b16": vit_b16,
        "vit_l16": vit_l16,
        "vit_h14": vit_h14,
    }
)
__all__ += [
    "moe",
    "moe_small",
    "moe_1_3b",
    "moe_2_4b",
    "moe_10b",
    "vit",
    "vit_small",
    "vit_b16",
    "vit_l16",
    "vit_h14",
    "wide_resnet",
    "wide_resnet_small",
    "wide_resnet_1b",
    "wide_resnet_2b",
    "wide_resnet_4b",
]
