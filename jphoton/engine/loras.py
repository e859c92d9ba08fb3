"""LoraSlots: which LoRA adapter each device slot holds, and who still uses it. Plain Python (no jax), like PagePool.

A request's sequence takes a reference on its adapter's slot at submission (`acquire`) and gives it back when its pages
go back (`release`: finished, aborted, and for a zombie only once no in-flight step references it, the `inflight_refs`
rule of pages). Unloading or replacing an adapter takes its name away at once (new requests are refused, or get the
new weights) while the old slot drains: it is reused only after its last release, so no step in flight ever reads a
slot being overwritten. Each load gets a fresh `key`, part of the prefix-cache key of the pages written under it
(engine/pages.py): KV computed under one adapter is never served to another, nor to a later load of the same name.
"""

from __future__ import annotations

import dataclasses
import itertools


class NoFreeLoraSlot(RuntimeError):
    """Every slot holds an adapter (RESOURCE_EXHAUSTED over gRPC); `draining` says whether one will free up."""

    def __init__(self, message: str, draining: bool):
        super().__init__(message)
        self.draining = draining


@dataclasses.dataclass
class LoraSlot:
    index: int
    name: str | None = None  # None: free, or draining (unloaded/replaced, still referenced)
    key: int = 0  # the load's unique id (prefix-cache key part)
    rank: int = 0
    source: str = ""
    refs: int = 0  # live sequences using it

    @property
    def free(self) -> bool:
        return self.name is None and self.refs == 0


class LoraSlots:
    def __init__(self, max_loras: int):
        self.slots = [LoraSlot(i) for i in range(max_loras)]
        self._by_name: dict[str, LoraSlot] = {}
        self._keys = itertools.count(1)

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def free_slot(self) -> int:
        """A slot a load may write now; NoFreeLoraSlot if none (draining=True: one frees once its requests finish)."""
        if not self.slots:
            raise NoFreeLoraSlot("LoRA is off for this engine: start it with max_loras > 0", draining=False)
        for s in self.slots:
            if s.free:
                return s.index
        draining = any(s.name is None for s in self.slots)
        raise NoFreeLoraSlot(f"all {len(self.slots)} LoRA slots hold adapters"
                             + (" (an unloaded one is still in use by running requests)" if draining
                                else ": unload one first (or start with a larger max_loras)"), draining)

    def loaded(self, name: str, index: int, rank: int, source: str = "") -> None:
        """Slot `index` (from `free_slot`, its weights now written) serves `name`; a slot that served the name before
        drains."""
        slot = self.slots[index]
        assert slot.free, "loaded into a slot in use"
        self.unload(name)
        slot.name, slot.key, slot.rank, slot.source = name, next(self._keys), rank, source
        self._by_name[name] = slot

    def unload(self, name: str) -> bool:
        """Take the name away (its slot drains until its last reference is released); False if it was not loaded."""
        slot = self._by_name.pop(name, None)
        if slot is None:
            return False
        slot.name = None
        return True

    def acquire(self, name: str) -> tuple[int, int]:
        """A reference on the adapter's slot for one sequence: (slot index, load key). ValueError if not loaded."""
        slot = self._by_name.get(name)
        if slot is None:
            raise ValueError(self.unknown(name))
        slot.refs += 1
        return slot.index, slot.key

    def unknown(self, name: str) -> str:
        """Why a request naming `name` is refused (it is not loaded, or LoRA is off)."""
        if not self.slots:
            return f"lora={name!r}: LoRA is off for this engine (create it with max_loras=N and load_lora)"
        known = ", ".join(map(repr, sorted(self._by_name))) or "none"
        return f"unknown LoRA adapter {name!r} (loaded: {known})"

    def release(self, index: int) -> None:
        slot = self.slots[index]
        assert slot.refs > 0, "LoRA slot released more often than acquired"
        slot.refs -= 1

    def listing(self) -> list[dict]:
        """Loaded adapters: name, slot, rank, source, running (sequences using it)."""
        return [{"name": s.name, "slot": s.index, "rank": s.rank, "source": s.source, "running": s.refs}
                for s in sorted(self._by_name.values(), key=lambda s: s.name)]

    def stats(self) -> dict:
        return {"lora_slots_total": len(self.slots),
                "lora_slots_loaded": len(self._by_name),
                "lora_slots_draining": sum(1 for s in self.slots if s.name is None and s.refs),
                "lora_slots_free": sum(1 for s in self.slots if s.free)}
