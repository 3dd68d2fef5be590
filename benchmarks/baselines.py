"""Hand-written baselines as plain ``jax.jit`` shardings (PartitionSpec pytrees built
from parameter paths). Every baseline fixes the specs of the train state and the batch;
GSPMD's sharding propagation decides everything inside the step.

* ``dp``        data parallel: state replicated, batch split over every device.
* ``fsdp``      FSDP / ZeRO-3: params and optimizer state sharded over every device
                (the largest dim the device count divides), batch split over every device.
* ``megatron``  Megatron-LM tensor parallel x data parallel (transformers): q/k/v/c_fc
                column-split on ``model``, o/c_proj row-split, token embedding
                vocab-split, MoE expert FFNs split on their hidden dim; everything else
                replicated; batch on ``data``.
* ``expert``    expert parallel (MoE): expert weights ``[E, ...]`` split on ``model``,
                the rest replicated, batch split over every device (DeepSpeed-MoE
                layout: data parallel over all devices, experts over one axis, the
                dispatch/combine einsums become all-to-alls over ``model``).
* ``expert_all``  GShard's layout: experts over every device, batch over every device.

Optimizer state follows its parameter (``opt_state/0/mu/<param path>`` gets the spec of
``params/<param path>``); scalars and batch-norm statistics follow the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.ir.capture import path_str
from benchmarks.stages import param_path

P = PartitionSpec
Rule = Callable[[str, tuple[int, ...]], PartitionSpec]


def _fits(shape, dim: int, axes: tuple[str, ...], mesh_shape: dict[str, int]) -> bool:
    n = math.prod(mesh_shape[a] for a in axes)
    return 0 <= dim < len(shape) and shape[dim] % n == 0


def _on(shape, dim: int, axes: tuple[str, ...], mesh_shape) -> PartitionSpec:
    """Split `dim` over `axes` when it divides, else replicate."""
    if not axes or not _fits(shape, dim, axes, mesh_shape):
        return P()
    spec: list = [None] * len(shape)
    spec[dim] = axes[0] if len(axes) == 1 else tuple(axes)
    return P(*spec)


def _largest(shape, axes, mesh_shape) -> PartitionSpec:
    """ZeRO-3: the largest dim the axes divide (first one on ties)."""
    dims = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    for d in dims:
        if _fits(shape, d, axes, mesh_shape):
            return _on(shape, d, axes, mesh_shape)
    return P()


@dataclass(frozen=True)
class Baseline:
    name: str
    state_rule: Callable[[str, tuple[int, ...], dict[str, int]], PartitionSpec]
    batch_axes: Callable[[dict[str, int]], tuple[str, ...]]
    description: str


def _all_axes(mesh_shape) -> tuple[str, ...]:
    return tuple(a for a, s in mesh_shape.items() if s > 1) or tuple(mesh_shape)[:1]


def _data_axes(mesh_shape) -> tuple[str, ...]:
    return ("data",) if "data" in mesh_shape else ()


def _replicated(path, shape, mesh_shape):
    return P()


def _fsdp(path, shape, mesh_shape):
    if not shape:
        return P()
    return _largest(shape, _all_axes(mesh_shape), mesh_shape)


_COLUMN = ("q", "k", "v", "c_fc")
_ROW = ("o", "c_proj")
# Names public Flax code gives the same layers (none of them is used by the suite's models).
_COLUMN_USER = (
    *("c_attn", "qkv", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
    *("wi", "fc1", "query", "key", "value", "intermediate"),
)
_ROW_USER = ("o_proj", "down_proj", "wo", "fc2", "attn_out", "output")
_EMBED = ("wte", "embed_tokens", "shared", "word_embeddings")
_HEADS = ("query", "key", "value")  # DenseGeneral kernels [in, heads, head_dim]


def _megatron(path, shape, mesh_shape):
    """Megatron-LM's split of a transformer (and of MoE expert FFNs) on ``model``."""
    pp = param_path(path)
    if not pp or "model" not in mesh_shape:
        return P()
    parts = pp.split("/")
    leaf, owner = parts[-1], parts[-2] if len(parts) > 1 else ""
    m = ("model",)
    if owner in _HEADS and len(shape) in (2, 3) and (leaf == "bias") == (len(shape) == 2):
        # DenseGeneral: kernel [in, heads, hd] -> split heads; bias [heads, hd] -> heads.
        return _on(shape, len(shape) - 2, m, mesh_shape)
    if owner == "out" and leaf == "kernel" and len(shape) == 3:
        return _on(shape, 0, m, mesh_shape)  # DenseGeneral [heads, hd, out]: row
    if owner in _COLUMN or owner in _COLUMN_USER:
        # kernel [in, out] -> split out; bias [out] -> split.
        return _on(shape, len(shape) - 1, m, mesh_shape)
    if (owner in _ROW or owner in _ROW_USER) and leaf == "kernel":
        return _on(shape, 0, m, mesh_shape)
    if (owner in _EMBED or owner.endswith("_embed")) and leaf == "embedding":
        return _on(shape, 0, m, mesh_shape)  # vocab-parallel embedding
    if owner == "moe" and leaf == "wi":
        return _on(shape, 2, m, mesh_shape)  # [E, M, H]: column
    if owner == "moe" and leaf == "wo":
        return _on(shape, 1, m, mesh_shape)  # [E, H, M]: row
    return P()


