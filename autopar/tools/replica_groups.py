"""Replica groups and device lists of HLO collectives, as XLA prints them (explicit
`{{0,1},{2,3}}`, iota `[2,2]<=[4]`, `T(...)` transposes), matched to mesh axes."""

from __future__ import annotations

import itertools
import math
import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    pass


def balanced(s: str, start: int) -> int:
    """Index just past the bracket group opening at ``s[start]``."""
    depth = 0
    i = start
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in {s[start : start + 80]!r}")


def split_top(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


COMMENT_RE = re.compile(r"/\*.*?\*/")


def attr_value(attrs: str, key: str) -> str | None:
    """Raw value of ``key=...`` in an attribute string (balanced brackets respected)."""
    m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
    if m is None:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] in "([{":
        return attrs[i : balanced(attrs, i)]
    j = i
    while j < len(attrs) and attrs[j] not in ", ":
        j += 1
    return attrs[i:j]


# --------------------------------------------------------------------------- replica groups


def _iota(reshape_dims: list[int], perm: list[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape_dims), dtype=np.int64).reshape(reshape_dims)
    if perm is not None:
        arr = arr.transpose(perm)
    return arr.ravel()


def ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", s)]


_IOTA_GROUPS_RE = re.compile(r"^\[([\d,\s]*)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?$")
_TILE_RE = re.compile(r"^\[([\d,\s]*)\](?:<=\[([\d,\s]*)\])?(?:T\(([\d,\s]*)\))?$")


def _device_list(spec: str) -> np.ndarray:
    """A mesh's ``device_ids=(...)``: iota ``[dims]T(perm)`` / ``[d]<=[r]T(p)`` or explicit."""
    spec = spec.strip()
    m = _TILE_RE.match(spec)
    if m:
        dims = ints(m.group(1))
        reshape = ints(m.group(2)) if m.group(2) is not None else dims
        perm = ints(m.group(3)) if m.group(3) is not None else None
        return _iota(reshape, perm)
    m = re.match(r"^\[[\d,\s]*\](.*)$", spec)  # "[2,4]0,4,1,5,..." (dims then values)
    if m and m.group(1).strip():
        spec = m.group(1)
    return np.array(ints(spec), dtype=np.int64)


