"""jphoton.image.load_image: every input kind and conversion, built in memory with Pillow; pixels checked, not just
"no error"."""

from __future__ import annotations

import io
import pathlib
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from jphoton.image import DEFAULT_MAX_IMAGE_PIXELS, DecodedImage, load_image

RNG = np.random.default_rng(0)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _refused(image, match: str = "", **kw) -> str:
    with pytest.raises(ValueError) as ei:
        load_image(image, **kw)
    msg = str(ei.value)
    assert msg.startswith("image: ") and "\n" not in msg and len(msg) < 200, msg
    assert match in msg, msg
    return msg


def _rgb(pixels: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in pixels)


# ---- bytes: the three main formats ----

def test_png_is_exact_and_digest_matches_numpy_and_pil():
    a = RNG.integers(0, 256, (13, 17, 3), dtype=np.uint8)
    from_png = load_image(_encode(Image.fromarray(a), "PNG"))
    from_np = load_image(a)
    from_pil = load_image(Image.fromarray(a))
    assert isinstance(from_png, DecodedImage)
    for d in (from_png, from_np, from_pil):
        assert d.pixels.shape == (13, 17, 3) and d.pixels.dtype == np.uint8 and d.pixels.flags.c_contiguous
        np.testing.assert_array_equal(d.pixels, a)
    assert from_png.digest == from_np.digest == from_pil.digest
    assert len(from_png.digest) == 64 and int(from_png.digest, 16) >= 0
    b = a.copy()
    b[5, 7, 1] ^= 1
    assert load_image(b).digest != from_np.digest
    # same bytes, other shape: the shape is in the digest
    assert load_image(a.reshape(17, 13, 3)).digest != from_np.digest


def test_output_is_a_read_only_copy():
    a = RNG.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    d = load_image(a)
    a[0, 0] = (1, 2, 3)
    assert _rgb(d.pixels[0, 0]) != (1, 2, 3) or d.pixels is not a
    assert not d.pixels.flags.writeable
    with pytest.raises(ValueError):
        d.pixels[0, 0, 0] = 9
    with pytest.raises(AttributeError):
        d.digest = "x"  # frozen


def test_jpeg_decodes_to_rgb():
    img = Image.new("RGB", (24, 16), (200, 30, 60))
    d = load_image(_encode(img, "JPEG", quality=95))
    assert d.pixels.shape == (16, 24, 3)
    assert np.abs(d.pixels.astype(int) - (200, 30, 60)).max() <= 6


def test_webp_lossless_is_exact_and_lossy_close():
    a = RNG.integers(0, 256, (9, 11, 3), dtype=np.uint8)
    d = load_image(_encode(Image.fromarray(a), "WEBP", lossless=True))
    np.testing.assert_array_equal(d.pixels, a)
    assert d.digest == load_image(a).digest
    lossy = load_image(_encode(Image.new("RGB", (16, 16), (10, 120, 240)), "WEBP", quality=95))
    assert np.abs(lossy.pixels.astype(int) - (10, 120, 240)).max() <= 8


def test_bytearray_and_memoryview_accepted():
    a = RNG.integers(0, 256, (3, 5, 3), dtype=np.uint8)
    data = _encode(Image.fromarray(a), "PNG")
    for x in (bytearray(data), memoryview(data)):
        np.testing.assert_array_equal(load_image(x).pixels, a)


# ---- bytes: refused ----

def _noisy_jpeg(progressive: bool = False, seed: int | None = None) -> bytes:
    rng = RNG if seed is None else np.random.default_rng(seed)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return _encode(Image.fromarray(noise), "JPEG", quality=90, progressive=progressive)


