"""The radix prefix cache on its own: every operation, page granularity, integrity."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.radix import RadixCache


def _setup(num_pages=64, page_size=1):
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc)


def _slots(alloc, n):
    pages = alloc.alloc(n // alloc.page_size)
    return np.concatenate([np.arange(p * alloc.page_size, (p + 1) * alloc.page_size) for p in pages])


def _owned_ok(alloc, cache, extra=()):
    owned = set((cache.owned_slots() // alloc.page_size).tolist())
    assert not owned & alloc.free_page_set()
    assert owned | alloc.free_page_set() | set(extra) == set(range(1, alloc.num_pages + 1))
    cache.check_integrity()


def test_insert_then_match_longest_prefix():
    alloc, cache = _setup()
    s = _slots(alloc, 6)
    cache.insert([1, 2, 3, 4, 5, 6], s)
    m = cache.match([1, 2, 3, 9])
    assert m.num_tokens == 3 and m.slots.tolist() == s[:3].tolist()
    assert cache.match([7, 8]).num_tokens == 0
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 6
    _owned_ok(alloc, cache)


def test_split_keeps_both_branches():
    alloc, cache = _setup()
    a = _slots(alloc, 5)
    cache.insert([1, 2, 3, 4, 5], a)
    b = _slots(alloc, 5)
    cache.insert([1, 2, 9, 9, 9], b)  # shares [1, 2]: b's first two slots are duplicates, freed
    assert cache.cached_tokens == 8
    assert cache.match([1, 2, 9, 9, 9]).slots.tolist() == a[:2].tolist() + b[2:].tolist()
    assert cache.match([1, 2, 3, 4, 5]).slots.tolist() == a.tolist()
    assert alloc.num_free_pages == 64 - 8
    _owned_ok(alloc, cache)


def test_page_granularity():
    alloc, cache = _setup(page_size=4)
    s = _slots(alloc, 8)
    cache.insert(list(range(8)), s)
    assert cache.match(list(range(7))).num_tokens == 4  # whole pages only
    assert cache.match([0, 1, 2, 3, 4, 5, 99, 7]).num_tokens == 4
    t = _slots(alloc, 8)
    cache.insert([0, 1, 2, 3, 50, 51, 52, 53], t)  # diverges inside page 2: split at the page boundary
    assert cache.cached_tokens == 12
    _owned_ok(alloc, cache)


def test_locked_nodes_survive_eviction_and_lru_order():
    alloc, cache = _setup()
    old, new = _slots(alloc, 4), _slots(alloc, 4)
    cache.insert([1, 1, 1, 1], old)
    cache.insert([2, 2, 2, 2], new)
    cache.match([1, 1, 1, 1])  # touch: [2,2,2,2] is now least recently used
    assert cache.evict(1) == 4 and cache.match([2, 2, 2, 2]).num_tokens == 0
    m = cache.match([1, 1, 1, 1])
    cache.lock(m.node)
    assert cache.evictable_tokens == 0 and cache.evict(100) == 0
    cache.unlock(m.node)
    assert cache.evictable_tokens == 4 and cache.evict(100) == 4
    assert alloc.num_free_pages == 64 and cache.stats.evicted_tokens == 8
    _owned_ok(alloc, cache)


def test_lock_protects_the_whole_path_and_parents_go_after_children():
    alloc, cache = _setup()
    cache.insert([1, 2, 3], _slots(alloc, 3))
    cache.insert([1, 2, 4], _slots(alloc, 3))
    m = cache.match([1, 2, 4])
    cache.lock(m.node)
    assert cache.evictable_tokens == 1  # only the [3] branch
    cache.evict(10)
    assert cache.match([1, 2, 3]).num_tokens == 2
    cache.unlock(m.node)
    with pytest.raises(AssertionError):
        cache.unlock(m.node)


def test_flush_drops_unlocked_entries_and_stats_count():
    alloc, cache = _setup()
    cache.insert([5, 6, 7], _slots(alloc, 3))
    locked = cache.insert([8, 9], _slots(alloc, 2))
    cache.lock(locked)
    cache.flush()
    assert cache.cached_tokens == 2 and cache.match([8, 9]).num_tokens == 2
    assert cache.stats.matched_tokens == 2 and cache.stats.queried_tokens == 2
    cache.unlock(locked)
    cache.flush()
    assert cache.cached_tokens == 0 and alloc.num_free_pages == 64


def test_random_operations_keep_integrity():
    rng = np.random.default_rng(0)
    alloc, cache = _setup(num_pages=400, page_size=2)
    locked = []
    for _ in range(300):
        op = rng.integers(5)
        seq = rng.integers(0, 3, size=int(rng.integers(1, 10)) * 2).tolist()
        if op == 0 and alloc.num_free_pages >= len(seq) // 2:
            cache.insert(seq, _slots(alloc, len(seq)))
        elif op == 1:
            m = cache.match(seq)
            if m.node is not None:
                cache.lock(m.node)
                locked.append(m.node)
        elif op == 2 and locked:
            cache.unlock(locked.pop(int(rng.integers(len(locked)))))
        elif op == 3 and rng.random() < 0.2:
            cache.advance_epoch()
        else:
            cache.evict(int(rng.integers(1, 20)))
        _owned_ok(alloc, cache)


def test_a_new_weight_epoch_never_matches_old_kv():
    """Entries of earlier weights: unlocked ones are freed at once, locked
    ones stay for their holders (never matched) and go with their last lock;
    the same tokens computed again are cached anew."""
    alloc, cache = _setup(num_pages=32, page_size=2)
    old_slots = _slots(alloc, 8)
    held = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], old_slots)
    cache.insert([9, 9], _slots(alloc, 2))
    cache.lock(held)
    cache.advance_epoch()
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 0
    assert cache.match([9, 9]).num_tokens == 0 and alloc.num_free_pages == 32 - 4
    assert cache.evictable_tokens == 0  # the stale entry is locked: not counted as reclaimable
    _owned_ok(alloc, cache)
    new_slots = _slots(alloc, 8)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], new_slots)
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.num_tokens == 8 and m.slots.tolist() == new_slots.tolist()
    _owned_ok(alloc, cache)
    cache.unlock(held)  # its holder finished: the stale pages are freed
    assert set((old_slots // 2).tolist()) <= alloc.free_page_set()
    assert cache.cached_tokens == 8
    _owned_ok(alloc, cache)
