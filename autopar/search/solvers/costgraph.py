"""The abstract cost graph the exact solvers work on, and their common answer.

A cost graph has one node per operator and one edge per producer/consumer
pair. Node ``v`` has ``S_v`` candidate strategies, each with a time (seconds)
and a memory (bytes); edge ``(u, v)`` has an ``[S_u, S_v]`` matrix of
resharding times. Choosing one strategy per node costs

    sum_v node_cost[v][s_v] + sum_(u, v) edges[u, v][s_u, s_v]

and uses ``sum_v node_mem[v][s_v]`` bytes (a simple additive memory model).
The solvers treat the graph as undirected: an edge's direction only fixes
the orientation of its matrix. Nothing here knows about JAX.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CostGraph", "Solution"]

# An edge matrix counts as ``a[i] + b[j]`` when it differs from that by less
# than this fraction of its largest entry.
_SEPARABLE_RTOL = 1e-13


def _named(name: str, at: object) -> str:
    return f"{name}[{', '.join(map(str, at)) if isinstance(at, tuple) else at}]"


def _frozen_array(x, ndim: int, name: str, at: object) -> np.ndarray:
    """`x` as a read-only float64 view (a copy only where it is not float64 already);
    `name[at]` in the error where it cannot be one of `ndim` dimensions. (Graphs of
    10k+ nodes are built several times per search: the message is made on error only.)"""
    try:
        a = np.asarray(x, dtype=np.float64).view()  # no copy of a float64 array
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{_named(name, at)} must be convertible to a float64 array: {e}"
        ) from None
    if a.ndim != ndim:
        raise ValueError(f"{_named(name, at)} must be {ndim}-D, got shape {a.shape}.")
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class CostGraph:
    """Operators with candidate strategies, and resharding costs between them.

    Attributes:
      node_cost: per node ``v``, float64 ``[S_v]`` time (seconds) of each strategy.
      node_mem: per node ``v``, float64 ``[S_v]`` bytes of each strategy.
      edges: ``(u, v) -> float64 [S_u, S_v]`` resharding time. Usually ``u < v``
        (a DAG in node index order), but the solvers do not require it; a pair
        given in both orientations counts as two parallel edges.

    Arrays are held as read-only float64 views (copied only where the input is not
    a float64 array already: the engines' tables are large, and a search builds
    several graphs of them), so a caller must not change them in place afterwards;
    call :meth:`check` to validate shapes and values (the solvers do).
    """

    node_cost: tuple[np.ndarray, ...]
    node_mem: tuple[np.ndarray, ...]
    edges: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        cost = tuple(_frozen_array(c, 1, "node_cost", v) for v, c in enumerate(self.node_cost))
        mem = tuple(_frozen_array(m, 1, "node_mem", v) for v, m in enumerate(self.node_mem))
        edges = {}
        for (u, v), m in self.edges.items():
            u, v = int(u), int(v)
            edges[u, v] = _frozen_array(m, 2, "edges", (u, v))
        object.__setattr__(self, "node_cost", cost)
        object.__setattr__(self, "node_mem", mem)
        object.__setattr__(self, "edges", edges)

    @classmethod
    def build(
        cls,
        node_cost: Sequence[Sequence[float]],
        node_mem: Sequence[Sequence[float]],
        edge_list: Iterable[tuple[int, int, np.ndarray]] = (),
    ) -> CostGraph:
        """A graph from ``(u, v, matrix)`` triples, summing parallel edges.

        Edges are stored as ``(min(u, v), max(u, v))``; a triple given as
        ``(v, u, M)`` with ``u < v`` contributes ``M.T``.
        """
        edges: dict[tuple[int, int], np.ndarray] = {}
        for u, v, m in edge_list:
            u, v = int(u), int(v)
            m = np.asarray(m, dtype=np.float64)
            if u > v:
                u, v, m = v, u, m.T
            if (u, v) in edges:
                if edges[u, v].shape != m.shape:
                    raise ValueError(
                        f"Parallel edges between nodes {u} and {v} have different shapes "
                        f"{edges[u, v].shape} and {m.shape}; both must be [S_{u}, S_{v}]."
                    )
                edges[u, v] = edges[u, v] + m
            else:
                edges[u, v] = m
        return cls(tuple(node_cost), tuple(node_mem), edges)

    def num_nodes(self) -> int:
        return len(self.node_cost)

    def num_strategies(self) -> tuple[int, ...]:
        return tuple(c.shape[0] for c in self.node_cost)

    def check(self) -> None:
        """Raise ValueError unless every shape matches and every value is finite."""
        n = len(self.node_cost)
        if len(self.node_mem) != n:
            raise ValueError(
                f"node_cost has {n} nodes but node_mem has {len(self.node_mem)}; "
                "give one memory vector per node."
            )
        for v, (c, m) in enumerate(zip(self.node_cost, self.node_mem)):
            if c.shape[0] == 0:
                raise ValueError(f"Node {v} has no strategies; every node needs at least one.")
            if m.shape != c.shape:
                raise ValueError(
                    f"Node {v} has {c.shape[0]} strategy costs but {m.shape[0]} memory "
                    "sizes; node_cost[v] and node_mem[v] must have the same length."
                )
            if not (np.isfinite(c).all() and np.isfinite(m).all()):
                raise ValueError(
                    f"Node {v} has a non-finite cost or memory: cost={c}, mem={m}. "
                    "Drop infeasible strategies instead of giving them infinite cost."
                )
        for (u, v), e in self.edges.items():
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"Edge ({u}, {v}) names a node outside 0..{n - 1}.")
            if u == v:
                raise ValueError(f"Edge ({u}, {v}) is a self-loop; fold it into node_cost[{u}].")
            want = (self.node_cost[u].shape[0], self.node_cost[v].shape[0])
            if e.shape != want:
                raise ValueError(
                    f"Edge ({u}, {v}) has a {e.shape} matrix but nodes {u} and {v} have "
                    f"{want[0]} and {want[1]} strategies; it must be [S_{u}, S_{v}] = {want}."
                )
            if not np.isfinite(e).all():
                raise ValueError(f"Edge ({u}, {v}) has a non-finite resharding cost.")

    def merged_edges(self) -> dict[tuple[int, int], np.ndarray]:
        """Edges keyed ``(a, b)`` with ``a < b``, parallel edges summed, ``[S_a, S_b]``."""
        out: dict[tuple[int, int], np.ndarray] = {}
        for (u, v), m in self.edges.items():
            if u > v:
                u, v, m = v, u, m.T
            out[u, v] = out[u, v] + m if (u, v) in out else m
        return out

    def min_memory(self) -> float:
        """The smallest memory any plan uses: every node at its smallest strategy."""
        return math.fsum(float(m.min()) for m in self.node_mem)

    def check_budget(self, memory_budget: float) -> None:
        """Raise ValueError, giving the smallest memory possible, if no plan fits."""
        smallest = self.min_memory()
        if smallest > memory_budget:
            raise ValueError(
                f"No plan fits memory_budget={memory_budget:.6g} bytes: the smallest memory "
                f"any plan uses is {smallest:.6g} bytes (every node at its smallest-memory "
                "strategy). Raise the budget, or add strategies that shard more so each "
                "device holds less."
            )

    def presolve(self) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
        """Node costs and merged edges, with every additively separable edge folded away.

        An edge whose matrix is ``M[i, j] = a[i] + b[j]`` (all zero, constant,
        or touching a node with one strategy) does not couple its endpoints:
        ``a`` joins ``u``'s node cost, ``b`` joins ``v``'s, and the edge is
        dropped. Plans keep exactly the same total. Returns
        ``(node_cost, {(u, v): [S_u, S_v]} with u < v)``.
        """
        cost = list(self.node_cost)
        edges = {}
        for (u, v), m in self.merged_edges().items():
            a = m[:, 0]
            b = m[0, :] - m[0, 0]
            resid = m - a[:, None] - b[None, :]
            if np.abs(resid).max() <= _SEPARABLE_RTOL * np.abs(m).max():
                cost[u] = cost[u] + a
                cost[v] = cost[v] + b
            else:
                edges[u, v] = m
        return cost, edges

    def restrict(self, pinned: Mapping[int, int]) -> CostGraph:
        """The graph with each pinned node ``v`` left only its strategy ``pinned[v]``
        (index 0 there). A pinned node's edges then touch a one-strategy node, so
        :meth:`presolve` folds them into its neighbours' costs and the solvers never
        see them: pinning the arguments (``data``, ``fsdp``, ZeRO retries) cuts the
        hubs parameters make between forward, backward and optimizer. Map plans with
        :meth:`lift_choice` and :meth:`lower_choice`."""
        if not pinned:
            return self
        cost, mem = list(self.node_cost), list(self.node_mem)
        for v, s in pinned.items():
            cost[v], mem[v] = cost[v][s : s + 1], mem[v][s : s + 1]
        edges = {}
        for (u, v), m in self.edges.items():
            if u in pinned:
                m = m[pinned[u] : pinned[u] + 1]
            if v in pinned:
                m = m[:, pinned[v] : pinned[v] + 1]
            edges[u, v] = m
        return CostGraph(tuple(cost), tuple(mem), edges)

    @staticmethod
    def lift_choice(choice: Sequence[int], pinned: Mapping[int, int]) -> list[int]:
        """A plan of ``restrict(pinned)`` as a plan of this graph."""
        return [pinned.get(v, int(s)) for v, s in enumerate(choice)]

    @staticmethod
    def lower_choice(choice: Sequence[int], pinned: Mapping[int, int]) -> list[int]:
        """A plan of this graph as a plan of ``restrict(pinned)`` (pins override)."""
        return [0 if v in pinned else int(s) for v, s in enumerate(choice)]

    def _check_choice(self, choice: Sequence[int]) -> None:
        if len(choice) != len(self.node_cost):
            raise ValueError(
                f"A choice needs one strategy per node: got {len(choice)} for "
                f"{len(self.node_cost)} nodes."
            )
        for v, s in enumerate(choice):
            if not 0 <= s < self.node_cost[v].shape[0]:
                raise ValueError(
                    f"Node {v} has strategies 0..{self.node_cost[v].shape[0] - 1}, got {s}."
                )

    def total(self, choice: Sequence[int]) -> float:
        """Time of a plan: node costs plus resharding costs on every edge."""
        self._check_choice(choice)
        t = math.fsum(float(c[s]) for c, s in zip(self.node_cost, choice))
        return t + math.fsum(float(m[choice[u], choice[v]]) for (u, v), m in self.edges.items())

    def memory(self, choice: Sequence[int]) -> float:
        """Bytes of a plan: the sum of the chosen strategies' memory."""
        self._check_choice(choice)
        return math.fsum(float(m[s]) for m, s in zip(self.node_mem, choice))


@dataclass(frozen=True)
class Solution:
    """A plan and what is known about it.

    Attributes:
      choice: strategy index of every node.
      cost: ``graph.total(choice)`` in seconds.
      memory: ``graph.memory(choice)`` in bytes.
      optimal: proven optimal under the cost model (and memory budget).
      gap: relative gap ``(cost - lower_bound) / |cost|`` when a bound is known,
        ``0.0`` when proven optimal, else ``None``.
      seconds: wall-clock time the solver took.
      info: solver details (elimination counts, solver status, ...).
    """

    choice: tuple[int, ...]
    cost: float
    memory: float
    optimal: bool
    gap: float | None
    seconds: float
    info: Mapping[str, object] = field(default_factory=dict)
