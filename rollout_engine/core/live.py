"""The engines' step loops alive in this process: stopped at interpreter
exit (core/engine_core.py), waited for when an engine was dropped without
shutdown(), so that the next engine's build finds its memory given back
(core/build.py)."""
from __future__ import annotations

import gc
import weakref
from typing import Any, Protocol


class Loop(Protocol):
    """What this module needs of an EngineCore."""

    def stop(self, timeout: float | None = None) -> None: ...

    def join_if_stopping(self, timeout: float) -> None: ...


_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
DROPPED_LOOP_WAIT_S = 10.0  # for a dropped engine's loop to finish its step and end


def add(core: Loop) -> None:
    _LIVE.add(core)


def discard(core: Loop) -> None:
    _LIVE.discard(core)


def live_cores() -> list[Loop]:
    """Every engine core whose loop has not ended."""
    return list(_LIVE)


def release_dropped_engines(wait_s: float = DROPPED_LOOP_WAIT_S) -> None:
    """Free what engines dropped without shutdown() hold. A dropped engine's
    finalizer (run now, for one kept only by reference cycles) asks its loop
    to stop without waiting; its parts go once the loop has ended, by a
    second collection (the core and its controls refer to each other). Call
    it without holding DEVICE_WIDE: an ending loop may take it."""
    gc.collect()
    _join_stopping(wait_s)
    gc.collect()


def _join_stopping(wait_s: float) -> None:
    # A function of its own: the cores it names are no longer referenced once it returns.
    for core in list(_LIVE):
        core.join_if_stopping(wait_s)
