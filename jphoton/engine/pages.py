"""PagePool: the host's view of the device KV page pool (free list + refcounts). No jax here."""

from __future__ import annotations


class PagePool:
    """Pages are ints in [0, num_pages). A page may have several owners (refcounts): a `choice` request's branches share
    their leader's full prompt pages, read-only (engine/choice.py). The device pool has one extra page past the end
    (`trash_page`) where padding rows write harmlessly."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.trash_page = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """One more owner for each of `pages` (allocated ones); returns them."""
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"KV page {p} shared while free")
            self._refs[p] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"KV page {p} released twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
