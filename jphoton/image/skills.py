"""Moondream's skills as prompts (host side, no jax): an image made ready for the vision step (`prepare`) and the
token ids of a query or a caption (`skill_prompt`), per the templates of the 2025-06 release; the reference's sampling
settings (`DEFAULTS`) and the crop geometry a process without the model prepares images with (`CropGeometry`).

Prompt layout (the reference implementation's): with an image, BOS, one placeholder position per image embedding (the
image run, which starts at 1), then the template; a query's template is prefix + question + suffix, the suffix twice
for Moondream 2 (its reference appends it twice when it does not reason) and once for Moondream 3 (`answer_suffixes`);
a caption's is its length's template. Without an image (text-only query): BOS + the query template, attended causally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jphoton.engine.images import ImageInput
from jphoton.image.crops import overlap_crops, pool_weights
from jphoton.image.decode import DEFAULT_MAX_IMAGE_PIXELS, load_image
from jphoton.params import SamplingParams

TEMPLATES = {
    "caption": {"short": (1, 32708, 2, 12492, 3), "normal": (1, 32708, 2, 6382, 3), "long": (1, 32708, 2, 4059, 3)},
    "query": {"prefix": (1, 15381, 2), "suffix": (3,)},
    "detect": {"prefix": (1, 7235, 476, 2), "suffix": (3,)},
    "point": {"prefix": (1, 2581, 2), "suffix": (3,)},
}
CAPTION_LENGTHS = tuple(TEMPLATES["caption"])
DEFAULTS = SamplingParams(max_tokens=768, temperature=0.5, top_p=0.3)  # the reference's sampling settings
BOS_ID = 0
PLACEHOLDER = 0  # the token id an image position holds on the host (the engine rewrites it per chunk)


class CropGeometry(NamedTuple):
    """What `prepare` needs of a model's Vision (models/protocol.py): a server's frontend process prepares images with
    it, without the model (server/engine_loop.py request_limits sends it over)."""

    crop_size: int
    patch_size: int
    overlap_margin: int
    max_crops: int

    @classmethod
    def of(cls, vision) -> CropGeometry:
        return cls(vision.crop_size, vision.patch_size, vision.overlap_margin, vision.max_crops)


def prepare(image, vision, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
            max_image_bytes: int | None = None) -> ImageInput:
    """Decode (jphoton/image/decode.py: bytes, PIL or numpy; ValueError "image: ..." for bad input, encoded bytes over
    `max_image_bytes` too), crop and compute the pooling weights of one image for `vision` (models/protocol.py Vision,
    or its CropGeometry). CPU work of ~10-50 ms: run it on the caller's thread or a worker, never on the engine's."""
    if isinstance(image, ImageInput):
        return image
    if max_image_bytes is not None and isinstance(image, (bytes, bytearray, memoryview)):
        size = memoryview(image).nbytes
        if size > max_image_bytes:
            raise ValueError(f"image: {size} bytes, more than max_image_bytes={max_image_bytes}")
    decoded = load_image(image, max_image_pixels=max_image_pixels)
    crops, tiling = overlap_crops(decoded.pixels, vision.crop_size, vision.patch_size, vision.overlap_margin,
                                  vision.max_crops)
    rows, cols = pool_weights(tiling, vision.crop_size // vision.patch_size, vision.overlap_margin)
    h, w = decoded.pixels.shape[:2]
    return ImageInput(decoded.digest, crops, rows, cols, tiling, (h, w))


def skill_prompt(skill: str, encode: Callable[[str], list[int]], embed_rows: int, *, with_image: bool,
                 question: str | None = None, length: str = "normal",
                 obj: str | None = None, answer_suffixes: int = 2) -> tuple[list[int], tuple[int, int]]:
    """(prompt ids, image run (start, length); (0, 0) without an image) for skill "query", "caption", "point" or
    "detect" (obj: what to find; the reference encodes it after a space); answer_suffixes: the model's
    (models/protocol.py Vision)."""
    if skill == "query":
        if not isinstance(question, str) or not question.strip():
            raise ValueError("query: the question must be a non-empty string")
        t = TEMPLATES["query"]
        body = [*t["prefix"], *encode(question), *t["suffix"] * answer_suffixes]
    elif skill == "caption":
        if length not in TEMPLATES["caption"]:
            raise ValueError(f"caption: length must be one of {', '.join(CAPTION_LENGTHS)}, got {length!r}")
        if not with_image:
            raise ValueError("caption: an image is required")
        body = list(TEMPLATES["caption"][length])
    elif skill in ("point", "detect"):
        if not isinstance(obj, str) or not obj.strip():
            raise ValueError(f"{skill}: the object must be a non-empty string")
        if not with_image:
            raise ValueError(f"{skill}: an image is required")
        t = TEMPLATES[skill]
        body = [*t["prefix"], *encode(" " + obj), *t["suffix"]]
    else:
        raise ValueError(f"unknown skill {skill!r}; expected 'query', 'caption', 'point' or 'detect'")
    if not with_image:
        return [BOS_ID, *body], (0, 0)
    return [BOS_ID, *[PLACEHOLDER] * embed_rows, *body], (1, embed_rows)
