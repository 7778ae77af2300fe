"""Decoding encoded image bytes into HWC uint8 numpy arrays.

JPEG goes through simplejpeg (libjpeg-turbo, releases the GIL); other formats (PNG, BMP, TIFF,
WebP, ...) through OpenCV's `imdecode`; PIL is the fallback for anything those two refuse
(CMYK JPEGs, unusual PNG modes, other PIL modes) and the reference backend (`backend="pil"`).
EXIF orientation is ignored by every backend (as PIL and torchvision do by default), so all
backends give the same geometry.

Output: a C-contiguous `uint8` array of shape (H, W, C): C=3 for "RGB", C=1 for "L",
C=4 for "RGBA" (PIL modes other than these also decode via PIL; C is that mode's band count).

Image fields hold encoded bytes, or a Hugging Face `datasets` image: a dict
``{"bytes": ..., "path": ...}`` (its `Image` feature, stored in Parquet as
``struct<bytes: binary, path: string>``). The bytes are decoded; an image whose bytes are None
(an HF dataset that refers to files by path instead of embedding them) is an error naming the
path: such paths are usually absolute paths on the machine that built the dataset, and reading
files named by stored data would let a dataset reach outside its root, so they are never opened.

Before any pixel is decoded, the image's size is read from its header and checked: an image with
more pixels than `max_pixels` (default 178,956,970, PIL's bound; the environment variable
``SHARDLOADER_MAX_IMAGE_PIXELS`` changes it), or a JPEG that claims more pixels than its bytes
can hold, is an ImageDecodeError instead of a multi-GiB allocation (see
`shardloader.transforms.image_size`).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardloader.transforms.base import (
    Sample,
    Transform,
    TransformError,
    describe_sample,
    get_field,
    opencv,
    with_field,
)
from shardloader.transforms.image_size import max_image_pixels, oversize_problem

BACKENDS = ("auto", "pil")
_JPEG_MAGIC = b"\xff\xd8\xff"
_SIMPLEJPEG_COLORSPACE = {"RGB": "RGB", "L": "GRAY"}


class ImageDecodeError(TransformError):
    """Bytes that should hold an image do not decode (corrupt, truncated, not an image)."""


def is_jpeg(data: Any) -> bool:
    """True if `data` starts with the JPEG SOI marker."""
    return bytes(memoryview(data)[:3]) == _JPEG_MAGIC


def decode_image(data: Any, mode: str = "RGB", backend: str = "auto", *,
                 max_pixels: int | None = None) -> np.ndarray:
    """Decode image bytes (`bytes`, `bytearray`, `memoryview` or a uint8 numpy array) into an
    HWC uint8 array in PIL mode `mode`. Raises ImageDecodeError with the reason on failure, and
    before decoding when the header declares more than `max_pixels` pixels (None: the default,
    see `shardloader.transforms.image_size`) or more than a JPEG's bytes can hold."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r} (known: {', '.join(BACKENDS)})")
    try:
        view = memoryview(data)
    except TypeError:
        raise ImageDecodeError(
            f"expected encoded image bytes, got {type(data).__name__}"
        ) from None
    if view.nbytes == 0:
        raise ImageDecodeError("image bytes are empty")
    problem = oversize_problem(view, max_image_pixels(max_pixels))
    if problem is not None:
        raise ImageDecodeError(problem)
    errors: list[str] = []
    if backend == "auto":
        if mode in _SIMPLEJPEG_COLORSPACE and is_jpeg(view):
            try:
                return decode_jpeg(view, mode)
            except ValueError as e:  # CMYK, truncated, corrupt: PIL may still read it
                errors.append(f"simplejpeg: {e}")
        elif mode in _SIMPLEJPEG_COLORSPACE:
            image = _decode_opencv(view, mode)
            if image is not None:
                return image
            errors.append("opencv: not a format it reads, or corrupt")
    try:
        return _decode_pil(view, mode)
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError, ...)
        reason = str(e)
        if "cannot identify image file" in reason:  # PIL names the BytesIO object, not useful
            reason = "cannot identify the image format"
        errors.append(f"PIL: {type(e).__name__}: {reason}")
    head = bytes(view[:8]).hex(" ")
    raise ImageDecodeError(
        f"{view.nbytes} bytes (starting {head}) are not a decodable image: " + "; ".join(errors)
    )


def image_problem(data: Any) -> str | None:
    """Why `data` is not a decodable image, judged cheaply from its header; None if it looks fine.

    JPEG: simplejpeg parses the header (no pixel decoding). Other formats: PIL identifies the
    format and runs its `verify` (for PNG this checks every chunk's CRC). A file cut short after
    a valid JPEG header passes; decoding it later raises ImageDecodeError naming the sample.
    """
    view = memoryview(data)
    if view.nbytes == 0:
        return "the file is empty"
    if is_jpeg(view):
        import simplejpeg

        try:
            simplejpeg.decode_jpeg_header(view)
        except ValueError as e:
            return f"not a readable JPEG ({e})"
        return None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(view)) as img:
            img.verify()
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, SyntaxError, ...)
        reason = str(e)
        if "cannot identify image file" in reason:
            reason = "cannot identify the image format"
        return f"not a readable image ({type(e).__name__}: {reason})"
    return None


