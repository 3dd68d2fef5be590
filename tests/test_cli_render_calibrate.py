"""`autopar render` and `autopar calibrate` through the real entry point (`python -m
autopar ...` in a subprocess), on a small searched plan; plus the layer grouping behind
the picture on a synthetic 96-layer plan."""

from __future__ import annotations

import copy
import html
import json
import math
import tomllib
from pathlib import Path

import pytest
from helpers import bad_input, ok, run_cli

import cost_models
from autopar.plan.plan import Plan
from autopar.tools import render

ROOT = Path(__file__).resolve().parents[1]
GPT = "autopar/examples/examples.py:gpt_small"


def run(*args: str, **kw):
    return run_cli(*args, **kw)


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory) -> Path:
    # fsdp: parameters sharded over both axes, so the picture has tiles to draw
    path = tmp_path_factory.mktemp("plans") / "gpt_small.plan.json"
    ok(run("search", GPT, "--mesh", "data=2,model=4", "--engine", "fsdp", "--out", str(path)))
    return path


def in_process(capsys, *args: str) -> str:
    """Bad input through `autopar.cli.main` in this process: exit 2, one line, no traceback."""
    from autopar import cli

    assert cli.main(list(args)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


# ---------------------------------------------------------------------------- render


def test_render_png_and_svg(small_plan, tmp_path):
    plan = tmp_path / "copy.json"
    plan.write_text(small_plan.read_text())
    out = ok(run("render", str(plan)))  # default: the plan's name with .png
    png = tmp_path / "copy.png"
    assert str(png) in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a real picture, not an empty canvas

    svg = tmp_path / "plan.svg"
    ok(run("render", str(small_plan), "-o", str(svg), "--top", "4"))
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert len(text) > 20_000
    assert text.count("<path") > 50  # boxes, tiles and glyphs


def test_render_bad_input(small_plan, tmp_path, capsys):
    bad_input(run("render", str(tmp_path / "missing.json")), "autopar render", "does not exist")
    broken = tmp_path / "broken.json"
    broken.write_text(small_plan.read_text()[:500])
    assert "not valid JSON" in in_process(capsys, "render", str(broken))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something/9"}))
    assert "autopar.plan/1" in in_process(capsys, "render", str(other))
    line = in_process(capsys, "render", str(small_plan), "--out", str(tmp_path / "x.jpg"))
    assert ".png, .svg" in line
    line = in_process(capsys, "render", str(small_plan), "-o", str(tmp_path / "no" / "x.png"))
    assert "does not exist" in line
    assert "--top" in in_process(capsys, "render", str(small_plan), "--top", "many")


# ---------------------------------------------------------------------------- calibrate


def test_calibrate_writes_a_loadable_profile_that_search_uses(tmp_path):
    prof = tmp_path / "local.toml"
    out = ok(run("calibrate", "--out", str(prof), "--quick", "--mesh", "data=2,model=4"))
    assert "written to" in out
    p = cost_models.load(str(prof))
    assert p.name.startswith("calibrated-cpu")
    assert p.flops_for("float32") > 0 and p.flops_for("bfloat16") > 0
    assert p.hbm_bandwidth > 0 and p.hbm_bytes > 0
    assert p.intra_bandwidth > 0 and p.intra_latency > 0
    assert p.devices_per_node == 8
    assert (
        p.compute_efficiency
        == p.hbm_efficiency
        == p.intra_link_efficiency
        == p.inter_link_efficiency
        == 1.0
    )
    assert "efficiency is 1.0" in p.description
    # the same tables and keys as a bundled profile
    mine = tomllib.loads(prof.read_text())
    ref = tomllib.loads((ROOT / "cost_models" / "h100-sxm.toml").read_text())
    assert set(mine) == set(ref)
    for table in ("memory", "network", "efficiency"):
        assert set(mine[table]) == set(ref[table]), table
    assert {"float32", "bfloat16"} <= set(mine["peak_flops_tflops"])

    plan = tmp_path / "plan.json"
    args = ["--mesh", "data=2,model=4", "--cluster", str(prof), "--engine", "data"]
    ok(run("search", GPT, *args, "--out", str(plan)))
    assert json.loads(plan.read_text())["cluster"]["name"] == p.name


def test_calibrate_bad_input(tmp_path, capsys):
    bad_input(run("calibrate", "--out", str(tmp_path / "p.txt")), "autopar calibrate", ".toml")
    line = in_process(capsys, "calibrate", "--out", str(tmp_path / "no" / "p.toml"))
    assert "does not exist" in line
    line = in_process(capsys, "calibrate", "--out", str(tmp_path / "p.toml"), "--mesh", "data=0")
    assert "mesh" in line
    assert "--out" in in_process(capsys, "calibrate")


def test_fit_alpha_beta_recovers_a_line():
    from autopar.cost.calibrate import fit_alpha_beta

    alpha, beta = 20e-6, 5e9
    xs = [1e3, 1e5, 1e6, 1e7, 1e8]
    fit = fit_alpha_beta([(x, alpha + x / beta) for x in xs])
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)


