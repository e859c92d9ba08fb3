"""Image inputs on the engine's side (plain Python, no jax): a request's prepared image, and the slots of the device's
image cache (the projected embeddings of recent images, keyed by content hash).

An image request's prompt is BOS, `embed_rows` placeholder positions, then its text; when a step's prefill chunk
covers the placeholders, the engine (engine/pipeline.py) takes a slot for the image's digest, runs the vision step
into it unless the slot already holds that image, and rewrites the chunk's placeholders to the negative tokens that
name the slot's rows (models/protocol.py Vision).
Invariants: a slot is pinned from the plan that uses it to that step's launch (never evicted in between); an unpinned
slot keeps its image until the least recently used slot is needed; the scheduler never splits an image run across
chunks (bidirectional attention needs the whole prefix in one forward).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)
class ImageInput:
    """A decoded, cropped image (jphoton/image): what the vision step needs, plus its content hash (the cache key)."""

    digest: str
    crops: np.ndarray  # [1 + th * tw, S, S, 3] uint8, the global view first
    pool_rows: np.ndarray  # [th * tw, g, g] float32 (jphoton/image/crops.py pool_weights)
    pool_cols: np.ndarray
    tiling: tuple[int, int]
    size: tuple[int, int]  # (height, width) of the decoded image


class ImageSlots:
    """Which image each slot of the device's image cache holds; LRU over the unpinned ones."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._by_digest: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU first
        self._digest = [None] * num_slots
        self._pins = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.hits = 0
        self.encodes = 0

    def acquire(self, digest: str) -> tuple[int, bool]:
        """(slot, resident) for an image, pinned: resident means the slot already holds it (no vision step needed).
        RuntimeError if every slot is pinned (the engine sizes slots above the rows of one step)."""
        slot = self._by_digest.get(digest)
        if slot is not None:
            self._by_digest.move_to_end(digest)
            self._pins[slot] += 1
            self.hits += 1
            return slot, True
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((d for d, s in self._by_digest.items() if not self._pins[s]), None)
            if victim is None:
                raise RuntimeError(f"all {self.num_slots} image cache slots are pinned")
            slot = self._by_digest.pop(victim)
        self._by_digest[digest] = slot
        self._digest[slot] = digest
        self._pins[slot] += 1
        self.encodes += 1
        return slot, False

    def unpin(self, slot: int) -> None:
        assert self._pins[slot] > 0, f"image slot {slot} is not pinned"
        self._pins[slot] -= 1
        if not self._pins[slot] and self._digest[slot] is None:  # (forgotten while pinned)
            self._free.append(slot)

    def forget(self, slot: int) -> None:
        """The slot's contents are not trustworthy (its encode produced non-finite values): never a hit again."""
        digest = self._digest[slot]
        if digest is not None and self._by_digest.get(digest) == slot:
            del self._by_digest[digest]
            self._digest[slot] = None
            if not self._pins[slot]:
                self._free.append(slot)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._pins if p)

    def stats(self) -> dict:
        return {"image_cache_slots": self.num_slots, "image_cache_hits": self.hits, "image_encodes": self.encodes}


def placeholder_tokens(row_start: int, row_tokens: list[int], run_start: int, run_len: int, slot: int,
                       embed_rows: int) -> list[int]:
    """A prefill chunk's tokens with the image run (positions run_start .. run_start + run_len) rewritten to the
    negative tokens of the slot's embedding rows: position run_start + j -> -(1 + slot * embed_rows + j)."""
    out = list(row_tokens)
    lo, hi = max(run_start, row_start), min(run_start + run_len, row_start + len(out))
    base = slot * embed_rows - run_start
    for p in range(lo, hi):
        out[p - row_start] = -(1 + base + p)
    return out