def _mesh_groups(s: str) -> tuple[tuple[int, ...], ...]:
    """``mesh['a'=2,'b'=4](, device_ids=(...))? {'b'}`` -> replica groups."""
    i = s.index("[")
    j = balanced(s, i)
    axis_names, axis_sizes = [], []
    for item in split_top(s[i + 1 : j - 1]):
        name, _, size = item.rpartition("=")
        axis_names.append(name.strip().strip("'\""))
        axis_sizes.append(int(size))
    rest = s[j:].strip()
    devices = np.arange(math.prod(axis_sizes), dtype=np.int64)
    if rest.startswith(","):
        rest = rest[1:].strip()
        if not rest.startswith("device_ids="):
            raise ValueError(f"unexpected mesh replica groups {s!r}")
        k = rest.index("(")
        e = balanced(rest, k)
        devices = _device_list(rest[k + 1 : e - 1])
        rest = rest[e:].strip()
    if not rest.startswith("{"):
        raise ValueError(f"mesh replica groups without axes: {s!r}")
    refs: list[tuple[int, int, int]] = []  # (mesh axis index, pre_size, size)
    for item in split_top(rest[1 : balanced(rest, 0) - 1]):
        m = re.match(r"^['\"]?(.+?)['\"]?(?::\((\d+)\)(\d+))?$", item)
        if m is None:
            raise ValueError(f"bad mesh axis reference {item!r}")
        ax = axis_names.index(m.group(1))
        if m.group(2) is not None:
            refs.append((ax, int(m.group(2)), int(m.group(3))))
        else:
            refs.append((ax, 1, axis_sizes[ax]))
    if devices.size != math.prod(axis_sizes):
        raise ValueError(f"mesh device list does not match the mesh shape: {s!r}")
    # Split every mesh axis (major to minor) at the boundaries of its referenced sub-axes;
    # each reference then covers exactly one split dimension.
    split_dims: list[int] = []
    ref_dim: dict[tuple[int, int, int], int] = {}
    for ax, size in enumerate(axis_sizes):
        bounds = {1, size}
        for r_ax, pre, sz in refs:
            if r_ax == ax:
                bounds |= {pre, pre * sz}
        bounds_sorted = sorted(bounds)
        starts = {}
        for lo, hi in itertools.pairwise(bounds_sorted):
            starts[lo] = len(split_dims)
            split_dims.append(hi // lo)
        for ref in refs:
            if ref[0] == ax:
                ref_dim[ref] = starts[ref[1]]
    grouped = [ref_dim[r] for r in refs]
    order = [d for d in range(len(split_dims)) if d not in grouped] + grouped
    group_size = math.prod(split_dims[d] for d in grouped)
    arr = devices.reshape(split_dims).transpose(order).reshape(-1, group_size)
    return tuple(tuple(int(x) for x in row) for row in arr)


def parse_replica_groups(s: str) -> tuple[tuple[int, ...], ...] | None:
    """Parse a ``replica_groups=`` value.  ``None`` means ``{}`` (all devices, one group).

    Forms: explicit ``{{0,4},{1,5}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and
    mesh-axes ``mesh['x'=2,'y'=4], device_ids=([2,4]T(1,0)) {'y'}``.
    """
    s = s.strip()
    if s.startswith("mesh"):
        return _mesh_groups(s)
    m = _IOTA_GROUPS_RE.match(s)
    if m:
        shape = ints(m.group(1))
        perm = ints(m.group(3)) if m.group(3) is not None else None
        arr = _iota(ints(m.group(2)), perm).reshape(shape)
        return tuple(tuple(int(x) for x in row) for row in arr)
    if s.startswith("{"):
        groups = tuple(tuple(ints(g)) for g in re.findall(r"\{([^{}]*)\}", s[1:-1]) if ints(g))
        return groups or None
    raise ValueError(f"unrecognized replica_groups {s!r}")


_RG_ITEM_RE = re.compile(
    r"mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\}"
    r"|\[[\d,\s]*\]<=\[[\d,\s]*\](?:T\([\d,\s]*\))?"
)


def replica_groups_attr(attrs: str) -> str | None:
    """The raw ``replica_groups=`` value of an instruction, in any of its three forms."""
    m = re.search(r"(?:^|[\s,])replica_groups=", attrs)
    if m is None:
        return None
    i = m.end()
    if attrs.startswith("{", i):
        return attrs[i : balanced(attrs, i)]
    item = _RG_ITEM_RE.match(attrs, i)
    if item is None:
        raise ValueError(f"unrecognized replica_groups in {attrs[i : i + 120]!r}")
    return item.group(0)


def permute_components(pairs: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        a, b = find(pair[0]), find(pair[1])
        if a != b:
            parent[max(a, b)] = min(a, b)
    comps: dict[int, list[int]] = {}
    for x in sorted(parent):
        comps.setdefault(find(x), []).append(x)
    return tuple(tuple(c) for c in sorted(comps.values()))


# --------------------------------------------------------------------------- mesh axes


def _axis_partition(shape: tuple[int, ...], axes: tuple[int, ...]) -> frozenset:
    pos = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    rest = [d for d in range(len(shape)) if d not in axes]
    size = math.prod(shape[d] for d in axes)
    rows = pos.transpose(rest + list(axes)).reshape(-1, size)
    return frozenset(frozenset(int(x) for x in row) for row in rows)


def match_axes(
    groups: tuple[tuple[int, ...], ...], mesh, pad_singletons: bool
) -> tuple[str, ...] | None:
    """Mesh axes (by position in ``mesh.devices.flat``) whose partition equals ``groups``.

    Subsets are tried smallest first (in mesh-axis order), so size-1 axes are only named
    when nothing smaller matches.
    """
    if not groups:
        return None
    shape = tuple(mesh.devices.shape)
    n = math.prod(shape)
    target = {frozenset(g) for g in groups}
    if pad_singletons:
        covered = set().union(*target)
        target |= {frozenset([p]) for p in range(n) if p not in covered}
    if any(x < 0 or x >= n for g in target for x in g):
        return None
    target = frozenset(target)
    names = tuple(mesh.axis_names)
    for k in range(1, len(shape) + 1):
        for subset in itertools.combinations(range(len(shape)), k):
            if _axis_partition(shape, subset) == target:
                return tuple(names[d] for d in subset)
    return None


# --------------------------------------------------------------------------- module parsing
