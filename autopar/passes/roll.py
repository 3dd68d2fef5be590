"""Rolling a layer stack unrolled in Python into loops over stages, to pipeline it.

The pipeline (`autopar.passes.pipeline`, `autopar.lower.pipeline`) runs a `scan` over
layers, its per-layer inputs split over the mesh's stage axis. A model that unrolls its
layers in Python (`for i in range(n): x = Block(name=f"h_{i}")(x)`, NNX's list of
blocks, every `transformers` Flax model) has no such loop, so `roll` writes one: with
`n = S k` layers on `S` stages, stage `s` runs layers `s k .. s k + k - 1`, and

* the forward pass becomes a `scan` of length `S` whose body is layers `0..k-1`'s ops
  (each step one stage's `k` layers); its carry is the residual stream, its `ys` the
  values other ops read per layer (the backward pass's residuals);
* the backward pass becomes a reversed `scan` of the same shape whose body is the
  first-run stage's backward ops (`autopar.passes.stacks` finds both);
* each parameter leaf `t` of layer slot `j` becomes one **group**: the leaves of layers
  `j, k + j, ..., (S - 1) k + j` concatenated along dim 0 (stacked, for scalars). Split
  over the stage axis on dim 0, the rows stage `s` holds are exactly layer `s k + j`'s
  leaf, so the caller assembles a group from the user's per-layer arrays without a copy
  (`jax.make_array_from_single_device_arrays`; `autopar.lower.rolled`), and splits the
  updated group back the same way. Optimizer state that mirrors the parameters
  (`Block.state`) is grouped alike.

The ops outside the stack (embedding, head, loss, optimizer) stay as they are and read
one layer's value as a row of its group or of a loop's `ys`. The rolled function is
captured again, so what follows (search, pipeline, lowering) sees ordinary scans.
`Roll` records how the rolled graph's inputs and outputs stand for the user's leaves.
docs/algorithms.md, "Pipelining layers unrolled in Python", has the reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np

from autopar.errors import PipelineError
from autopar.ir.capture import abstract_value, capture, lines_from
from autopar.ir.chunks import chunk_position, chunk_rows, unchunk_rows
from autopar.ir.eval import bind_marked, bind_node, marked, relined, run_nodes
from autopar.ir.graph import Graph, find_aliases, signature, without_dead
from autopar.passes.roll_io import Roll, layout
from autopar.passes.roll_units import per_layer_ops
from autopar.passes.stack_pad import padded
from autopar.passes.stacks import BACKWARD_DIFFERS, LayerStack

SCOPE = "rolled_layers"  # name scope of the loops `roll` writes


@dataclass
class _Loop:
    """One rolled loop: its chunks (node ids per stage, sorted), run in `order`."""

    chunks: list[list[int]]
    reverse: bool
    consts: list[int] = field(default_factory=list)  # ref values, the same for all chunks
    carry: list[tuple[int, tuple[int, int]]] = field(default_factory=list)  # (init, source)
    xs: list[tuple[int, tuple]] = field(default_factory=list)  # (ref value, how it's built)
    ys: list[tuple[int, int]] = field(default_factory=list)  # (position, output index)
    ys_in: list[int] = field(default_factory=list)  # carries whose per-chunk input is a ys

    @property
    def order(self) -> list[int]:
        n = len(self.chunks)
        return list(range(n - 1, -1, -1) if self.reverse else range(n))

    @property
    def ref(self) -> int:
        return self.order[0]

    def next(self, c: int) -> int:
        return c - 1 if self.reverse else c + 1


class _Rolling:
    """The analysis of one stack on `S` stages (`roll`); `resident`: (stages, virtual
    stages) where the `S` loop steps are chunks of the interleaved schedule, each group
    stored in chunk order (`autopar.ir.chunks`)."""

    def __init__(
        self, g: Graph, stack: LayerStack, S: int, resident: tuple[int, int] | None = None
    ):
        fwd = stack.forward
        L = len(fwd)
        if S < 2 or L % S:
            raise PipelineError(
                f"{stack.named()} (unrolled in Python) do not split into "
                f"{S} equal stages; pick pipeline_stages that divides {L}"
            )
        self.g, self.stack, self.S, self.k = g, stack, S, L // S
        self.resident = resident
        # per row of a stacked array, the loop step (layer chunk) it holds
        self.order = list(range(S))
        if resident is not None:
            for u in range(S):
                self.order[chunk_position(u, *resident, S)] = u
        self.pos = {u: p for p, u in enumerate(self.order)}
        # a stacked array is held as `per` parts (the rolled inputs' layout): row `p` is
        # row `p // per` of part `p mod per`; one part of every row where not resident
        self.per = 1 if resident is None else S // resident[0]
        leaves = [b.params + b.state for b in fwd]
        if len({len(lv) for lv in leaves}) != 1:
            raise PipelineError(f"the layers of {stack.template} hold different leaves")
        self.leaf = {g.inputs[p]: (n, t) for n, lv in enumerate(leaves) for t, p in enumerate(lv)}
        k = self.k
        self.groups = [
            tuple(leaves[s * k + j][t] for s in range(S))
            for j in range(k)
            for t in range(len(leaves[0]))
        ]
        self.vgroup = {
            g.inputs[p]: (i, s) for i, ms in enumerate(self.groups) for s, p in enumerate(ms)
        }
        by_index = {b.index: n for n, b in enumerate(fwd)}
        loops = [_Loop(self._chunks([b.nodes for b in fwd]), reverse=False)]
        if stack.backward:
            bwd: list = [None] * L
            for b in stack.backward:
                bwd[by_index[b.index]] = b.nodes
            loops.append(_Loop(self._chunks(bwd), reverse=True))
        self.loops = loops
        self.made = {}  # value -> (loop, chunk, position, output index)
        for li, lp in enumerate(loops):
            for c, chunk in enumerate(lp.chunks):
                for q, i in enumerate(chunk):
                    for r, v in enumerate(g.nodes[i].outputs):
                        self.made[v] = (li, c, q, r)
        for li, lp in enumerate(loops):
            self._classify(li, lp)
        self.rows: dict[int, tuple[Any, int]] = {}  # value -> (stacked array's key, row)
        for gi, ms in enumerate(self.groups):
            self.rows.update((g.inputs[p], (("group", gi), s)) for s, p in enumerate(ms))
        for li, lp in enumerate(loops):
            for q, r in lp.ys:
                for c, ch in enumerate(lp.chunks):
                    self.rows[g.nodes[ch[q]].outputs[r]] = (("ys", li, (q, r)), c)
            carry_in = self._carry_in(li)
            for ci in lp.ys_in:
                for c, v in enumerate(carry_in[ci]):
                    self.rows.setdefault(v, (("ys", li, ("in", ci)), c))
        self.units = per_layer_ops(self)
        try:
            self.sequence = self._order()
        except nx.NetworkXUnfeasible:  # the per-layer ops do not roll (a chain across layers)
            for nodes in self.units.values():
                for n in nodes:
                    for y in g.nodes[n].outputs:
                        self.rows.pop(y, None)
            self.units = {}
            self.sequence = self._order()

    def _chunks(self, blocks: Sequence[Sequence[int]]) -> list[list[int]]:
        g, k = self.g, self.k
        chunks = [sorted(i for b in blocks[s * k : (s + 1) * k] for i in b) for s in range(self.S)]
        sigs = [[signature(g, g.nodes[i]) for i in ch] for ch in chunks]
        for s, sg in enumerate(sigs[1:], 1):
            if sg != sigs[0]:
                at = next((q for q, (a, b) in enumerate(zip(sg, sigs[0])) if a != b), len(sg))
                where = g.nodes[chunks[s][min(at, len(chunks[s]) - 1)]].key
                raise PipelineError(
                    f"layers {s * k}..{(s + 1) * k - 1} of {self.stack.template} differ from "
                    f"layers 0..{k - 1} at op {at} ({where}); every stage must run the same ops"
                )
        return chunks

    # ------------------------------------------------------------------ analysis
    def _classify(self, li: int, lp: _Loop) -> None:
        """Sort what the reference chunk reads from outside into loop constants, carries
        and per-stage inputs (`xs`), and what it makes for others into `ys`."""
        g, S = self.g, self.S
        ref, nodes = lp.ref, self.g.nodes
        seen: dict[int, tuple] = {}
        for q, i in enumerate(lp.chunks[ref]):
            for a, x in enumerate(nodes[i].inputs):
                ys = [nodes[lp.chunks[c][q]].inputs[a] for c in range(S)]
                kind = self._kind(li, lp, x, ys)
                if seen.setdefault(x, kind) != kind:
                    raise PipelineError(
                        f"the layers of {self.stack.template} read {g.values[x]} at "
                        f"{nodes[i].key} in two ways across stages; they cannot be rolled"
                    )
        for x, kind in seen.items():
            if kind[0] == "const":
                lp.consts.append(x)
            elif kind[0] == "carry":
                lp.carry.append((x, kind[1]))
            elif kind[0] not in ("inner", "literal"):
                lp.xs.append((x, kind))
                if kind[0] == "ys" and kind[2][0] == "in":
                    ys_in = self.loops[kind[1]].ys_in
                    ys_in += [kind[2][1]] if kind[2][1] not in ys_in else []
        carried = {pos for _, pos in lp.carry}
        gout, sets = set(g.outputs), [set(ch) for ch in lp.chunks]
        for q, i in enumerate(lp.chunks[ref]):
            for r in range(len(nodes[i].outputs)):
                for c in range(S):
                    if (q, r) in carried and c == lp.order[-1]:
                        continue  # the final carry: bound as it is
                    v = nodes[lp.chunks[c][q]].outputs[r]
                    after = sets[lp.next(c)] if (q, r) in carried else ()  # as the carry
                    readers = g.consumers.get(v, ())
                    if v in gout or any(u not in sets[c] and u not in after for u in readers):
                        lp.ys.append((q, r))
                        break

    def _kind(self, li: int, lp: _Loop, x: int, ys: list[int]) -> tuple:
        """How value `x`, read by the reference chunk, is had per chunk (its copies `ys`,
        one per chunk): made inside ("inner"), a literal, a group's row, the same for
        all (a loop constant), the previous chunk's output (a carry), another loop's
        `ys` or carry in, or anything else, stacked per chunk ("stack")."""
        g, made, ref = self.g, self.made, lp.ref
        at = lambda y: made.get(y, (None,) * 4)  # noqa: E731
        if at(x)[:2] == (li, ref):
            if any(at(y)[:2] != (li, c) or at(y)[2:] != at(x)[2:] for c, y in enumerate(ys)):
                raise PipelineError(f"the stages' copies of {g.values[x]} do not line up")
            return ("inner",)
        if x in g.consts:
            return ("literal",) if self._same_literal(ys) else ("stack", tuple(ys))
        if x in self.vgroup:
            gi = self.vgroup[x][0]
            if all(self.vgroup.get(y) == (gi, c) for c, y in enumerate(ys)):
                return ("group", gi)
        if all(y == x for y in ys):
            return ("const",)
        prev = {c: lp.next(c) for c in range(self.S)}
        others = [(c, y) for c, y in enumerate(ys) if c != ref]
        if all(at(y)[:2] == (li, next(p for p, n in prev.items() if n == c)) for c, y in others):
            pos = {at(y)[2:] for _, y in others}
            if len(pos) == 1:
                return ("carry", pos.pop())
        for lj in range(li):
            if all(at(y)[:2] == (lj, c) and at(y)[2:] == at(x)[2:] for c, y in enumerate(ys)):
                return ("ys", lj, at(x)[2:])
            for ci, vals in enumerate(self._carry_in(lj)):
                if list(ys) == vals:
                    return ("ys", lj, ("in", ci))
        return ("stack", tuple(ys))

    def _carry_in(self, li: int) -> list[list[int]]:
        """Per carry of loop `li`, the value each chunk reads as it (chunk order)."""
        lp, nodes = self.loops[li], self.g.nodes
        out = []
        for init, (q, r) in lp.carry:
            vals = [init] * self.S
            for c in range(self.S):
                if c != lp.ref:
                    before = next(p for p in range(self.S) if lp.next(p) == c)
                    vals[c] = nodes[lp.chunks[before][q]].outputs[r]
            out.append(vals)
        return out

    # ------------------------------------------------------------------ the rolled function
    def _order(self) -> list[tuple]:
        """Loops, per-layer ops and the other ops in an order that respects every read:
        ("loop", i), ("op", (j, q)) or ("node", id), program order where it is free.
        Raises where an op outside the stack sits between its layers."""
        g = self.g
        owner: dict[int, tuple] = {
            i: ("loop", li) for li, lp in enumerate(self.loops) for ch in lp.chunks for i in ch
        }
        owner.update((i, ("op", u)) for u, nodes in self.units.items() for i in nodes)
        dg = nx.DiGraph()
        first: dict[tuple, int] = {}
        for n in g.nodes:
            unit = owner.get(n.id, ("node", n.id))
            first.setdefault(unit, n.id)
            dg.add_node(unit)
            for x in n.inputs:
                p = g.producer.get(x)
                if p is not None:
                    src = owner.get(p, ("node", p))
                    if src != unit:
                        dg.add_edge(src, unit)
        try:
            return list(nx.lexicographical_topological_sort(dg, key=lambda u: first[u]))
        except nx.NetworkXUnfeasible:
            if self.units:
                raise
            cyc = nx.find_cycle(dg)
            ops = [g.nodes[u[1]].key for e in cyc for u in e if u[0] == "node"]
            raise PipelineError(
                f"an op outside the layers of {self.stack.template} reads one layer and feeds "
                f"a later one ({ops[0] if ops else 'between the layers'}); such a stack cannot "
                "be rolled into a loop"
            ) from None

    def function(self, roll: Roll):
        g, rows = self.g, self.rows
        gin = {p: i for i, ms in enumerate(roll.inputs) for p in ms}

        def fn(*flat):
            env: dict[int, Any] = {}
            stacked: dict[Any, Any] = {}
            for p, v in enumerate(g.inputs):
                i = gin[p]
                if len(roll.inputs[i]) == 1:
                    env[v] = flat[i]
            # a stacked array: its rows as the rolled inputs hold them (`parts`)
            for gi, ms in enumerate(self.groups):
                t = g.values[g.inputs[ms[0]]]
                parts = [flat[gin[p[0]]] for p in self.parts(ms)]
                stacked[("group", gi)] = [x.reshape((-1, *t.shape)) for x in parts]

            def read(v):
                if v in env:
                    return env[v]
                if v in rows:
                    key, row = rows[v]
                    p = self.pos[row]
                    env[v] = stacked[key][p % self.per][p // self.per]
                    return env[v]
                return jnp.asarray(g.consts[v])

            for kind, i in self.sequence:
                if kind == "node":
                    run_nodes([g.nodes[i]], read, env, bind_marked)
                elif kind == "op":
                    self._run_op(i, read, stacked)
                else:
                    self._run_loop(i, read, env, stacked)
            outs = []
            for ms, st in zip(roll.outputs, roll.stacked_out):
                vals = [g.outputs[o] for o in ms]
                if len(ms) == 1:
                    outs.append(read(vals[0]))
                    continue
                key, part = self._part_of(vals)
                if key is not None:  # one stacked array's rows, in order: as it is
                    whole = stacked[key][part]
                    outs.append(whole if st else whole.reshape((-1, *whole.shape[2:])))
                else:
                    parts = [read(v) for v in vals]
                    outs.append(_stack(parts) if st else jnp.concatenate(parts, axis=0))
            return outs

        return fn

    def parts(self, members: Sequence[int]) -> list[tuple[int, ...]]:
        """A group's members (one per loop step) as the rolled inputs that hold them: all
        of them, or, resident, one input per chunk and loop step of a chunk, each with
        one member per stage (`chunk_position`'s order: the input of row `p` of stage
        `r` is `p mod (v q)`)."""
        if self.resident is None:
            return [tuple(members)]
        per, stages = self.per, self.resident[0]
        return [tuple(members[self.order[r * per + m]] for r in range(stages)) for m in range(per)]

    def _part_of(self, values: Sequence[int]) -> tuple[Any, int]:
        """The stacked array whose rows are `values` (and, resident, which of `parts`
        they are), or (None, 0)."""
        if self.resident is None:
            return self._batched(values), 0
        keys = {self.rows[v][0] if v in self.rows else None for v in values}
        if len(keys) != 1 or None in keys:
            return None, 0
        at = [self.pos[self.rows[v][1]] for v in values]
        m = at[0]
        return (
            (keys.pop(), m) if at == [r * self.per + m for r in range(len(values))] else (None, 0)
        )

    def _batched(self, values: Sequence[int]) -> Any:
        """The key of the stacked array whose rows are `values`, in stage order, or None."""
        keys = {self.rows[v][0] if v in self.rows else None for v in values}
        in_order = [self.rows.get(v, (None, -1))[1] for v in values] == list(range(self.S))
        return keys.pop() if len(keys) == 1 and None not in keys and in_order else None

    def _equal(self, a: int, b: int, depth: int = 4) -> bool:
        """Whether values `a` and `b` are the same computation: the same value, equal
        literals, or made by ops of one signature from equal operands (optax computes
        a bias correction once per leaf; `depth` bounds the walk)."""
        if a == b:
            return True
        g, prod = self.g, self.g.producer
        if a in g.consts or b in g.consts:
            return self._same_literal([a, b])
        if depth == 0 or a not in prod or b not in prod or a in self.rows or b in self.rows:
            return False
        na, nb = g.nodes[prod[a]], g.nodes[prod[b]]
        return (
            na.outputs.index(a) == nb.outputs.index(b)
            and signature(g, na) == signature(g, nb)
            and all(self._equal(x, y, depth - 1) for x, y in zip(na.inputs, nb.inputs))
        )

    def _same_literal(self, values: Sequence[int]) -> bool:
        c = self.g.consts
        return all(v in c and _same_const(c[values[0]], c[v]) for v in values)

    def _run_op(self, unit: tuple[int, int], read, stacked: dict) -> None:
        """One per-layer op of every stage at once, `jax.vmap`ped over the stages (over
        the rows of each of a stacked array's parts: no part is copied into one array
        for it)."""
        nodes = [self.g.nodes[i] for i in self.units[unit]]
        ref = nodes[0]
        kinds = []
        for a, x in enumerate(ref.inputs):
            copies = [n.inputs[a] for n in nodes]
            key = self._batched(copies)
            same = key is None and all(self._equal(x, y) for y in copies)
            kinds.append((copies, key, same))
        made = []
        for m in range(self.per):
            args, axes = [], []
            for copies, key, same in kinds:
                if key is not None:
                    args.append(stacked[key][m])
                elif same:
                    args.append(read(copies[0]))
                else:
                    rows = self.order[m :: self.per]
                    args.append(_stack([read(copies[u]) for u in rows]))
                axes.append(None if same else 0)
            # named per layer slot, so `search.layers` folds the slots' alike ops into one
            with jax.named_scope(f"{SCOPE}_slot{unit[0]}"), marked(ref):
                made.append(jax.vmap(lambda *xs: bind_node(ref, xs), in_axes=axes)(*args))
        for r, ys in enumerate(zip(*made)):
            stacked[("op", *unit, r)] = list(ys)

    def _run_loop(self, li: int, read, env: dict, stacked: dict) -> None:
        g, lp, S = self.g, self.loops[li], self.S
        nodes = [g.nodes[i] for i in lp.chunks[lp.ref]]
        ref_out = lambda pos: nodes[pos[0]].outputs[pos[1]]  # noqa: E731
        consts = {x: read(x) for x in lp.consts}
        xs = []
        for _, kind in lp.xs:
            if kind[0] == "group":
                xs.append(self._in_steps(stacked, ("group", kind[1])))
            elif kind[0] == "ys":
                xs.append(stacked[("steps", kind[1], kind[2])])
            elif (key := self._batched(kind[1])) is not None:  # a per-layer op's rows
                xs.append(self._in_steps(stacked, key))
            else:
                xs.append(_stack([read(y) for y in kind[1]]))
        xs_ids = [x for x, _ in lp.xs]
        carry_ids = [x for x, _ in lp.carry]

        def body(carry, xs):
            local = dict(zip(carry_ids, carry))
            local.update(zip(xs_ids, xs))
            local.update(consts)
            lread = lambda v: local[v] if v in local else jnp.asarray(g.consts[v])  # noqa: E731
            run_nodes(nodes, lread, local)
            ys = [local[ref_out(p)] for p in lp.ys] + [carry[ci] for ci in lp.ys_in]
            return [local[ref_out(pos)] for _, pos in lp.carry], ys

        with jax.named_scope(SCOPE):
            final, ys = jax.lax.scan(
                body, [read(x) for x in carry_ids], xs, length=S, reverse=lp.reverse
            )
        last = lp.chunks[lp.order[-1]]
        for (_, (q, r)), val in zip(lp.carry, final):
            env[g.nodes[last[q]].outputs[r]] = val
        for pos, y in zip([*lp.ys, *(("in", ci) for ci in lp.ys_in)], ys):
            stacked[("steps", li, pos)] = y  # in loop-step order, for the other loops
            if self.resident is None:
                stacked[("ys", li, pos)] = [y]
                continue
            y = unchunk_rows(y, *self.resident)  # its parts' rows: no copy
            y = y.reshape((-1, self.per, *y.shape[1:]))
            stacked[("ys", li, pos)] = [
                jax.lax.index_in_dim(y, m, axis=1, keepdims=False) for m in range(self.per)
            ]

    def _in_steps(self, stacked: dict, key) -> Any:
        """Stacked array `key` as one array in loop-step order (resident: its parts side
        by side in chunk order, each stage's rows its own, once per key)."""
        if key[0] == "ys":
            return stacked[("steps", *key[1:])]
        parts = stacked[key]
        if self.resident is None:
            return parts[0]
        if ("steps", key) not in stacked:
            side = jnp.concatenate([jnp.expand_dims(x, 1) for x in parts], axis=1)
            whole = side.reshape((self.S, *parts[0].shape[1:]))
            stacked[("steps", key)] = chunk_rows(whole, *self.resident)
        return stacked[("steps", key)]


def _ref_nodes(graph: Graph, loop: _Loop | None) -> list:
    """The ops a loop's body names its ops after: the first stage's (the chunks run the
    same ops), so the forward and backward bodies and the forward ops remat copies into
    the backward one all name layer slot `j` after layer `j` (`search.layers` folds the
    slots by these names)."""
    return [] if loop is None else [graph.nodes[i] for i in loop.chunks[0]]


def _stack(values: Sequence[Any]):
    """`jnp.stack`, written as a concatenation of `[1, ...]` views (primitives the search
    has sharding rules for; `jnp.stack` traces to its own)."""
    return jnp.concatenate([jnp.expand_dims(v, 0) for v in values], axis=0)


def _same_const(a, b) -> bool:
    if a is b:
        return True
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def roll(
    graph: Graph,
    stack: LayerStack,
    stages: int,
    mesh: Any = None,
    resident: tuple[int, int] | None = None,
) -> tuple[Graph, Roll]:
    """`graph` with `stack`'s layers run as loops of `stages` steps (module doc), and
    how its inputs and outputs stand for `graph`'s; `resident`: (stages, virtual
    stages) of the interleaved schedule whose chunks the steps are, the groups stored
    in its chunk order (`autopar.ir.chunks`). Raises PipelineError, naming the op,
    where the stack does not roll."""
    if stack.pads:  # its first layer reads an argument of the step (`stack_pad`)
        got = padded(stack, graph)
        if got is None:
            raise PipelineError(
                f"layer {stack.forward[0].index} of {stack.template} reads an argument of the "
                "step, so its backward computes no input gradient, and the ops it lacks do not "
                f"line up with the other layers'; {BACKWARD_DIFFERS.split('; ')[1]}"
            )
        graph, stack = got
    r = _Rolling(graph, stack, stages, resident)
    g = graph
    indices = [b.index for b in stack.forward]
    named = lambda ms: [indices[r.leaf[g.inputs[m]][0]] for m in ms]  # noqa: E731
    parts = [p for ms in r.groups for p in r.parts(ms)]
    inputs, stacked_in, in_paths = layout(
        len(g.inputs), [(p, named(p)) for p in parts], g, g.inputs, g.input_paths, stack
    )
    aliases = {i: o for o, i in find_aliases(g).items()}
    out_groups = [
        (tuple(aliases[m] for m in p), named(p)) for p in parts if all(m in aliases for m in p)
    ]
    outputs, stacked_out, out_paths = layout(
        len(g.outputs), out_groups, g, g.outputs, g.output_paths, stack
    )
    info = Roll(
        stages,
        stack.template,
        len(stack.forward),
        tuple(inputs),
        tuple(outputs),
        tuple(stacked_in),
        tuple(stacked_out),
        len(g.outputs),
        g.out_tree,
        resident,
        stack.period,
    )
    args = []
    for ms, st in zip(inputs, stacked_in):
        t, n = g.values[g.inputs[ms[0]]], len(ms)
        shape = t.shape if n == 1 else (n,) if st else (n * t.shape[0], *t.shape[1:])
        args.append(abstract_value(t, shape))
    # the replayed ops include those the step never reads (its unused scalar converts,
    # once per layer slot: a third of GPT-3 175B's rolled graph), dropped as `jax.jit` does
    new = relined(without_dead(capture(r.function(info), args, (), mesh)), graph)
    # the loops stand for the user's layers: named by the first layer's first line, and
    # their bodies' ops by the user's lines of the layers they came from
    where = graph.nodes[stack.forward[0].nodes[0]].source
    loops = iter(r.loops)
    nodes = tuple(
        replace(n, source=where, body=lines_from(n.body, _ref_nodes(graph, next(loops, None))))
        if n.body is not None and SCOPE in n.name_stack
        else n
        for n in new.nodes
    )
    flat = lambda n: jax.tree_util.tree_structure(tuple(range(n)))  # noqa: E731
    new = replace(
        new,
        nodes=nodes,
        input_paths=tuple(in_paths),
        output_paths=tuple(out_paths),
        in_tree=flat(len(inputs)),
        out_tree=flat(len(outputs)),
        name=graph.name,
    )
    return new, info
