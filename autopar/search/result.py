"""What a search returns: the plan, what produced it, its price, and the others found."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.cost.model import Cost

# What the exact solvers prove, by engine name, for the plan file (`search_info`).
SolverInfo = dict[str, object]


@dataclass(frozen=True)
class SearchResult:
    choice: tuple[int, ...]
    engine: str  # what produced the choice, e.g. "recursive" or "recursive+zero3"
    cost: Cost
    seconds: float
    candidates: dict[str, Cost]
    ranked: tuple[tuple[str, tuple[int, ...], Cost], ...] = ()  # every fitting plan, best first
    solver_info: dict[str, SolverInfo] = field(default_factory=dict)  # optimality / gap per engine

    def pick(self, name: str) -> SearchResult:
        """The same search, answered with the ranked plan `name` instead of the best."""
        _, choice, cost = next(r for r in self.ranked if r[0] == name)
        return replace(self, choice=choice, engine=name, cost=cost)
