"""Moondream's spatial skills on the host (no jax): how a point / detect row's decoded values travel as token ids, and
the answer they build.

A spatial row emits one value per step in place of a token (models/moondream.py `spatial_tokens` picks it on the device
from the step's hidden state): the x of a new object (the step's argmax token was not eos), its y, and for detect its
(width, height). Each is a negative id below -SPATIAL_BASE, far from the image placeholders (-1 .. -slots * 729) and
NONFINITE (-1), so that it rides the token path: the next step reads it as its input (the model embeds it with the
region encoders), a commit appends it, a preempted row's recompute prefills it. Invariant: a text token is >= 0, a
spatial id <= -SPATIAL_BASE; an id's kind is its range: X, then Y (COORD_SPAN bins each), then SIZE (w * SIZE_SPAN + h).
"""

from __future__ import annotations

SPATIAL_BASE = 1 << 24
COORD_SPAN = 1 << 16  # bins of one coordinate id range (Moondream 2: 1,024)
SIZE_SPAN = 1 << 12  # the height's bins inside a size id (Moondream 2: 1,024)
X_BASE, Y_BASE, SIZE_BASE = SPATIAL_BASE, SPATIAL_BASE + COORD_SPAN, 2 * SPATIAL_BASE
MODES = {"point": 1, "detect": 2}  # a row's spatial mode in the step input (0: a text row)
DEFAULT_MAX_OBJECTS = 50  # the reference's


def x_id(b: int) -> int:
    return -(X_BASE + b)


def y_id(b: int) -> int:
    return -(Y_BASE + b)


def size_id(w: int, h: int) -> int:
    return -(SIZE_BASE + w * SIZE_SPAN + h)


def decode_id(token: int) -> tuple[str, tuple[int, ...]] | None:
    """("x" | "y", (bin,)) or ("size", (w_bin, h_bin)) for a spatial id; None for anything else."""
    v = -token
    if v >= SIZE_BASE:
        return "size", divmod(v - SIZE_BASE, SIZE_SPAN)
    if v >= Y_BASE:
        return "y", (v - Y_BASE,)
    if v >= X_BASE:
        return "x", (v - X_BASE,)
    return None


class SpatialAnswer:
    """One point / detect request's objects as they arrive: bins (x, y) or (x, y, w, h) per complete object. `push`
    takes a committed spatial id and says whether max_objects is reached (the request ends, as the reference's loop)."""

    __slots__ = ("mode", "max_objects", "objects", "_partial")

    def __init__(self, skill: str, max_objects: int):
        self.mode = MODES[skill]
        self.max_objects = max_objects
        self.objects: list[tuple[int, ...]] = []
        self._partial: list[int] = []

    @property
    def skill(self) -> str:
        return "point" if self.mode == 1 else "detect"

    def push(self, token: int) -> bool:
        kind, bins = decode_id(token) or ("?", ())
        want = ("x", "y", "size")[len(self._partial) if self.mode == 2 else len(self._partial) % 2]
        if kind != want:
            raise ValueError(f"{self.skill}: expected a {want} value, got token {token}")
        self._partial += bins
        if len(self._partial) == 2 * self.mode:
            self.objects.append(tuple(self._partial))
            self._partial = []
        return len(self.objects) >= self.max_objects

    def steps_needed(self) -> int:
        """Decode steps of max_objects objects and the final eos decision (the request's max_tokens)."""
        return (self.mode + 1) * self.max_objects + 1

    def normalized(self, coord_bins: int, size_bins: int) -> list[tuple[float, ...]]:
        return normalize(self.objects, coord_bins, size_bins)


def normalize(objects: list[tuple[int, ...]], coord_bins: int, size_bins: int) -> list[tuple[float, ...]]:
    """Objects' bins as the reference reports them, in [0, 1]: points (x, y); boxes (x_min, y_min, x_max, y_max), the
    centre -/+ half the size (bin b: coordinate b / coord_bins, size 2 ** (b / (size_bins - 1) * 10 - 10), in float32
    as the reference computes them)."""
    import numpy as np

    out = []
    for b in objects:
        x, y = (float(np.float32(v) / np.float32(coord_bins)) for v in b[:2])
        if len(b) == 2:
            out.append((x, y))
            continue
        w, h = (float(np.exp2(np.float32(v) / np.float32(size_bins - 1) * np.float32(10.0) - np.float32(10.0)))
                for v in b[2:])
        out.append((x - w / 2, y - h / 2, x + w / 2, y + h / 2))
    return out


def answer_of(skill: str, token_ids: list[int], max_objects: int = DEFAULT_MAX_OBJECTS) -> SpatialAnswer:
    """A point / detect request's answer rebuilt from its streamed ids (a text id, the eos that ended it, is skipped)."""
    answer = SpatialAnswer(skill, max_objects)
    for t in token_ids:
        if t < 0:
            answer.push(t)
    return answer