# ---------------------------------------------------------------------------- layer groups


def _many_layers(plan_json: dict, n: int, perturb=()) -> Plan:
    """A copy of the gpt_small plan with h_1 repeated as h_1..h_{n-1}; layers in
    `perturb` get one contraction's strategy changed."""
    d = copy.deepcopy(plan_json)

    def clone(records, field, make):
        out = []
        for r in records:
            if "/h_1/" in r[field]:
                for k in range(1, n):
                    out.append(make(r, k))
            else:
                out.append(r)
        return out

    def rename(r, k, field):
        r = dict(r)
        r[field] = r[field].replace("/h_1/", f"/h_{k}/")
        return r

    d["inputs"] = clone(d["inputs"], "path", lambda r, k: rename(r, k, "path"))
    ops = clone(d["ops"], "key", lambda r, k: rename(r, k, "key"))
    for k in perturb:
        for o in ops:
            if f"/h_{k}/" in o["key"] and o["op"] == "dot_general":
                o["strategy"] += " (changed)"
                break
    d["ops"] = ops
    return Plan.from_json(d)


def test_identical_layers_are_drawn_once(small_plan, tmp_path):
    d = json.loads(small_plan.read_text())
    plan = _many_layers(d, 96)
    groups = render.layer_groups(plan)
    labels = [g.label for g in groups]
    h = [g for g in groups if g.names[0].startswith("h_")]
    # h_0 may differ from h_1 (the first block sees the embeddings), the rest are one box
    assert h[-1].label.startswith("h_") and h[-1].names[-1] == "h_95", labels
    assert sum(len(g.names) for g in h) == 96
    assert len(h) <= 2 and "identical" in h[-1].label, labels
    assert len(groups) < 12
    params = render.param_groups(plan, 8)
    assert any(p.count >= 95 and "h_*" in p.name for p in params)

    # Layers that differ (a strategy changed in every other one) stay separate unless there
    # would be too many boxes; then consecutive layers with the same colours merge.
    mixed = _many_layers(d, 96, perturb=range(3, 96, 2))
    groups = render.layer_groups(mixed)
    assert len(groups) <= render.MAX_BOXES
    assert any("similar" in g.label for g in groups), [g.label for g in groups]
    assert sum(len(g.names) for g in groups if g.names[0].startswith("h_")) == 96
    out = render.render_plan(mixed, tmp_path / "mixed.png")
    assert out.stat().st_size > 20_000


