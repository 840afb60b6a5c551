"""KV bookkeeping for requests: prefix match, slot allocation for an extend,
release into the prefix cache, and the integrity check.

Every KV page is in exactly one of: the allocator's free list, a running
request's own part of its table row (positions locked_len..kv_len), or the
prefix cache. `check_integrity` asserts it.
"""
from __future__ import annotations

import numpy as np

from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.prefix_cache import PrefixCache
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.request import Request


class KVManager:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable, cache: PrefixCache):
        self.allocator = allocator
        self.table = table
        self.cache = cache
        self.page_size = allocator.page_size

    @property
    def available_tokens(self) -> int:
        return self.allocator.num_free_tokens + self.cache.evictable_tokens

    def admit(self, req: Request) -> None:
        """Give `req` a table row and lock its longest cached prefix. At least
        one token is left to compute, so the step produces logits."""
        req.row = self.table.alloc_row()
        req.kv_epoch = self.cache.epoch
        if req.prompt_logprobs is not None and req.wants_prompt_logprobs():
            return  # prompt logprobs need the logits of every prompt position
        match = self.cache.match(req.all_ids[: req.seq_len - 1])
        if match.num_tokens:
            self.cache.lock(match.node)
            req.cache_node = match.node
            self.table.write(req.row, 0, match.slots)
        req.kv_len = req.locked_len = match.num_tokens
        if req.num_retractions == 0:
            req.num_cached_tokens = min(match.num_tokens, len(req.prompt_ids))

    def alloc_extend(self, req: Request, num_tokens: int) -> np.ndarray | None:
        """Slots for positions kv_len..kv_len+num_tokens of `req`, written to
        its table row; None (nothing taken) when memory is short even after
        evicting the cache. Does not advance kv_len."""
        p = self.page_size
        if num_tokens == 1:  # decode: the common case, kept cheap
            return self._alloc_one(req)
        start, end = req.kv_len, req.kv_len + num_tokens
        have_pages, need_pages = -(-start // p), -(-end // p)
        new_pages = need_pages - have_pages
        if new_pages > self.allocator.num_free_pages:
            self.cache.evict((new_pages - self.allocator.num_free_pages) * p)
        pages = self.allocator.alloc(new_pages)
        if pages is None:
            return None
        positions = np.arange(start, end)
        slots = np.empty(num_tokens, dtype=np.int64)
        in_old_page = positions < have_pages * p
        if in_old_page.any():  # fill the rest of the request's own last page
            base = self.table.table[req.row, (start // p) * p]
            slots[in_old_page] = base + positions[in_old_page] % p
        if new_pages:
            fresh = positions[~in_old_page]
            page_ids = np.asarray(pages, dtype=np.int64)[fresh // p - have_pages]
            slots[~in_old_page] = page_ids * p + fresh % p
        self.table.write(req.row, start, slots)
        return slots

    def _alloc_one(self, req: Request) -> np.ndarray | None:
        p, pos = self.page_size, req.kv_len
        if pos % p:  # room left in the request's own last page
            slot = int(self.table.table[req.row, pos - 1]) + 1
        else:
            if not self.allocator.num_free_pages:
                self.cache.evict(p)
            pages = self.allocator.alloc(1)
            if pages is None:
                return None
            slot = pages[0] * p
        slots = np.array([slot], dtype=np.int64)
        self.table.write(req.row, pos, slots)
        return slots

    def alloc_decode(self, reqs: list[Request]) -> np.ndarray | None:
        """One slot each for the next position of `reqs` (a decode step),
        written to their table rows in one go; None (nothing taken) when too
        few pages are free. Evicts nothing. Does not advance kv_len."""
        p, n = self.page_size, len(reqs)
        rows = np.fromiter((r.row for r in reqs), np.int64, n)
        pos = np.fromiter((r.kv_len for r in reqs), np.int64, n)
        fresh = pos % p == 0  # the position starts a page
        slots = np.empty(n, dtype=np.int64)
        num_fresh = int(fresh.sum())
        if num_fresh:
            pages = self.allocator.alloc(num_fresh)
            if pages is None:
                return None
            slots[fresh] = np.asarray(pages, dtype=np.int64) * p
        if num_fresh < n:  # room left in the request's own last page
            slots[~fresh] = self.table.table[rows[~fresh], pos[~fresh] - 1] + 1
        self.table.write_cells(rows, pos, slots)
        return slots

    def cache_prefix(self, req: Request, computed_len: int) -> None:
        """Put the request's KV of positions [0, computed_len) (whole pages)
        into the prefix cache while it keeps running, so requests sharing the
        prefix (its n-sample siblings, later turns) reuse it. The request then
        points at the cache's copy and holds a lock on it. Positions past
        `computed_len` may belong to a step scheduled ahead, whose input
        token is still a placeholder."""
        if not self.cache.enabled or req.row is None or req.kv_epoch != self.cache.epoch:
            return  # (KV of earlier weights is never shared)
        end = min(req.kv_len, computed_len)
        aligned = end - end % self.page_size
        if aligned <= req.locked_len:
            return
        ids = req.all_ids[:aligned]
        self.cache.insert(ids, self.table.slots(req.row, 0, aligned).copy())
        match = self.cache.match(ids)
        self.cache.stats.queried_tokens -= len(ids)  # bookkeeping, not a lookup
        self.cache.stats.matched_tokens -= match.num_tokens
        self.cache.lock(match.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        self.table.write(req.row, 0, match.slots)
        req.cache_node, req.locked_len = match.node, match.num_tokens

    def computed_slots(self, req: Request, kv_of: Request | None = None) -> np.ndarray:
        """The KV slots of every position of `req` that went through the
        model: all but its last sampled token, or the whole prompt where it
        kept no token (max_new_tokens=0; an aborted request: those
        computed). From its own row, or when it holds none, from `kv_of`'s
        (a fork sibling that finished on its first token shares its
        leader's prompt KV); none when neither holds KV."""
        holder = req if req.row is not None else kv_of
        if holder is None or holder.row is None:
            return np.zeros(0, np.int64)
        n = min(holder.kv_len, len(req.prompt_ids) + max(req.num_output_tokens - 1, 0))
        return self.table.slots(holder.row, 0, n)

    def release(self, req: Request) -> None:
        """Hand the request's computed KV to the prefix cache (which keeps or
        frees it; KV begun under earlier weights is freed), free the partial
        tail page, unlock, free the row."""
        if req.row is None:
            return
        p = self.page_size
        aligned = req.kv_len - req.kv_len % p
        if req.kv_epoch == self.cache.epoch:
            self.cache.insert(req.all_ids[:aligned], self.table.slots(req.row, 0, aligned).copy())
        elif aligned > req.locked_len:  # computed under earlier weights: freed, never cached
            self.allocator.free_slots(self.table.slots(req.row, req.locked_len, aligned))
        if aligned < req.kv_len:
            self.allocator.free_slots(self.table.slots(req.row, aligned, aligned + 1))
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        self.table.free_row(req.row)
        req.row, req.kv_len, req.locked_len, req.cache_node = None, 0, 0, None

    def check_integrity(self, running: list[Request]) -> None:
        p = self.page_size
        free = self.allocator.free_page_set()
        cached_slots = self.cache.owned_slots()
        cached = set((cached_slots // p).tolist())
        assert not free & cached, f"pages both free and cached: {sorted(free & cached)[:8]}"
        owned: set[int] = set()
        for req in running:
            assert req.row is not None, f"running request {req.request_id} has no row"
            locked = self.table.slots(req.row, 0, req.locked_len)
            assert set(locked.tolist()) <= set(cached_slots.tolist()), "a locked prefix slot is not in the cache"
            pages = set((self.table.slots(req.row, req.locked_len, req.kv_len) // p).tolist())
            assert not pages & (free | cached | owned), f"request {req.request_id} shares KV pages"
            owned |= pages
        self.cache.check_integrity()
        total = set(range(1, self.allocator.num_pages + 1))
        assert free | cached | owned == total, f"leaked KV pages: {sorted(total - free - cached - owned)[:8]}"
