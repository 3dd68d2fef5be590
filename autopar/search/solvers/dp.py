"""Exact strategy search by graph elimination (docs/algorithms.md, section 3).

The cost graph is shrunk one node at a time. Each step removes a node ``v``
whose best strategy is a function of at most two surviving neighbours, folds
its cost into them, and logs what it minimized over. When every node is gone,
the log is replayed backwards: each entry picks ``v``'s strategy from the
strategies already fixed for the neighbours it was folded into.

Edge direction only orients matrices, so elimination works on the undirected
graph. Every step is exact (in float32, `_DTYPE`); a graph that shrinks to nothing
without giving up (see ``star``) is solved optimally, up to float32's rounding. A
memory budget is handled by Lagrangian relaxation over the exact solver (see
:func:`_within_budget`).
"""

from __future__ import annotations

import collections
import math
import time

import numpy as np

from autopar.search.solvers.costgraph import CostGraph, Solution
from autopar.search.solvers.forest import RTOL as _RTOL
from autopar.search.solvers.forest import forest_descent as _forest_descent
from autopar.search.solvers.kernels import minplus as _minplus

__all__ = ["solve_dp"]

# The elimination's arithmetic. float32 halves the bytes the star fusions build and
# move: their tables reach 100+ MB in float64, and fresh allocations that size are
# slow (docs/algorithms.md). Plans are priced again in float64; a plan is optimal up
# to float32's rounding of the sums it compares (relative 6e-8 per addition).
_DTYPE = np.float32
# Under a memory budget, how many of the Lagrangian plans (repaired to fit)
# get the budget-respecting ICM polish.
_POLISHED = 4


