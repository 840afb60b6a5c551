"""Radix-tree prefix cache over token ids, at page granularity.

Each node holds a run of tokens (a whole number of pages) and their KV slots.
A node's `lock_ref` counts the running requests using it (through itself or a
descendant); locked nodes are never evicted. Eviction frees least recently
used unlocked leaves, so a parent goes only after its children.

Weight epochs: KV is only valid for the weights it was computed with. When
the weights change (`advance_epoch`), the whole tree becomes stale: lookups
and inserts start from a new, empty root, the stale tree's unlocked nodes are
freed at once and its locked ones (held by requests that were running across
the update) as soon as their last lock goes. No lookup ever reaches a stale
node, so KV from other weights is never served.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

import numpy as np

from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.prefix_cache import Match, PrefixCache


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), value: np.ndarray | None = None, parent: "Node | None" = None):
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.key = key
        self.value = value if value is not None else np.zeros(0, dtype=np.int64)
        self.lock_ref = 0
        self.last_access = 0


class RadixCache(PrefixCache):
    enabled = True

    def __init__(self, allocator: PageAllocator):
        super().__init__(allocator)
        self.root = Node()
        self._stale_roots: list[Node] = []  # trees of earlier weight epochs, pruned as their locks go
        self._total = 0  # tokens held
        self._protected = 0  # tokens in locked nodes
        self._clock = itertools.count(1)

    def advance_epoch(self) -> None:
        super().advance_epoch()
        if self.root.children:
            self._stale_roots.append(self.root)
            self.root = Node()
        self._prune_stale()

    def _prune_stale(self) -> None:
        """Free every unlocked node of the stale trees (leaves first)."""
        for root in self._stale_roots:
            freed = 0
            stack = [root]
            order = []
            while stack:
                node = stack.pop()
                order.append(node)
                stack.extend(node.children.values())
            for node in reversed(order):  # children before their parents
                if node is root or node.children or node.lock_ref:
                    continue
                self.allocator.free_slots(node.value)
                freed += len(node.key)
                del node.parent.children[node.key[: self.page_size]]
            self._total -= freed
            self.stats.evicted_tokens += freed
        self._stale_roots = [r for r in self._stale_roots if r.children]

    def _prune_path(self, node: Node) -> None:
        """After an unlock in a stale tree: only the nodes on the unlocked
        path can have lost their last lock (a stale tree keeps no unlocked
        node), so free those that are now unlocked leaves, upwards."""
        freed = 0
        while node.parent is not None and not node.children and not node.lock_ref:
            self.allocator.free_slots(node.value)
            freed += len(node.key)
            del node.parent.children[node.key[: self.page_size]]
            node = node.parent
        self._total -= freed
        self.stats.evicted_tokens += freed
        if node.parent is None and not node.children:
            self._stale_roots.remove(node)

    # ---- lookups ---------------------------------------------------------------
    def _common_pages(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child` after `at` tokens; returns the new upper part."""
        p = self.page_size
        upper = Node(child.key[:at], child.value[:at], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[:p]] = upper
        child.key, child.value, child.parent = child.key[at:], child.value[at:], upper
        upper.children[child.key[:p]] = child
        return upper

    def _walk(self, key: tuple[int, ...], slots: np.ndarray | None) -> tuple[Node, int, list[np.ndarray]]:
        """Follow `key` down the tree, splitting the last node at the point of
        divergence. With `slots`, frees the caller's slots that duplicate ones
        the tree already holds. Returns (deepest node, tokens matched, values)."""
        p, now = self.page_size, next(self._clock)
        node, i, values = self.root, 0, []
        while i < len(key):
            child = node.children.get(key[i: i + p])
            if child is None:
                break
            m = self._common_pages(child.key, key[i:])
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            if slots is not None:
                mine = slots[i: i + m]
                dup = mine != child.value
                if dup.any():
                    self.allocator.free_slots(mine[dup])
            child.last_access = now
            values.append(child.value)
            node, i = child, i + m
        return node, i, values

    def match(self, token_ids: list[int]) -> Match:
        self.stats.queried_tokens += len(token_ids)
        usable = len(token_ids) - len(token_ids) % self.page_size
        node, matched, values = self._walk(tuple(token_ids[:usable]), None)
        self.stats.matched_tokens += matched
        slots = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
        return Match(matched, slots, node if matched else None)

    def insert(self, token_ids: list[int], slots: np.ndarray) -> Any:
        assert len(token_ids) == len(slots) and len(slots) % self.page_size == 0
        key = tuple(token_ids)
        node, i, _ = self._walk(key, np.asarray(slots, dtype=np.int64))
        if i < len(key):
            leaf = Node(key[i:], np.asarray(slots[i:], dtype=np.int64).copy(), node)
            leaf.last_access = next(self._clock)
            node.children[leaf.key[: self.page_size]] = leaf
            self._total += len(leaf.key)
            node = leaf
        return node if node is not self.root else None

    # ---- locks -----------------------------------------------------------------
    def lock(self, node: Any) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Any) -> None:
        start = node
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            if node.lock_ref == 0:
                self._protected -= len(node.key)
            node = node.parent
        if node is not None and node is not self.root:  # the lock was in a stale tree
            self._prune_path(start)

    # ---- eviction ----------------------------------------------------------------
    def _nodes(self):
        stack = [self.root, *self._stale_roots]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free_slots(leaf.value)
            freed += len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._total -= freed
        self.stats.evicted_tokens += freed
        return freed

    def flush(self) -> None:
        self.evict(self._total)

    @property
    def evictable_tokens(self) -> int:
        return self._total - self._protected

    @property
    def cached_tokens(self) -> int:
        return self._total

    def owned_slots(self) -> np.ndarray:
        values = [n.value for n in self._nodes()]
        return np.concatenate(values) if values else np.zeros(0, dtype=np.int64)

    def check_integrity(self) -> None:
        total = protected = 0
        for n in self._nodes():
            assert len(n.key) == len(n.value) and len(n.key) % self.page_size == 0 and n.key
            assert n.lock_ref >= 0 and n.parent.children[n.key[: self.page_size]] is n
            assert n.lock_ref or self._reaches(n, self.root), "an unlocked node of a stale tree was kept"
            assert all(c.lock_ref <= n.lock_ref for c in n.children.values()), "child locked more than parent"
            total += len(n.key)
            protected += len(n.key) if n.lock_ref else 0
        assert (total, protected) == (self._total, self._protected), "cache counters drifted"

    @staticmethod
    def _reaches(node: Node, root: Node) -> bool:
        while node.parent is not None:
            node = node.parent
        return node is root