def test_truncated_jpeg_is_refused_not_padded():
    for progressive in (False, True):
        data = _noisy_jpeg(progressive=progressive)
        assert load_image(data).pixels.shape == (64, 64, 3)
        for cut in (len(data) // 2, len(data) - 10, len(data) - 2, len(data) - 1):  # -2: only the EOI marker gone
            _refused(data[:cut], "image: cannot decode JPEG: image file is truncated")
    assert load_image(data + b"trailing bytes after EOI").digest == load_image(data).digest


def test_jpeg_without_eoi_is_refused_even_where_pillow_accepts_it():
    data = _noisy_jpeg(seed=35)  # its last scan ends on a byte boundary: Pillow decodes it fully without the EOI
    with Image.open(io.BytesIO(data[:-2])) as img:
        img.load()  # Pillow alone: no error
    _refused(data[:-2], "image file is truncated (no end-of-image marker)")
    _refused(data[:-1], "image file is truncated")


def test_truncated_png_is_refused():
    data = _encode(Image.fromarray(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)), "PNG")
    _refused(data[: len(data) // 2], "cannot decode")


def test_random_empty_and_other_format_bytes_are_refused():
    _refused(RNG.integers(0, 256, 1000, dtype=np.uint8).tobytes(), "not a JPEG, PNG, WebP or GIF")
    _refused(b"", "empty")
    img = Image.new("RGB", (4, 4), (1, 2, 3))
    for fmt in ("BMP", "TIFF"):
        _refused(_encode(img, fmt), "not a JPEG, PNG, WebP or GIF")


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png_header_only(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(b"\0" * 64)  # a little data: not nearly enough for the claimed size
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def test_decompression_bomb_png_refused_from_the_header_fast():
    t0 = time.perf_counter()
    _refused(_png_header_only(100_000, 100_000),
             f"the image has 10000000000 pixels, more than max_image_pixels={DEFAULT_MAX_IMAGE_PIXELS}")
    # under Pillow's own limit but over ours
    _refused(_png_header_only(8000, 8000), "the image has 64000000 pixels, more than max_image_pixels=50000000")
    assert time.perf_counter() - t0 < 1.0


def test_webp_canvas_checked_before_the_decoder_allocates_it():
    w, h = 10_000, 10_000  # 100 MP: over our limit, under Pillow's 2 x MAX_IMAGE_PIXELS
    vp8x = b"\x00\x00\x00\x00" + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    _refused(b"RIFF" + struct.pack("<I", len(body)) + body, "the image has 100000000 pixels, more than")


def test_pixel_limit_for_every_input_kind():
    a = np.zeros((100, 100, 3), np.uint8)
    msg = "the image has 10000 pixels, more than max_image_pixels=9999"
    _refused(_encode(Image.fromarray(a), "PNG"), msg, max_image_pixels=9999)
    _refused(_encode(Image.fromarray(a), "WEBP", lossless=True), msg, max_image_pixels=9999)
    _refused(Image.fromarray(a), msg, max_image_pixels=9999)
    _refused(a, msg, max_image_pixels=9999)
    assert load_image(a, max_image_pixels=10_000).pixels.shape == (100, 100, 3)
    for bad in (0, -1, 1.5, True, None):
        _refused(a, "max_image_pixels must be a positive int", max_image_pixels=bad)


def test_zero_size_refused():
    _refused(Image.new("RGB", (0, 5)), "empty")
    _refused(np.zeros((0, 4, 3), np.uint8), "empty")
    _refused(np.zeros((4, 0), np.uint8), "empty")


# ---- modes ----

def test_sixteen_bit_png_is_scaled_not_clipped():
    values = np.array([[0, 1, 128, 257, 1000, 32896, 65534, 65535]], dtype=np.uint16)
    data = _encode(Image.fromarray(values), "PNG")
    with Image.open(io.BytesIO(data)) as img:
        assert img.mode.startswith("I")  # really a 16-bit PNG
    d = load_image(data)
    expected = [0, 0, 0, 1, 4, 128, 255, 255]  # round(v * 255 / 65535)
    assert d.pixels.shape == (1, 8, 3)
    np.testing.assert_array_equal(d.pixels[0], np.repeat(np.array(expected, np.uint8)[:, None], 3, axis=1))
    # mode "I" (32-bit) PIL input: the same 16-bit scale, clipped outside 0..65535
    i32 = Image.fromarray(np.array([[-5, 65535, 70000, 32896]], dtype=np.int32), mode="I")
    np.testing.assert_array_equal(load_image(i32).pixels[0, :, 0], [0, 255, 255, 128])


def test_cmyk_jpeg_to_rgb():
    img = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # red
    data = _encode(img, "JPEG", quality=95)
    d = load_image(data)
    assert d.pixels.shape == (16, 16, 3)
    assert np.abs(d.pixels.astype(int) - (255, 0, 0)).max() <= 8
    with Image.open(io.BytesIO(data)) as ref:  # the reference's convert("RGB")
        np.testing.assert_array_equal(d.pixels, np.array(ref.convert("RGB")))


def test_palette_with_and_without_transparency():
    p = Image.new("P", (4, 2), 0)
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * (254 * 3))
    p.putpixel((3, 1), 1)
    plain = load_image(_encode(p, "PNG"))
    assert _rgb(plain.pixels[0, 0]) == (255, 0, 0) and _rgb(plain.pixels[1, 3]) == (0, 255, 0)
    clear = load_image(_encode(p, "PNG", transparency=0))  # index 0 transparent -> black
    assert _rgb(clear.pixels[0, 0]) == (0, 0, 0) and _rgb(clear.pixels[1, 3]) == (0, 255, 0)


def test_rgba_and_la_composited_on_black():
    rgba = np.array([[[200, 100, 50, 255], [200, 100, 50, 0], [200, 100, 50, 128]]], dtype=np.uint8)
    expected = [(200, 100, 50), (0, 0, 0), (100, 50, 25)]  # round(c * a / 255)
    for image in (_encode(Image.fromarray(rgba, "RGBA"), "PNG"), Image.fromarray(rgba, "RGBA"), rgba):
        d = load_image(image)
        assert [_rgb(px) for px in d.pixels[0]] == expected
    la = Image.fromarray(np.array([[[200, 255], [200, 0], [200, 128]]], dtype=np.uint8), "LA")
    d = load_image(_encode(la, "PNG"))
    assert [_rgb(px) for px in d.pixels[0]] == [(200,) * 3, (0,) * 3, (100,) * 3]
    assert d.digest == load_image(la).digest


def test_rgb_with_trns_key_is_transparent():
    img = Image.new("RGB", (2, 1), (10, 20, 30))
    img.putpixel((1, 0), (40, 50, 60))
    d = load_image(_encode(img, "PNG", transparency=(10, 20, 30)))
    assert [_rgb(px) for px in d.pixels[0]] == [(0, 0, 0), (40, 50, 60)]


def test_grayscale_and_bilevel_to_rgb():
    g = RNG.integers(0, 256, (5, 7), dtype=np.uint8)
    want = np.repeat(g[:, :, None], 3, axis=2)
    for image in (_encode(Image.fromarray(g, "L"), "PNG"), Image.fromarray(g, "L"), g, g[:, :, None]):
        np.testing.assert_array_equal(load_image(image).pixels, want)
    bw = Image.new("1", (3, 1), 0)
    bw.putpixel((1, 0), 1)
    assert [_rgb(px) for px in load_image(_encode(bw, "PNG")).pixels[0]] == [(0,) * 3, (255,) * 3, (0,) * 3]


def test_exif_orientation_6_is_applied():
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :] = (0, 0, 255)
    a[:6, :6] = (255, 0, 0)  # red top-left corner
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = _encode(Image.fromarray(a), "JPEG", quality=95, exif=exif.tobytes())
    d = load_image(data)
    assert d.pixels.shape == (40, 20, 3)  # H and W swapped
    top_right, top_left = d.pixels[2, 17].astype(int), d.pixels[2, 2].astype(int)
    assert np.abs(top_right - (255, 0, 0)).max() <= 40, top_right  # the corner moved clockwise
    assert np.abs(top_left - (0, 0, 255)).max() <= 40, top_left
    with Image.open(io.BytesIO(data)) as lazy:  # PIL input: the same
        assert load_image(lazy).digest == d.digest


def test_animated_gif_webp_apng_give_the_first_frame():
    frames = [Image.new("RGB", (8, 6), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    cases = {
        "GIF": dict(save_all=True, append_images=frames[1:], duration=50, loop=0),
        "WEBP": dict(save_all=True, append_images=frames[1:], duration=50, lossless=True),
        "PNG": dict(save_all=True, append_images=frames[1:], duration=50),
    }
    for fmt, kw in cases.items():
        data = _encode(frames[0], fmt, **kw)
        with Image.open(io.BytesIO(data)) as img:
            assert getattr(img, "n_frames", 1) == 3, fmt  # really animated
        d = load_image(data)
        assert d.pixels.shape == (6, 8, 3), fmt
        assert (d.pixels == (255, 0, 0)).all(), fmt


# ---- PIL and numpy input ----

def test_pil_lazy_truncated_file_is_refused():
    data = _noisy_jpeg()
    with Image.open(io.BytesIO(data[: len(data) // 2])) as lazy:
        _refused(lazy, "cannot read the PIL image")


def test_pil_unsupported_mode_refused():
    _refused(Image.new("F", (2, 2)), "pixel mode F is not supported")


def test_numpy_non_contiguous_is_copied_contiguous():
    a = RNG.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    view = a[:, ::2]
    d = load_image(view)
    assert d.pixels.flags.c_contiguous and d.pixels.shape == (6, 5, 3)
    np.testing.assert_array_equal(d.pixels, view)
    assert d.digest == load_image(np.ascontiguousarray(view)).digest


def test_numpy_bad_dtype_and_shape_refused_with_them_in_the_message():
    msg = _refused(np.zeros((4, 4, 3), np.float32), "uint8")
    assert "float32" in msg and "(4, 4, 3)" in msg
    assert "(4, 4, 3, 1)" in _refused(np.zeros((4, 4, 3, 1), np.uint8), "shape")
    assert "(4, 4, 2)" in _refused(np.zeros((4, 4, 2), np.uint8), "shape")
    assert "(4,)" in _refused(np.zeros((4,), np.uint8), "shape")
    assert "uint16" in _refused(np.zeros((4, 4), np.uint16), "uint8")


def test_paths_and_other_types_refused():
    _refused("/etc/passwd", "pass the encoded file's bytes")
    _refused(pathlib.Path("/etc/passwd"), "pass the encoded file's bytes")
    _refused(12, "unsupported input type int")
    _refused([[0, 0, 0]], "unsupported input type list")