def decode_jpeg(
    data: Any,
    mode: str = "RGB",
    *,
    min_height: int = 0,
    min_width: int = 0,
    fastdct: bool = False,
    fastupsample: bool = False,
) -> np.ndarray:
    """JPEG through simplejpeg, optionally reduced in size by libjpeg's DCT scaling to the
    smallest M/8 scale with height >= `min_height` and width >= `min_width`. Raises
    ValueError (from simplejpeg) on bad data."""
    import simplejpeg

    image = simplejpeg.decode_jpeg(
        data,
        colorspace=_SIMPLEJPEG_COLORSPACE[mode],
        fastdct=fastdct,
        fastupsample=fastupsample,
        min_height=min_height,
        min_width=min_width,
    )
    return image


def decode_jpeg_crop(data: Any, image_height: int, image_width: int, top: int, left: int,
                     height: int, width: int) -> np.ndarray | None:
    """RGB pixels [top:top+height, left:left+width] of the JPEG `data` (image_height x
    image_width, from its header), decoding only what that box needs; the same bytes as
    `decode_jpeg(data, "RGB")[top:top+height, left:left+width]`. None when the crop decoder
    is not built here, is switched off, or declines the image (a kind it does not take,
    damaged data): the caller then decodes the whole image.

    The decoder is a C extension over libjpeg-turbo (`shardloader/transforms/_jpegcrop.c`,
    built by `pip install` where a compiler and the libjpeg-turbo headers are found). Before its
    first use in a process its output is compared with simplejpeg's on JPEGs of every chroma
    subsampling it takes; any difference switches it off there, with a warning.
    `SHARDLOADER_JPEG_CROP=0` switches it off too."""
    decoder = _current_crop_decoder()
    if decoder is None:
        return None
    return _crop_view(decoder, data, image_height, image_width, top, left, height, width)


def _crop_view(decoder: Any, data: Any, image_height: int, image_width: int, top: int, left: int,
               height: int, width: int) -> np.ndarray | None:
    """`decoder`'s crop as a view of the rows it decoded (they hold a few more columns than
    the crop: no copy of the pixels), or None when it declines."""
    out = np.empty(height * (width + _EXTRA_COLUMNS) * 3, dtype=np.uint8)
    try:
        where = decoder(data, image_height, image_width, top, left, height, width, out)
    except (TypeError, ValueError, BufferError):  # a buffer it cannot take: decode it whole
        return None
    if where is None:
        return None
    offset, stride = where
    return np.ndarray((height, width, 3), dtype=np.uint8, buffer=out, offset=offset,
                      strides=(stride, 3, 1))


#: The columns beyond a crop's that the crop decoder needs room for (its C source says why).
_EXTRA_COLUMNS = 18


def crop_decoder_on() -> bool:
    """Whether `decode_jpeg_crop` decodes crops in this process (checking it on first call).
    Worker processes forked after this call inherit the answer instead of each checking."""
    return _current_crop_decoder() is not None


def use_crop_decoder(enabled: bool) -> bool:
    """Switch `decode_jpeg_crop` on or off in this process (benchmarks compare the two); whether
    it is on now (off when not built here or when its check failed)."""
    global _crop_decoder
    _crop_decoder = _checked_crop_decoder() if enabled else None
    return _crop_decoder is not None


_UNCHECKED = object()
#: The checked crop decoder; None when off. Two threads that both check first assign the same.
_crop_decoder: Any = _UNCHECKED


def _current_crop_decoder() -> Any:
    """The crop decoder in use here (None: off), chosen and checked on the first call."""
    if _crop_decoder is _UNCHECKED:
        enabled = os.environ.get("SHARDLOADER_JPEG_CROP", "1").strip().lower() not in ("0", "false", "no", "off")
        use_crop_decoder(enabled)
    return _crop_decoder


