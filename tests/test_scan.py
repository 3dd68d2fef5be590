"""Layers under `scan`: the body is captured as a graph, searched once, recorded in the
plan file and lowered as a `lax.scan` over the body's own plan."""

from __future__ import annotations

import json
from dataclasses import replace

import jax
from helpers import assert_trees_close
from test_cli import SCHEMA, check_schema

import autopar
from autopar.examples.models import gpt
from autopar.ir.capture import capture

MESH = {"data": 2, "model": 4}


def _gpt(layers: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(hidden=64, heads=4, seq=32, vocab=256, layers=layers, scan_layers=True)


def test_graph_size_does_not_grow_with_depth():
    sizes = []
    for layers in (2, 6):
        ts = gpt.make_train_step(_gpt(layers))
        g = capture(ts.step, gpt.abstract_args(_gpt(layers)))
        bodies = [n.body for n in g.nodes if n.op == "scan"]
        assert len(bodies) == 2  # forward and backward layer
        sizes.append((len(g.nodes), [len(b.nodes) for b in bodies]))
    assert sizes[0] == sizes[1]


def test_scan_plan_file_round_trips_and_runs(tmp_path):
    cfg = _gpt(3)
    ts = gpt.make_train_step(cfg)
    state, batch = jax.jit(ts.init)(0), ts.batch(0)
    step = autopar.parallelize(ts.step, mesh=MESH)
    plan = step.plan(state, batch)
    scans = [o for o in plan.ops if o.op == "scan"]
    assert len(scans) == 2 and all(o.body is not None and o.body.ops for o in scans)
    assert "body searched once" in str(plan)

    path = tmp_path / "plan.json"
    plan.save(path)
    assert check_schema(json.loads(path.read_text()), SCHEMA) == []
    loaded = autopar.Plan.load(path)
    assert loaded.to_json() == plan.to_json()
    replay = autopar.parallelize(ts.step, mesh=MESH, plan=loaded)
    assert_trees_close(replay(state, batch), step(state, batch), rtol=0, atol=0)
    assert_trees_close(step(state, batch)[1], jax.jit(ts.step)(state, batch)[1])


def test_a_loops_collectives_count_as_communication(monkeypatch):
    """A scanned loop's price is its body's step times its length; the collectives in
    that body are communication (`Problem.loop_comm`), in the plan's `comm_s` and its
    bytes by kind and axes, every step of the loop counted, not part of `compute_s`. At
    hidden 256: at 64 the whole step on every device is the cheapest plan, and `dp`
    returns it (no collective anywhere)."""
    import autopar.compile.driver as driver
    from autopar.search.evaluate import edge_collectives

    made = []
    real = driver.make_plan
    monkeypatch.setattr(driver, "make_plan", lambda p, r, *a: made.append((p, r)) or real(p, r, *a))
    cfg = replace(_gpt(3), hidden=256)
    ts = gpt.make_train_step(cfg)
    plan = autopar.parallelize(ts.step, mesh=MESH).plan(*gpt.abstract_args(cfg))
    problem, result = made[-1]
    n_in, choice = problem.num_inputs, result.choice
    loops = {i: problem.loop_comm[i][choice[n_in + i]] for i in problem.loop_comm}
    assert len(loops) == 2 and any(seconds > 0 for seconds, _ in loops.values())
    for i, (seconds, sent) in loops.items():
        body = problem.bodies[i][1][choice[n_in + i]].cost
        assert seconds == 3 * body.comm_s
        assert sent == {k: 3 * b for k, b in body.comm_bytes.items()}
    outside = edge_collectives(problem, choice)
    outer = {}
    for _, _, c in outside:
        key = f"{c.kind}@{','.join(sorted(c.axes, key=problem.mesh.axis_names.index))}"
        outer[key] = outer.get(key, 0) + c.bytes
    for key in {k for _, sent in loops.values() for k in sent} | set(outer):
        want = outer.get(key, 0) + sum(int(sent.get(key, 0)) for _, sent in loops.values())
        assert plan.cost.comm_bytes.get(key, 0) == want, key
    assert plan.cost.comm_s >= sum(seconds for seconds, _ in loops.values())
