"""The plan's memory walk (`autopar.search.memory`) against its definition, op by op.

The walk runs on flat arrays (spec ids gathered per plan, sums scattered in order); this
file keeps the op-by-op definition it replaced and checks that both give the same bytes
on the problems a pipelined search builds (1F1B regions, resident fractions, pipeline
buffers, partial sums) and on a plain one, for the engines' plans and random ones."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import autopar
from autopar.cost.model import FUSED_OPS
from autopar.examples.models import gpt


def _reference_peak(problem, choice, settled, targets) -> tuple[int, int]:
    """`memory.peak_memory` as its docstring defines it, one op after the other."""
    g, n_in = problem.graph, problem.num_inputs
    nodes, values, strategies = g.nodes, g.values, problem.strategies
    strat = [strategies[n_in + n.id][choice[n_in + n.id]] for n in nodes]
    args = int(sum(problem.node_mem[i][choice[i]] for i in range(n_in)))
    made = {
        v: settled.get(v, sp) if sp.partial else sp
        for n, s in zip(nodes, strat)
        for v, sp in zip(n.outputs, s.out_specs)
    }
    stored = {v: strategies[i][choice[i]].out_specs[0] for i, v in enumerate(g.inputs)}
    stored.update(made)
    returned = set(g.outputs)
    virtual = set()  # made by a fused op for one fused op to read, in the layout made
    for n in nodes:
        for v in n.outputs:
            readers = g.consumers.get(v, ())
            if (
                n.op in FUSED_OPS
                and v not in returned
                and len(readers) == 1
                and nodes[readers[0]].op in FUSED_OPS
            ):
                c = readers[0]
                js = [j for j, x in enumerate(nodes[c].inputs) if x == v]
                if all(strat[c].in_specs[j] == made[v] for j in js):
                    virtual.add(v)
    start, end = list(range(len(nodes))), list(range(len(nodes)))
    for region in problem.regions:
        for i in region:
            start[i], end[i] = min(region), max(region)
    roots, last_use = {}, {}
    for node, s in zip(nodes, strat):
        for x, want in zip(node.inputs, s.in_specs):
            held = stored.get(x)
            at = start[node.id] if held is not None and want != held else end[node.id]
            for r in roots[x] if x in virtual else (x,):
                last_use[r] = max(last_use.get(r, -1), at)
        for v in node.outputs:
            if v in virtual:
                roots[v] = {r for x in node.inputs for r in (roots[x] if x in virtual else (x,))}
    for x in g.outputs:
        last_use[x] = len(nodes)
    made_at, free_at = [0.0] * (len(nodes) + 1), [0.0] * (len(nodes) + 1)
    copied = set()
    size = problem.cost.local_bytes
    for node, s in zip(nodes, strat):
        at, hi = start[node.id], end[node.id]
        for x, want in zip(node.inputs, s.in_specs):
            held = stored.get(x)
            if held is None or want == held or (at, x, want) in copied:
                continue
            copied.add((at, x, want))
            b = size(values[x], want) * problem.resident.get(x, 1.0)
            made_at[at] += b
            free_at[hi] += b
        for v in node.outputs:
            if v not in virtual:
                b = size(values[v], stored[v]) * problem.resident.get(v, 1.0)
                made_at[at] += b
                free_at[max(last_use.get(v, node.id), hi)] += b
    for x, t in zip(g.outputs, targets):  # returned in another layout: a copy at the end
        if x in stored and stored[x] != t and values[x].rank:
            made_at[len(nodes) - 1] += size(values[x], t)
    for i, buffer in problem.buffers.items():
        made_at[start[i]] += float(buffer[choice[n_in + i]])
        free_at[end[i]] += float(buffer[choice[n_in + i]])
    live = np.cumsum(made_at) - np.concatenate(([0.0], np.cumsum(free_at)[:-1]))
    return int(args + max(0.0, float(live[: len(nodes)].max(initial=0.0)))), args


@pytest.mark.slow
def test_memory_walk_equals_the_op_by_op_walk(monkeypatch):
    import autopar.compile.driver as driver
    from autopar.search import memory
    from autopar.search.evaluate import settle

    cfg = gpt.GPTConfig(hidden=64, heads=4, seq=32, vocab=256, layers=4, batch_size=8)
    ts = gpt.make_train_step(cfg)
    args = (jax.eval_shape(ts.init, 0), jax.eval_shape(ts.batch, 0))
    real, seen = driver._searched, []

    def keep(problem, *a, **k):
        got = real(problem, *a, **k)
        plans = [] if isinstance(got, driver.Infeasible) else [c for _, c, _ in got.ranked]
        seen.append((problem, plans))
        return got

    monkeypatch.setattr(driver, "_searched", keep)
    monkeypatch.setenv("AUTOPAR_WORKERS", "1")  # every search in this process
    mesh = {"stage": 2, "data": 2, "model": 2}
    for schedule in ("1f1b", "zb-h1"):  # ZB-H1: a ring of boundary values as buffers
        autopar.parallelize(
            ts.step, mesh=mesh, cluster="cpu", pipeline_stages=2, pipeline_schedule=schedule
        ).plan(*args)
    autopar.parallelize(ts.step, mesh={"data": 2, "model": 4}, cluster="cpu").plan(*args)
    assert any(p.regions and p.resident for p, _ in seen) and any(p.buffers for p, _ in seen)
    rng = np.random.default_rng(0)
    compared = partial = copies = 0
    for problem, plans in seen:
        rand = [[int(rng.integers(len(t))) for t in problem.strategies] for _ in range(4)]
        for choice in [*map(list, plans), *rand]:
            targets, settled = settle(problem, choice)
            partial += bool(settled)
            want = _reference_peak(problem, choice, settled, targets)
            assert memory.peak_memory(problem, choice, settled, targets) == want
            copies += want[0] > _reference_peak(problem, choice, settled, ())[0]
            compared += 1
    assert compared >= 20 and partial and copies  # some plans return a reshaped copy


def _plain_gpt_step(layers: int, d: int, vocab: int, seq: int, heads: int = 4):
    """A GPT written in plain JAX as a trial user wrote it (unrolled layers, AdamW)."""
    import jax.numpy as jnp
    import optax

    def ln(x, p):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * p["g"] + p["b"]

    def forward(p, tok):
        b, t = tok.shape
        x = p["wte"][tok] + p["wpe"][:t]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for lay in p["layers"]:
            q, k, v = jnp.split(ln(x, lay["ln1"]) @ lay["qkv"], 3, axis=-1)
            q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
            s = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q, k), -1e9)
            a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
            x = x + a @ lay["proj"]
            x = x + jax.nn.gelu(ln(x, lay["ln2"]) @ lay["fc1"]) @ lay["fc2"]
        return ln(x, p["lnf"]) @ p["wte"].T

    tx = optax.adamw(1e-3)

    def step(params, opt_state, tok, tgt):
        loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            forward(p, tok), tgt
        ).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    norm = {"g": f32(d), "b": f32(d)}
    layer = {"ln1": norm, "ln2": norm, "qkv": f32(d, 3 * d), "proj": f32(d, d)}
    layer |= {"fc1": f32(d, 4 * d), "fc2": f32(4 * d, d)}
    params = {"wte": f32(vocab, d), "wpe": f32(seq, d), "lnf": norm, "layers": [layer] * layers}
    return step, params, jax.eval_shape(tx.init, params)


def test_the_outputs_returned_in_another_layout_than_made_are_counted():
    """With `remat="full"` on data 8 the plan updates the parameters split and returns
    them in their arguments' layout: the returned copies were left out of the peak
    (262 MiB predicted where the arguments and the returned outputs alone take 340; a
    trial's 8-layer step: 704 against 1061, and XLA compiled 1157). Nothing is donated,
    so the peak holds both; donated, the copies go into the arguments' buffers."""
    import jax.numpy as jnp

    step, params, opt = _plain_gpt_step(layers=2, d=1024, vocab=8192, seq=256)
    tok = jax.ShapeDtypeStruct((16, 256), jnp.int32)
    args = (params, opt, tok, tok)
    plan = autopar.parallelize(step, mesh={"data": 8}, cluster="a100-80g", remat="full").plan(*args)

    def per_device(shardings, values) -> int:
        pairs = zip(jax.tree.leaves(shardings), jax.tree.leaves(values))
        return sum(int(np.prod(s.shard_shape(v.shape))) * v.dtype.itemsize for s, v in pairs)

    returned = per_device(plan.in_shardings, args) + per_device(
        plan.out_shardings, jax.eval_shape(step, *args)
    )
    assert plan.cost.peak_memory_bytes >= returned, (plan.cost.peak_memory_bytes, returned)
    # the state donated, as a training loop passes it: the updated state is written into
    # the arguments' buffers, no copies of its own
    donated = autopar.parallelize(
        step, mesh={"data": 8}, cluster="a100-80g", remat="full", donate_argnums=(0, 1)
    ).plan(*args)
    assert donated.cost.peak_memory_bytes < returned <= plan.cost.peak_memory_bytes


def test_arguments_returned_as_they_came_are_copied_unless_donated():
    """A LoRA step returns its frozen weights unchanged (NNX writes every leaf back):
    XLA copies each into an output buffer of its own unless it is donated. The copies
    were left out, and the peak predicted 1.7x below XLA's on a new user's NNX LoRA
    step; now the prediction holds them, and donated they go away."""
    import jax.numpy as jnp

    from autopar.compile.lowering import compiled_memory

    def step(frozen, lora, x):
        loss = lambda a: jnp.sum(jnp.tanh(x @ frozen + x @ a[0] @ a[1]))  # noqa: E731
        g = jax.grad(loss)(lora)
        return frozen, jax.tree.map(lambda p, d: p - 0.1 * d, lora, g)

    frozen = jnp.ones((512, 512)) * 0.01
    lora = (jnp.full((512, 4), 0.01), jnp.full((4, 512), 0.01))
    x = jnp.ones((64, 512))
    par = autopar.parallelize(step, mesh={"data": 8})
    plan = par.plan(frozen, lora, x)
    compiled = compiled_memory(par.lower(frozen, lora, x).compile())
    assert plan.cost.peak_memory_bytes >= 0.8 * compiled, (plan.cost.peak_memory_bytes, compiled)
    donated = autopar.parallelize(step, mesh={"data": 8}, donate_argnums=(0, 1)).plan(
        frozen, lora, x
    )
    frozen_bytes = 512 * 512 * 4
    assert donated.cost.peak_memory_bytes <= plan.cost.peak_memory_bytes - frozen_bytes // 2