class _Eliminator:
    """The shrinking graph, and the log that recovers every strategy.

    ``adj[x][y]`` is the ``[S_x, S_y]`` matrix of edge x--y; ``adj[y][x]`` is
    its transpose view. Fused nodes get fresh ids after the original ones.
    """

    def __init__(self, cost, edges, max_states: int, max_work: float):
        self.n = len(cost)
        self.cost = [np.asarray(c, dtype=_DTYPE) for c in cost]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in cost]
        # star_plan per node, dropped whenever the node's neighbours change (sizes of
        # existing nodes never do): each star step scans every node
        self._plans: dict[int, tuple[int, list[list[int]]] | None] = {}
        for (u, v), m in edges.items():
            self._add_edge(u, v, np.asarray(m, dtype=_DTYPE))
        self.alive = set(range(self.n))
        self.log: list[tuple] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.max_states = max_states
        self.max_work = max_work
        self.exact = True

    def _add_edge(self, x: int, y: int, m: np.ndarray) -> bool:
        """Add ``m`` to edge x--y; True when the edge already existed."""
        merged = y in self.adj[x]
        if merged:
            m = self.adj[x][y] + m
        self.adj[x][y] = m
        self.adj[y][x] = m.T
        if not merged:
            self._plans.pop(x, None)
            self._plans.pop(y, None)
        return merged

    def _remove(self, x: int) -> None:
        for y in self.adj[x]:
            del self.adj[y][x]
            self._plans.pop(y, None)
        self.adj[x] = {}
        self._plans.pop(x, None)
        self.alive.discard(x)

    def size(self, x: int) -> int:
        return self.cost[x].shape[0]

    # -- eliminations ------------------------------------------------------

    def root(self, v: int) -> None:
        """An isolated node: everything else of its component is folded in.

        ``v``  becomes  (nothing)        s_v = argmin node_v
        """
        self.log.append(("root", v, self.cost[v]))
        self._remove(v)
        self.counts["root"] += 1

    def leaf(self, v: int) -> None:
        """A node with one neighbour folds into it ("merge" / "contract").

        merge:     v --> u <-- ...     contract:  ... --> u --> v
                   node_u'(su) = node_u(su) + min_sv edge(sv, su) + node_v(sv)
        """
        (u,) = self.adj[v]
        m, c = self.adj[v][u], self.cost[v]  # [S_v, S_u], [S_v]
        self.cost[u] = self.cost[u] + (m + c[:, None]).min(axis=0)
        # the table m + c is not kept (S_v x S_u floats per leaf): `replay` adds the one
        # column it needs, the same sums
        self.log.append(("leaf", v, u, m, c))
        self._remove(v)
        self.counts["merge" if v < u else "contract"] += 1

    def op_work(self, v: int) -> int:
        u, w = self.adj[v]
        return self.size(u) * self.size(v) * self.size(w)

    def op(self, v: int) -> None:
        """A node with two neighbours becomes an edge between them ("op", "triangle").

        op:        u --> v --> w       becomes  u --> w
        triangle:  u --> v --> w, u --> w      the new edge adds onto u --> w
                   edge'(su, sw) = min_sv edge(su, sv) + node_v(sv) + edge(sv, sw)
        """
        u, w = self.adj[v]
        m, c = self.adj[u][v], self.cost[v]  # [S_u, S_v], [S_v]
        a = m + c[None, :]
        b = self.adj[v][w]  # [S_v, S_w]
        self.log.append(("op", v, u, w, m, c, b))  # not `a`: `replay` adds the row it needs
        self._remove(v)
        self.counts["triangle" if self._add_edge(u, w, _minplus(a, b)) else "op"] += 1

    def fuse(self, a: int, b: int) -> int:
        """Two nodes become one whose strategies are their pairs (used by ``star``).

            n1 -- a -- n2             n1 -- (a,b) -- n2
                  |          becomes           \\
                  b -- n3                        n3
            node(sa, sb) = node_a(sa) + node_b(sb) + edge(sa, sb)
        """
        sa, sb = self.size(a), self.size(b)
        c = self.cost[a][:, None] + self.cost[b][None, :]
        if b in self.adj[a]:
            c = c + self.adj[a][b]
        k = len(self.cost)
        self.cost.append(c.reshape(-1))
        self.adj.append({})
        ea = {y: m for y, m in self.adj[a].items() if y != b}
        eb = {y: m for y, m in self.adj[b].items() if y != a}
        self._remove(a)
        self._remove(b)
        for y in ea.keys() | eb.keys():
            if y not in eb:
                m = np.repeat(ea[y], sb, axis=0)
            elif y not in ea:
                m = np.tile(eb[y], (sa, 1))
            else:
                m = (ea[y][:, None, :] + eb[y][None, :, :]).reshape(sa * sb, -1)
            self._add_edge(k, y, m)
        self.alive.add(k)
        self.log.append(("fuse", k, a, b, sb))
        self.counts["fuse"] += 1
        return k

    def star_plan(self, v: int) -> tuple[int, list[list[int]]] | None:
        """Work and neighbour groups to eliminate ``v`` by fusing, or None if too big."""
        nbrs = sorted(self.adj[v], key=self.size, reverse=True)
        groups: list[list[int]] = [[], []]
        sizes = [1, 1]
        for y in nbrs:
            g = 0 if sizes[0] <= sizes[1] else 1
            groups[g].append(y)
            sizes[g] *= self.size(y)
        work = self.size(v) * sizes[0] * sizes[1]
        fused_too_big = any(len(g) > 1 and s > self.max_states for g, s in zip(groups, sizes))
        if fused_too_big or work > self.max_work:
            return None
        return work, groups

    def star(self) -> bool:
        """Last resort when every node has three or more neighbours.

            n1   n2   n3                (n1,n2)   n3
              \\  |  /        becomes        \\   /      then op-eliminate v
                 v                            v

        Pick the node whose neighbours' strategy product is smallest, fuse its
        neighbours into two groups (enumerating their strategy pairs), and
        eliminate it as an ``op``. Exponential in the degree, so bounded by
        ``max_states`` per fused node and ``max_work`` per step; returns False
        when no node fits.
        """
        best = None
        plans = self._plans
        for v in self.alive:
            if v in plans:
                plan = plans[v]
            else:
                plan = plans[v] = self.star_plan(v)
            if plan is not None and (best is None or plan[0] < best[0]):
                best = (plan[0], v, plan[1])
        if best is None:
            return False
        _, v, groups = best
        groups = [list(g) for g in groups]
        for g in groups:
            while len(g) > 1:
                g[:2] = [self.fuse(g[0], g[1])]
        self.counts["star"] += 1
        self.op(v)
        return True

    def kernel(self) -> None:
        """Too big to enumerate: fix what is left by greedy + iterated conditional modes.

        The remaining nodes carry everything eliminated so far in their costs,
        so a good kernel assignment is still replayed exactly into the rest.
        """
        nodes = sorted(self.alive, key=lambda x: -len(self.adj[x]))
        choice: dict[int, int] = {}

        def local(x):
            c = self.cost[x]
            for y, m in self.adj[x].items():
                if y in choice:
                    c = c + m[:, choice[y]]
            return c

        for x in nodes:
            choice[x] = int(np.argmin(local(x)))
        for _ in range(100):
            changed = False
            for x in nodes:
                c = local(x)
                s = int(np.argmin(c))
                if c[s] < c[choice[x]]:
                    choice[x] = s
                    changed = True
            if not changed:
                break
        self.log.append(("kernel", choice))
        self.counts["kernel"] += len(nodes)
        self.exact = False
        for x in nodes:
            self._remove(x)

    # -- driver ------------------------------------------------------------

    def run(self) -> list[int]:
        low = collections.deque(x for x in range(self.n) if len(self.adj[x]) <= 1)
        mid = collections.deque(x for x in range(self.n) if len(self.adj[x]) == 2)
        while self.alive:
            while low or mid:
                x = low.popleft() if low else mid.popleft()
                if x not in self.alive:
                    continue
                nbrs = list(self.adj[x])
                if len(nbrs) == 0:
                    self.root(x)
                elif len(nbrs) == 1:
                    self.leaf(x)
                elif len(nbrs) == 2 and self.op_work(x) <= self.max_work:
                    self.op(x)
                else:
                    continue
                for y in self.adj_after(nbrs):
                    (low if len(self.adj[y]) <= 1 else mid).append(y)
            if self.alive and not self.star():
                self.kernel()
            for y in self.alive:
                if len(self.adj[y]) <= 2:
                    (low if len(self.adj[y]) <= 1 else mid).append(y)
        return self.replay()

    def adj_after(self, nbrs: list[int]) -> list[int]:
        """Neighbours of an eliminated node that may now be eliminable."""
        return [y for y in nbrs if y in self.alive and len(self.adj[y]) <= 2]

    def replay(self) -> list[int]:
        choice = [-1] * len(self.cost)
        for entry in reversed(self.log):
            kind = entry[0]
            if kind == "root":
                _, v, c = entry
                choice[v] = int(np.argmin(c))
            elif kind == "leaf":
                _, v, u, m, c = entry
                choice[v] = int(np.argmin(m[:, choice[u]] + c))
            elif kind == "op":
                _, v, u, w, m, c, b = entry
                choice[v] = int(np.argmin(m[choice[u]] + c + b[:, choice[w]]))
            elif kind == "fuse":
                _, k, a, b, sb = entry
                choice[a], choice[b] = divmod(choice[k], sb)
            else:  # kernel
                for x, s in entry[1].items():
                    choice[x] = s
        return choice[: self.n]


