"""Checkpoints that outlive a plan: save a train state under one plan, restore it
onto another plan's shardings (another mesh, another engine), with Orbax.

    autopar.checkpoint.save(ckpt_dir, state, step=100)
    ...
    step_fn = autopar.parallelize(train_step, mesh={"data": 8})       # a new plan
    state = autopar.checkpoint.restore(ckpt_dir, step_fn.plan(state_abstract, batch))

A checkpoint directory holds one sub-directory per step (`ckpt_dir/100/`). Orbax
writes each step into a temporary directory and renames it when every array is
written, so a save that dies half-way leaves the previous steps readable and is
never picked up by `restore` or `latest_step`. Arrays are read straight into the
target layout: each device reads only its shard (no full copy on one host), and
in a multi-process run every process writes and reads its own shards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding

from autopar.errors import CheckpointError
from autopar.ir.capture import path_str
from autopar.plan.plan import Plan


def _manager(path: str | os.PathLike, *, create: bool, max_to_keep: int | None = None):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=create,
        enable_async_checkpointing=False,  # `save` returns once the step is committed
    )
    return ocp.CheckpointManager(
        Path(path).absolute(), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def all_steps(path: str | os.PathLike) -> list[int]:
    """The committed steps in `path`, ascending (interrupted saves are not listed)."""
    if not Path(path).is_dir():
        return []
    with _manager(path, create=False) as mgr:
        return sorted(mgr.all_steps())


def latest_step(path: str | os.PathLike) -> int | None:
    """The newest committed step in `path`, or None when there is none."""
    steps = all_steps(path)
    return steps[-1] if steps else None


def save(
    path: str | os.PathLike,
    state: Any,
    step: int | None = None,
    *,
    max_to_keep: int | None = None,
) -> int:
    """Save the pytree `state` (sharded `jax.Array`s, numpy arrays, scalars) as `step`.

    `step` defaults to one past the latest step in `path` (0 for a new directory).
    Returns the step saved. Blocks until the step is committed; a step that already
    exists raises `CheckpointError`. `max_to_keep` deletes the oldest steps beyond
    that many. In a multi-process run every process must call it (each writes its
    shards).
    """
    with _manager(path, create=True, max_to_keep=max_to_keep) as mgr:
        steps = mgr.all_steps()
        if step is None:
            step = max(steps, default=-1) + 1
        elif step in steps:
            raise CheckpointError(
                f"{path} already has step {step}; pass a new step number "
                f"(the latest is {max(steps)}) or delete {Path(path) / str(step)}"
            )
        mgr.save(int(step), args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    return int(step)


def restore(
    path: str | os.PathLike,
    target: Plan | Sharding | Any = None,
    abstract_state: Any = None,
    *,
    step: int | None = None,
    argnum: int = 0,
) -> Any:
    """Read a saved state straight into the layout a (new) plan wants.

    `target` says where the arrays go:
    * a `Plan` (from `step_fn.plan(...)`): the shardings of its argument `argnum`
      (the train state, by default) — the layout the step function takes it in;
    * a pytree of `jax.sharding.Sharding`s shaped like the state (e.g.
      `plan.in_shardings[0]`), or one `Sharding` for every leaf;
    * None: the shardings inside `abstract_state`'s ShapeDtypeStructs.
    `abstract_state` (optional) is a pytree of ShapeDtypeStructs (e.g. from
    `jax.eval_shape(init)`) that gives the state's structure — namedtuples of
    optimizer states included — and is checked against the saved shapes and dtypes;
    without it the structure comes from `target`, and the shapes from the checkpoint.
    `step` defaults to the latest committed step. A state saved as `nnx.state(model)`
    restores with a Plan as the pure dict its shardings describe (each Variable's
    array, as `nnx.to_pure_dict` gives it): `nnx.replace_by_pure_dict(nnx.state(model),
    restored)` and `nnx.update(model, ...)` put it back into the model.
    """
    steps = all_steps(path)
    if not steps:
        raise CheckpointError(
            f"no checkpoint in {path}"
            + ("" if Path(path).is_dir() else " (the directory does not exist)")
            + "; save one with autopar.checkpoint.save(path, state)"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{path} has no step {step}; committed steps: {steps}")
    with _manager(path, create=False) as mgr:
        saved = _saved_arrays(mgr.item_metadata(step))
        shardings = _shardings(target, argnum)
        if isinstance(target, Plan) and isinstance(shardings, Sharding) and abstract_state is None:
            raise CheckpointError(
                f"restore: argument {argnum} of the plan for {target.function or 'the function'} "
                "is one array, not a pytree of state, so the plan does not say what the saved "
                "state looks like; pass the argnum of the state the checkpoint holds (0 for "
                "a train state passed first), or give abstract_state"
            )
        abstract, (tree, wrapped) = _abstract_target(path, step, saved, shardings, abstract_state)
        got = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
        if not any(wrapped):
            return got
        parts = tree.flatten_up_to(got)
        return jax.tree_util.tree_unflatten(
            tree, [x["value"] if w else x for x, w in zip(parts, wrapped)]
        )


# ---- internals --------------------------------------------------------------------------


def _shardings(target: Any, argnum: int) -> Any:
    if isinstance(target, Plan):
        shardings = target.in_shardings
        if not isinstance(shardings, tuple | list) or not 0 <= argnum < len(shardings):
            raise CheckpointError(
                f"the plan for {target.function or 'the function'} has no argument {argnum}"
            )
        return shardings[argnum]
    return target


def _name(path) -> str:
    """Orbax's name for a leaf: its key path joined by dots (`opt_state.0.mu.wte`)."""
    return path_str(path, ".")


