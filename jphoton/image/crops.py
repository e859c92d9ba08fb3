"""Moondream's overlapping crops, on the host (numpy + Pillow, never jax): a global view of the whole image resized to
one crop, plus a grid of overlapping local crops of a resized copy; and the weights that stitch the local crops'
patch features back together and average-pool them to one crop's grid (`pool_weights`).

Invariants: crops are uint8 [1 + th*tw, S, S, 3], the global view first, local crops row-major; resizing is Pillow's
Lanczos, as the reference implementation does without pyvips; `pool_weights(tiling)` reproduces the reference's
reconstruct-from-crops + adaptive average pool exactly (each stitched cell belongs to one crop), padded to any
number of crops with zero weights.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image


def select_tiling(height: int, width: int, crop_size: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops covering an image of this size (the reference's rule)."""
    if height <= crop_size or width <= crop_size:
        return (1, 1)
    min_h, min_w = math.ceil(height / crop_size), math.ceil(width / crop_size)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    h_tiles = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    w_tiles = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if h_tiles * w_tiles > max_crops:
        if w_tiles > h_tiles:
            w_tiles = math.floor(max_crops / h_tiles)
        else:
            h_tiles = math.floor(max_crops / w_tiles)
    return (max(1, h_tiles), max(1, w_tiles))


def tiling_for(height: int, width: int, crop_size: int = 378, patch: int = 14, margin: int = 4,
               max_crops: int = 12) -> tuple[int, int]:
    m = 2 * patch * margin
    return select_tiling(height - m, width - m, (crop_size // patch - 2 * margin) * patch, max_crops)


def overlap_crops(pixels: np.ndarray, crop_size: int = 378, patch: int = 14, margin: int = 4,
                  max_crops: int = 12) -> tuple[np.ndarray, tuple[int, int]]:
    """pixels [H, W, 3] uint8 -> (crops [1 + th*tw, S, S, 3] uint8, (th, tw))."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"image: expected HxWx3 uint8 pixels, got {pixels.dtype} {pixels.shape}")
    H, W = pixels.shape[:2]
    margin_px = patch * margin
    window = (crop_size // patch - 2 * margin) * patch
    th, tw = tiling_for(H, W, crop_size, patch, margin, max_crops)
    crops = np.zeros((th * tw + 1, crop_size, crop_size, 3), np.uint8)
    img = Image.fromarray(pixels)
    crops[0] = np.asarray(img.resize((crop_size, crop_size), resample=Image.Resampling.LANCZOS))
    size = (tw * window + 2 * margin_px, th * window + 2 * margin_px)
    # one local crop the size of a crop (a 1x1 tiling): the same resize as the global view's
    resized = crops[0] if size == (crop_size, crop_size) else np.asarray(img.resize(size,
                                                                                 resample=Image.Resampling.LANCZOS))
    for i in range(th):
        for j in range(tw):
            region = resized[i * window: i * window + crop_size, j * window: j * window + crop_size]
            crops[1 + i * tw + j, : region.shape[0], : region.shape[1]] = region
    return crops, (th, tw)


def _adaptive_pool_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in]: torch's adaptive average pooling along one axis (window floor(i*n/o) .. ceil((i+1)*n/o))."""
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        a, b = (i * n_in) // n_out, -(-((i + 1) * n_in) // n_out)
        m[i, a:b] = 1.0 / (b - a)
    return m


def _axis_weights(tiles: int, grid: int, margin: int) -> np.ndarray:
    """[tiles, grid, grid]: for the crop at tile t, out cell i <- its patch row j weight (stitch + pool, one axis)."""
    step = grid - 2 * margin
    pool = _adaptive_pool_matrix(step * tiles + 2 * margin, grid)
    w = np.zeros((tiles, grid, grid), np.float64)
    for t in range(tiles):
        lo = 0 if t == 0 else margin
        hi = grid if t == tiles - 1 else grid - margin
        w[t, :, lo:hi] = pool[:, t * step + lo: t * step + hi]
    return w


def pool_weights(tiling: tuple[int, int], grid: int = 27, margin: int = 4,
                 num_crops: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) float32 [C, grid, grid] for the local crops in row-major order, padded with zeros to num_crops
    (default th*tw): pooled = sum_c rows[c] @ F_c @ cols[c]^T (F_c the crop's [grid, grid, E] features)."""
    th, tw = tiling
    C = num_crops if num_crops is not None else th * tw
    if C < th * tw:
        raise ValueError(f"pool_weights: {th}x{tw} crops do not fit in {C}")
    rw, cw = _axis_weights(th, grid, margin), _axis_weights(tw, grid, margin)
    rows = np.zeros((C, grid, grid), np.float32)
    cols = np.zeros((C, grid, grid), np.float32)
    for i in range(th):
        for j in range(tw):
            rows[i * tw + j], cols[i * tw + j] = rw[i], cw[j]
    return rows, cols
