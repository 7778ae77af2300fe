"""Refusing decompression bombs: an image's size, read from its header, checked before decoding.

A few hundred bytes of JPEG can claim 65000 x 65000 pixels, which a decoder would allocate
11.8 GiB for before finding that the pixel data is not there. Before any pixel is decoded,
`DecodeImage`, `DecodeCropFlip` and `decode_image` read the image's height and width from its
header (JPEG: simplejpeg's header parser; PNG, GIF, BMP, WebP: the fields at fixed offsets;
other formats: PIL's lazy open)
and refuse the image, with an `ImageDecodeError` naming the field and the sample, when

- it has more pixels than the maximum (`DEFAULT_MAX_IMAGE_PIXELS`, PIL's own decompression-bomb
  bound: 13,377 x 13,377 px, 537 MB decoded as RGB). Raise it with ``max_pixels=`` (the
  transforms, `decode_image`) or the environment variable ``SHARDLOADER_MAX_IMAGE_PIXELS`` (read
  when a transform is made, and by `decode_image` without `max_pixels`);
- it is a JPEG that claims more pixels than its bytes can hold. A Huffman-coded JPEG spends at
  least one bit on every 8x8 block of its full-resolution component (the block's DC code), so
  it holds at most 512 pixels per byte (the densest JPEGs measured, blank images with
  optimised tables, hold 256). More pixels than that per byte is a truncated or forged file.
  Arithmetic-coded JPEGs (rare) can be denser and are not held to this.

PIL keeps its own bound (``PIL.Image.MAX_IMAGE_PIXELS``, twice which it refuses) for the images
it decodes (formats other than JPEG and PNG, and the fallback); raise both for such images.
"""

from __future__ import annotations

import io
import os
import struct
import warnings

#: The most pixels (height x width) an image may have unless configured otherwise: PIL's
#: decompression-bomb bound (2 x PIL.Image.MAX_IMAGE_PIXELS).
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970
#: The environment variable that sets the default maximum (a positive integer of pixels).
MAX_PIXELS_ENV = "SHARDLOADER_MAX_IMAGE_PIXELS"
#: The most pixels a Huffman-coded JPEG can hold per byte of file (one bit per 8x8 block).
JPEG_MAX_PIXELS_PER_BYTE = 512

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# JPEG frame markers (SOF0..SOF15 without DHT C4, JPG C8, DAC CC); C9.. are arithmetic-coded.
_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7,
                          0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_ARITHMETIC_SOF = frozenset((0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


def max_image_pixels(max_pixels: int | None = None, *, who: str = "max_pixels") -> int:
    """`max_pixels` if given, else ``SHARDLOADER_MAX_IMAGE_PIXELS`` if set, else the default;
    a ValueError naming the argument (`who`) or the variable when it is not a positive integer."""
    if max_pixels is None:
        text = os.environ.get(MAX_PIXELS_ENV)
        if text is None or not text.strip():
            return DEFAULT_MAX_IMAGE_PIXELS
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"the environment variable {MAX_PIXELS_ENV}={text!r} must be a "
                             "positive whole number of pixels")
        return value
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels <= 0:
        raise ValueError(f"{who} must be a positive int (pixels), got {max_pixels!r}")
    return max_pixels


def header_size(view: memoryview) -> tuple[int, int] | None:
    """(height, width) that the image header in `view` declares; None when no header is read
    (not an image, or damaged: decoding then reports it). JPEG, PNG, GIF, BMP and WebP headers
    are read here (microseconds); any other format through PIL's lazy open."""
    head = bytes(view[:32])
    if head.startswith(_JPEG_MAGIC):
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(view)
        except ValueError:
            return None
        return int(height), int(width)
    size = _fixed_offset_size(head)
    if size is not None:
        return size
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(view)) as img:  # reads the header only
                width, height = img.size
    except Image.DecompressionBombError as e:  # more than PIL's own bound: report its words
        raise _PILRefused(str(e)) from None
    except Exception:  # noqa: BLE001 - not an image PIL knows: decoding reports it
        return None
    return int(height), int(width)


def _fixed_offset_size(head: bytes) -> tuple[int, int] | None:
    """(height, width) from the first 32 bytes of a PNG, GIF, BMP or WebP file, whose sizes
    lie at fixed offsets; None for anything else."""
    if len(head) < 30:
        return None
    if head.startswith(_PNG_MAGIC) and head[12:16] == b"IHDR":
        width, height = struct.unpack_from(">II", head, 16)
    elif head.startswith((b"GIF87a", b"GIF89a")):
        width, height = struct.unpack_from("<HH", head, 6)
    elif head.startswith(b"BM") and struct.unpack_from("<I", head, 14)[0] >= 40:
        width, height = (abs(v) for v in struct.unpack_from("<ii", head, 18))  # < 0: top-down
    elif head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        chunk = head[12:16]
        if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":  # lossy
            width, height = (v & 0x3FFF for v in struct.unpack_from("<HH", head, 26))
        elif chunk == b"VP8L" and head[20] == 0x2F:  # lossless
            bits = struct.unpack_from("<I", head, 21)[0]
            width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        elif chunk == b"VP8X":  # extended: the canvas size
            width = int.from_bytes(head[24:27], "little") + 1
            height = int.from_bytes(head[27:30], "little") + 1
        else:
            return None
    else:
        return None
    return int(height), int(width)


class _PILRefused(Exception):
    """PIL refused to open the header of an image larger than its own bound."""


def oversize_problem(view: memoryview, max_pixels: int,
                     size: tuple[int, int] | None = None) -> str | None:
    """Why the image in `view` must not be decoded (too many pixels for `max_pixels`, or for
    its bytes), or None. `size`: its (height, width) if already read from the header."""
    if size is None:
        try:
            size = header_size(view)
        except _PILRefused as e:
            return f"not decoded: PIL refuses its header: {e} (PIL.Image.MAX_IMAGE_PIXELS sets that bound)"
        if size is None:
            return None
    height, width = size
    pixels = height * width
    if pixels > max_pixels:
        return (f"not decoded: the image header declares {width} x {height} = {pixels:,} "
                f"pixels, more than max_pixels={max_pixels:,} (decoding would need "
                f"{_gib(pixels * 3)} as RGB). If your images really are this large, pass a "
                f"larger max_pixels to DecodeImage / DecodeCropFlip or set {MAX_PIXELS_ENV}")
    nbytes = view.nbytes
    if (pixels > JPEG_MAX_PIXELS_PER_BYTE * nbytes and bytes(view[:3]) == _JPEG_MAGIC
            and not _arithmetic_jpeg(view)):
        return (f"not decoded: the JPEG header declares {width} x {height} = {pixels:,} "
                f"pixels, but {nbytes:,} bytes of JPEG hold at most "
                f"{JPEG_MAX_PIXELS_PER_BYTE * nbytes:,} ({JPEG_MAX_PIXELS_PER_BYTE} per byte): "
                "the file is truncated or forged")
    return None


def _arithmetic_jpeg(view: memoryview) -> bool:
    """Whether the JPEG in `view` is arithmetic-coded: its frame marker is SOF9..SOF15. Walks
    the marker segments before the first scan (a few, each skipped by its length). Called only
    for a JPEG that claims more pixels than its bytes hold: at most a few hundred KiB."""
    data = bytes(view)
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _SOF_MARKERS:
            return marker in _ARITHMETIC_SOF
        if marker == 0xDA:  # start of scan without a frame: not a JPEG decoders read
            return False
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return False


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.0f} MiB"

