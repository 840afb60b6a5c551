"""Ctrl-C noted instead of raised, for the stretches where a
KeyboardInterrupt landing anywhere would do harm (an import under way, a
library's cleanup): the code checks the note at points of its own."""
from __future__ import annotations


class DeferredInterrupt:
    """A SIGINT handler that only notes the signal."""

    def __init__(self) -> None:
        self.hit = False

    def __call__(self, signum, frame) -> None:
        self.hit = True