def _checked_crop_decoder() -> Any:
    """The C crop decoder if it is built and gives simplejpeg's pixels here, else None.

    The check decodes boxes of small JPEGs (every chroma subsampling the decoder takes) both
    ways: a libjpeg-turbo that decodes differently from simplejpeg's would change pixels, and
    pixels never change silently (about 2 ms, once per process)."""
    try:
        from shardloader.transforms._jpegcrop import EXTRA_COLUMNS, decode_crop
    except ImportError:
        return None
    if EXTRA_COLUMNS != _EXTRA_COLUMNS:  # a stale build of another version
        return None
    import simplejpeg

    height, width = 45, 67  # not a multiple of any block size: edges are exercised
    # a gradient with a hashed pattern on it (detail in every block, no RNG to set up)
    pixel = np.arange(height * width * 3, dtype=np.uint64)
    image = ((pixel * 2654435761 % 97) + pixel * 200 // pixel.size).astype(np.uint8).reshape(height, width, 3)
    boxes = [(0, 0, height, width), (1, 17, 30, 33), (13, 1, 32, 66), (20, 40, 25, 27), (44, 66, 1, 1)]
    for subsampling in ("444", "422", "420"):
        data = simplejpeg.encode_jpeg(image, quality=90, colorspace="RGB", colorsubsampling=subsampling)
        whole = simplejpeg.decode_jpeg(data, "RGB")
        for top, left, h, w in boxes:
            crop = _crop_view(decode_crop, data, height, width, top, left, h, w)
            if crop is None or not np.array_equal(crop, whole[top:top + h, left:left + w]):
                warnings.warn(
                    "shardloader: the JPEG crop decoder gives other pixels than simplejpeg with "
                    f"this libjpeg-turbo ({subsampling} subsampling, box {(top, left, h, w)}); it "
                    "is off, images are decoded whole", RuntimeWarning, stacklevel=3)
                return None
    return decode_crop


def _decode_opencv(view: memoryview, mode: str) -> np.ndarray | None:
    cv2 = opencv()
    buf = np.frombuffer(view, dtype=np.uint8)
    flags = cv2.IMREAD_GRAYSCALE if mode == "L" else cv2.IMREAD_COLOR
    try:
        image = cv2.imdecode(buf, flags | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error:  # e.g. more pixels than OpenCV's own bound: PIL tries, and says why
        return None
    if mode == "L":
        return None if image is None else image[:, :, None]
    if image is None:
        return None
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _decode_pil(view: memoryview, mode: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(view)) as img:
        img.load()
        if img.mode != mode:
            img = img.convert(mode)
        image = np.array(img)
    if image.dtype != np.uint8:
        raise ValueError(f"mode {mode!r} gives {image.dtype} pixels, not uint8")
    if image.ndim == 2:
        image = image[:, :, None]
    return image


def image_bytes(data: Any, sample: Sample, field: str) -> Any:
    """The encoded image of field `field`: `data` itself, or the ``bytes`` of a Hugging Face
    image dict ``{"bytes", "path"}``; an ImageDecodeError naming the field, sample and path when
    the dict embeds no bytes."""
    if not isinstance(data, Mapping):
        return data
    if "bytes" not in data:
        keys = ", ".join(sorted(repr(k) for k in data)) or "none"
        raise ImageDecodeError(
            f"field {field!r} of {describe_sample(sample)} is a dict without 'bytes' (keys: {keys}); "
            "expected encoded image bytes or a Hugging Face image {'bytes': ..., 'path': ...}"
        )
    if data["bytes"] is None:
        raise ImageDecodeError(
            f"field {field!r} of {describe_sample(sample)} embeds no image bytes, only the path "
            f"{data.get('path')!r}; shardloader never opens paths stored in a dataset. Embed the "
            "image bytes first (Hugging Face datasets' `push_to_hub` and `embed_table_storage` "
            "do), or `shardloader convert` the image folder"
        )
    return data["bytes"]


class DecodeImage(Transform):
    """Decode the encoded image in `sample[field]` into an HWC uint8 array at `sample[out]`.

    `mode` is a PIL mode ("RGB", "L", "RGBA", ...); `backend="auto"` uses simplejpeg for JPEG
    and OpenCV for other formats (PIL as fallback), `backend="pil"` uses PIL only. The field
    holds encoded bytes or a Hugging Face image dict ``{"bytes", "path"}`` (see module doc).
    An image whose header declares more than `max_pixels` pixels (None: 178,956,970 or
    ``SHARDLOADER_MAX_IMAGE_PIXELS``, read here) is an ImageDecodeError before it is decoded;
    `max_pixels` changes no output, so it is not part of the transform's version.
    """

    #: Constructor arguments that change no output (a bound on the input), so not in `params()`
    #: and the version: a resume with another max_pixels is the same pipeline.
    unversioned = ("max_pixels",)

    def __init__(
        self, field: str = "image", out: str = "image", mode: str = "RGB", backend: str = "auto",
        *, max_pixels: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"DecodeImage: unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
        self.field, self.out, self.mode, self.backend = field, out, mode, backend
        self.max_pixels = max_image_pixels(max_pixels, who="DecodeImage: max_pixels")

    def __call__(self, sample: Sample) -> Sample:
        data = get_field(sample, self.field, "DecodeImage")
        return with_field(sample, self.out, decode_field(data, sample, self.field, self.mode,
                                                         self.backend, self.max_pixels))

    def params(self) -> dict[str, Any]:
        return {"field": self.field, "out": self.out, "mode": self.mode, "backend": self.backend}


def decode_field(data: Any, sample: Sample, field: str, mode: str, backend: str,
                 max_pixels: int | None = None) -> np.ndarray:
    """`decode_image` of `image_bytes(data)`, whose errors name the field and the sample."""
    data = image_bytes(data, sample, field)
    try:
        return decode_image(data, mode, backend, max_pixels=max_pixels)
    except ImageDecodeError as e:
        raise ImageDecodeError(f"field {field!r} of {describe_sample(sample)}: {e}") from None