def _expert_on(axes_of):
    def rule(path, shape, mesh_shape):
        pp = param_path(path)
        if pp.endswith("moe/wi") or pp.endswith("moe/wo"):
            return _on(shape, 0, axes_of(mesh_shape), mesh_shape)
        return P()

    return rule


BASELINES: dict[str, Baseline] = {
    "dp": Baseline("dp", _replicated, _all_axes, "data parallel"),
    "fsdp": Baseline("fsdp", _fsdp, _all_axes, "FSDP / ZeRO-3 over all devices"),
    "megatron": Baseline("megatron", _megatron, _data_axes, "Megatron TP on model x DP on data"),
    "expert": Baseline(
        "expert",
        _expert_on(lambda ms: ("model",) if "model" in ms else _all_axes(ms)),
        _all_axes,
        "expert parallel on model, DP over all devices",
    ),
    "expert_all": Baseline(
        "expert_all", _expert_on(_all_axes), _all_axes, "GShard: experts and batch over all devices"
    ),
    "replicated": Baseline(
        "replicated", _replicated, lambda ms: (), "everything replicated, the batch too"
    ),
}


def specs(baseline: Baseline, args, mesh_shape: dict[str, int]):
    """``(state_specs, batch_specs)`` PartitionSpec pytrees for ``args = (state, batch)``."""
    state, batch = args

    def state_spec(path, x):
        return baseline.state_rule(path_str(path), tuple(x.shape), mesh_shape)

    bax = baseline.batch_axes(mesh_shape)

    def batch_spec(path, x):
        return _on(tuple(x.shape), 0, bax, mesh_shape) if x.shape else P()

    return (
        jax.tree_util.tree_map_with_path(state_spec, state),
        jax.tree_util.tree_map_with_path(batch_spec, batch),
    )


def jitted(step, baseline: Baseline, args, mesh):
    """``jax.jit(step)`` with the baseline's in/out shardings on ``mesh`` (state donated)."""
    mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    state_specs, batch_specs = specs(baseline, args, mesh_shape)
    to_sh = lambda tree: jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    state_sh, batch_sh = to_sh(state_specs), to_sh(batch_specs)
    metrics_sh = {"loss": NamedSharding(mesh, P())}
    return jax.jit(
        step,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, metrics_sh),
        donate_argnums=(0,),
    )


def for_model(family: str) -> list[str]:
    """The baselines that apply to a model family."""
    if family in ("gpt", "vit"):
        return ["dp", "fsdp", "megatron"]
    if family == "moe":
        return ["dp", "fsdp", "megatron", "expert", "expert_all"]
    return ["dp", "fsdp"]


# -- steps written as public code writes them -----------------------------------------


def _user_path(path: str) -> str:
    """A state leaf's path (``fc1/kernel``, ``opt_state/0/mu/fc1/kernel``, an NNX
    ``0/fc1/kernel/value``) in the ``params/...`` form the rules read: they look at the
    tail (layer name, leaf name) only."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[-1] in ("value", "raw_value"):
        parts = parts[:-1]
    return "/".join(["params", *parts])


def user_specs(
    baseline: Baseline,
    args: tuple,
    mesh_shape: dict[str, int],
    state_argnums: tuple[int, ...],
    batch_argnums: tuple[int, ...],
) -> tuple:
    """One PartitionSpec pytree per argument of ``step(*args)``: the baseline's rule on
    the leaves of ``state_argnums`` (whatever their pytree: dicts, optax states, a
    ``TrainState``, NNX states), dim 0 split over its batch axes on ``batch_argnums``,
    everything else (rng keys, flags) replicated."""
    bax = baseline.batch_axes(mesh_shape)

    def state_spec(path, x):
        shape = tuple(x.shape)
        return baseline.state_rule(_user_path(path_str(path)), shape, mesh_shape)

    def batch_spec(path, x):
        return _on(tuple(x.shape), 0, bax, mesh_shape) if x.shape else P()

    out = []
    for i, a in enumerate(args):
        if i in state_argnums:
            out.append(jax.tree_util.tree_map_with_path(state_spec, a))
        elif i in batch_argnums:
            out.append(jax.tree_util.tree_map_with_path(batch_spec, a))
        else:
            out.append(jax.tree_util.tree_map(lambda x: P(), a))
    return tuple(out)


def splits_anything(baseline: Baseline, args, mesh_shape, state_argnums) -> bool:
    """Whether the baseline's rule splits any state leaf (``megatron`` on a model without
    the layers it names, or on a mesh without ``model``, is data parallel again)."""
    specs = user_specs(baseline, args, mesh_shape, state_argnums, ())
    leaves = [
        leaf
        for i in state_argnums
        for leaf in jax.tree_util.tree_leaves(
            specs[i], is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
    ]
    return any(any(d is not None for d in s) for s in leaves)


def user_jitted(step, baseline: Baseline, args, mesh, state_argnums, batch_argnums):
    """``jax.jit(step)`` with the baseline's shardings on every argument; ``step`` returns
    ``(*new_state, loss)``, the new state in the order of ``state_argnums`` and laid out
    as it came in, the loss replicated."""
    mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    specs = user_specs(baseline, args, mesh_shape, state_argnums, batch_argnums)
    to_sh = lambda tree: jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    shardings = tuple(to_sh(s) for s in specs)
    outs = (*(shardings[i] for i in state_argnums), NamedSharding(mesh, P()))
    return jax.jit(step, in_shardings=shardings, out_shardings=outs)
