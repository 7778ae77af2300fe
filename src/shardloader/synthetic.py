"""A procedural image dataset: JPEG samples of distinct, learnable pattern classes.

Tests, the demo, the examples and the benchmarks need image data that is free, offline,
reproducible and realistic enough that decoding costs what real decoding costs and that a small
CNN can learn the labels. Each class is a pattern family (discs, stripes, checkerboard, rings,
triangles, crosshatch, outlined squares, blobs, rays, dot lattice) drawn in a class hue, over a
random gradient background, with per-sample position, scale, rotation, colour jitter and sensor
noise. Images are JPEG-encoded (libjpeg-turbo through simplejpeg, 4:2:0 chroma subsampling like
most photos) at sizes drawn from `[min_size, max_size]` per side.

Sample `i` depends only on `(seed, i, num_classes, min_size, max_size, quality)`: it is drawn
from its own `numpy` generator keyed by `(seed, i)`, so any slice of the stream can be made
alone and the same seed gives the same bytes. Labels are balanced: `label = i % num_classes`.
Drawing is vectorised numpy/OpenCV (about 1-2 ms per image on one core).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import cv2
import numpy as np
import simplejpeg

FAMILIES = (
    "discs", "stripes", "checker", "rings", "triangles",
    "crosshatch", "squares", "blobs", "rays", "dots",
)


def class_name(label: int, num_classes: int = 10) -> str:
    """Directory-safe class name; sorting names sorts labels (`c003_rings`)."""
    width = max(3, len(str(num_classes - 1)))
    return f"c{label:0{width}d}_{FAMILIES[label % len(FAMILIES)]}"


def make_image_samples(
    n: int,
    *,
    num_classes: int = 10,
    min_size: int = 128,
    max_size: int = 256,
    seed: int = 0,
    quality: int = 90,
    start: int = 0,
) -> Iterator[dict[str, Any]]:
    """Yield `n` samples `{"image": jpeg_bytes, "label": int, "class": str}`.

    Sample numbers run from `start` to `start + n - 1`; sample `i` is the same whatever `n`
    and `start` are, so streams can be split across processes.
    """
    _check_args(n, num_classes, min_size, max_size, quality)
    for i in range(start, start + n):
        image, label = make_image(
            i, num_classes=num_classes, min_size=min_size, max_size=max_size, seed=seed
        )
        yield {
            "image": encode_jpeg(image, quality),
            "label": label,
            "class": class_name(label, num_classes),
        }


def write_image_folder(
    root: str | os.PathLike[str],
    n: int,
    *,
    num_classes: int = 10,
    min_size: int = 128,
    max_size: int = 256,
    seed: int = 0,
    quality: int = 90,
) -> list[tuple[str, int]]:
    """Write `n` samples as `root/<class>/<i>.jpg` (an image-folder dataset) and return
    `(path, label)` for each in sample order. File names are zero-padded so that sorted
    names are in sample order."""
    root = os.fspath(root)
    width = max(6, len(str(max(n - 1, 0))))
    written: list[tuple[str, int]] = []
    for i, sample in enumerate(
        make_image_samples(
            n, num_classes=num_classes, min_size=min_size, max_size=max_size, seed=seed,
            quality=quality,
        )
    ):
        folder = os.path.join(root, sample["class"])
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{i:0{width}d}.jpg")
        with open(path, "wb") as f:
            f.write(sample["image"])
        written.append((path, sample["label"]))
    return written


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """JPEG bytes of an HWC uint8 RGB image (4:2:0 subsampling, deterministic)."""
    return simplejpeg.encode_jpeg(
        np.ascontiguousarray(image), quality=quality, colorspace="RGB", colorsubsampling="420"
    )


def make_image(
    index: int,
    *,
    num_classes: int = 10,
    min_size: int = 128,
    max_size: int = 256,
    seed: int = 0,
) -> tuple[np.ndarray, int]:
    """The raw HWC uint8 RGB image of sample `index` and its label (before JPEG encoding)."""
    _check_args(1, num_classes, min_size, max_size, 90)
    rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, index]))
    label = index % num_classes
    h, w = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
    family = label % len(FAMILIES)
    variant = label // len(FAMILIES)

    ys = np.arange(h, dtype=np.float32)[:, None]
    xs = np.arange(w, dtype=np.float32)[None, :]
    grid = _Grid(h, w, ys, xs)

    # Colours: the class hue (evenly spaced over the hue circle, jittered) on a dull background.
    hue = (label * 180.0 / num_classes + rng.uniform(-0.25, 0.25) * 180.0 / num_classes) % 180
    fg = _hsv_to_rgb(hue, rng.uniform(150, 255), rng.uniform(160, 255))
    bg0 = _hsv_to_rgb(rng.uniform(0, 180), rng.uniform(0, 70), rng.uniform(20, 140))
    bg1 = _hsv_to_rgb(rng.uniform(0, 180), rng.uniform(0, 70), rng.uniform(20, 140))

    # Background: a linear ramp between two colours along a random direction (bilinear
    # interpolation of the four corner colours), foreground: the class colour where `mask` is 1.
    angle = rng.uniform(0, np.pi)
    t = np.array([[0.0, np.cos(angle)], [np.sin(angle), np.cos(angle) + np.sin(angle)]])
    t = (t - t.min()) / max(float(np.ptp(t)), 1e-6)
    corners = (bg0 + (bg1 - bg0) * t[..., None].astype(np.float32)).astype(np.float32)
    background = cv2.resize(corners, (w, h), interpolation=cv2.INTER_LINEAR)
    foreground = cv2.resize(fg.reshape(1, 1, 3), (w, h), interpolation=cv2.INTER_NEAREST)

    mask = _FAMILY_DRAW[family](grid, rng, variant)
    image = cv2.blendLinear(foreground, background, mask, np.float32(1.0) - mask)
    cv2.scaleAdd(_noise(rng, h, w), float(rng.uniform(2, 9)), image, dst=image)
    np.clip(image, 0, 255, out=image)
    return image.astype(np.uint8), label


_NOISE_SIDE = 512
_noise_bank: np.ndarray | None = None


def _noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Unit Gaussian sensor noise for an (h, w, 3) image: a window at a random offset of a fixed
    noise field, repeated periodically for images larger than it (drawing fresh normals costs
    more than everything else in `make_image`). The field never depends on earlier calls, so a
    sample's bytes do not either."""
    global _noise_bank
    if _noise_bank is None:
        bank_rng = np.random.default_rng(0x5EED)
        _noise_bank = bank_rng.standard_normal((_NOISE_SIDE, _NOISE_SIDE, 3), dtype=np.float32)
    bank = _noise_bank
    if h > _NOISE_SIDE or w > _NOISE_SIDE:
        reps = (-(-h // _NOISE_SIDE) + 1, -(-w // _NOISE_SIDE) + 1, 1)
        bank = np.tile(_noise_bank, reps)
    y = int(rng.integers(0, bank.shape[0] - h + 1))
    x = int(rng.integers(0, bank.shape[1] - w + 1))
    return bank[y : y + h, x : x + w]


# -- pattern families: each returns an (h, w) float32 coverage mask in [0, 1] --------------------


class _Grid:
    __slots__ = ("h", "w", "ys", "xs")

    def __init__(self, h: int, w: int, ys: np.ndarray, xs: np.ndarray) -> None:
        self.h, self.w, self.ys, self.xs = h, w, ys, xs

    def rotated(self, theta: float, cx: float = 0.0, cy: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Coordinates (u, v) of every pixel in a frame rotated by `theta` about (cx, cy)."""
        c, s = np.float32(np.cos(theta)), np.float32(np.sin(theta))
        x, y = self.xs - np.float32(cx), self.ys - np.float32(cy)
        return x * c + y * s, y * c - x * s


def _soft(signed: np.ndarray, width: float = 1.0) -> np.ndarray:
    """Anti-aliased step: 0 where `signed` < 0, 1 where > 0, a ramp of about `width` px."""
    return np.clip(0.5 + signed / np.float32(width), 0.0, 1.0)


def _periodic(grid: _Grid, rng: np.random.Generator, base_angle: float) -> tuple[np.ndarray, np.ndarray, float]:
    period = rng.uniform(9, 24) * min(grid.h, grid.w) / 192.0
    theta = base_angle + rng.uniform(-0.3, 0.3)
    u, v = grid.rotated(theta, rng.uniform(0, grid.w), rng.uniform(0, grid.h))
    return u / np.float32(period), v / np.float32(period), period


def _draw_discs(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    mask = np.zeros((grid.h, grid.w), np.uint8)
    side = min(grid.h, grid.w)
    for _ in range(int(rng.integers(3, 8))):
        center = (int(rng.uniform(0, grid.w) * 16), int(rng.uniform(0, grid.h) * 16))
        radius = int(rng.uniform(0.06, 0.2) * side * 16)
        cv2.circle(mask, center, radius, 255, -1, cv2.LINE_AA, shift=4)
    return mask.astype(np.float32) / 255.0


def _draw_stripes(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    u, _, period = _periodic(grid, rng, base_angle=0.5 * variant)
    return _soft(np.sin(np.float32(2 * np.pi) * u) * np.float32(period / 6.0))


def _draw_checker(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    u, v, period = _periodic(grid, rng, base_angle=np.pi / 4 + 0.3 * variant)
    two_pi = np.float32(2 * np.pi)
    return _soft(np.sin(two_pi * u) * np.sin(two_pi * v) * np.float32(period / 3.0))


def _draw_rings(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    cx, cy = rng.uniform(0.2, 0.8) * grid.w, rng.uniform(0.2, 0.8) * grid.h
    period = rng.uniform(10, 22) * min(grid.h, grid.w) / 192.0
    r = np.sqrt((grid.xs - np.float32(cx)) ** 2 + (grid.ys - np.float32(cy)) ** 2)
    return _soft(np.sin(r * np.float32(2 * np.pi / period)) * np.float32(period / 6.0))


def _polygons(grid: _Grid, rng: np.random.Generator, sides: int, filled: bool) -> np.ndarray:
    mask = np.zeros((grid.h, grid.w), np.uint8)
    side = min(grid.h, grid.w)
    for _ in range(int(rng.integers(2, 6))):
        cx, cy = rng.uniform(0, grid.w), rng.uniform(0, grid.h)
        radius = rng.uniform(0.12, 0.3) * side
        start = rng.uniform(0, 2 * np.pi)
        angles = start + np.arange(sides) * (2 * np.pi / sides)
        pts = np.stack([cx + radius * np.cos(angles), cy + radius * np.sin(angles)], axis=1)
        pts = np.round(pts * 16).astype(np.int32)
        if filled:
            cv2.fillPoly(mask, [pts], 255, cv2.LINE_AA, shift=4)
        else:
            thickness = max(2, int(side * rng.uniform(0.02, 0.04)))
            cv2.polylines(mask, [pts], True, 255, thickness, cv2.LINE_AA, shift=4)
    return mask.astype(np.float32) / 255.0


def _draw_triangles(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    return _polygons(grid, rng, sides=3, filled=True)


def _draw_squares(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    return _polygons(grid, rng, sides=4, filled=False)


def _draw_crosshatch(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    u, v, period = _periodic(grid, rng, base_angle=0.2 * variant)
    line = np.float32(rng.uniform(0.08, 0.16))
    du = np.abs(u - np.round(u))
    dv = np.abs(v - np.round(v))
    return _soft((line - np.minimum(du, dv)) * np.float32(period))


def _draw_blobs(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    cells = int(rng.integers(4, 8))
    coarse = rng.standard_normal((cells, cells)).astype(np.float32)
    smooth = cv2.resize(coarse, (grid.w, grid.h), interpolation=cv2.INTER_CUBIC)
    return _soft(smooth * np.float32(min(grid.h, grid.w) / 24.0))


def _draw_rays(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    cx, cy = rng.uniform(0.25, 0.75) * grid.w, rng.uniform(0.25, 0.75) * grid.h
    spokes = int(rng.integers(5, 10)) + 2 * variant
    phi = np.arctan2(grid.ys - np.float32(cy), grid.xs - np.float32(cx))
    r = np.sqrt((grid.xs - np.float32(cx)) ** 2 + (grid.ys - np.float32(cy)) ** 2)
    wave = np.sin(phi * np.float32(spokes) + np.float32(rng.uniform(0, 2 * np.pi)))
    # Scale the slope by the radius so edges stay about one pixel wide at every distance.
    return _soft(wave * (r + np.float32(1.0)) / np.float32(spokes))


def _draw_dots(grid: _Grid, rng: np.random.Generator, variant: int) -> np.ndarray:
    u, v, period = _periodic(grid, rng, base_angle=0.25 * variant)
    radius = np.float32(rng.uniform(0.2, 0.32))
    du, dv = u - np.round(u), v - np.round(v)
    dist = np.sqrt(du * du + dv * dv)
    return _soft((radius - dist) * np.float32(period))


_FAMILY_DRAW: tuple[Callable[[_Grid, np.random.Generator, int], np.ndarray], ...] = (
    _draw_discs, _draw_stripes, _draw_checker, _draw_rings, _draw_triangles,
    _draw_crosshatch, _draw_squares, _draw_blobs, _draw_rays, _draw_dots,
)


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    """One OpenCV-convention HSV colour (h in [0,180), s and v in [0,255]) as float32 RGB."""
    hsv = np.array([[[h, s, v]]], dtype=np.float32)
    hsv[..., 0] *= 2.0  # float HSV in OpenCV uses degrees
    hsv[..., 1:] /= 255.0
    rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0] * 255.0
    return rgb.astype(np.float32)


def _check_args(n: int, num_classes: int, min_size: int, max_size: int, quality: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if not 8 <= min_size <= max_size:
        raise ValueError(f"need 8 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in [1, 100], got {quality}")