def _eliminate(cost, edges, max_states, max_work, polish=(30, 3)):
    """Minimize node + edge costs; exact unless the kernel had to be guessed.
    ``polish``: (max_rounds, patience) of the forest descent after a guessed kernel."""
    e = _Eliminator(cost, edges, max_states, max_work)
    choice = e.run()
    counts = dict(e.counts)
    if not e.exact:
        choice, counts["forest_rounds"] = _forest_descent(cost, edges, choice, *polish)
    return choice, e.exact, counts


class _LocalSearch:
    """One-node moves on a plan, used to polish a plan under a memory budget."""

    def __init__(self, cost, mem, edges, budget):
        self.cost, self.mem, self.budget = cost, mem, budget
        self.nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in cost]
        for (u, v), m in edges.items():
            self.nbrs[u].append((v, m))
            self.nbrs[v].append((u, m.T))

    def local(self, v: int, choice) -> np.ndarray:
        """Time of each strategy of ``v`` with its neighbours held fixed."""
        c = self.cost[v]
        for y, m in self.nbrs[v]:
            c = c + m[:, choice[y]]
        return c

    def repair(self, choice) -> list[int]:
        """Free memory greedily, by the least time added per byte, until within budget."""
        choice = list(choice)
        used = math.fsum(float(m[s]) for m, s in zip(self.mem, choice))
        ratio = np.full(len(choice), np.inf)
        target = [0] * len(choice)

        def best_move(v):
            c, m = self.local(v, choice), self.mem[v]
            freed = m[choice[v]] - m
            r = np.where(freed > 0, (c - c[choice[v]]) / np.where(freed > 0, freed, 1), np.inf)
            target[v] = int(np.argmin(r))
            ratio[v] = r[target[v]]

        for v in range(len(choice)):
            best_move(v)
        while used > self.budget:
            v = int(np.argmin(ratio))
            if not np.isfinite(ratio[v]):
                break
            used -= self.mem[v][choice[v]] - self.mem[v][target[v]]
            choice[v] = target[v]
            best_move(v)
            for y, _ in self.nbrs[v]:
                best_move(y)
        return choice

    def polish(self, choice, sweeps: int = 20) -> list[int]:
        """Budget-respecting ICM: move one node at a time to a cheaper strategy that fits."""
        choice = list(choice)
        used = math.fsum(float(m[s]) for m, s in zip(self.mem, choice))
        for _ in range(sweeps):
            changed = False
            for v in range(len(choice)):
                m = self.mem[v]
                room = self.budget - (used - m[choice[v]])
                c = np.where(m <= room, self.local(v, choice), np.inf)
                s = int(np.argmin(c))
                if c[s] < c[choice[v]] - _RTOL * abs(c[choice[v]]):
                    used += m[s] - m[choice[v]]
                    choice[v] = s
                    changed = True
            if not changed:
                break
        return choice


