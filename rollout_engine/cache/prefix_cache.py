"""The prefix-cache contract, and the implementation used when the cache is
disabled.

Ownership: slots handed to `insert` belong to the cache from then on (it
keeps them or frees them). Slots returned by `match` may be used only while
the returned node is locked: lock before using them, unlock when done. A
locked node is never evicted.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_engine.cache.allocator import PageAllocator


@dataclass
class Match:
    num_tokens: int
    slots: np.ndarray
    node: Any = None


@dataclass
class CacheStats:
    matched_tokens: int = 0
    queried_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache(ABC):
    enabled = True  # False: finished KV is freed, nothing is shared

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.stats = CacheStats()
        # Counts weight changes (complete or not). KV carries the epoch it was
        # computed in; only KV of the current epoch is ever matched.
        self.epoch = 0

    def advance_epoch(self) -> None:
        """The weights changed: nothing cached so far may be served again."""
        self.epoch += 1

    @abstractmethod
    def match(self, token_ids: list[int]) -> Match:
        """Longest cached prefix of `token_ids`, a whole number of pages."""

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def insert(self, token_ids: list[int], slots: np.ndarray) -> Any:
        """Take ownership of `slots` (page-aligned, one per token). Returns the
        node of the inserted sequence (a lock handle), or None."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots of unlocked entries if possible;
        returns how many were freed."""

    @abstractmethod
    def flush(self) -> None:
        """Drop every unlocked entry."""

    @property
    @abstractmethod
    def evictable_tokens(self) -> int: ...

    @property
    @abstractmethod
    def cached_tokens(self) -> int: ...

    @abstractmethod
    def owned_slots(self) -> np.ndarray:
        """Every slot the cache holds (for integrity checks)."""

    def check_integrity(self) -> None:
        """Assert the cache's own invariants."""


class NoPrefixCache(PrefixCache):
    """Caches nothing: inserted slots are freed at once."""

    enabled = False

    def match(self, token_ids: list[int]) -> Match:
        self.stats.queried_tokens += len(token_ids)
        return Match(0, np.zeros(0, dtype=np.int64))

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def insert(self, token_ids: list[int], slots: np.ndarray) -> Any:
        self.allocator.free_slots(slots)
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> None:
        pass

    @property
    def evictable_tokens(self) -> int:
        return 0

    @property
    def cached_tokens(self) -> int:
        return 0

    def owned_slots(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)
