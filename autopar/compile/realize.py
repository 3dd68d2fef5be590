"""Tries priced on a stack unrolled in Python rolled into one loop (`proxied`: one
layer a step, as under `scan`), made as they run: the fastest rolled into loops over
its stages (and, with no schedule asked for, tried interleaved too) or the step
searched with its layers unrolled, and the fastest try without a pipeline beside a
pipeline (docs/algorithms.md, "Pipelining layers unrolled in Python"). A mixin of
`compile.driver._Driver`, beside `compile.pipelines.PipelineTries`."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from jax.sharding import AbstractMesh

from autopar.compile.calls import OneLoop, Proxy
from autopar.compile.pipelines import Infeasible, proxied
from autopar.compile.tries import bound
from autopar.ir.graph import Graph
from autopar.passes.pipeline import PipelinedScans

log = logging.getLogger("autopar")


class Realizing:
    """`_realized`: a proxied try made as it runs (module doc)."""

    def _realized(self, graph: Graph, found, notes: tuple[str, ...], lead: tuple[str, ...]):
        """`found.ranked`'s first entry, a try priced on its unrolled stack rolled into
        one loop over all the layers (`proxied`), rolled into loops over its stages,
        built and searched as it will run; its plans, then the entries after it other
        than its own, made into the plan as `_first_that_fits` makes them."""
        step_s, k, _, mesh, _, _, pipelined = found.ranked[0]
        if isinstance(pipelined, OneLoop):
            return self._realized_unpipelined(graph, found, notes, lead)
        pipe = pipelined.pipe
        if self.o.pipeline_schedule is None and (pipe.schedule == "zb-h1" or pipelined.fallback):
            # a lock-step try's plans priced again (`_other_schedule`): searched as such;
            # or one that ran GPipe where 1F1B did not apply on one loop: tried as it runs
            pipe = replace(pipe, schedule="1f1b")
        rest = [
            r
            for r in found.ranked
            if not (r[1] == k and proxied(r[6]) and r[6].pipe.microbatches == pipe.microbatches)
        ]
        name = f"{dict(zip(mesh.axis_names, mesh.axis_sizes))} M={pipe.microbatches}"
        log.info("mesh %s: searching it again rolled into %d stages", name, pipe.stages)
        piped, got, fastest = self._made(graph, k, mesh, pipe)
        ranked = sorted(got, key=lambda r: r[:3]) if isinstance(got, list) else []
        again = (
            f"{ranked[0][0] * 1e3:.4g} ms searched again rolled into loops over its "
            f"{pipe.stages} stages (what runs)"
            if ranked
            else f"rolled into loops over its {pipe.stages} stages: {got.brief}"
        )
        notes = (
            *notes,
            f"{name}: {step_s * 1e3:.4g} ms as priced with its layers in one loop; {again}",
        )
        # and the fastest try without a pipeline, searched as it runs too: the one-loop
        # price of an unpipelined step can be well above it (a trial's ViT-B/16 on 64
        # devices: 36.8 ms on one loop, 32.5 as it runs, against the pipeline's 33.4)
        plain = next((r for r in rest if isinstance(r[6], OneLoop)), None)
        if plain is not None:
            more, note = self._plain(graph, plain)
            ranked, notes = sorted(ranked + more, key=lambda r: r[:3]), (*notes, note)
            rest = [r for r in rest if not (r[1] == plain[1] and isinstance(r[6], OneLoop))]
        if isinstance(piped, PipelinedScans) and piped.roll is not None:
            made = min((r[0] for r in ranked), default=math.inf)
            more, said = self._interleaved(graph, k, mesh, pipe, piped.roll.layers, fastest, made)
            ranked, notes = sorted(ranked + more, key=lambda r: r[:3]), (*notes, *said)
        out = self._first_that_fits(graph, replace(found, ranked=ranked + rest), notes, lead)
        return out.realize() if isinstance(out, Proxy) else out

    def _interleaved(
        self, graph: Graph, k: int, mesh, pipe, layers: int, fastest: float, made: float
    ) -> tuple[list, list]:
        """With no schedule asked for, a lock-step pipeline of layers unrolled in Python
        tried under the interleaved 1F1B too, at `virtual` 4 and 2 where the depth splits
        so, each rolled and searched as it runs (its leaves kept in chunk order: nothing
        moves, `autopar.ir.chunks`); its entries and the notes that say so. Not priced on
        one loop: the interleaved schedule needs its own roll. `fastest`: the lock-step
        search's fastest plan of any memory (`tries.bound`); `made`: the fastest plan
        made. The interleaved schedule at `v` runs the same work in `v M + S - 1` chunk
        slots of a `v`-th of a lock-step slot where the lock-step runs `M + S - 1`: on an
        abstract mesh (whose plans no compile check turns away, as for the walk's FLOP
        floor), where `fastest` shrunk so is no faster than the fastest made, `v` is not
        searched (the more chunks first: their bubble is the smaller, their plan the
        likelier best)."""
        if self.o.pipeline_schedule is not None or pipe.schedule != "1f1b":
            return [], []
        S, M = pipe.stages, pipe.microbatches
        out, said = [], []
        for v in (4, 2):
            if layers % (S * v) or M % S:
                continue
            floor = fastest * (v * M + S - 1) / (v * (M + S - 1))
            if isinstance(mesh, AbstractMesh) and floor >= made:
                said.append(
                    f"interleaved 1F1B, {v} virtual stages: not searched, its bubble alone "
                    f"cannot make it faster than {made * 1e3:.4g} ms (the lock-step plans' "
                    f"fastest of any memory, {fastest * 1e3:.4g} ms, in its slots: "
                    f"{floor * 1e3:.4g} ms)"
                )
                continue
            log.info("mesh %s: searching it interleaved, %d virtual stages", mesh.axis_sizes, v)
            chunked = replace(pipe, schedule="interleaved", virtual=v)
            _, mine, _ = self._made(graph, k, mesh, chunked)
            if isinstance(mine, Infeasible):
                said.append(f"interleaved 1F1B, {v} virtual stages: {mine.brief}")
                continue
            if not mine:
                continue
            out += mine
            best = min(r[0] for r in mine)
            made = min(made, best)
            said.append(
                f"interleaved 1F1B, {v} virtual stages (the layers' leaves kept in chunk "
                f"order), searched as it runs too: {best * 1e3:.4g} ms"
            )
        return out, said

    def _made(self, graph: Graph, k: int, mesh, pipe) -> tuple:
        """Try `k` rolled into loops over `pipe`'s stages (its chunks, interleaved) and
        searched as it runs: (its `PipelinedScans`, or the Infeasible that stopped it
        first; its entries, or that Infeasible; its fastest plan of any memory,
        `tries.bound`)."""
        got = self._looped(graph, pipe.stages, mesh, proxy=False, virtual=pipe.virtual)
        if not isinstance(got, Infeasible):
            got = self._pipelined(got[0], pipe, mesh, got[1])
        if isinstance(got, Infeasible):
            return got, got, 0.0
        problem = self._built(got.graph, self._info(mesh), got)
        problem, result, other = self._searched_try(problem, mesh, got, {})
        fastest = bound(result, other, None)
        if isinstance(result, Infeasible):
            return got, result, fastest
        return got, self._entries(k, mesh, problem, result, got, other), fastest

    def _realized_unpipelined(
        self, graph: Graph, found, notes: tuple[str, ...], lead: tuple[str, ...]
    ):
        """`_realized` of a `OneLoop` try: the step searched as it runs (`graph`, its
        layers unrolled) on the try's mesh."""
        ranked, note = self._plain(graph, found.ranked[0])
        k = found.ranked[0][1]
        rest = [r for r in found.ranked if not (r[1] == k and isinstance(r[6], OneLoop))]
        out = self._first_that_fits(
            graph, replace(found, ranked=ranked + rest), (*notes, note), lead
        )
        return out.realize() if isinstance(out, Proxy) else out

    def _plain(self, graph: Graph, entry) -> tuple[list, str]:
        """A `OneLoop` try's entries searched as it runs, and the note that says so."""
        step_s, k, _, mesh, _, _, _ = entry
        name = f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}"
        log.info("mesh %s: searching it again with its layers unrolled", name)
        problem = self._built(graph, self._info(mesh), None)
        problem, result, other = self._searched_try(problem, mesh, None, {})
        ranked = []
        if not isinstance(result, Infeasible):
            ranked = sorted(
                self._entries(k, mesh, problem, result, None, other), key=lambda r: r[:3]
            )
        again = (
            f"{ranked[0][0] * 1e3:.4g} ms searched again as it runs"
            if ranked
            else f"searched again as it runs: {result.brief}"
        )
        return ranked, (
            f"{name} without a pipeline: {step_s * 1e3:.4g} ms as priced with its layers in "
            f"one loop; {again}"
        )