def _within_budget(g, cost, edges, budget, first, max_states, max_work, polish=(30, 3)):
    """Cheapest plan within ``budget``, by Lagrangian relaxation on memory.

    Minimizing ``time + lam * memory`` exactly gives a plan ``x(lam)`` and a
    lower bound ``L(lam) = time(x) + lam * (memory(x) - budget)`` on the
    constrained optimum. Start from the unconstrained plan (lam = 0, over
    budget) and the cheapest smallest-memory plan (lam -> inf, within budget);
    repeatedly solve at the ``lam`` where their two lines cross, replacing the
    one on the same side of the budget (Kelley's cutting plane on the concave
    dual). It stops when the new plan is no better than the crossing: ``lam``
    then maximizes ``L``. The best plan within budget is then polished by a
    budget-respecting ICM pass. ``optimal`` holds when the bound closes the gap.

    Pareto lists of (time, memory) per state are not kept: their length grows
    with every fold, and ``solve_ilp`` is the exact answer under a budget.
    """
    mem = g.node_mem

    def evaluate(x):
        return g.total(x), g.memory(x)

    lo = (first[0], *evaluate(first[0]))  # over budget
    exact = first[1]
    smallest = [np.where(m <= m.min(), c, np.inf) for c, m in zip(cost, mem)]
    x, _, _ = _eliminate(smallest, edges, max_states, max_work, polish)
    hi = (x, *evaluate(x))
    best = hi
    seen = [lo, hi]
    bound = lo[1]
    lam = 0.0
    iterations = 0
    while iterations < 64 and hi[1] > lo[1]:
        iterations += 1
        lam = (hi[1] - lo[1]) / (lo[2] - hi[2])
        x, ex, _ = _eliminate(
            [c + lam * m for c, m in zip(cost, mem)], edges, max_states, max_work, polish
        )
        exact &= ex
        t, used = evaluate(x)
        seen.append((x, t, used))
        bound = max(bound, t + lam * (used - budget))
        if used <= budget and t < best[1]:
            best = (x, t, used)
        crossing = lo[1] + lam * lo[2]
        if t + lam * used >= crossing - _RTOL * abs(crossing):
            break
        if used > budget:
            lo = (x, t, used)
        else:
            hi = (x, t, used)

    def gap_of(t):
        return max(0.0, (t - bound) / abs(t)) if t else 0.0

    if not (exact and gap_of(best[1]) <= _RTOL):
        search = _LocalSearch(cost, mem, edges, budget)
        repaired = [x if used <= budget else search.repair(x) for x, _, used in seen]
        for x in sorted(repaired, key=g.total)[:_POLISHED]:
            x = search.polish(x)
            t, used = evaluate(x)
            if used <= budget and t < best[1]:
                best = (x, t, used)
    gap = gap_of(best[1]) if exact else None
    optimal = gap is not None and gap <= _RTOL
    info = {"lagrange_iterations": iterations, "lambda": lam}
    if exact:
        info["lower_bound"] = bound
    return best[0], optimal, (0.0 if optimal else gap), info


