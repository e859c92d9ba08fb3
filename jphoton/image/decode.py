"""User image -> one HxWx3 uint8 RGB array (host side: numpy + Pillow, never jax).

Owns: decoding encoded bytes (JPEG, PNG/APNG, WebP, GIF only), converting PIL images and numpy arrays, the pixel
limit, and the digest a prefix cache keys "same image" on. Invariants: `DecodedImage.pixels` is HxWx3 uint8,
C-contiguous, read-only, H, W >= 1 and H*W <= max_image_pixels; `digest` = sha256 over the shape and those bytes, so
the same pixels give the same digest whatever the input kind. Every refusal is a one-line ValueError starting with
"image: "; nothing is returned for a truncated or corrupt file (Pillow never pads: LOAD_TRUNCATED_IMAGES must stay
False; a JPEG must end its last scan with EOI). The limit is checked from the header, before pixel data is decoded.
Conversions: see `load_image`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pathlib
import re

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

# 50 MP: an 8192x6144 photo fits (larger than any phone camera); decoded RGB is <= 150 MB, RGBA <= 200 MB.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000

# The only decoders encoded bytes reach (Pillow's names; "PNG" covers APNG, "JPEG" covers MPO). GIF is in because
# users paste GIFs and Pillow's decoder for it is small and well kept; BMP/TIFF/ICO/... are refused.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF")

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


@dataclasses.dataclass(frozen=True, eq=False)
class DecodedImage:
    """pixels: HxWx3 uint8 RGB, C-contiguous, read-only. digest: hex sha256 over "HxWx3:" + the pixel bytes."""

    pixels: np.ndarray
    digest: str

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    @property
    def width(self) -> int:
        return self.pixels.shape[1]


def load_image(image, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """Decode/convert `image` (bytes/bytearray/memoryview of a JPEG, PNG, WebP or GIF file; a PIL image; a numpy array).

    Conversions (the Moondream reference does `image.convert("RGB")`; we match it wherever that is well defined):
      bytes               decoded by Pillow, formats FORMATS only; truncated/corrupt/unknown -> ValueError
      EXIF orientation    applied (ImageOps.exif_transpose), for bytes and PIL input alike
      animated            frame 0 only (GIF, animated WebP, APNG's default image, MPO's first picture)
      RGB                 as is;  L, 1, CMYK, YCbCr, P without transparency -> PIL convert("RGB")
      alpha               RGBA, LA, PA, RGBa, La, P or L/RGB with a tRNS key -> RGBA, composited on BLACK:
                          c * a / 255 rounded. convert("RGB") drops alpha, which shows what is stored under
                          transparent pixels: encoders store (0, 0, 0, 0) there, i.e. black; opaque pixels are
                          unchanged, so this equals the reference except where hidden colours differ
      16-bit              I;16* and I (taken as 0..65535, clipped) scaled to 8 bits: round(v * 255 / 65535), then
                          gray -> RGB (the reference's convert("RGB") clips to 255 instead: a deliberate difference)
      other modes         (F, LAB, HSV, ...) -> ValueError
      numpy               uint8 only: HxWx3 as is (copied), HxW and HxWx1 gray -> RGB, HxWx4 RGBA -> as alpha above
      str / Path          refused: pass the file's bytes (a server must not read paths users name)
    Pixel limit: H*W > max_image_pixels -> ValueError, from the header (before decoding) for bytes and lazy PIL images.
    Pillow's own bomb check (2 x Image.MAX_IMAGE_PIXELS, ~179 MP by default) stays as a backstop; this module never
    changes that global.
    """
    if isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int) or max_image_pixels < 1:
        raise ValueError(f"image: max_image_pixels must be a positive int, got {max_image_pixels!r}")
    if isinstance(image, (bytes, bytearray, memoryview)):
        pixels = _from_bytes(bytes(image), max_image_pixels)
    elif isinstance(image, Image.Image):
        pixels = _from_pil(image, max_image_pixels)
    elif isinstance(image, np.ndarray):
        pixels = _from_numpy(image, max_image_pixels)
    elif isinstance(image, (str, pathlib.PurePath)):
        raise ValueError("image: got a path/str; pass the encoded file's bytes, a PIL image or a numpy array")
    else:
        raise ValueError(f"image: unsupported input type {type(image).__name__} (bytes, PIL image or numpy array)")
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    pixels.setflags(write=False)
    return DecodedImage(pixels=pixels, digest=pixel_digest(pixels))


def pixel_digest(pixels: np.ndarray) -> str:
    """Hex sha256 over "HxWx3:" and the C-order bytes of an HxWx3 uint8 array."""
    h = hashlib.sha256("x".join(map(str, pixels.shape)).encode() + b":")
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()


def _check_pixels(width: int, height: int, max_image_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ValueError(f"image: the image is empty ({width}x{height})")
    if width * height > max_image_pixels:
        raise ValueError(f"image: the image has {width * height} pixels, more than max_image_pixels={max_image_pixels}"
                         f" ({width}x{height})")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:120] if text else "") or type(e).__name__


def _from_bytes(data: bytes, max_image_pixels: int) -> np.ndarray:
    if not data:
        raise ValueError("image: empty bytes")
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("image: PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set (Pillow would pad truncated files)")
    if (size := _webp_canvas_size(data)) is not None:  # libwebp allocates the canvas at open: check it before that
        _check_pixels(*size, max_image_pixels)
    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except UnidentifiedImageError:
        raise ValueError("image: not a JPEG, PNG, WebP or GIF file (or its header is corrupt)") from None
    except Image.DecompressionBombError as e:
        raise ValueError(_bomb_message(e, max_image_pixels)) from None
    except Exception as e:
        raise ValueError(f"image: cannot decode: {_one_line(e)}") from e
    with img:
        _check_pixels(*img.size, max_image_pixels)  # header only: pixel data is decoded by load() below
        if img.format in ("JPEG", "MPO") and data.rfind(b"\xff\xd9") < data.rfind(b"\xff\xda"):
            # Pillow accepts a JPEG cut just before its EOI marker when the last scan happens to be complete: refuse
            # it like any other truncated file (the last SOS is the main image's; an EXIF thumbnail's EOI precedes it)
            raise ValueError(f"image: cannot decode {img.format}: image file is truncated (no end-of-image marker)")
        return _load_rgb(img, f"cannot decode {img.format}")  # full decode now: a truncated/corrupt file raises here


def _bomb_message(e: Exception, max_image_pixels: int) -> str:
    m = re.search(r"\((\d+) pixels\)", str(e))
    n = int(m.group(1)) if m else None
    if n is not None and n > max_image_pixels:
        return f"image: the image has {n} pixels, more than max_image_pixels={max_image_pixels}"
    return f"image: the image has {n or 'too many'} pixels, more than Pillow's limit (2 x Image.MAX_IMAGE_PIXELS)"


def _webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a WebP header (VP8X canvas, VP8 frame or VP8L), None if not a WebP or unreadable."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


def _from_pil(img: Image.Image, max_image_pixels: int) -> np.ndarray:
    _check_pixels(*img.size, max_image_pixels)  # before load(): a lazily opened file is not decoded yet
    if isinstance(img, ImageFile.ImageFile) and ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("image: PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set (Pillow would pad truncated files)")
    return _load_rgb(img, "cannot read the PIL image")


def _load_rgb(img: Image.Image, what: str) -> np.ndarray:
    """Decode the pixel data (load()), apply EXIF orientation, convert to RGB; any failure -> "image: {what}: ..."."""
    try:
        img.load()
        return _to_rgb(ImageOps.exif_transpose(img))
    except ValueError as e:
        if str(e).startswith("image: "):
            raise
        raise ValueError(f"image: {what}: {_one_line(e)}") from e
    except Exception as e:
        raise ValueError(f"image: {what}: {_one_line(e)}") from e


def _to_rgb(img: Image.Image) -> np.ndarray:
    """A loaded PIL image (any mode) -> HxWx3 uint8 RGB, per the table in `load_image`."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return np.array(img)
    if mode in _SIXTEEN_BIT_MODES:
        return _gray_to_rgb(_scale_16_to_8(np.asarray(img)))
    if mode in _ALPHA_MODES or (mode in ("P", "L", "RGB") and "transparency" in img.info):
        return _composite_on_black(np.asarray(img.convert("RGBA")))
    if mode in ("L", "1", "CMYK", "YCbCr", "P"):
        return np.array(img.convert("RGB"))
    raise ValueError(f"image: pixel mode {mode} is not supported")


def _scale_16_to_8(a: np.ndarray) -> np.ndarray:
    v = np.clip(a.astype(np.int64), 0, 65535)
    return ((v * 255 + 32767) // 65535).astype(np.uint8)


def _gray_to_rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[:, :, None], 3, axis=2)


def _composite_on_black(rgba: np.ndarray) -> np.ndarray:
    rgb = rgba[:, :, :3].astype(np.uint16)
    alpha = rgba[:, :, 3:4].astype(np.uint16)
    return ((rgb * alpha + 127) // 255).astype(np.uint8)


def _from_numpy(a: np.ndarray, max_image_pixels: int) -> np.ndarray:
    if a.dtype != np.uint8:
        raise ValueError(f"image: a numpy image must be uint8, got {a.dtype} with shape {a.shape}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        raise ValueError(f"image: a numpy image must be HxW, HxWx1, HxWx3 or HxWx4, got shape {a.shape}")
    _check_pixels(a.shape[1], a.shape[0], max_image_pixels)
    if a.ndim == 2:
        return _gray_to_rgb(a)
    if a.shape[2] == 4:
        return _composite_on_black(a)
    return np.array(a, order="C", copy=True)
