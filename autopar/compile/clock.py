"""The wall clock of one `.plan()`: the seconds of each phase, and `time_limit=`.

`Clock.phase(name)` times a phase exclusively (time spent in a phase nested inside it
counts for the nested one only), so the phases add up to the time of the call; what
no phase covers is reported as "other". The search (`autopar.search.search`) takes the
clock to time each engine and the polish, and asks `out_of_time()` before work it can
leave out; whatever is left out is named by `skip()` and reported to the user."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Clock:
    def __init__(self, time_limit: float | None = None):
        self.start = time.perf_counter()
        self.time_limit = time_limit
        self.deadline = None if time_limit is None else self.start + float(time_limit)
        self.phases: dict[str, float] = {}
        # seconds the search workers (`search.workers`) spent per phase, added up over
        # the workers: they overlap the parent's wait ("engines", "screen", "tries")
        self.workers: dict[str, float] = {}
        self.skipped: list[str] = []
        self._stack: list[list[float]] = []  # [started, seconds of nested phases]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._stack.append([t0, 0.0])
        try:
            yield
        finally:
            _, nested = self._stack.pop()
            spent = time.perf_counter() - t0
            self.phases[name] = self.phases.get(name, 0.0) + spent - nested
            if self._stack:
                self._stack[-1][1] += spent

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def worked(self, name: str, seconds: float) -> None:
        self.workers[name] = self.workers.get(name, 0.0) + seconds

    def skip(self, what: str) -> None:
        if what not in self.skipped:
            self.skipped.append(what)

    def report(self) -> dict[str, float]:
        """Seconds per phase, "other" (what no phase covered) and "total"."""
        total = self.elapsed()
        out = {k: round(v, 6) for k, v in self.phases.items()}
        out["other"] = round(max(total - sum(self.phases.values()), 0.0), 6)
        out["total"] = round(total, 6)
        return out


def try_name(shape: dict, pipelined) -> str:
    """A (mesh, pipeline) try as the progress display and the notes name it."""
    return f"{shape}" + (f" M={pipelined.pipe.microbatches}" if pipelined else "")


def left_out(tries: list, left: list[int], policy: str | None) -> str:
    """What `time_limit=` left out of the (mesh index, mesh, pipeline) `tries`: those at
    the indices `left`."""
    names = [
        try_name(dict(zip(m.axis_names, m.axis_sizes)), p) for _, m, p in (tries[i] for i in left)
    ]
    remat = f" (remat={policy})" if policy not in (None, "none") else ""
    return f"{len(names)} of {len(tries)} mesh/pipeline tries{remat}: " + ", ".join(names)