def test_calibrate_recovers_known_synthetic_timings(tmp_path, monkeypatch):
    """`calibrate` on synthetic measurements (collectives that take exactly
    alpha + bus factor x bytes / beta, known matmul and memory rates) writes a profile
    with those figures, and the cost model then prices every measured collective at
    the time it was measured."""
    import jax
    from jax.sharding import AbstractMesh

    from autopar.cost import calibrate as cal
    from autopar.cost.model import BUS_FACTOR, CostModel
    from autopar.sharding import mesh_info

    alpha, beta = 30e-6, 12e9  # s, bytes/s
    peaks = {"float32": 2.5e12, "bfloat16": 7.5e12}
    hbm_bw = 80e9
    measured = []

    def collective(kind, mesh, axis, nbytes, reps):
        t = alpha + BUS_FACTOR[kind](mesh.shape[axis]) * nbytes / beta
        measured.append((kind, axis, nbytes, t))
        return nbytes, t

    monkeypatch.setattr(cal, "matmul_flops", lambda dev, dt, s, log=None: (peaks[dt], 1024))
    monkeypatch.setattr(cal, "memory_bandwidth", lambda dev, s, log=None: hbm_bw)
    monkeypatch.setattr(cal, "measure_collective", collective)
    mesh = {"data": 2, "model": 4}
    p = cal.calibrate(str(tmp_path / "synthetic.toml"), mesh=mesh, quick=True, log=None)
    assert len(measured) >= 2 * 4 * 2  # two axes, four kinds, several sizes
    # written at 4 significant digits
    assert p.intra_latency == pytest.approx(alpha, rel=1e-3)
    assert p.intra_bandwidth == pytest.approx(beta, rel=1e-3)
    assert p.inter_latency == pytest.approx(alpha, rel=1e-3)  # one host: copied
    assert p.inter_bandwidth == pytest.approx(beta, rel=1e-3)
    assert p.flops_for("float32") == pytest.approx(peaks["float32"], rel=1e-3)
    assert p.flops_for("bfloat16") == pytest.approx(peaks["bfloat16"], rel=1e-3)
    assert p.hbm_bandwidth == pytest.approx(hbm_bw, rel=1e-3)
    info = mesh_info(AbstractMesh(tuple(mesh.values()), tuple(mesh)), p.devices_per_node)
    cm = CostModel(p, info)
    for kind, axis, nbytes, t in measured:
        # link time: the calibration's all-to-all splits and concatenates the major dim,
        # which needs none of the HBM copies the model adds for other dims
        link = cm.collective(kind, (axis,), nbytes, copies=False).seconds
        assert link == pytest.approx(t, rel=2e-3), (
            kind,
            axis,
            nbytes,
        )
    assert jax.device_count() == 8  # the mesh ran on the simulated devices


def test_render_draws_the_layout_boxes_and_labels(small_plan, tmp_path):
    """The layout of the fsdp gpt_small plan (`layer_groups`, `param_groups`) has one box
    per layer in program order and the largest parameters split over both mesh axes;
    the rendered picture carries every box's label, every parameter's name and spec,
    and one tile label per shard (SVG with text kept as text)."""
    import re

    import matplotlib

    plan = Plan.from_json(json.loads(small_plan.read_text()))
    groups = render.layer_groups(plan)
    labels = [g.label for g in groups]
    # the batch first, then the layers in program order; the two blocks are identical
    # (the same strategies and specs) and drawn as one box
    assert labels[0] == "batch", labels
    hs = [g for g in groups if g.names[0].startswith("h_")]
    assert [n for g in hs for n in g.names] == ["h_0", "h_1"], labels
    for g in hs:  # one box per block, or one for both when they are identical
        assert g.label == (g.names[0] if len(g.names) == 1 else "h_0..h_1 (2 identical)")
    h = hs[-1]
    assert labels.index("wte") < labels.index(hs[0].label), labels
    assert labels.index(h.label) < labels.index("ln_f"), labels
    assert h.split == "data,model", h.split  # fsdp: parameters over both axes
    assert h.param_local_bytes * 8 == h.param_bytes
    params = render.param_groups(plan, 4)
    assert len(params) == 4
    sizes = [math.prod(p.record.shape) for p in params]
    assert sizes == sorted(sizes, reverse=True)
    # the two blocks' same-shaped, same-spec kernels are one group of two
    assert (params[0].name, params[0].count) == ("h_*/mlp/c_fc/kernel", 2), params[0]
    assert all(p.record.spec.shards(plan.mesh) == 8 for p in params), [
        str(p.record.spec) for p in params
    ]

    out = tmp_path / "plan.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        render.render_plan(plan, out, top=4)
    svg = out.read_text()
    texts = [
        html.unescape(t)
        for t in re.findall(r"<text[^>]*>(.*?)</text>", svg, re.S)
        for t in [re.sub(r"<[^>]+>", "", t)]
    ]
    body = "\n".join(texts)
    for g in groups:
        assert g.label in texts, (g.label, texts[:20])
    for p in params:
        assert any(t.startswith(p.name) for t in texts), p.name
        assert f"spec {p.record.spec}" in body
    # tiles: a parameter split 8 ways over (data, model) has its 8 shards labelled
    # with their mesh coordinates, data major
    coords = {t for t in texts if re.fullmatch(r"data \d,model \d", t)}
    assert coords == {f"data {i},model {j}" for i in range(2) for j in range(4)}, coords


