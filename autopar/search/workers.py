"""Searches side by side, in forked worker processes.

The planner runs searches that are deterministic and read nothing the others write:
`auto`'s engines on one problem (`search.AUTO_ENGINES`, the ZeRO-3 candidate, then the
ZeRO retries), the screen of each mesh shape (`compile.screen`) and a call's (mesh,
pipeline) tries (`compile.tries`). On a machine with more than one core they run at
once, each in a child process forked from the planner: `fork` hands the child the
built problem (its strategies and cost tables) without a copy or pickling; a problem
holds the captured jaxpr, which does not pickle. The child returns its result (a plan
as strategy indices, its price, the solver's info), the seconds of its phases, what it
left out under `time_limit=` and the warnings it raised; the caller takes the results
in the order its sequential loop would have made them, so the plan is the same byte
for byte.

A child runs numpy, Python and the search's numba-compiled loops (loaded in the parent
before it forks, `solvers.kernels.warm`; they start no threads) and of JAX only its
dtype and pytree helpers (it never traces, compiles or touches a device array), which
is what makes forking a process with XLA's threads alive safe: `fork` copies the
calling thread only, and nothing in the child waits on a lock another thread held (the child drops JAX's garbage-collection
hook, the one call into XLA it would make, and freezes the objects it inherits out of
its own collections). JAX and Python 3.12+ warn about any fork in a multi-threaded
process; those warnings are filtered at the fork for that reason. A child never forks
again (the searches it starts run inline).

Workers: `AUTOPAR_WORKERS` (an integer; 1 turns this off), by default the CPUs this
process may use on Linux (elsewhere 1: on macOS a fork of a threaded process can crash
in system libraries, which is why Python stopped forking there by default), and never
more than the memory available holds (`memory_cap`). A problem below `MIN_NODES`
cost-graph nodes is searched inline: its engines take less time than a fork of the
planner's process."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from typing import Any

from autopar.errors import user_level

log = logging.getLogger("autopar")

MIN_NODES = 1000
_IN_CHILD = False  # set in a worker: it searches inline


def count() -> int:
    """How many searches may run at once: `AUTOPAR_WORKERS`, else the CPUs this process
    may use on Linux and 1 elsewhere."""
    env = os.environ.get("AUTOPAR_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(
                f"AUTOPAR_WORKERS={env!r}: expected a whole number of workers"
            ) from None
    if not sys.platform.startswith("linux"):
        return 1  # macOS: a fork of a threaded process can crash in system libraries
    return len(os.sched_getaffinity(0))


def usable(nodes: int, tasks: int) -> int:
    """Workers for `tasks` searches of a problem with `nodes` nodes (<= 1: inline), at
    most as many as the free memory holds (`memory_cap`)."""
    if _IN_CHILD or tasks < 2 or nodes < MIN_NODES or not hasattr(os, "fork"):
        return 1
    return max(1, min(count(), tasks, memory_cap()))


def memory_cap() -> int:
    """How many children the memory available holds, each taken to need as much as
    this process has resident (a child's search tables are of the size of the
    problem it shares with the parent); unbounded where /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return 1 << 30
    return max(1, avail // max(resident, 1))


def run_all(
    tasks: Mapping[Any, Callable[[], Any]],
    workers: int,
    clock: Any,
    enough: Callable[[dict[str, Any]], bool] = lambda done: bool(done),
    phase: str = "engines",
    skip: Callable[[Any, dict[Any, Any]], bool] = lambda key, done: False,
    label: Callable[[Any], str] = str,
    beside: Callable[[], Mapping[Any, Callable[[], Any]] | None] | None = None,
) -> dict[Any, Any]:
    """Each task's result, computed in up to `workers` forked children (in task order),
    while this process runs `beside` (if given) once the first children are started;
    the tasks `beside` returns, if any (tasks of what it made), are run after the rest.

    The parent's time waiting for them is the clock's `phase`; the children's own
    phases overlap it, so they go to `clock.worked`, not to its phases; their skips go
    to `clock.skip`, their warnings to `warnings`. Past the clock's deadline, once
    `enough(results so far)`, the children still running are stopped and named to
    `clock.skip` (as `label(key)`) and left out of the results; a task whose child
    died is named in a warning and run in this process. A task for which
    `skip(key, results so far)` holds when its turn comes is not run (nor named)."""
    from autopar.search.solvers import kernels

    kernels.warm()  # the compiled search loops loaded once here, not in every child
    ctx = multiprocessing.get_context("fork")
    tasks = dict(tasks)
    pending = list(tasks.items())
    running: dict[Any, tuple[Any, Any]] = {}  # connection -> (key, process)
    results: dict[Any, Any] = {}
    phases: dict[Any, dict[str, float]] = {}
    deadline = getattr(clock, "deadline", None)

    def start(key: Any, task: Callable[[], Any]) -> None:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(task, clock, send), daemon=True)
        with warnings.catch_warnings():  # fork with XLA's threads alive (module docstring)
            warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12's
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)  # JAX's
            proc.start()
        send.close()
        running[recv] = (key, proc)

    def stop(why: str) -> None:
        for conn, (key, proc) in running.items():
            proc.terminate()
            proc.join()
            conn.close()
            if why:
                clock.skip(f"{label(key)} ({why})")
        running.clear()

    with clock.phase(phase):
        try:
            while pending or running or beside is not None:
                while pending and len(running) < workers:
                    key, task = pending.pop(0)
                    if not skip(key, results):
                        start(key, task)
                if beside is not None:
                    more = beside() or {}  # this process's own share of the work
                    beside = None
                    tasks.update(more)
                    pending += list(more.items())
                    continue
                if not running:
                    break
                now = time.perf_counter()
                if deadline is not None and now >= deadline and results and enough(results):
                    stop("stopped at the time limit")
                    for key, _ in pending:
                        clock.skip(f"{label(key)} (not started: the time limit)")
                    break
                timeout = deadline - now if deadline is not None and now < deadline else None
                for conn in wait(list(running), timeout):
                    key, proc = running.pop(conn)
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "died", None
                    conn.close()
                    proc.join()
                    if status == "error":
                        raise payload
                    if status == "died":
                        warnings.warn(
                            f"autopar: the search worker for {label(key)} ended without a result "
                            f"(exit code {proc.exitcode}); it is searched in this process "
                            "instead",
                            RuntimeWarning,
                            stacklevel=user_level(),
                        )
                        results[key] = tasks[key]()
                        continue
                    result, spent, skipped, caught = payload
                    results[key] = result
                    phases[key] = spent
                    for what in skipped:
                        clock.skip(what)
                    for w in caught:
                        warnings.warn_explicit(w[0], w[1], w[2], w[3])
        finally:
            stop("")  # after an error: the other children are not waited for
    for key, spent in phases.items():
        for name, seconds in spent.items():
            clock.worked(name, seconds)
        log.debug(
            "%s searched side by side: %s", label(key), {k: round(v, 2) for k, v in spent.items()}
        )
    return results


def _child(task: Callable[[], Any], clock: Any, send) -> None:
    global _IN_CHILD
    _IN_CHILD = True
    # JAX's collector hook (`jax._src.lib`) calls into XLA on every garbage collection,
    # which could wait on a lock an XLA thread of the parent held at the fork
    gc.callbacks.clear()
    # the parent's objects out of the child's collections: collecting would walk (and
    # write to, so copy) every inherited page, the more the longer the planner has run
    gc.freeze()
    log.disabled = True  # the parent's progress display speaks for its children
    before = dict(getattr(clock, "phases", {}))
    skipped = len(getattr(clock, "skipped", []))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = task()
        spent = {
            k: v - before.get(k, 0.0)
            for k, v in getattr(clock, "phases", {}).items()
            if v - before.get(k, 0.0) > 0
        }
        ws = [(w.message, w.category, w.filename, w.lineno) for w in caught]
        send.send(("ok", (result, spent, list(getattr(clock, "skipped", []))[skipped:], ws)))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, raised there
        try:
            send.send(("error", e))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            send.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        send.close()
