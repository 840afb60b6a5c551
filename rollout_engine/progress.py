"""Progress bars suited to where they are shown. On a terminal: tqdm's live
bar. In a log (stderr redirected to a file or a pipe, as in batch jobs): a
plain line at most every LOG_EVERY_S seconds and one at the end, instead of
a bar redrawn with carriage returns many times a second into one long line.
For a long step with nothing to count (a kernel build): `Ticking`."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, TextIO

LOG_EVERY_S = 30.0
NEVER_S = 1e9


class _Lines:
    """A file for tqdm that writes each redraw as a line of its own. A
    stream that can no longer be written (its reader gone: `... 2>&1 | head`)
    is dropped: tqdm writes while holding its lock and, when the write
    raises, keeps the lock, so every later bar in the process (the main
    thread's, at exit) would wait for it forever."""

    def __init__(self, stream: TextIO):
        self.stream: TextIO | None = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text and self.stream is not None:  # tqdm's clears and its closing newline write nothing here
            self._guarded(self.stream.write, text + "\n")

    def flush(self) -> None:
        if self.stream is not None:
            self._guarded(self.stream.flush)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except (OSError, ValueError):  # a closed pipe, a closed file
            self.stream = None


def _on_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """A counted bar (`total` items of `unit`); `show=False` shows nothing."""

    def __init__(self, total: int, desc: str, unit: str, show: bool = True):
        from tqdm import tqdm

        stream = sys.stderr
        self.live = _on_terminal(stream)
        # In a log the lines are timed here, so tqdm's own redraws (and its monitor's) are off.
        extra = {} if self.live else {"file": _Lines(stream), "mininterval": NEVER_S, "maxinterval": NEVER_S,
                                      "ncols": 100}
        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=not show, **extra)
        self.last_line = time.monotonic()

    def update(self, n: int = 0, redraw: bool = False, **postfix: Any) -> None:
        """`n` more items done; `postfix` (e.g. tokens=...) shown beside the
        count. On a terminal the bar redraws now if `redraw`, else at tqdm's
        pace; in a log a line is written once LOG_EVERY_S has passed since
        the last one."""
        self.bar.update(n)
        if postfix:
            self.bar.set_postfix(refresh=redraw and self.live, **postfix)
        if not self.live and time.monotonic() - self.last_line >= LOG_EVERY_S:
            self.last_line = time.monotonic()
            self.bar.refresh()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Ticking:
    """Lines on `log` (at WARNING, the level shown without any logging
    set up) while a long step with nothing to count runs, e.g. a kernel
    build: every `every_s` seconds (LOG_EVERY_S unless given) how long it
    has taken so far, and at the end how long it took (or that it stopped).
    With `quiet_if_quick` (a routine step, such as an engine's start, that
    is only worth a line when it is slow), a step over before the first tick
    shows nothing, and one that fails no end line: the caller reports the
    failure in its own one line."""

    def __init__(self, log: logging.Logger, what: str, every_s: float | None = None, quiet_if_quick: bool = False):
        self.log, self.what = log, what
        self.every_s = LOG_EVERY_S if every_s is None else every_s
        self.quiet_if_quick, self.ticked = quiet_if_quick, False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="rollout-engine-ticking", daemon=True)

    def _tick(self) -> None:
        while not self.stop.wait(self.every_s):
            self.ticked = True
            self.log.warning("%s: %s so far", self.what, _duration(time.monotonic() - self.start))

    def __enter__(self) -> "Ticking":
        self.start = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        taken = _duration(time.monotonic() - self.start)
        if self.quiet_if_quick and (not self.ticked or kind is not None):
            return
        if kind is None:
            self.log.warning("%s: done in %s", self.what, taken)
        else:
            self.log.warning("%s: stopped after %s", self.what, taken)
