"""Geometric transforms on HWC numpy images: random resized crop, resize, center crop, flip.

Semantics follow torchvision's transforms of the same names. Randomness comes only from the
`generator` passed in (see `base`). Resizing uses OpenCV by default and PIL as the reference
(`backend="pil"`, bilinear with PIL's built-in antialiasing).

Resizing with OpenCV (measured against PIL bilinear on crops of synthetic 128-256 px images
resized to 112 px; mean absolute difference in levels of 255, mean cost per RandomResizedCrop
crop; see docs/transforms.md):

* upscaling: INTER_LINEAR matches PIL (0.26).
* downscaling: INTER_LINEAR aliases (1.63, up to 8 on fine textures; ~30 us); INTER_AREA is
  closer (0.78) but its generic non-integer path is slow (~95 us); *linear resize to k x the
  target, then INTER_AREA by the integer k* (k = ceil of the downscale factor) is closer still
  (0.69) at ~65 us, because INTER_AREA's integer-factor path is fast. That is `antialias=True`
  (the default); `antialias=False` is plain INTER_LINEAR.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from shardloader.transforms.base import (
    Sample,
    Transform,
    TransformError,
    get_field,
    opencv,
    with_field,
)

BACKENDS = ("cv2", "pil")
#: How `antialias=True` downscales (see the module doc): "k-area" (the first method, kept so
#: that states saved with it resume exactly) or "adaptive" (the default since it was added:
#: closer to PIL and cheaper).
ANTIALIAS_METHODS = ("k-area", "adaptive")
DEFAULT_ANTIALIAS_METHOD = "adaptive"
#: "adaptive" resizes with plain INTER_LINEAR up to this downscale factor.
ADAPTIVE_LINEAR_MAX_FACTOR = 1.25
CROP_ATTEMPTS = 10
CROP_DRAWS = 4 * CROP_ATTEMPTS  # (area, ratio, top, left) per attempt

Box = tuple[int, int, int, int]  # (top, left, height, width)


def size_pair(size: int | tuple[int, int] | list[int], who: str) -> tuple[int, int]:
    if isinstance(size, int):
        pair = (size, size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        pair = (int(size[0]), int(size[1]))
    else:
        raise ValueError(f"{who}: size must be an int or (height, width), got {size!r}")
    if pair[0] < 1 or pair[1] < 1:
        raise ValueError(f"{who}: size must be positive, got {size!r}")
    return pair


def _check_backend(backend: str, who: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{who}: unknown backend {backend!r} (known: {', '.join(BACKENDS)})")


def _image(sample: Sample, field: str, who: str) -> np.ndarray:
    image = get_field(sample, field, who)
    if not isinstance(image, np.ndarray) or image.ndim != 3:
        what = f"array of shape {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise TransformError(
            f"{who}: field {field!r} must be an HWC numpy image (decode it first with "
            f"DecodeImage), got {what}"
        )
    return image


# -- random crop parameters ------------------------------------------------------------------


def sample_crop_box(
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> Box:
    """A random crop box with torchvision's RandomResizedCrop semantics.

    Up to 10 attempts draw an area fraction uniformly from `scale` and an aspect ratio
    log-uniformly from `ratio`; the first box that fits is placed uniformly at random. If none
    fits, the fallback is a central crop of the whole image clamped to `ratio`. All draws come
    from one `torch.rand((10, 4), float64)` call, so the stream consumption does not depend on
    the image size and a composite transform can reproduce it exactly.
    """
    draws = torch.rand((CROP_ATTEMPTS, 4), dtype=torch.float64, generator=generator).view(-1).tolist()
    return crop_box_from_draws(height, width, scale, ratio, draws)


def sample_crop_box_and_flip(
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    p: float,
    generator: torch.Generator | None = None,
) -> tuple[Box, bool]:
    """`sample_crop_box(...)` then `draw_flip(p, ...)` from the same generator, with the same
    values, in one `torch.rand` call of 41 values instead of two calls.

    torch fills a float64 tensor from the generator's stream value by value, so the first 40
    values of one draw of 41 are the (10, 4) crop draws and the 41st is the flip draw (tests
    check this against the two calls). One call instead of two saves ~5 us per sample, 2% of
    a decode + crop + flip of a 128-256 px JPEG.
    """
    draws = torch.rand(CROP_DRAWS + 1, dtype=torch.float64, generator=generator).tolist()
    return crop_box_from_draws(height, width, scale, ratio, draws), draws[CROP_DRAWS] < p


def crop_box_from_draws(
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    draws: list[float],
) -> Box:
    """The crop box of `sample_crop_box` from its 40 uniform draws (4 per attempt, in order)."""
    area = float(height * width)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for i in range(0, CROP_DRAWS, 4):
        u_area, u_ratio, u_top, u_left = draws[i : i + 4]
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_lo + (log_hi - log_lo) * u_ratio)
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = min(int(u_top * (height - h + 1)), height - h)
            left = min(int(u_left * (width - w + 1)), width - w)
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def draw_flip(p: float, generator: torch.Generator | None) -> bool:
    """One draw: True with probability `p`. Always consumes exactly one value."""
    return torch.rand((), dtype=torch.float64, generator=generator).item() < p


# -- resizing --------------------------------------------------------------------------------


def resize_cv2(
    image: np.ndarray,
    height: int,
    width: int,
    antialias: bool = True,
    method: str = "k-area",
    dst: np.ndarray | None = None,
) -> np.ndarray:
    """Resize an HWC (or a crop view of one) to (height, width) with OpenCV. See the module
    doc for the antialias methods and their measured accuracy against PIL.

    `dst`, if given, is a C-contiguous (height, width, C) array of the image's dtype that the
    result is written into (and returned): a slice of a batch, so the batch needs no stacking.
    The bytes are the same as without `dst`.
    """
    check_antialias_method(method, "resize_cv2")
    cv2 = opencv()
    h, w = image.shape[:2]
    channels = image.shape[2] if image.ndim == 3 else None
    if (h, w) == (height, width):
        if dst is not None:
            np.copyto(dst, image)
            return dst
        out = np.array(image, copy=True, order="C")
    else:
        factor = max(h / height, w / width)
        linear_below = ADAPTIVE_LINEAR_MAX_FACTOR if method == "adaptive" else 1.0
        if not antialias or factor <= linear_below:
            out = _cv2_resize(cv2, image, width, height, cv2.INTER_LINEAR, dst)
        else:
            k = math.ceil(factor - 1e-9)
            if (h, w) != (k * height, k * width):
                image = cv2.resize(image, (k * width, k * height), interpolation=cv2.INTER_LINEAR)
            out = _cv2_resize(cv2, image, width, height, cv2.INTER_AREA, dst)
    if channels == 1 and out.ndim == 2:
        out = out[:, :, None]
    return out


def _cv2_resize(cv2: Any, image: np.ndarray, width: int, height: int, interpolation: int,
                dst: np.ndarray | None) -> np.ndarray:
    if dst is None or image.ndim != 3 or image.shape[2] == 1:
        out = cv2.resize(image, (width, height), interpolation=interpolation)
        if dst is not None:
            np.copyto(dst, out if out.ndim == 3 else out[:, :, None])
            return dst
        return out
    out = cv2.resize(image, (width, height), dst=dst, interpolation=interpolation)
    if out is not dst and not np.may_share_memory(out, dst):  # OpenCV reallocated: copy
        np.copyto(dst, out)
    return dst


def method_param(antialias: bool, backend: str, method: str) -> dict[str, str]:
    """The antialias method as a version parameter, where it decides the bytes: with OpenCV
    antialiasing, and not for "k-area", the first method, whose transforms keep the version
    string they had before methods existed (so states saved with them still resume)."""
    if not antialias or backend != "cv2" or method == "k-area":
        return {}
    return {"antialias_method": method}


def check_antialias_method(method: str, who: str) -> None:
    if method not in ANTIALIAS_METHODS:
        raise ValueError(f"{who}: unknown antialias_method {method!r} "
                         f"(known: {', '.join(ANTIALIAS_METHODS)})")


def resized_crop(
    image: np.ndarray,
    box: Box,
    size: tuple[int, int],
    *,
    antialias: bool = True,
    backend: str = "cv2",
    antialias_method: str = "k-area",
) -> np.ndarray:
    """Crop `box` = (top, left, height, width) out of an HWC image and resize it to `size`."""
    top, left, h, w = box
    if backend == "pil":
        return _pil_resize(image, size, (left, top, left + w, top + h))
    return resize_cv2(image[top : top + h, left : left + w], size[0], size[1], antialias,
                      antialias_method)


def _pil_resize(image: np.ndarray, size: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray:
    from PIL import Image

    if image.dtype != np.uint8:
        raise TransformError(f"the PIL backend needs uint8 images, got {image.dtype}")
    channels = image.shape[2]
    pil = Image.fromarray(image[:, :, 0] if channels == 1 else image)
    out = np.asarray(pil.resize((size[1], size[0]), Image.BILINEAR, box=box))
    return out[:, :, None] if out.ndim == 2 else out


# -- transforms ------------------------------------------------------------------------------


class RandomResizedCrop(Transform):
    """Crop a random area/aspect box (torchvision semantics) and resize it to `size`."""

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        field: str = "image",
        *,
        antialias: bool = True,
        backend: str = "cv2",
        antialias_method: str = DEFAULT_ANTIALIAS_METHOD,
    ) -> None:
        self.size = size_pair(size, "RandomResizedCrop")
        check_antialias_method(antialias_method, "RandomResizedCrop")
        self.antialias_method = antialias_method
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"RandomResizedCrop: need 0 < scale[0] <= scale[1], got {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"RandomResizedCrop: need 0 < ratio[0] <= ratio[1], got {ratio!r}")
        _check_backend(backend, "RandomResizedCrop")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.field, self.antialias, self.backend = field, antialias, backend

    def __call__(self, sample: Sample, generator: torch.Generator | None = None) -> Sample:
        image = _image(sample, self.field, "RandomResizedCrop")
        box = sample_crop_box(image.shape[0], image.shape[1], self.scale, self.ratio, generator)
        out = resized_crop(image, box, self.size, antialias=self.antialias, backend=self.backend,
                           antialias_method=self.antialias_method)
        return with_field(sample, self.field, out)

    def params(self) -> dict[str, Any]:
        return {
            "size": self.size, "scale": self.scale, "ratio": self.ratio, "field": self.field,
            "antialias": self.antialias, "backend": self.backend,
            **method_param(self.antialias, self.backend, self.antialias_method),
        }


class Resize(Transform):
    """Resize to `size`: an int matches the shorter side (keeping the aspect ratio, the longer
    side truncated as torchvision does), a pair is (height, width)."""

    def __init__(
        self,
        size: int | tuple[int, int],
        field: str = "image",
        *,
        antialias: bool = True,
        backend: str = "cv2",
        antialias_method: str = DEFAULT_ANTIALIAS_METHOD,
    ) -> None:
        check_antialias_method(antialias_method, "Resize")
        self.antialias_method = antialias_method
        if isinstance(size, int):
            if size < 1:
                raise ValueError(f"Resize: size must be positive, got {size}")
            self.size: int | tuple[int, int] = size
        else:
            self.size = size_pair(size, "Resize")
        _check_backend(backend, "Resize")
        self.field, self.antialias, self.backend = field, antialias, backend

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        if not isinstance(self.size, int):
            return self.size
        short, long = (height, width) if height <= width else (width, height)
        new_short, new_long = self.size, int(self.size * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)

    def __call__(self, sample: Sample) -> Sample:
        image = _image(sample, self.field, "Resize")
        h, w = image.shape[:2]
        size = self.output_size(h, w)
        out = resized_crop(image, (0, 0, h, w), size, antialias=self.antialias, backend=self.backend,
                           antialias_method=self.antialias_method)
        return with_field(sample, self.field, out)

    def params(self) -> dict[str, Any]:
        return {"size": self.size, "field": self.field, "antialias": self.antialias, "backend": self.backend,
                **method_param(self.antialias, self.backend, self.antialias_method)}


class CenterCrop(Transform):
    """Crop the center `size` box; an image smaller than `size` is padded with zeros first
    (torchvision semantics)."""

    def __init__(self, size: int | tuple[int, int], field: str = "image") -> None:
        self.size = size_pair(size, "CenterCrop")
        self.field = field

    def __call__(self, sample: Sample) -> Sample:
        image = _image(sample, self.field, "CenterCrop")
        ch, cw = self.size
        h, w = image.shape[:2]
        if ch > h or cw > w:
            pad_top, pad_left = max(ch - h, 0) // 2, max(cw - w, 0) // 2
            padded = np.zeros((max(h, ch), max(w, cw), image.shape[2]), dtype=image.dtype)
            padded[pad_top : pad_top + h, pad_left : pad_left + w] = image
            image = padded
            h, w = image.shape[:2]
        top = int(round((h - ch) / 2.0))
        left = int(round((w - cw) / 2.0))
        out = np.ascontiguousarray(image[top : top + ch, left : left + cw])
        return with_field(sample, self.field, out)

    def params(self) -> dict[str, Any]:
        return {"size": self.size, "field": self.field}


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability `p`. Works on HWC numpy images and on CHW (or any
    `...W`) torch tensors. Always draws exactly one value from the generator."""

    def __init__(self, p: float = 0.5, field: str = "image") -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p, self.field = float(p), field

    def __call__(self, sample: Sample, generator: torch.Generator | None = None) -> Sample:
        image = get_field(sample, self.field, "RandomHorizontalFlip")
        if not draw_flip(self.p, generator):
            return sample
        if isinstance(image, torch.Tensor):
            return with_field(sample, self.field, torch.flip(image, dims=(-1,)))
        if not isinstance(image, np.ndarray) or image.ndim != 3:
            raise TransformError(
                f"RandomHorizontalFlip: field {self.field!r} must be an HWC numpy image or a "
                f"tensor, got {type(image).__name__}"
            )
        return with_field(sample, self.field, flip_hwc(image))

    def params(self) -> dict[str, Any]:
        return {"p": self.p, "field": self.field}


