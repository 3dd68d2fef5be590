"""What users read: capture errors whose hint fits the mistake, "did you mean" for option
values and mesh axes, notes told apart from warnings, the offline-plan and
`pipeline_stages="auto"` warnings, and inspection of models whose layers are numbered
any of the usual ways (`layers_3`, `layers/3`, `h.3`), down to the user's own line."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import ok, run_cli
from jax.sharding import PartitionSpec

import autopar
from autopar.compile.notes import no_pipeline_why
from autopar.errors import did_you_mean
from autopar.plan.plan import is_note
from autopar.tools import inspect as insp

MESH = {"data": 2, "model": 4}
HERE = Path(__file__).name
DOCS = " (see docs/troubleshooting.md#capture-errors)"
W, X = jnp.ones((64, 32)), jnp.ones((16, 64))


def _line(fn, offset: int) -> int:
    return fn.__code__.co_firstlineno + offset


def _capture_error(fn, *args, **kw) -> str:
    with pytest.raises(autopar.CaptureError) as e:
        autopar.parallelize(fn, mesh=MESH, **kw).plan(*args)
    return str(e.value)


# ---------------------------------------------------------------------------- capture hints


def _branchy(w, x):
    y = x @ w
    if y.sum() > 0:
        return y
    return -y


def _to_float(w, x):
    loss = (x @ w).sum()
    return float(loss)


CONCRETE_HINT = (
    "Under tracing an argument has a shape and dtype but no value: branch on it with "
    "jnp.where or jax.lax.cond (keep float(...), int(...) and .item() outside the function), "
    "or, if it is a setting rather than data, pass it as a static argument "
    "(static_argnums / static_argnames)." + DOCS
)


def test_python_if_on_a_traced_value_names_the_line():
    msg = _capture_error(_branchy, W, X)
    assert msg.endswith(
        f"A traced value is used as a concrete Python value at {HERE}:{_line(_branchy, 2)}:\n"
        "    if y.sum() > 0:\n" + CONCRETE_HINT
    ), msg
    assert "TracerBoolConversionError" in msg and "arguments w and x" in msg
    assert "flat_fn" not in msg and "dyn[" not in msg


def test_float_of_a_traced_loss_names_the_line():
    msg = _capture_error(_to_float, W, X)
    assert msg.endswith(
        f"A traced value is used as a concrete Python value at {HERE}:{_line(_to_float, 2)}:\n"
        "    return float(loss)\n" + CONCRETE_HINT
    ), msg


def _counted(w, batch):
    return (batch["x"] @ w) * jnp.arange(batch["n"]).sum()


def _sliced(w, batch):
    return batch["x"][: batch["n"]] @ w


INNER = (
    "is inside an argument, and static_argnums cannot reach inside a dict or list: autopar "
    "traces every leaf of a non-static argument, as jax.jit does. Make it an array if it is "
    "data, or close over it (a closure or functools.partial) if it is a setting." + DOCS
)


@pytest.mark.parametrize(
    "fn, code",
    [
        (_counted, 'return (batch["x"] @ w) * jnp.arange(batch["n"]).sum()'),
        (_sliced, 'return batch["x"][: batch["n"]] @ w'),
    ],
    ids=["arange", "slice"],
)
def test_int_inside_a_dict_batch_says_static_argnums_cannot_reach_it(fn, code):
    msg = _capture_error(fn, W, {"x": X, "n": 4})
    assert msg.endswith(
        f"A traced value is used as a concrete Python value at {HERE}:{_line(fn, 1)}:\n"
        f"    {code}\nbatch['n'] (a Python int) " + INNER
    ), msg
    assert "Check that the function runs under jax.jit" not in msg


def test_string_inside_a_dict_says_make_it_an_array_or_close_over_it():
    msg = _capture_error(lambda w, b: b["x"] @ w, W, {"x": X, "mode": "train"})
    assert msg.endswith("\nb['mode'] (a Python str) " + INNER), msg
    assert "passed to the function at path b['mode']" in msg


def test_top_level_string_keeps_the_static_argnums_hint():
    msg = _capture_error(lambda x, mode: x * 2, X, "train")
    assert msg.endswith(
        "\nCheck that the function runs under jax.jit with these shapes; pass Python "
        "scalars/configs through static_argnums." + DOCS
    ), msg


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x)


def test_unbound_linen_module_says_pass_model_apply():
    msg = _capture_error(_Mlp(), X)
    assert msg.endswith(
        "\n_Mlp is an unbound flax.linen Module: pass `model.apply` as the function and the "
        "variables as its first argument, e.g. parallelize(model.apply, mesh=...)(variables, "
        "x), with variables = model.init(key, x)." + DOCS
    ), msg


# ---------------------------------------------------------------------------- did you mean


def test_did_you_mean_helper():
    assert did_you_mean("fsdb", ["dp", "fsdp"]) == " (did you mean 'fsdp'?)"
    assert did_you_mean("BF16", ["bf16", "fp16"]) == " (did you mean 'bf16'?)"
    assert did_you_mean("zzz", ["dp", "fsdp"]) == ""
    assert did_you_mean(3, ["dp"]) == ""


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"engine": "fsdb"},
            "unknown engine 'fsdb' (did you mean 'fsdp'?); choose one of: auto, ",
        ),
        (
            {"remat": "dot"},
            "remat='dot' (did you mean 'dots'?): choose None, 'auto' or one of "
            "('none', 'dots', 'selective', 'full')",
        ),
        (
            {"pipeline_schedule": "1F1B"},
            "pipeline_schedule='1F1B' (did you mean '1f1b'?): choose None (1F1B where the step "
            "allows it, else GPipe) or one of ('gpipe', '1f1b', '1f1b-async', 'zb-h1', "
            "'interleaved')",
        ),
        (
            {"precision": "bfloat_16"},
            "precision='bfloat_16' (did you mean 'bfloat16'?): choose None (as traced), 'bf16' "
            "or 'fp16'",
        ),
        (
            {"cluster": "h100"},
            "unknown cost profile 'h100' (did you mean 'h100-sxm'?); available: ",
        ),
    ],
    ids=["engine", "remat", "schedule", "precision", "cluster"],
)
def test_option_values_did_you_mean(kw, message):
    with pytest.raises(autopar.AutoparError) as e:
        autopar.parallelize(lambda x: x, mesh=MESH, **kw)
    assert str(e.value).startswith(message), str(e.value)


def test_mesh_axis_did_you_mean():
    def f(w, x):
        return jax.lax.with_sharding_constraint(x @ w, PartitionSpec("modle"))

    msg = _capture_error(f, W, X)
    assert msg.endswith(
        "\nA sharding constraint names the axis 'modle', which the mesh lacks (did you mean "
        "'model'?); the mesh's axes are ('data', 'model')." + DOCS
    ), msg
    step = autopar.parallelize(
        lambda w, x: x @ w, mesh=MESH, in_specs=(PartitionSpec(None, "modle"), None)
    )
    with pytest.raises(autopar.MeshError) as e:
        step.plan(W, X)
    assert (
        "names axes ['modle'] that the mesh {'data': 2, 'model': 4} does not have (did you "
        "mean 'model'?)" in str(e.value)
    )


# ---------------------------------------------------------------------------- grad accumulation


def _regression(w, batch):
    def loss(w):
        return ((batch["x"] @ w - batch["y"]) ** 2).mean() * batch["scale"]

    return w - 0.1 * jax.grad(loss)(w)


@pytest.mark.parametrize("scale", [jnp.float32(2.0), 2.0], ids=["array", "python"])
def test_grad_accumulation_blames_the_scalar_leaf(scale):
    batch = {"x": jnp.ones((32, 16)), "y": jnp.ones((32, 4)), "scale": scale}
    with pytest.raises(autopar.MicrobatchError) as e:
        autopar.parallelize(_regression, mesh={"data": 8}, grad_accumulation=4).plan(
            jnp.ones((16, 4)), batch
        )
    what = "float32[]" if hasattr(scale, "dtype") else "(a Python float)"
    assert str(e.value).startswith(
        f"_regression ({HERE}:{_regression.__code__.co_firstlineno}): grad_accumulation=4 cuts "
        "the batch (batch, the last argument but PRNG keys) along its leaves' leading dim, 32 for "
        "the others, "
        f"but batch['scale'] {what} has none; pass such values in another argument or close "
        "over them"
    ), str(e.value)


# ---------------------------------------------------------------------------- notes, warnings


def test_notes_print_as_notes_and_warnings_as_warnings():
    plan = autopar.parallelize(lambda w, x: x @ w, mesh=MESH).plan(W, X)
    note = "remat='auto' tried remat=none: 1 ms"
    warn = "unsupported primitive 'foo' at model.py:3 runs replicated"
    assert is_note(note) and not is_note(warn)
    # the interleaved tries a lock-step pipeline of unrolled layers also gets (unasked)
    assert is_note(
        "interleaved 1F1B, 2 virtual stages (the layers' leaves kept in chunk order), "
        "searched as it runs too: 0.1177 ms"
    )
    text = replace(plan, warnings=(note, warn)).summary()
    assert f"\n  note: {note}\n  warning: {warn}" in text


def test_pipeline_auto_without_a_layer_loop_says_why():
    def mlp(w, x):
        return jnp.tanh(x @ w).sum()

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        plan = autopar.parallelize(mlp, mesh=8, pipeline_stages="auto").plan(
            jnp.ones((64, 64)), jnp.ones((32, 64))
        )
    assert plan.pipeline is None
    why = (
        "pipeline_stages='auto' returned an unpipelined plan: {'stage': 2, 'model': 4}, "
        "{'stage': 4, 'model': 2}, {'stage': 8}: it has no loop over layers and no stack of "
        "repeated layers unrolled in Python was found (layers are told apart by their "
        "parameters' paths: `h_0`, `layers/3`, ...; a loop is flax.linen.scan, nnx.scan or "
        "jax.lax.scan over stacked weights)"
    )
    assert why in plan.warnings
    assert f"  warning: {why}" in plan.summary()
    assert any(str(w.message).endswith(why) for w in got), [str(w.message) for w in got]


# ---------------------------------------------------------------------------- offline plans


def _offline_budget(fn, args, mesh, **kw) -> float:
    """A memory budget under which the plan of `fn` on `mesh` peaks at 80% of it."""
    plan = autopar.parallelize(fn, mesh=mesh, **kw).plan(*args)
    return plan.cost.peak_memory_bytes / 0.8


def test_offline_plan_close_to_the_budget_warns():
    from autopar.examples import examples

    wl = examples.gpt(hidden=64, layers=2, heads=2, seq=32, vocab=128, batch=32, name="gpt_tiny")
    mesh = {"data": 32, "model": 8}  # 256 devices: planned on an abstract mesh
    kw = dict(static_argnums=wl.static_argnums, engine="dp")
    budget = _offline_budget(wl.fn, wl.args, mesh, **kw)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        plan = autopar.parallelize(wl.fn, mesh=mesh, memory_budget=budget, **kw).plan(*wl.args)
    (w,) = [w for w in plan.warnings if w.startswith("not compile-checked")]
    assert w.startswith(
        "not compile-checked: planned on a mesh with no devices here ({'data': 32, 'model': 8}, "
        "256 devices; this machine has 8), and its predicted peak "
    )
    assert " is 80% of the memory budget " in w
    assert w.endswith(
        "; XLA's own temporaries come on top of that. Check it with `autopar verify PLAN "
        "TARGET` (compiles the plan for the whole mesh on simulated CPU devices), or compile "
        "the same per-device shapes on a smaller mesh"
    )
    assert f"  warning: {w}" in plan.summary()
    assert any(str(x.message).endswith(w) for x in got)
    # far from the budget: no warning
    calm = autopar.parallelize(wl.fn, mesh=mesh, memory_budget=budget * 4, **kw).plan(*wl.args)
    assert not any(w.startswith("not compile-checked") for w in calm.warnings)


def test_offline_warning_in_the_cli(tmp_path):
    from autopar.examples import examples

    wl = examples.mlp_small()
    budget = _offline_budget(
        wl.fn, wl.args, {"data": 16, "model": 8}, static_argnums=wl.static_argnums, engine="dp"
    )
    out = ok(
        run_cli(
            "search",
            "autopar/examples/examples.py:mlp_small",
            "--mesh",
            "data=16,model=8",
            "--engine",
            "dp",
            "--memory-budget",
            str(int(budget)),
            "--out",
            str(tmp_path / "p.json"),
        )
    )
    assert "  warning: not compile-checked: planned on a mesh with no devices here" in out, out
    assert "`autopar verify PLAN TARGET`" in out


# ---------------------------------------------------------------------------- inspection


_USER_LINE = f"{HERE}:" + str(
    next(
        i
        for i, t in enumerate(Path(__file__).read_text().splitlines(), 1)
        if t.endswith("# the user's line explain looks up") and "return" in t
    )
)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(32)(x))  # the user's line explain looks up


class Layers(nn.Module):
    """Blocks named `0`..`3` (as transformers' Flax models name theirs): `layers/<i>`."""

    def setup(self):
        self.blocks = [Block(name=str(i)) for i in range(4)]

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Model(nn.Module):
    numbered: str = "list"  # "list": `layers_<i>` (a linen list); "dir": `layers/<i>`

    def setup(self):
        if self.numbered == "list":
            self.layers = [Block() for _ in range(4)]
        else:
            self.layers = Layers()

    def __call__(self, x):
        if self.numbered == "list":
            for layer in self.layers:
                x = layer(x)
            return x
        return self.layers(x)


class Top(nn.Module):
    numbered: str = "list"

    @nn.compact
    def __call__(self, x):
        return Model(self.numbered, name="model")(x)


def _loss_step(numbered: str):
    """A forward step over `Top(numbered)` and its arguments."""
    model = Top(numbered)
    x = jnp.ones((16, 32))
    variables = model.init(jax.random.key(0), x)

    def step(variables, x):  # forward only: every layer the same ops
        return (model.apply(variables, x) ** 2).mean()

    return step, variables, x


@pytest.fixture(scope="module", params=["list", "dir"])
def layered(request, tmp_path_factory):
    step, variables, x = _loss_step(request.param)
    plan = autopar.parallelize(step, mesh=MESH, engine="dp").plan(variables, x)
    path = tmp_path_factory.mktemp("plans") / f"{request.param}.json"
    plan.save(path)
    return request.param, plan, path


def test_layer_grouping_understands_every_numbering():
    assert insp.layer_of_path("variables/params/model/layers/3/Dense_0/kernel") == "layers/3"
    assert insp.layer_of_path("state/opt_state/1/0/mu/model/layers/12/q/kernel") == "layers/12"
    assert insp.layer_of_path("model/blocks/0/linear/kernel") == "blocks/0"  # NNX state
    assert insp.layer_of_path("params/h.3/attn/w") == "h.3"
    assert insp.layer_of_path("args/0/x") == "args"  # an argument's tuple index is not a layer
    assert insp.layer_of_op("jvp(Llama)/model/layers/3/self_attn/dot_general#0") == "layers/3"
    assert insp.layer_of_op("h.3/attn/dot_general#0") == "h.3"
    assert insp.layer_of_op("jvp(GPT)/wte.attend/dot_general#0") == "wte"


def test_inspect_by_layer_collapses_repeated_layers(layered):
    numbered, plan, path = layered
    name = {"list": "layers_", "dir": "layers/"}[numbered]
    layers = {r["layer"] for r in insp.inspect_summary(plan)["layers"]}
    assert {f"{name}{i}" for i in range(4)} <= layers, layers
    out = ok(run_cli("inspect", str(path), "--by", "layer"))
    rows = [
        ln.split()[:2]
        for ln in out.splitlines()
        if ln.startswith("  " + name) and "layers with the same" not in ln
    ]
    # the four identical layers: one row, and a note saying what agrees
    assert rows == [[f"{name}*", "×4"]], out
    assert f"  {name}* ×4: 4 layers with the same arrays, specs and strategies\n" in out, out


def test_ops_record_the_users_line_and_the_library_line(layered):
    _, plan, path = layered
    line = _USER_LINE
    dense = [o for o in plan.ops if o.op == "dot_general"]
    assert dense and all(o.source == line for o in dense), {o.source for o in dense}
    assert all(o.library_source.startswith("linear.py:") for o in dense)
    saved = json.loads(path.read_text())["ops"]
    assert any(o.get("library_source", "").startswith("linear.py:") for o in saved)
    assert autopar.Plan.load(path).ops == plan.ops


def test_explain_finds_the_op_by_the_users_line(layered):
    numbered, plan, path = layered
    line = _USER_LINE
    hits = insp.find_ops(plan, line)
    assert hits and all(plan.ops[i].source == line for i in hits)
    # every layer's forward and backward ops come from that one line: too many to explain
    # them all, so the command explains the costliest and names the others
    out = ok(run_cli("explain", str(path), line))
    top = max(hits, key=lambda i: (plan.ops[i].compute_s, -i))
    assert f"'{line}' matches {len(hits)} ops; explaining the costliest, {plan.ops[top].key}" in out
    assert f"\nop {plan.ops[top].key}\n" in out, out  # explained: the only op record
    # one op from that line, explained with the user's line and the library line under it
    key = next(plan.ops[i].key for i in hits if plan.ops[i].op == "dot_general")
    out = ok(run_cli("explain", str(path), key))
    assert f"  source    {line} (through linear.py:" in out, out
    text = "\n".join(
        insp.explain_op(
            plan,
            plan.ops.index(next(o for o in plan.ops if o.key == key)),
            [str(Path(__file__).parent)],
        )
    )
    assert "return nn.relu(nn.Dense(32)(x))  # the user's line explain looks up" in text, text


def test_collapsed_layers_list_the_ones_that_differ():
    from autopar.tools.inspect.report import collapse_layers

    row = ["2", "1", "4.0 KiB", "1.0 KiB", "9", "5 ns", "RS = RR x RS (2 of 2)"]
    odd = ["2", "0", "4.0 KiB", "4.0 KiB", "9", "5 ns", "RR = RR x RR (2 of 2)"]
    rows = [[f"h.{i}", *(odd if i == 2 else row)] for i in range(5)] + [["wte", *row]]
    sigs = {f"h.{i}": ("same",) for i in range(5)}
    out, notes = collapse_layers(rows, sigs)
    assert [r[0] for r in out] == ["h.* ×4", "h.2", "wte"]
    assert notes == [
        "h.* ×4: 4 layers with the same arrays, specs and strategies; except h.2 (listed)"
    ]
    # a member whose shown columns are the others' but whose signature differs: said so
    sigs["h.3"] = ("other",)
    out, notes = collapse_layers(rows, sigs)
    assert [r[0] for r in out] == ["h.* ×3", "h.2", "h.3", "wte"]
    assert "h.3 differs in the specs or strategies of some arrays or ops" in notes[0], notes
    assert "h.2 differs" not in notes[0]


def _bad_loss(w, x):
    h = x @ w
    return jnp.mean(h - x)  # (16, 32) - (16, 64): no broadcast


def test_a_failed_trace_names_the_users_line():
    """The error names the line of the user's code that raised, not only the step (it
    was in the chained traceback alone)."""
    msg = _capture_error(lambda w, x: jax.grad(_bad_loss)(w, x), W, X)
    assert (
        "\n  raised at test_messages.py:" in msg and " in _bad_loss: return jnp.mean(h - x)" in msg
    ), msg


def _tanh_layer(x, w):
    return jnp.tanh(x @ w)


def test_a_mesh_nothing_divides_warns():
    """On `{"data": 3}` a step whose dims (5, 7, 11) none divides by 3 runs whole on every
    device: correct, but a `UserWarning` says so (and what to change), and the plan
    records it; where a dim divides (6), nothing is said."""
    x = jnp.cos(jnp.arange(35.0)).reshape(5, 7)
    w = jnp.sin(jnp.arange(77.0)).reshape(7, 11)
    f = autopar.parallelize(_tanh_layer, mesh={"data": 3})
    with pytest.warns(
        UserWarning, match=r"nothing in _tanh_layer \(.*\) can be split on the mesh data=3"
    ):
        plan = f.plan(x, w)
    assert any(n.startswith("nothing in _tanh_layer") for n in plan.warnings)
    assert jnp.allclose(f(x, w), _tanh_layer(x, w), atol=1e-6)
    x6 = jnp.cos(jnp.arange(42.0)).reshape(6, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.parallelize(_tanh_layer, mesh={"data": 3}).plan(x6, w)
    assert not [c for c in caught if "can be split" in str(c.message)]


def test_pipeline_auto_says_why_per_micro_batch_count_apart():
    failure = (
        "{'stage': 2, 'model': 4}: no micro-batch count works:\n"
        "  2 micro-batches: the step is odd\n  4 micro-batches: the step is odder"
    )
    assert no_pipeline_why([failure]).endswith(
        "{'stage': 2, 'model': 4}: no micro-batch count works: 2 micro-batches: the step is "
        "odd; 4 micro-batches: the step is odder"
    )


def test_a_reason_that_lists_plans_keeps_its_list_in_the_tried_notes():
    """`remat="auto"` notes why each policy gave no plan; a reason whose first line
    introduces a list (the plans rejected once compiled) used to end at "by XLA:"."""
    from autopar.compile.pipelines import Infeasible
    from autopar.errors import MemoryBudgetError

    why = (
        "every plan the cost model fit into 40.1 MiB needs more once compiled by XLA:\n"
        "  data: compiled 40.6 MiB\n  dp: compiled 41.2 MiB\n"
        "Raise memory_budget, use more devices, or shrink the batch."
    )
    brief = Infeasible(MemoryBudgetError(why)).brief
    assert brief.endswith("by XLA: data: compiled 40.6 MiB; dp: compiled 41.2 MiB"), brief
    assert Infeasible(MemoryBudgetError("no plan fits\nTry more devices")).brief == "no plan fits"


def test_a_chosen_plan_priced_again_says_its_own_price():
    """A plan whose layouts were priced again under another schedule (`pipeline_stages=
    "auto"` re-prices lock-step 1F1B's plans under ZB-H1) costs other than its engine's
    candidate entry: the summary and `inspect` say its own price beside the mark (a
    trial read "dp 34.3 ms <- chosen" on a 33.4 ms plan)."""
    import dataclasses

    from autopar.tools.inspect.report import render_inspect

    step, variables, x = _loss_step("list")
    plan = autopar.parallelize(step, mesh=MESH, engine="dp").plan(variables, x)
    assert "as it runs" not in plan.summary() and "as it runs" not in render_inspect(plan)
    cheaper = dataclasses.replace(plan.cost, compute_s=plan.cost.compute_s * 0.5)
    again = dataclasses.replace(plan, cost=cheaper)
    assert f"dp's plan as it runs: {cheaper.step_s * 1e3:.3f} ms" in again.summary()
    assert "<- chosen (" in render_inspect(again) and "as it runs)" in render_inspect(again)


def test_an_ilp_stopped_at_its_time_limit_warns(monkeypatch):
    """engine='ilp' that runs out of time returns HiGHS's best so far, which may be far
    from the best plan (3.9x `auto`'s on a new user's Whisper-style step): it warns,
    where only the summary's search line said "not proven optimal"."""
    import autopar.search as search

    monkeypatch.setattr(search, "ILP_TIME_LIMIT_S", 1e-4)

    def f(w1, w2, x):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum()

    args = (jnp.ones((64, 128)), jnp.ones((128, 64)), jnp.ones((32, 64)))
    with pytest.warns(UserWarning, match="engine='ilp' stopped at its time limit"):
        plan = autopar.parallelize(f, mesh=MESH, engine="ilp").plan(*args)
    assert plan.search_info["ilp"]["optimal"] is False


def test_a_weakly_typed_argument_that_turns_strong_says_why_it_plans_again():
    """A parameter made without a dtype (`jnp.full(shape, 0.1)`) is weakly typed; the
    optimizer's update returns it strong, so the next call plans and compiles again
    (jax.jit traces it apart too), which took a trial 13-16 s a step, silently: it
    says so now, naming the leaf and the fix."""

    def step(params, x):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"]) * p["scale"]))(params)
        return jax.tree.map(lambda p, d: (p - 0.1 * d).astype(jnp.float32), params, g)

    par = autopar.parallelize(step, mesh=MESH, progress=False)
    params = {"w": jnp.ones((16, 16), jnp.float32), "scale": jnp.full((16,), 0.1)}
    x = jnp.ones((8, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = par(params, x)  # the first plan: nothing to say
    with pytest.warns(UserWarning, match=r"planning and compiling again: .*\['scale'\].*dtype"):
        par(params, x)


def _sgd_tanh(w, x):
    def loss(w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    value, grad = jax.value_and_grad(loss)(w)
    return value, w - 0.1 * grad


def test_a_mesh_axis_the_plan_leaves_idle_is_named():
    """Every dim here is 2 mod 4: the data axis (2) splits something, the model axis
    (4) nothing, so its 4 devices repeat each other's work; the plan says so (a DLRM-style
    step on data 32 x model 8 left data idle, and only `inspect` showed it). On a mesh of
    one axis there is nothing to say."""
    args = (
        jax.ShapeDtypeStruct((1022, 1022), jnp.float32),
        jax.ShapeDtypeStruct((2046, 1022), jnp.float32),
    )
    two = autopar.parallelize(
        _sgd_tanh, mesh={"data": 2, "model": 4}, cluster="a100-80g", progress=False
    )
    with pytest.warns(UserWarning, match=r"splits nothing over mesh axis 'model' \(4 devices\)"):
        plan = two.plan(*args)
    assert any("'model' (4 devices)" in w for w in plan.warnings)
    assert not any("'data'" in w and "splits nothing" in w for w in plan.warnings)
    one = autopar.parallelize(_sgd_tanh, mesh={"data": 2}, cluster="a100-80g", progress=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plan = one.plan(*args)
    assert plan.inputs[0].spec.used_axes or plan.inputs[1].spec.used_axes  # data is used
    assert not [w for w in said if "splits nothing over" in str(w.message)]
