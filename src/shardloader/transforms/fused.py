"""`DecodeCropFlip`: decode + random resized crop + horizontal flip in one step.

The usual training augmentation done with less work than the three transforms in a row:

* The crop box is drawn from the JPEG header's size before decoding, so that, when the crop is
  at least 2x (4x, 8x) larger than the output on both sides, libjpeg-turbo's DCT scaling decodes
  the image at 1/2 (1/4, 1/8) size directly. DCT scaling is itself a good low-pass filter, so
  quality stays close to a full decode followed by an antialiased resize. Only power-of-two
  scales are used: libjpeg-turbo's other M/8 scales (5/8, 3/4, 7/8) measured slower than a full
  decode (no SIMD kernels), see docs/transforms.md.
* After a 1/k reduced decode the crop box's edges are rounded to multiples of k full-size
  pixels (`snap_box`: at most k/2 pixels per edge, on a crop at least 2k x the output size), so
  that the crop is whole pixels of the reduced image and the fast `cv2.resize` applies.
  Sampling the unrounded box exactly with `cv2.warpAffine` measured ~3x slower than the resize
  it replaces, which cancelled the gain of the reduced decode.
* Only the crop is resized (a view, no copy), and the flip is done on the small output.
* The random draws are exactly those of `Compose([DecodeImage(), RandomResizedCrop(size),
  RandomHorizontalFlip(p)])` with the same generator: the crop box, then the flip. Without a
  reduced decode the output is bit-identical to that Compose; with one it differs only by the
  DCT-scaled resampling (tests measure the difference).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardloader.transforms.base import (
    Sample,
    Transform,
    describe_sample,
    get_field,
    opencv,
    with_field,
)
from shardloader.transforms.decode import (
    ImageDecodeError,
    decode_field,
    decode_jpeg,
    decode_jpeg_crop,
    image_bytes,
    is_jpeg,
)
from shardloader.transforms.geometry import (
    DEFAULT_ANTIALIAS_METHOD,
    check_antialias_method,
    flip_hwc_in_place,
    method_param,
    resize_cv2,
    sample_crop_box_and_flip,
    size_pair,
)
from shardloader.transforms.image_size import max_image_pixels, oversize_problem

_REDUCTIONS = (8, 4, 2)


class DecodeCropFlip(Transform):
    """Decode `sample[field]`, random-resized-crop it to `size`, flip it with probability `p`;
    the HWC uint8 result goes to `sample[out]`.

    `reduced_decode` enables DCT-scaled JPEG decoding when the crop is at least 2x the output
    on both sides; `max_upscale` > 1 also allows it when the reduced crop must then be upscaled
    by up to that factor (faster, loses detail: see the benchmark's fidelity column).
    `fastdct` and `fastupsample` select libjpeg-turbo's faster integer IDCT and nearest chroma
    upsampling: measured +5-10% samples/s, but mean pixel differences from the exact decode of
    about 1 and 3.6 levels respectively, so both are off by default.
    `antialias_method` is how `antialias=True` downscales: "adaptive" (default) or "k-area"
    (the only method before "adaptive" was added; pass it to resume a state saved then). See
    `shardloader.transforms.geometry`.
    An image whose header declares more than `max_pixels` pixels (None: 178,956,970 or
    ``SHARDLOADER_MAX_IMAGE_PIXELS``, read here), or a JPEG that declares more pixels than its
    bytes can hold, is an ImageDecodeError naming the field and sample, before it is decoded
    (see `shardloader.transforms.image_size`; not part of the version: it changes no output).

    `into(sample, dst, generator)` writes the image into a preallocated array instead (a slice
    of a batch: the Loader's fast batch path), with the same bytes.
    """

    impl = 1
    #: Constructor arguments that change no output (a bound on the input), so not in `params()`
    #: and the version: a resume with another max_pixels is the same pipeline.
    unversioned = ("max_pixels",)

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        p: float = 0.5,
        field: str = "image",
        out: str = "image",
        mode: str = "RGB",
        *,
        antialias: bool = True,
        reduced_decode: bool = True,
        fastdct: bool = False,
        fastupsample: bool = False,
        max_upscale: float = 1.0,
        antialias_method: str = DEFAULT_ANTIALIAS_METHOD,
        max_pixels: int | None = None,
    ) -> None:
        self.size = size_pair(size, "DecodeCropFlip")
        self.max_pixels = max_image_pixels(max_pixels, who="DecodeCropFlip: max_pixels")
        check_antialias_method(antialias_method, "DecodeCropFlip")
        self.antialias_method = antialias_method
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"DecodeCropFlip: need 0 < scale[0] <= scale[1], got {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"DecodeCropFlip: need 0 < ratio[0] <= ratio[1], got {ratio!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"DecodeCropFlip: p must be in [0, 1], got {p}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.p = float(p)
        self.field, self.out, self.mode = field, out, mode
        self.antialias, self.reduced_decode = antialias, reduced_decode
        self.fastdct, self.fastupsample = fastdct, fastupsample
        if not max_upscale >= 1.0:
            raise ValueError(f"DecodeCropFlip: max_upscale must be >= 1, got {max_upscale}")
        self.max_upscale = float(max_upscale)

    def params(self) -> dict[str, Any]:
        return {
            "size": self.size, "scale": self.scale, "ratio": self.ratio, "p": self.p,
            "field": self.field, "out": self.out, "mode": self.mode,
            "antialias": self.antialias, "reduced_decode": self.reduced_decode,
            "fastdct": self.fastdct, "fastupsample": self.fastupsample,
            "max_upscale": self.max_upscale,
            **method_param(self.antialias, "cv2", self.antialias_method),
        }

    @property
    def _crop_decodable(self) -> bool:
        """Whether `decode_jpeg_crop` can give this transform's pixels (it decodes as
        simplejpeg does by default: RGB, accurate IDCT, fancy upsampling)."""
        return self.mode == "RGB" and not self.fastdct and not self.fastupsample

    def reduction(self, crop_height: int, crop_width: int) -> int:
        """The largest power-of-two DCT reduction that keeps the reduced crop at least the output
        size divided by `max_upscale` (1: never upscale after a reduced decode)."""
        if not self.reduced_decode:
            return 1
        th, tw = self.size
        for k in _REDUCTIONS:
            if crop_height * self.max_upscale >= k * th and crop_width * self.max_upscale >= k * tw:
                return k
        return 1

    def __call__(self, sample: Sample, generator: torch.Generator | None = None) -> Sample:
        crop, flip = self._crop(sample, generator)
        out = resize_cv2(crop, self.size[0], self.size[1], self.antialias, self.antialias_method)
        if flip:
            out = flip_hwc_in_place(out)  # a fresh array of ours
        return with_field(sample, self.out, out)

    def batch_shape(self) -> tuple[int, int, int] | None:
        """The (height, width, channels) of every output, if `into` can write it; else None."""
        return (*self.size, 3) if self.mode == "RGB" else None

    def into(self, sample: Sample, dst: np.ndarray, generator: torch.Generator | None = None,
             scratch: np.ndarray | None = None) -> None:
        """Write `self(sample, generator)[self.out]` into `dst`, a C-contiguous uint8 array of
        shape `batch_shape()` (e.g. one sample of a batch tensor), bit for bit the same.

        Saves the per-sample output array, the sample dict and collate's copy of each image
        into the batch. A flipped image is resized into `scratch` (same shape as `dst`, reused
        across samples) and mirrored into `dst`."""
        crop, flip = self._crop(sample, generator)
        target = dst
        if flip:
            target = scratch if scratch is not None else np.empty_like(dst)
        resize_cv2(crop, self.size[0], self.size[1], self.antialias, self.antialias_method, dst=target)
        if flip:
            out = opencv().flip(target, 1, dst=dst)
            if out is not dst and not np.may_share_memory(out, dst):  # OpenCV reallocated
                np.copyto(dst, out)

    def _crop(self, sample: Sample, generator: torch.Generator | None) -> tuple[np.ndarray, bool]:
        """The crop to resize (a view of the decoded, possibly DCT-reduced image; or of just
        the crop's rows, where the JPEG crop decoder takes the image: the same pixels) and
        whether to flip, drawn as `Compose([DecodeImage(), RandomResizedCrop,
        RandomHorizontalFlip])` draws them."""
        data = image_bytes(get_field(sample, self.field, "DecodeCropFlip"), sample, self.field)
        header = _jpeg_size(data) if self.mode in ("RGB", "L") else None
        if header is None:  # not a JPEG (or not one simplejpeg reads): decode, then crop
            image = decode_field(data, sample, self.field, self.mode, "auto", self.max_pixels)
            height, width = image.shape[:2]
            (top, left, h, w), flip = sample_crop_box_and_flip(
                height, width, self.scale, self.ratio, self.p, generator)
            return image[top : top + h, left : left + w], flip
        problem = oversize_problem(memoryview(data), self.max_pixels, header)
        if problem is not None:
            raise ImageDecodeError(f"field {self.field!r} of {describe_sample(sample)}: {problem}")
        height, width = header
        (top, left, h, w), flip = sample_crop_box_and_flip(
            height, width, self.scale, self.ratio, self.p, generator)
        k = self.reduction(h, w)
        if k == 1 and self._crop_decodable:
            crop = decode_jpeg_crop(data, height, width, top, left, h, w)
            if crop is not None:
                return crop, flip
        image = self._decode_jpeg(data, sample, k, height, width)
        if image.shape[:2] == (height, width):
            return image[top : top + h, left : left + w], flip
        # DCT-scaled by 1/k: reduced pixel j covers full-size pixels [j*k, j*k + k)
        y0, x0, y1, x1 = snap_box((top, left, h, w), k, image.shape[0], image.shape[1])
        return image[y0:y1, x0:x1], flip

    def _decode_jpeg(self, data: Any, sample: Sample, k: int, height: int, width: int) -> np.ndarray:
        opencv()  # configure OpenCV threads before the first resize in this process
        try:
            return decode_jpeg(
                data, self.mode,
                min_height=-(-height // k) if k > 1 else 0,
                min_width=-(-width // k) if k > 1 else 0,
                fastdct=self.fastdct, fastupsample=self.fastupsample,
            )
        except ValueError:
            # CMYK, truncated or corrupt: the general decoder falls back to PIL or raises an
            # ImageDecodeError that names the field and sample.
            return decode_field(data, sample, self.field, self.mode, "auto", self.max_pixels)


def snap_box(
    box: tuple[int, int, int, int], k: int, reduced_height: int, reduced_width: int
) -> tuple[int, int, int, int]:
    """(y0, x0, y1, x1) in a 1/k DCT-scaled image: the full-size `box` = (top, left, height,
    width) with its edges rounded to the nearest multiple of k (the crop actually taken is the
    full-size box `k * (y0, x0, y1, x1)`, at most k/2 pixels off on each edge)."""
    top, left, h, w = box
    y0 = min(int(round(top / k)), reduced_height - 1)
    x0 = min(int(round(left / k)), reduced_width - 1)
    y1 = max(min(int(round((top + h) / k)), reduced_height), y0 + 1)
    x1 = max(min(int(round((left + w) / k)), reduced_width), x0 + 1)
    return y0, x0, y1, x1


def _jpeg_size(data: Any) -> tuple[int, int] | None:
    """(height, width) from a JPEG header, or None if `data` is not a JPEG simplejpeg reads."""
    import simplejpeg

    try:
        if not is_jpeg(data):
            return None
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except (TypeError, ValueError):
        return None
    return int(height), int(width)
