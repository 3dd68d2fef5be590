"""Positions along the batch in a step cut into micro-batches.

`jnp.arange(B)` over the batch is an `iota`: traced at the micro-batch size it holds
the micro-batch's own positions `0 .. B/M - 1`, which are not rows `m::M` of the whole
batch's. Such values are right inside the micro-batch program only where they index
the batch dim of a value that is itself cut into micro-batches, as public code writes
per-example picks: `logp[jnp.arange(B), labels]` (a cross-entropy), `x[jnp.arange(B),
eot]` (CLIP's and GPT-2's last-token pooling), and the `scatter-add` JAX makes of them
for the gradient. `Positions` follows such values through `separate`
(`autopar.passes.microbatch`): the exact positions (`iota`, JAX's negative-index
normalisation `select_n(p < 0, p, p + n)`, casts, reshapes and broadcasts that only
add unit dims), the index arrays `concatenate` builds from them, and the gathers and
scatters they index. Any other reader of positions cannot run per micro-batch, and
no position may leave the micro-batch program (`escapes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.ir.graph import Graph, Node
from autopar.sharding import Spec

_SAME = ("convert_element_type", "reshape", "broadcast_in_dim", "squeeze")


def _split_on(spec: Spec, dim: int, axis: str) -> bool:
    return (
        not spec.partial
        and spec.dims[dim] == (axis,)
        and not any(a for d, a in enumerate(spec.dims) if d != dim)
    )


@dataclass
class Positions:
    """The position values of one `separate` run over `graph` on the virtual axis `axis`."""

    graph: Graph
    axis: str
    pos: dict[int, int] = field(default_factory=dict)  # value -> its dim of positions
    norm: dict[int, tuple] = field(default_factory=dict)  # `p < 0`, `p + n` -> (op, p)
    cols: dict[int, dict[int, int]] = field(default_factory=dict)  # index array -> {col: dim}

    def reads(self, node: Node) -> bool:
        return any(v in self.pos or v in self.norm or v in self.cols for v in node.inputs)

    def iota(self, node: Node, micro: Graph | None) -> Spec | None:
        """An `iota` whose length is the batch's (the traces differ): its spec, split
        along its positions, and it is recorded as positions; else None."""
        if node.op != "iota" or micro is None:
            return None
        (out,) = node.outputs
        full = self.graph.values[out]
        if micro.values[out].shape == full.shape:
            return None
        dim = node.params["dimension"]
        self.pos[out] = dim
        return Spec(tuple((self.axis,) if d == dim else () for d in range(full.rank)))

    def step(self, node: Node, got: Sequence[Spec]) -> list[Spec] | None:
        """The output specs of `node`, which reads positions, where it keeps them exact
        or indexes the batch with them; None where it cannot run per micro-batch."""
        g, ins = self.graph, node.inputs
        shape = lambda v: g.values[v].shape  # noqa: E731
        consts = g.consts
        if node.op in ("lt", "add") and ins[0] in self.pos and ins[1] in consts:
            # `p < 0`, `p + n`: JAX's fix-up of negative indices, `select_n(p < 0, p, p + n)`
            if not shape(ins[1]) and (node.op == "add" or consts[ins[1]] == 0):
                self.norm[node.outputs[0]] = (node.op, ins[0])
                return [got[0]]
            return None
        if node.op == "select_n" and len(ins) == 3 and ins[1] in self.pos:
            p = ins[1]
            if self.norm.get(ins[0]) == ("lt", p) and self.norm.get(ins[2]) == ("add", p):
                self.pos[node.outputs[0]] = self.pos[p]
                return [got[1]]
            return None
        if node.op in _SAME and ins[0] in self.pos:
            return self._reshaped(node, got)
        if node.op == "concatenate":
            return self._columns(node, got)
        if node.op == "gather":
            return self._gather(node, got)
        if node.op == "scatter-add":
            return self._scatter(node, got)
        return None

    def escapes(self, have: dict[int, Spec]) -> bool:
        """Whether a position value is read by an op that does not run per micro-batch,
        or is a result of the graph: it would leave the micro-batch program."""
        g = self.graph
        marked = self.pos.keys() | self.norm.keys() | self.cols.keys()
        if marked & set(g.outputs):
            return True
        return any(
            not all(y in have for y in g.nodes[c].outputs)
            for v in marked
            for c in g.consumers.get(v, ())
        )

    # ------------------------------------------------------------------ the rules
    def _reshaped(self, node: Node, got: Sequence[Spec]) -> list[Spec] | None:
        (x,), (out,) = node.inputs[:1], node.outputs
        n = self.graph.values[x].shape[self.pos[x]]
        new = self.graph.values[out].shape
        dims = [d for d, k in enumerate(new) if k == n]
        if len(dims) != 1 or any(k != 1 for d, k in enumerate(new) if d != dims[0]):
            return None
        self.pos[out] = dims[0]
        return [Spec(tuple((self.axis,) if d == dims[0] else () for d in range(len(new))))]

    def _columns(self, node: Node, got: Sequence[Spec]) -> list[Spec] | None:
        """An index array `[B, k]` concatenated along its last dim from columns, some
        of them positions along the batch (dim 0), the rest per example."""
        g, (out,) = self.graph, node.outputs
        rank = g.values[out].rank
        if rank != 2 or node.params["dimension"] != 1:
            return None
        cols, at = {}, 0
        for v, spec in zip(node.inputs, got):
            width = g.values[v].shape[1]
            if v in self.pos:
                if self.pos[v] != 0 or width != 1:
                    return None
                cols[at] = 0
            elif (
                v in self.norm
                or v in self.cols
                or (spec.used_axes and not _split_on(spec, 0, self.axis))
            ):
                return None
            at += width
        self.cols[out] = cols
        return [Spec(((self.axis,), ()))]

    def _gather(self, node: Node, got: Sequence[Spec]) -> list[Spec] | None:
        """`operand[positions, ...]` with the operand cut along dim 0: each micro-batch
        picks from its own rows, as the whole batch does from its."""
        operand, indices = node.inputs
        dn = node.params["dimension_numbers"]
        if indices not in self.cols or dn.operand_batching_dims:
            return None
        if not self._indexes_batch(self.cols[indices], dn.start_index_map, dn.collapsed_slice_dims):
            return None
        if not (_split_on(got[0], 0, self.axis) and _split_on(got[1], 0, self.axis)):
            return None
        out = self.graph.values[node.outputs[0]]
        first = next(d for d in range(out.rank) if d not in dn.offset_dims)
        return [Spec(tuple((self.axis,) if d == first else () for d in range(out.rank)))]

    def _scatter(self, node: Node, got: Sequence[Spec]) -> list[Spec] | None:
        """The gradient of such a gather: updates added into rows of a value cut along
        dim 0, at positions of the micro-batch's own rows."""
        operand, indices, updates = node.inputs
        dn = node.params["dimension_numbers"]
        if indices not in self.cols or dn.operand_batching_dims:
            return None
        if not self._indexes_batch(
            self.cols[indices], dn.scatter_dims_to_operand_dims, dn.inserted_window_dims
        ):
            return None
        rank_u = self.graph.values[updates].rank
        first = next((d for d in range(rank_u) if d not in dn.update_window_dims), None)
        whole = not got[0].used_axes and not got[0].partial  # sliced for free
        if first is None or not (whole or _split_on(got[0], 0, self.axis)):
            return None
        if not (_split_on(got[1], 0, self.axis) and _split_on(got[2], first, self.axis)):
            return None
        rank = self.graph.values[node.outputs[0]].rank
        return [Spec(tuple((self.axis,) if d == 0 else () for d in range(rank)))]

    @staticmethod
    def _indexes_batch(cols: dict[int, int], to_operand: Sequence[int], collapsed) -> bool:
        """The position columns index the operand's dim 0, one row each."""
        return bool(cols) and all(
            to_operand[c] == 0 and 0 in collapsed for c, dim in cols.items() if dim == 0
        )
