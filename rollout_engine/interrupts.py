"""Ctrl-C noted instead of raised, for the stretches where a
KeyboardInterrupt landing anywhere would do harm (an import under way, a
library's cleanup): the code checks the note at points of its own; or
ignored (workers starting, a server's engine shutting down). And
`generate` cut short by Ctrl-C with the samples so far kept (the CLI's
generate and demo)."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any


LAST_OUTPUT_S = 2.0  # after a second Ctrl-C, how long the aborted run may take to write its last lines
# A SIGINT this soon after the first is the same Ctrl-C delivered again: `timeout`, like some job runners,
# signals the process and then its whole group.
SAME_PRESS_S = 0.1


class DeferredInterrupt:
    """A SIGINT handler that only notes the signal; one that comes within
    `ignore_s` of the handler's creation is not counted."""

    def __init__(self, ignore_s: float = 0.0) -> None:
        self.hit = False
        self._counts_from = time.monotonic() + ignore_s

    def __call__(self, signum, frame) -> None:
        if time.monotonic() >= self._counts_from:
            self.hit = True


@contextlib.contextmanager
def ctrl_c_ignored():
    """SIGINT ignored inside. Only on the main thread over a handler set
    from Python (elsewhere Python cannot swap it back); a Ctrl-C inside is
    dropped."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def generate_keeping_partials(engine: Any, main_thread: bool, **kwargs: Any) -> tuple[list[Any], bool]:
    """(engine.generate's outputs, whether Ctrl-C cut it short). generate
    runs in a worker thread; a Ctrl-C aborts its requests, which then
    finish with what they produced (finish_reason "abort"), so the samples
    so far can be shown. A second Ctrl-C while they finish (not the first
    one delivered again within SAME_PRESS_S) gives up on them;
    after the first (from the main thread: `main_thread`), Ctrl-C only
    sets a flag until the caller puts its handler back."""
    if not main_thread:
        return engine.generate(**kwargs), False
    done: dict[str, Any] = {}
    finished = threading.Event()  # waited on, not the thread: a join cut by Ctrl-C can leave it looking ended

    def work() -> None:
        try:
            done["outs"] = engine.generate(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            done["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=work, name="generate", daemon=True).start()
    interrupted = False
    try:
        while not finished.wait(0.1):
            pass
    except KeyboardInterrupt:
        interrupted = True
        # From here a Ctrl-C is only noted (the caller restores the handler): raised at any point, it
        # could land in a library's cleanup and print a traceback there.
        again = DeferredInterrupt(ignore_s=SAME_PRESS_S)
        signal.signal(signal.SIGINT, again)
        engine.abort()
        deadline = time.monotonic() + 30
        while not finished.wait(0.05):
            if again.hit or time.monotonic() > deadline:  # a second Ctrl-C: no samples
                # ...but the aborted run's own last output (its progress bar's final line) still comes
                # before the caller's error line, if it ends within a moment
                finished.wait(LAST_OUTPUT_S)
                raise
        if again.hit:  # a second Ctrl-C as the run ended: no samples either
            raise
    if "error" in done:
        raise done["error"]
    return done["outs"], interrupted