def test_tile_labels_of_a_narrow_parameter_do_not_overlap(small_plan):
    """A parameter of few rows split 8 ways along them: its tiles are thinner than a
    label, so every n-th is labelled (and the last), none over another."""
    import dataclasses
    import re

    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    from autopar.sharding import Spec
    from autopar.tools.render import draw

    plan = Plan.from_json(json.loads(small_plan.read_text()))
    r = dataclasses.replace(
        plan.inputs[0], shape=(16, 100000), spec=Spec(((("data", "model")), ()))
    )
    plan = dataclasses.replace(plan, inputs=(r,))
    (pg,) = render.param_groups(plan, 1)
    fig = Figure(figsize=(3.3, 2.9))
    ax = fig.add_subplot(1, 1, 1)
    draw._draw_param(ax, pg, plan, {"data": "#4c72b0", "model": "#dd8452"})
    fig.canvas.draw()
    boxes = [
        t.get_window_extent() for t in ax.texts if re.fullmatch(r"data \d,model \d", t.get_text())
    ]
    assert 2 <= len(boxes) < 8  # thinned, the first and the last kept
    assert {t.get_text() for t in ax.texts} >= {"data 0,model 0", "data 1,model 3"}
    boxes.sort(key=lambda b: b.y0)
    assert all(a.y1 <= b.y0 for a, b in zip(boxes, boxes[1:])), boxes


def test_render_draws_the_pipeline_schedule(small_plan, tmp_path):
    """A pipelined plan's picture has the schedule: one row per stage, every slot's
    micro-batch, and the schedule line with the bubble (`autopar.plan.schedule`)."""
    import dataclasses
    import re

    import matplotlib

    from autopar.plan.schedule import schedule_line, timeline

    plan = Plan.from_json(json.loads(small_plan.read_text()))
    record = {
        "stages": 2,
        "microbatches": 3,
        "schedule": "1f1b",
        "axis": "stage",
        "scans": [
            {"op": "scan@1", "stages": [[0, 1], [1, 2]], "reverse": False, "seconds": 4e-3},
            {"op": "scan@2", "stages": [[0, 1], [1, 2]], "reverse": True, "seconds": 8e-3},
        ],
        "fused": [{"forward": "scan@1", "backward": "scan@2", "head": [], "head_seconds": 3e-4}],
    }
    piped = dataclasses.replace(plan, pipeline=record)
    out = tmp_path / "piped.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        render.render_plan(piped, out, top=2)
    texts = [
        re.sub(r"<[^>]+>", "", t)
        for t in re.findall(r"<text[^>]*>(.*?)</text>", out.read_text(), re.S)
    ]
    body = html.unescape("\n".join(texts))
    assert "stage 0" in body and "stage 1" in body
    assert "bubble" in body and "held per" in body
    slots = [t for t in timeline(record).slots if t.micro is not None]
    labels = [t for t in texts if re.fullmatch(r"[FBH]\d", html.unescape(t))]
    assert len(labels) == len(slots)  # forward, head and backward slots, each labelled
    # ZB-H1: the deferred weight-gradient slots are drawn and labelled too
    zb = {**record, "schedule": "zb-h1"}
    zb["fused"] = [{**record["fused"][0], "weight_seconds": 1e-3}]
    out = tmp_path / "zb.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        render.render_plan(dataclasses.replace(plan, pipeline=zb), out, top=2)
    texts = [
        html.unescape(re.sub(r"<[^>]+>", "", t))
        for t in re.findall(r"<text[^>]*>(.*?)</text>", out.read_text(), re.S)
    ]
    assert {"W0", "W1", "W2"} <= set(texts) and "weight" in texts
    assert schedule_line(timeline(record)).split(";")[0].removeprefix("schedule: ") in body.replace(
        "\n", " "
    )