def _saved_arrays(metadata: Any) -> dict[str, Any]:
    """{leaf name: metadata with .shape and .dtype} of a saved step."""
    tree = getattr(metadata, "tree", metadata)
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {_name(p): m for p, m in leaves if hasattr(m, "shape")}


def _abstract_target(path, step, saved: Mapping[str, Any], shardings, abstract_state) -> Any:
    """A ShapeDtypeStruct per leaf (saved shape and dtype, the target sharding), shaped
    like `abstract_state` or else like `shardings`; mismatches name the leaf."""
    where = f"checkpoint {path} step {step}"
    leaves, tree, targets = _leaves_and_targets(shardings, abstract_state)
    names = [_name(p) for p, _ in leaves]
    # saved from an nnx.State, each array under its Variable's `value`; asked for as the
    # pure dict a plan's shardings are (`l1.bias` for `l1.bias.value`)
    wrapped = [n not in saved and f"{n}.value" in saved for n in names]
    names = [f"{n}.value" if w else n for n, w in zip(names, wrapped)]
    missing = sorted(set(names) - saved.keys())
    if missing:
        extra = sorted(saved.keys() - set(names))
        raise CheckpointError(
            f"{where} does not hold the state asked for: missing {_few(missing)}"
            + (f"; it has instead {_few(extra)}" if extra else "")
            + ". Restore with the same state structure that was saved."
        )
    out = []
    for name, (_, want), sharding in zip(names, leaves, targets):
        shape = tuple(saved[name].shape)
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(saved[name].dtype))  # int64 -> int32
        if want is not None and (tuple(want.shape), np.dtype(want.dtype)) != (shape, dtype):
            raise CheckpointError(
                f"{where}: {name} was saved as {dtype.name}{list(shape)}, "
                f"the state asks for {np.dtype(want.dtype).name}{list(want.shape)}"
            )
        if sharding is None:
            raise CheckpointError(
                f"restore: no target sharding for {name}: give abstract_state leaves a "
                "sharding, or pass shardings (a Plan or plan.in_shardings[0])"
            )
        if not _divides(sharding, shape):
            raise CheckpointError(
                f"{where}: {name} {list(shape)} cannot be laid out as {sharding}: a sharded "
                "dim is not divisible by its mesh axes; use shardings from a plan for this state"
            )
        out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    out = [{"value": x} if w else x for x, w in zip(out, wrapped)]
    return jax.tree_util.tree_unflatten(tree, out), (tree, wrapped)


def _leaves_and_targets(shardings, abstract_state):
    """([(path, ShapeDtypeStruct or None)], treedef, [Sharding or None]) per leaf; the
    structure comes from `abstract_state` when given, else from `shardings`."""
    is_sharding = lambda x: isinstance(x, Sharding)
    if abstract_state is None:
        if shardings is None or is_sharding(shardings):
            raise CheckpointError(
                "restore: say where the arrays go and what the state looks like: a Plan, a "
                "pytree of shardings (plan.in_shardings[0]), or abstract_state (with a "
                "single Sharding, or with shardings in its ShapeDtypeStructs)"
            )
        leaves, tree = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=is_sharding)
        return [(p, None) for p, _ in leaves], tree, [s for _, s in leaves]
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract_state)
    if shardings is None:
        targets = [getattr(x, "sharding", None) for _, x in leaves]
    elif is_sharding(shardings):
        targets = [shardings] * len(leaves)
    else:
        have = jax.tree_util.tree_structure(shardings, is_leaf=is_sharding)
        if have != tree:
            keystr = jax.tree_util.keystr  # `[2]`, `[0]['embed']`: as the pytree indexes them
            a = [
                keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(shardings, is_leaf=is_sharding)[0]
            ]
            b = [keystr(p) for p, _ in leaves]
            only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            raise CheckpointError(
                "restore: the target shardings and abstract_state have different structures"
                + (f": only the shardings have leaves {_few(only_a)}" if only_a else "")
                + (f"; only abstract_state has leaves {_few(only_b)}" if only_b else "")
                + f" ({len(a)} leaves against {len(b)})"
                + (
                    " (an nnx.State names each array's Variable: give its pure dict, "
                    "nnx.to_pure_dict(state), or leave abstract_state out)"
                    if any(n.endswith(".value") for n in only_b)
                    else ""
                )
            )
        targets = jax.tree_util.tree_leaves(shardings, is_leaf=is_sharding)
    return leaves, tree, targets


def _divides(sharding: Sharding, shape: tuple[int, ...]) -> bool:
    try:
        sharding.shard_shape(shape)
    except ValueError:
        return False
    return True


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")
