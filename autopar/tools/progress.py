"""A one-line progress display for long searches, fed by the `autopar` logger.

The pipeline reports its phases with `logging.getLogger("autopar").info(...)`; the
CLI shows the latest phase and the elapsed time on stderr once a search has taken
more than a moment (a redrawn line on a terminal, plain lines otherwise).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("autopar")
SHOW_AFTER_S = 1.0


class Progress(logging.Handler):
    def __init__(self, stream=None, interval: float = 0.25):
        super().__init__(logging.INFO)
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval
        self.message = "starting"
        self.printed = ""
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()

    def _line(self) -> str:
        return f"[{time.perf_counter() - self.start:7.1f} s] {self.message}"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if (
                time.perf_counter() - self.start < SHOW_AFTER_S
                or self.message == self.printed
                and not self.tty
            ):
                continue
            if self.tty:
                self.stream.write("\r\033[K" + self._line()[:120])
            else:
                self.stream.write(self._line() + "\n")
            self.stream.flush()
            self.printed = self.message

    def __enter__(self) -> Progress:
        log.addHandler(self)
        self._saved = (log.level, log.propagate)
        log.setLevel(logging.INFO)
        log.propagate = False  # the phases go to this line only, not to root handlers
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        log.removeHandler(self)
        log.level, log.propagate = self._saved
        if self.tty and self.printed:
            self.stream.write("\r\033[K")
            self.stream.flush()
