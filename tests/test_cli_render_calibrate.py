"""`autopar render` and `autopar calibrate` through the real entry point (`python -m
autopar ...` in a subprocess), on a small searched plan; plus the layer grouping behind
the picture on a synthetic 96-layer plan."""

from __future__ import annotations

import copy
import json
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
