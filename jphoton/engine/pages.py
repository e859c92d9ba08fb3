"""PagePool: the host's view of the device KV page pool (free list, refcounts, prefix cache). No jax here.

Prefix cache: a full page whose KV is written is registered under a key that names everything that decides its
contents: the key of the page before it (so the key names the whole prefix), the page's tokens and an `extra` part (a
LoRA adapter id, later). A new request maps the longest run of cached pages its prompt starts with onto its block table
(shared, read-only: a sequence only writes positions past what it has computed, and cached pages are full) and
prefills only the rest. Pages nobody references stay cached (`evictable`) until `allocate` needs them, least recently
released first. A hash chain over full pages rather than a radix tree over tokens: only whole pages are shared, so a
lookup is one dict probe a page and nothing needs a tree's upkeep (vLLM v1 made the same choice).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

PageKey = tuple  # (hash of the previous page's key, the page's tokens, extra)


def page_keys(tokens: Sequence[int], page_size: int, num_pages: int, keys: list[PageKey],
              extra: Hashable = None) -> list[PageKey]:
    """Extend `keys` (the keys of tokens' first len(keys) pages) to `num_pages` full pages of `tokens`; returns it."""
    for i in range(len(keys), num_pages):
        prev = hash(keys[-1]) if keys else 0
        keys.append((prev, tuple(tokens[i * page_size:(i + 1) * page_size]), extra))
    return keys


class PagePool:
    """Pages are ints in [0, num_pages). A page may have several owners (refcounts): sequences that share a cached
    prefix, and a `choice` request's branches, which share their leader's full prompt pages (constrain/choice.py). The
    device pool has one extra page past the end (`trash_page`) where padding rows write harmlessly."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.trash_page = num_pages
        self.prefix_caching = prefix_caching
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._key_of: dict[int, PageKey] = {}  # cached page -> its key
        self._page_of: dict[PageKey, int] = {}  # key -> cached page
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; LRU
        self.hit_tokens = 0  # prompt tokens served from the cache
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def num_free(self) -> int:
        """Pages that hold nothing (kv_pages_free)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached pages that no sequence references (kv_pages_evictable): reused by `allocate` when nothing is free."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out: free, then evictable."""
        return len(self._free) + len(self._evictable)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV pages, {self.num_available} available")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:  # evict the least recently released cached page
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(p)]
            self._refs[p] = 1
            pages.append(p)
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """One more owner for each of `pages` (allocated ones); returns them."""
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"KV page {p} shared while free")
            self._refs[p] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        """One owner fewer; a page nobody owns goes back to the cache if it is cached, else to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"KV page {p} released twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._key_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # ---- prefix cache ----------------------------------------------------------------------------------------------
    def lookup(self, keys: list[PageKey]) -> list[int]:
        """The cached pages of the longest run of `keys` from the start, each with one more owner (taken out of the
        evictable set)."""
        pages = []
        for key in keys:
            p = self._page_of.get(key)
            if p is None:
                break
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1
            pages.append(p)
        return pages

    def register(self, pages: list[int], keys: list[PageKey]) -> None:
        """Cache full, written pages under their keys (pairs beyond the shorter list are ignored). A key already cached
        on another page keeps that page (this one stays private); a page is cached under one key only."""
        if not self.prefix_caching:
            return
        for p, key in zip(pages, keys, strict=False):
            if key not in self._page_of and p not in self._key_of:
                self._page_of[key] = p
                self._key_of[p] = key

    def uncache(self, pages: list[int]) -> None:
        """Take `pages` out of the prefix cache (their KV must never be served again); their owners keep them."""
        for p in pages:
            key = self._key_of.pop(p, None)
            if key is not None:
                del self._page_of[key]
                if self._refs[p] == 0:
                    del self._evictable[p]
                    self._free.append(p)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def refs(self, page: int) -> int:
        return self._refs[page]

    def reset_cache(self) -> int:
        """Forget every cached page: unreferenced ones become free, referenced ones private. Returns pages freed."""
        freed = len(self._evictable)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._page_of.clear()
        return freed