def solve_dp(
    g: CostGraph,
    memory_budget: float = math.inf,
    *,
    max_states: int = 4096,
    max_work: float = 2**26,
    polish: tuple[int, int] = (30, 3),
) -> Solution:
    """Choose one strategy per node minimizing total time, by graph elimination.

    Args:
      g: the cost graph.
      memory_budget: bytes the plan may use (``g.memory``); ``inf`` for none.
      max_states: the most strategies a node fused by ``star`` may have.
      max_work: the most min-plus terms one elimination step may evaluate.
        A graph that cannot be shrunk within these bounds has its remaining
        kernel assigned heuristically, and the result is marked not optimal.
      polish: (max_rounds, patience) of the forest descent that improves a plan
        whose kernel was guessed (``_forest_descent``); more rounds, better plans.

    Returns:
      A :class:`Solution`. ``optimal`` is True when the elimination was exact
      and, under a budget, the Lagrangian bound proves the plan optimal;
      ``gap`` is then 0.0, else the proven relative gap (or None when no
      bound is known). ``info`` counts each elimination kind.

    Raises:
      ValueError: if the graph is malformed, or if no plan fits the budget
        (the message gives the smallest memory possible).
    """
    start = time.perf_counter()
    g.check()
    cost, edges = g.presolve()
    choice, exact, counts = _eliminate(cost, edges, max_states, max_work, polish)
    counts["edge"] = len(g.edges) - len(g.merged_edges())
    counts["separable"] = len(g.merged_edges()) - len(edges)
    info: dict[str, object] = {"eliminations": counts, "exact": exact}
    optimal, gap = exact, (0.0 if exact else None)
    if g.memory(choice) > memory_budget:
        g.check_budget(memory_budget)
        choice, optimal, gap, extra = _within_budget(
            g, cost, edges, memory_budget, (choice, exact), max_states, max_work, polish
        )
        info.update(extra)
    choice = tuple(int(s) for s in choice)
    return Solution(
        choice=choice,
        cost=g.total(choice),
        memory=g.memory(choice),
        optimal=optimal,
        gap=gap,
        seconds=time.perf_counter() - start,
        info=info,
    )
