"""Tests for autopar.tools.hlo: collectives read from compiled HLO text.

Real programs are compiled on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.tools.hlo import (
    HloCollective,
    parse_collectives,
    parse_replica_groups,
    shape_bytes,
    summarize,
)

AUTO = jax.sharding.AxisType.Auto
F32 = 4


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


@pytest.fixture(scope="module")
def mesh2d():
    return make_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def mesh1d():
    return make_mesh((8,), ("x",))


@pytest.fixture(scope="module")
def mesh3d():
    return make_mesh((2, 2, 2), ("a", "b", "c"))


def compile_text(f, mesh, in_specs, out_spec, *args):
    in_shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
    jitted = jax.jit(f, in_shardings=in_shardings, out_shardings=NamedSharding(mesh, out_spec))
    return jitted.lower(*args).compile().as_text()


def only(collectives, kind=None):
    matching = [c for c in collectives if kind is None or c.kind == kind]
    assert len(matching) == 1, collectives
    return matching[0]


MODEL_GROUPS = {frozenset(range(4)), frozenset(range(4, 8))}
DATA_GROUPS = {frozenset({i, i + 4}) for i in range(4)}


def group_sets(c: HloCollective):
    return {frozenset(g) for g in c.groups}


# --------------------------------------------------------------------------- real programs


def test_all_reduce_over_model(mesh2d):
    a, b = jnp.ones((16, 64)), jnp.ones((64, 32))
    text = compile_text(lambda a, b: a @ b, mesh2d, [P(None, "model"), P("model", None)], P(), a, b)
    c = only(parse_collectives(text, mesh2d))
    assert c.kind == "all-reduce"
    assert c.bytes == 16 * 32 * F32  # full (unreduced) per-device partial product
    assert c.dtype == "f32"
    assert c.group_size == 4
    assert group_sets(c) == MODEL_GROUPS
    assert c.axes == ("model",)
    assert not c.in_loop


def test_all_gather_over_data(mesh2d):
    a = jnp.ones((16, 64))
    text = compile_text(lambda a: a * 2, mesh2d, [P("data", None)], P(), a)
    c = only(parse_collectives(text, mesh2d))
    assert c.kind == "all-gather"
    assert c.bytes == 16 * 64 * F32  # the gathered (result) side
    assert c.group_size == 2
    assert group_sets(c) == DATA_GROUPS
    assert c.axes == ("data",)


def test_reduce_scatter_gspmd_is_all_reduce_on_cpu(mesh2d):
    # GSPMD's reduce-scatter: contracted dim sharded on model, output sharded on model.
    # The CPU compiler emits all-reduce + dynamic-slice rather than reduce-scatter; both
    # report the full-size operand, so the bytes are the same either way.
    a, b = jnp.ones((16, 64)), jnp.ones((64, 32))
    text = compile_text(
        lambda a, b: a @ b, mesh2d, [P(None, "model"), P("model", None)], P("model", None), a, b
    )
    c = only(parse_collectives(text, mesh2d))
    assert c.kind in ("all-reduce", "reduce-scatter")
    assert c.bytes == 16 * 32 * F32
    assert c.group_size == 4
    assert c.axes == ("model",)
    if c.kind == "all-reduce":
        assert "dynamic-slice" in text


def test_all_to_all_reshard(mesh1d):
    a = jnp.ones((16, 64))
    text = compile_text(lambda a: a * 2, mesh1d, [P("x", None)], P(None, "x"), a)
    c = only(parse_collectives(text, mesh1d))
    assert c.kind == "all-to-all"
    assert c.bytes == 2 * 64 * F32  # the local shard, split into 8 tuple pieces
    assert c.group_size == 8
    assert c.groups == (tuple(range(8)),)
    assert c.axes == ("x",)


def test_collective_permute_from_roll(mesh1d):
    a = jnp.ones((16, 64))
    text = compile_text(lambda a: jnp.roll(a, 1, axis=0), mesh1d, [P("x", None)], P("x", None), a)
    c = only(parse_collectives(text, mesh1d))
    assert c.kind == "collective-permute"
    assert c.bytes == 1 * 64 * F32  # one boundary row moves to the neighbour
    assert c.group_size == 8  # a ring over all 8 devices
    assert c.axes == ("x",)


def test_two_axes_on_3d_mesh(mesh3d):
    # Groups along ("a", "c") come out of the mesh form with device_ids=([2,2,2]T(0,2,1)).
    a, b = jnp.ones((16, 64)), jnp.ones((64, 32))
    text = compile_text(
        lambda a, b: a @ b, mesh3d, [P(None, ("a", "c")), P(("a", "c"), None)], P(), a, b
    )
    c = only(parse_collectives(text, mesh3d))
    assert c.kind == "all-reduce"
    assert c.group_size == 4
    assert group_sets(c) == {frozenset({0, 1, 4, 5}), frozenset({2, 3, 6, 7})}
    assert c.axes == ("a", "c")


def test_groups_are_mesh_positions_not_device_ids(mesh2d):
    # A mesh over permuted devices compiles to the same HLO: ids are positions.
    order = [3, 1, 7, 0, 2, 6, 5, 4]
    devices = np.array(jax.devices())[order].reshape(2, 4)
    mesh = Mesh(devices, ("data", "model"), axis_types=(AUTO, AUTO))
    a, b = jnp.ones((16, 64)), jnp.ones((64, 32))
    specs = [P(None, "model"), P("model", None)]
    text = compile_text(lambda a, b: a @ b, mesh, specs, P(), a, b)
    c = only(parse_collectives(text, mesh))
    assert group_sets(c) == MODEL_GROUPS
    assert c.axes == ("model",)


def test_shard_map_collectives(mesh2d):
    def body(x):
        return (
            jax.lax.psum(x, "model"),
            jax.lax.ppermute(x, "data", [(0, 1), (1, 0)]),
            jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True),
            jax.lax.all_gather(x, "data", tiled=True),
            jax.lax.all_to_all(x, "model", 0, 1, tiled=True),
        )

    f = jax.shard_map(
        body, mesh=mesh2d, in_specs=P("data", "model"), out_specs=(P("data", "model"),) * 5
    )
    text = jax.jit(f).lower(jnp.ones((32, 64))).compile().as_text()
    cs = parse_collectives(text, mesh2d)
    local = 16 * 16 * F32  # per-device block of the (32, 64) input
    ar = only(cs, "all-reduce")
    assert (ar.bytes, ar.group_size, ar.axes) == (local, 4, ("model",))
    cp = only(cs, "collective-permute")
    assert (cp.bytes, cp.group_size, cp.axes) == (local, 2, ("data",))
    assert group_sets(cp) == DATA_GROUPS
    rs = only(cs, "reduce-scatter")  # a real reduce-scatter only comes from shard_map
    assert (rs.bytes, rs.group_size, rs.axes) == (local, 4, ("model",))
    ag = only(cs, "all-gather")
    assert (ag.bytes, ag.group_size, ag.axes) == (2 * local, 2, ("data",))
    a2a = only(cs, "all-to-all")
    assert (a2a.bytes, a2a.group_size, a2a.axes) == (local, 4, ("model",))
    assert summarize(cs) == {
        ("all-reduce", ("model",)): local,
        ("collective-permute", ("data",)): local,
        ("reduce-scatter", ("model",)): local,
        ("all-gather", ("data",)): 2 * local,
        ("all-to-all", ("model",)): local,
    }


def test_collective_inside_scan_is_in_loop(mesh2d):
    def f(w, x):
        def step(c, _):
            return jnp.tanh(c @ w), None

        return jax.lax.scan(step, x, None, length=3)[0]

    text = compile_text(
        f, mesh2d, [P("model", None), P(None, "model")], P(), jnp.ones((64, 64)), jnp.ones((16, 64))
    )
    cs = parse_collectives(text, mesh2d)
    ar = only(cs, "all-reduce")
    assert ar.in_loop
    assert ar.bytes == 16 * 64 * F32
    assert ar.axes == ("model",)
    assert ar.runs == 3  # the scan's length, XLA's known_trip_count
    ag = only(cs, "all-gather")  # the final reshard happens after the loop
    assert not ag.in_loop and ag.runs == 1
    per_step = summarize(cs, per_step=True)
    assert per_step[("all-reduce", ("model",))] == 3 * summarize(cs)[("all-reduce", ("model",))]


def test_no_mesh_gives_no_axes(mesh2d):
    a = jnp.ones((16, 64))
    text = compile_text(lambda a: a * 2, mesh2d, [P("data", None)], P(), a)
    c = only(parse_collectives(text))
    assert c.axes is None
    assert group_sets(c) == DATA_GROUPS


# --------------------------------------------------------------------------- group syntaxes


def test_explicit_groups():
    assert parse_replica_groups("{{0,4},{1,5},{2,6},{3,7}}") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert parse_replica_groups("{}") is None


def test_iota_groups():
    assert parse_replica_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    expected = tuple(
        tuple(int(x) for x in row)
        for row in np.arange(8).reshape(2, 2, 2).transpose(0, 2, 1).reshape(4, 2)
    )
    assert parse_replica_groups("[4,2]<=[2,2,2]T(0,2,1)") == expected


def test_mesh_groups():
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}") == (
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    )
    s = "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}"
    assert parse_replica_groups(s) == ((0, 1, 2, 3), (4, 5, 6, 7))
    s = "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}"
    assert parse_replica_groups(s) == ((0, 1, 4, 5), (2, 3, 6, 7))
    # Explicit device list, several axes, unquoted names.
    s = "mesh[a=2,b=2], device_ids=(3,2,1,0) {a,b}"
    assert parse_replica_groups(s) == ((3, 2, 1, 0),)


def test_mesh_sub_axes():
    assert parse_replica_groups("mesh['x'=8] {'x':(2)2}") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert parse_replica_groups("mesh['x'=8] {'x':(1)2,'x':(4)2}") == ((0, 1, 4, 5), (2, 3, 6, 7))


HEADER = "HloModule m, num_partitions=8\n\n"
ADD = "%add (x: f32[], y: f32[]) -> f32[] {\n  ROOT %r = f32[] add(%x, %y)\n}\n\n"


def module(*lines, header=HEADER):
    body = "\n".join(f"  {line}" for line in lines)
    return f"{header}{ADD}ENTRY %main (p: f32[8,128]) -> f32[8,128] {{\n{body}\n}}\n"


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("[2,4]<=[8]", ("model",)),
        ("[4,2]<=[2,4]T(1,0)", ("data",)),
        ("{}", ("data", "model")),
        ("{{0,1,2,3,4,5,6,7}}", ("data", "model")),
        ("{{0,2},{1,3},{4,6},{5,7}}", None),
    ],
)
def test_group_syntaxes_in_module(mesh2d, groups, axes):
    text = module(
        "%p = f32[8,128]{1,0} parameter(0)",
        f"ROOT %ar = f32[8,128]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add",
    )
    c = only(parse_collectives(text, mesh2d))
    assert c.kind == "all-reduce"
    assert c.bytes == 8 * 128 * F32
    assert c.axes == axes
    assert c.name == "ar"


def test_empty_groups_without_header_use_mesh_size(mesh2d):
    text = module(
        "%p = f32[8,128]{1,0} parameter(0)",
        "ROOT %ar = f32[8,128]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add",
        header="",
    )
    c = only(parse_collectives(text, mesh2d))
    assert c.group_size == 8
    assert c.axes == ("data", "model")


def test_cross_replica_and_partition_expands_groups():
    # channel_id without use_global_device_ids: groups are replica ids, every partition joins.
    text = module(
        "%p = f32[8,128]{1,0} parameter(0)",
        "ROOT %ar = f32[8,128]{1,0} all-reduce(%p), channel_id=3, replica_groups={{0}}, "
        "to_apply=%add",
    )
    c = only(parse_collectives(text))
    assert c.groups == (tuple(range(8)),)
    assert c.group_size == 8


# --------------------------------------------------------------------------- shapes and forms


def test_shape_bytes():
    assert shape_bytes("f32[8,128]{1,0}") == 8 * 128 * 4
    assert shape_bytes("(f32[8]{0}, f32[4,4]{1,0})") == 8 * 4 + 16 * 4
    assert shape_bytes("bf16[3,5]") == 30
    assert shape_bytes("pred[10]") == 10
    assert shape_bytes("c64[2]") == 16
    assert shape_bytes("s8[7]") == 7
    assert shape_bytes("f64[]") == 8
    assert shape_bytes("u32[<=6]") == 24
    assert shape_bytes("f32[8,128]{1,0:T(8,128)}") == 8 * 128 * 4


def test_tuple_all_reduce_and_dtypes(mesh2d):
    text = module(
        "%p = f32[8,128]{1,0} parameter(0)",
        "%a = bf16[16,32]{1,0} convert(%p)",
        "%b = bf16[4]{0} slice(%a), slice={[0:1], [0:4]}",
        "%ar = (bf16[16,32]{1,0}, bf16[4]{0}) all-reduce(%a, %b), channel_id=1, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_1'}, use_global_device_ids=true, to_apply=%add",
        "ROOT %g = bf16[16,32]{1,0} get-tuple-element(%ar), index=0",
    )
    c = only(parse_collectives(text, mesh2d))
    assert c.bytes == (16 * 32 + 4) * 2
    assert c.dtype == "bf16"
    assert c.axes == ("model",)


def test_async_pairs_counted_once(mesh2d):
    text = module(
        "%p = f32[8,128]{1,0} parameter(0)",
        "%ars = f32[8,128]{1,0} all-reduce-start(%p), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add",
        "%ard = f32[8,128]{1,0} all-reduce-done(%ars)",
        "%ags = (f32[8,128]{1,0}, f32[16,128]{1,0}) all-gather-start(%ard), channel_id=2, "
        "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true",
        "%agd = f32[16,128]{1,0} all-gather-done(%ags)",
        "%cps = (f32[16,128]{1,0}, f32[16,128]{1,0}, u32[], u32[]) collective-permute-start(%agd), "
        "channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}",
        "ROOT %cpd = f32[16,128]{1,0} collective-permute-done(%cps)",
    )
    cs = parse_collectives(text, mesh2d)
    assert [c.kind for c in cs] == ["all-reduce", "all-gather", "collective-permute"]
    ar, ag, cp = cs
    assert (ar.bytes, ar.axes) == (8 * 128 * F32, ("model",))
    assert (ag.bytes, ag.group_size, ag.axes) == (16 * 128 * F32, 2, ("data",))
    assert (cp.bytes, cp.group_size, cp.axes) == (16 * 128 * F32, 2, None)


def test_typed_operands_and_reduce_scatter_operand_bytes(mesh1d):
    text = module(
        "%p = f32[8,128]{1,0} parameter(0)",
        "ROOT %rs = f32[1,128]{1,0} reduce-scatter(f32[8,128]{1,0} %p), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, "
        "to_apply=%add",
    )
    c = only(parse_collectives(text, mesh1d))
    assert c.kind == "reduce-scatter"
    assert c.bytes == 8 * 128 * F32
    assert c.axes == ("x",)


def test_in_loop_is_transitive():
    text = """HloModule loop, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] add(%x, %y)
}

%inner (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %deep = f32[4]{0} all-reduce(%q), channel_id=2, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %c = f32[4]{0} call(%v), to_apply=%inner
  %direct = f32[4]{0} all-to-all(%c), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %o = (s32[], f32[4]{0}) tuple(%i, %direct)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%z, %p)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %res = f32[4]{0} get-tuple-element(%w), index=1
  ROOT %outside = f32[4]{0} all-reduce(%res), channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add
}
"""
    cs = {c.name: c for c in parse_collectives(text)}
    assert set(cs) == {"deep", "direct", "outside"}
    assert cs["deep"].in_loop
    assert cs["direct"].in_loop
    assert not cs["outside"].in_loop
    assert cs["outside"].groups == ((0, 1, 2, 3),)
    assert cs["direct"].bytes == 16
    assert summarize(cs.values()) == {("all-reduce", None): 32, ("all-to-all", None): 16}
    # a step runs the loop's (and what it calls) 3 times: the while's known_trip_count
    assert [cs[k].runs for k in ("deep", "direct", "outside")] == [3, 3, 1]
    assert summarize(cs.values(), per_step=True) == {
        ("all-reduce", None): 16 + 3 * 16,
        ("all-to-all", None): 3 * 16,
    }