def flip_hwc(image: np.ndarray) -> np.ndarray:
    """Left-right mirror of an HWC image, C-contiguous. cv2.flip is ~10x faster than copying a
    negative-stride numpy view of a 3-channel image (5 us vs 55 us at 112x112x3)."""
    if image.dtype == np.uint8 or image.dtype == np.float32:
        out = opencv().flip(image, 1)
        return out[:, :, None] if out.ndim == 2 else out
    return np.ascontiguousarray(image[:, ::-1])


def flip_hwc_in_place(image: np.ndarray) -> np.ndarray:
    """`flip_hwc(image)` written over `image` itself, for an array the caller just made and
    owns (a resize's output): one array and one pass fewer per flipped sample. OpenCV's
    horizontal flip swaps mirrored pairs, so it may write over its input; the result is
    checked to be `image`'s memory, else OpenCV's own output is returned (the same bytes).
    tests/test_transforms.py compares it with `flip_hwc` over dtypes, channels and sizes."""
    if (image.dtype == np.uint8 or image.dtype == np.float32) and image.flags.c_contiguous \
            and image.flags.writeable:
        out = opencv().flip(image, 1, dst=image)
        if out is image or np.shares_memory(out, image):
            return image
        return out[:, :, None] if out.ndim == 2 else out
    return flip_hwc(image)
