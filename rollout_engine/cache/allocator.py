"""KV slot allocator. Slots come in pages of `page_size` consecutive slots;
page 0 is reserved as the padding target (graph padding writes there), so
valid pages are 1..num_pages."""
from __future__ import annotations

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: the most recently freed page is reused first (warm in cache).
        self._free: list[int] = list(range(num_pages, 0, -1))
        self._is_free = np.ones(num_pages + 1, dtype=bool)
        self._is_free[0] = False

    @property
    def num_slots(self) -> int:
        """Slots in the pool, including the reserved page 0."""
        return (self.num_pages + 1) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, num_pages: int) -> list[int] | None:
        """`num_pages` pages, or None (and nothing taken) if too few are free."""
        if num_pages > len(self._free):
            return None
        pages = self._free[len(self._free) - num_pages:][::-1]
        del self._free[len(self._free) - num_pages:]
        self._is_free[pages] = False
        return pages

    def free(self, pages) -> None:
        pages = [int(p) for p in pages]
        if not pages:
            return
        if self._is_free[pages].any() or len(set(pages)) != len(pages):
            raise RuntimeError(f"double free of KV pages {pages}")
        self._is_free[pages] = True
        self._free.extend(reversed(pages))

    def free_slots(self, slots: np.ndarray) -> None:
        """Free the pages that hold `slots` (page-aligned runs of slots)."""
        self.free(np.unique(np.asarray(slots, dtype=np.int64) // self.page_size))

    def free_page_set(self) -> set[int]:
        return set(self._free)
