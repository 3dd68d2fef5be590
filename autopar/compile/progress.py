"""The progress display of a long search, fed by the `autopar` logger.

The driver and the search report their phases with `logging.getLogger("autopar").info`
(a record may carry `autopar_step=(k, n)`: the k-th of n tries). `Progress` shows,
once a search has run `show_after` seconds, the latest phase, the try it is on and
the elapsed time on stderr: a live `rich` progress bar on a terminal, plain
timestamped lines otherwise (a log file, a notebook's captured stderr). `parallelize`
opens one around every search unless `progress=False` or `AUTOPAR_PROGRESS=0`; the CLI
opens one too (nested displays show once).

While it is open the logger runs at INFO and does not propagate, so the phases do not
reach the user's own handlers; records at the level those would have seen anyway are
passed on to them."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("autopar")
SHOW_AFTER_S = 2.0


def enabled(option: bool | None) -> bool:
    """`progress=` resolved: None follows AUTOPAR_PROGRESS (default on)."""
    if option is not None:
        return bool(option)
    return os.environ.get("AUTOPAR_PROGRESS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


class Progress(logging.Handler):
    _open = 0  # displays open in this process: nested ones stay silent
    _lock = threading.Lock()

    def __init__(
        self,
        stream=None,
        interval: float = 0.25,
        show_after: float = SHOW_AFTER_S,
        prefix: str = "autopar ",
    ):
        super().__init__(logging.DEBUG)
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval, self.show_after = interval, show_after
        self.message, self.step = "starting", None
        self.shown = False
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autopar-progress", daemon=True)
        self._active = False

    # ---- logging --------------------------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno <= logging.INFO:
            self.message = record.getMessage()
            step = getattr(record, "autopar_step", None)
            if step is not None:
                self.step = step
        if self._propagate and record.levelno >= self._effective:
            _forward(record)

    # ---- display ----------------------------------------------------------------------------
    def _line(self) -> str:
        step = f" [{self.step[0]}/{self.step[1]}]" if self.step else ""
        return f"{self.prefix}[{time.perf_counter() - self.start:7.1f} s]{step} {self.message}"

    def _run(self) -> None:
        if self._stop.wait(self.show_after):
            return
        self.shown = True
        if self.tty:
            self._live()
            return
        printed = None
        while True:
            if self.message != printed:
                self.stream.write(self._line() + "\n")
                self.stream.flush()
                printed = self.message
            if self._stop.wait(self.interval):
                return

    def _live(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar
        from rich.table import Column

        fixed = lambda w: Column(min_width=w, no_wrap=True)
        bar = Bar(
            SpinnerColumn(table_column=fixed(1)),
            TextColumn("[bold]autopar[/]", table_column=fixed(7)),
            TimeElapsedColumn(table_column=fixed(7)),
            BarColumn(bar_width=12, table_column=fixed(12)),
            MofNCompleteColumn(table_column=fixed(5)),
            TextColumn(
                "{task.description}",
                markup=False,
                table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
            ),
            console=Console(file=self.stream),
            transient=True,
            expand=True,
        )
        with bar:
            task = bar.add_task(self.message, total=None)
            bar.tasks[0].start_time = bar.get_time() - (time.perf_counter() - self.start)
            while not self._stop.wait(self.interval):
                k, n = self.step if self.step else (0, None)
                bar.update(task, description=self.message, completed=max(k - 1, 0), total=n)

    # ---- context ------------------------------------------------------------------------------
    def __enter__(self) -> Progress:
        with Progress._lock:
            self._active = Progress._open == 0
            Progress._open += 1
        if not self._active:
            return self
        self._saved = (log.level, log.propagate)
        self._effective, self._propagate = log.getEffectiveLevel(), log.propagate
        if self._effective > logging.INFO:
            log.setLevel(logging.INFO)
        log.propagate = False  # phases go to the display only (see `_forward`)
        log.addHandler(self)
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with Progress._lock:
            Progress._open -= 1
        if not self._active:
            return
        self._stop.set()
        self._thread.join()
        log.removeHandler(self)
        log.setLevel(self._saved[0])  # not `log.level =`: that keeps the level cache stale
        log.propagate = self._saved[1]
        if self.shown:
            done = "stopped" if exc[0] is not None else "planned"
            self.stream.write(f"autopar: {done} in {time.perf_counter() - self.start:.1f} s\n")
            self.stream.flush()


def _forward(record: logging.LogRecord) -> None:
    """Hand `record` to the handlers above the `autopar` logger, as propagation would."""
    found = False
    c = log.parent
    while c is not None:
        for h in c.handlers:
            found = True
            if record.levelno >= h.level:
                h.handle(record)
        if not c.propagate:
            break
        c = c.parent
    if not found and logging.lastResort is not None and record.levelno >= logging.lastResort.level:
        logging.lastResort.handle(record)
