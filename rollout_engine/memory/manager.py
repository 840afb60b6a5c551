"""The engine's own record of which memory is resident, per tag. Every
release/resume goes through here, so a wrong-order call is a RuntimeError,
never a call into the saver in the wrong state."""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterable, Sequence

import torch

from rollout_engine.memory.saver import MemorySaver, NoSaver

TAGS = ("weights", "kv_cache", "cuda_graph")
RESIDENT, RELEASED = "resident", "released"


class MemoryManager:
    def __init__(self, saver: MemorySaver):
        self.saver = saver
        self.enabled = not isinstance(saver, NoSaver)
        self.state = {tag: RESIDENT for tag in TAGS}
        self._tensors: dict[str, list[torch.Tensor]] = {tag: [] for tag in TAGS}
        self._extra_bytes = {tag: 0 for tag in TAGS}

    def region(self, tag: str, cpu_backup: bool = False) -> ContextManager:
        """Allocate the tensors of `tag` inside this block."""
        return self.saver.region(tag, cpu_backup) if self.enabled else contextlib.nullcontext()

    def register(self, tag: str, tensors: Iterable[torch.Tensor] = (), extra_bytes: int = 0) -> None:
        """What `tag` holds, for the bytes a release reports."""
        self._tensors[tag].extend(tensors)
        self._extra_bytes[tag] += extra_bytes

    def tensors(self, tag: str) -> list[torch.Tensor]:
        return list(self._tensors[tag])

    def nbytes(self, tag: str) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors[tag]) + self._extra_bytes[tag]

    def resident(self, tag: str) -> bool:
        return self.state[tag] == RESIDENT

    def check(self, tags: Sequence[str], want: str, action: str) -> tuple[str, ...]:
        """Validate a whole request before acting on any tag: the tags
        themselves first (a wrong one is the caller's input, whatever the
        engine's state), then what the state allows."""
        if isinstance(tags, str):
            tags = (tags,)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"tags: unknown {unknown}; known: {list(TAGS)}")
        if not self.enabled:
            raise RuntimeError(f"cannot {action} memory: the engine was built without enable_memory_saver=True "
                               "(memory release needs it, on a CUDA device)")
        wrong = [t for t in tags if self.state[t] != want]
        if wrong:
            raise RuntimeError(f"cannot {action} {wrong}: already {'released' if want == RESIDENT else 'resident'}")
        return tuple(t for t in TAGS if t in tags)  # a fixed order: weights, kv_cache, cuda_graph

    def pause(self, tag: str) -> int:
        self.saver.pause(tag)
        self.state[tag] = RELEASED
        return self.nbytes(tag)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)
        self.state[tag] = RESIDENT

    def mark(self, tag: str, state: str) -> None:
        """Record a state change made without the saver (graphs kept or
        destroyed instead of unmapped)."""
        self.state[tag] = state
