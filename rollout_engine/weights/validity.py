"""Which weights are not usable, and why: the engine refuses to generate
while any are.

A weight is invalid after a release without `weights_cpu_backup` (all of
them), or when an update that could not be made atomic (a stream, a disk
load, a broadcast) stopped part-way: then exactly the tensors it wrote are
marked, since the model is a mix of two weight sets. Writing a marked tensor
again (any successful update that covers it) clears it."""
from __future__ import annotations

from typing import Iterable

SHOWN = 4  # names spelled out in a message; the rest are counted


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def name_list(names: list[str], shown: int = SHOWN) -> str:
    """'a, b, c, d and 21 more'."""
    head = ", ".join(names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"


class WeightValidity:
    def __init__(self, hf_names: dict):
        # (parameter, shard) target -> the Hugging Face name it is written under
        self._hf_names = hf_names
        self._invalid: dict = {}  # target -> why

    @property
    def count(self) -> int:
        """Invalid tensors, by Hugging Face name (a fused expert tensor is
        written in per-expert units, counted once)."""
        return len(self.names())

    def names(self) -> list[str]:
        """The invalid weights' Hugging Face names, sorted."""
        return self.names_of(self._invalid)

    def names_of(self, targets: Iterable) -> list[str]:
        return sorted({self._hf_names.get(t, str(t)) for t in targets})

    def mark(self, targets: Iterable, why: str) -> None:
        for t in targets:
            self._invalid[t] = why

    def mark_all(self, why: str) -> None:
        self.mark(self._hf_names, why)

    def clear(self, targets: Iterable) -> None:
        for t in targets:
            self._invalid.pop(t, None)

    def check(self) -> None:
        """RuntimeError naming the invalid weights, if there are any."""
        if not self._invalid:
            return
        reasons = sorted(set(self._invalid.values()))
        are = "weight is" if self.count == 1 else "weights are"
        raise RuntimeError(f"cannot generate: {self.count} {are} not usable ({name_list(self.names())}): "
                           f"{'; '.join(reasons)}. Write their old values again (update_weights with those names), "
                           "or the complete new set of weights; new values for these alone would mix two versions")
