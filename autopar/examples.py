"""Example workloads for the command line: `autopar search autopar/examples.py:gpt_small`.

Every factory returns an `autopar.Workload` whose arguments are
`jax.ShapeDtypeStruct`s (from each model's `abstract_args`), so even the
175B-parameter configuration is planned without allocating anything. The step
is the model's AdamW train step, `step(state, batch) -> (state, {"loss": ...})`,
with the state donated.

Small (fast to plan, for tests and trying things out): `gpt_small`, `mlp_small`,
`cnn_small`, `embedding_small`. GPT suite (the Alpa benchmark shapes, seq 1024,
vocab 51200, global batch 1024, bfloat16): `gpt_1_3b`, `gpt_2_6b`, `gpt_6_7b`;
and `gpt3_175b` (GPT-3: 96 layers, hidden 12288, 96 heads, seq 2048, batch 1536).
`gpt(...)` builds any other GPT: `autopar search 'autopar/examples.py:gpt(hidden=256, layers=4)'`.

The batch is the global batch of one step: the train step has no gradient
accumulation or rematerialization, so at the published batch sizes the
activations of the big configurations need far more than 80 GB per device even
on 64 devices. Plan a micro-batch instead: `autopar.examples:gpt_1_3b(batch=64)`.

MoE, ViT and Wide-ResNet workloads are not here yet: their models do not exist
in `autopar.models`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from autopar.workload import Workload

__all__ = [
    "SUITE",
    "cnn_small",
    "embedding_small",
    "gpt",
    "gpt3_175b",
    "gpt_1_3b",
    "gpt_2_6b",
    "gpt_6_7b",
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
) -> Workload:
    """A GPT-2 style decoder's AdamW train step (`autopar.models.gpt`)."""
    from autopar.models import gpt as m

    cfg = m.GPTConfig(
        vocab=vocab,
        seq=seq,
        hidden=hidden,
        layers=layers,
        heads=heads,
        ffn=ffn,
        dtype=_dtype(dtype),
        batch_size=batch,
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
    """A 2-layer GPT with hidden 32: about 80k parameters, plans in seconds."""
    return gpt(hidden=32, layers=2, heads=4, seq=16, vocab=128, batch=8, name="gpt_small")


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
    """A 2-hidden-layer MLP regressor (`autopar.models.mlp` defaults)."""
    from autopar.models import mlp as m

    cfg = m.MLPConfig()
    return _workload(m, cfg, "mlp_small")


def cnn_small() -> Workload:
    """A 2-conv CNN with batch norm and pooling (`autopar.models.cnn` defaults)."""
    from autopar.models import cnn as m

    cfg = m.CNNConfig()
    return _workload(m, cfg, "cnn_small")


def embedding_small() -> Workload:
    """An embedding-bag classifier (`autopar.models.embedding` defaults)."""
    from autopar.models import embedding as m

    cfg = m.EmbeddingConfig()
    return _workload(m, cfg, "embedding_small")


SUITE = {
    "gpt_1_3b": gpt_1_3b,
    "gpt_2_6b": gpt_2_6b,
    "gpt_6_7b": gpt_6_7b,
    "gpt3_175b": gpt3_175b,
}
