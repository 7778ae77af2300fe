"""The JPEG crop decoder (`shardloader/transforms/_jpegcrop.c` through `decode_jpeg_crop`):
the pixels of a box, decoding only what the box needs, bit for bit those of simplejpeg's
whole-image decode; or None, and the caller decodes the whole image as before.

Tests that need the compiled decoder skip where it is not built (no compiler or no
libjpeg-turbo headers when the package was installed); the transform's results must not
depend on it, which the tests without it check too.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from shardloader.synthetic import make_image
from shardloader.transforms import DecodeCropFlip, ImageDecodeError
from shardloader.transforms import decode as decode_module
from shardloader.transforms.decode import (
    crop_decoder_on,
    decode_image,
    decode_jpeg_crop,
    use_crop_decoder,
)

try:
    from shardloader.transforms import _jpegcrop
except ImportError:  # not built here: the transform decodes whole images
    _jpegcrop = None

needs_decoder = pytest.mark.skipif(_jpegcrop is None, reason="the JPEG crop decoder is not built here")


@pytest.fixture(autouse=True)
def _crop_decoder_restored():
    """Each test starts with the decoder as the environment sets it, and leaves it so."""
    yield
    decode_module._crop_decoder = decode_module._UNCHECKED


def _boxes(height: int, width: int, rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    boxes = [(0, 0, height, width), (height - 1, width - 1, 1, 1), (0, width - 1, height, 1)]
    for _ in range(n):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        boxes.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    return boxes


def _image(height: int, width: int, seed: int) -> np.ndarray:
    """Detail everywhere (so every block and chroma sample matters), not noise only."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x * y) % 256], -1)
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


@needs_decoder
@pytest.mark.parametrize("subsampling", ["444", "422", "420"])
@pytest.mark.parametrize("quality", [50, 95])
@pytest.mark.parametrize("size", [(1, 1), (7, 300), (129, 257), (256, 192)])
def test_crops_are_simplejpegs_pixels_bit_for_bit(subsampling, quality, size):
    height, width = size
    data = simplejpeg.encode_jpeg(_image(height, width, quality), quality=quality,
                                  colorspace="RGB", colorsubsampling=subsampling)
    whole = simplejpeg.decode_jpeg(data, "RGB")
    rng = np.random.default_rng(height * width + quality)
    for top, left, h, w in _boxes(height, width, rng, 60):
        crop = decode_jpeg_crop(data, height, width, top, left, h, w)
        assert crop is not None, (top, left, h, w)
        assert crop.shape == (h, w, 3) and crop.dtype == np.uint8
        assert np.array_equal(crop, whole[top:top + h, left:left + w]), (top, left, h, w)


@needs_decoder
def test_pil_encoded_jpegs_with_restart_markers_decode_the_same():
    """Another encoder, and restart intervals (each resets the decoder's state)."""
    rng = np.random.default_rng(5)
    for index in range(12):
        image, _ = make_image(index, seed=3)
        buffer = io.BytesIO()
        extra = {"restart_marker_blocks": 3} if index % 2 else {}
        Image.fromarray(image).save(buffer, "JPEG", quality=90, subsampling=index % 3, **extra)
        data = buffer.getvalue()
        whole = simplejpeg.decode_jpeg(data, "RGB")
        height, width = whole.shape[:2]
        for top, left, h, w in _boxes(height, width, rng, 10):
            crop = decode_jpeg_crop(data, height, width, top, left, h, w)
            assert crop is not None and np.array_equal(crop, whole[top:top + h, left:left + w])


def _encoded(kind: str) -> bytes:
    image = _image(40, 56, 1)
    if kind == "progressive":
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, "JPEG", quality=90, progressive=True)
        return buffer.getvalue()
    if kind == "gray":
        return simplejpeg.encode_jpeg(image[:, :, :1].copy(), colorspace="GRAY", colorsubsampling="Gray")
    return simplejpeg.encode_jpeg(image, colorspace="RGB", colorsubsampling=kind)


@needs_decoder
@pytest.mark.parametrize("kind", ["progressive", "gray", "440", "411"])
def test_kinds_it_does_not_take_are_declined(kind):
    assert crop_decoder_on()
    assert decode_jpeg_crop(_encoded(kind), 40, 56, 3, 5, 20, 30) is None


@needs_decoder
def test_a_truncated_file_is_declined_even_when_the_crop_lies_before_the_cut():
    data = simplejpeg.encode_jpeg(_image(256, 192, 2), quality=90, colorspace="RGB", colorsubsampling="420")
    assert decode_jpeg_crop(data, 256, 192, 0, 0, 16, 16) is not None
    assert decode_jpeg_crop(data[: len(data) * 3 // 4], 256, 192, 0, 0, 16, 16) is None


@needs_decoder
def test_damaged_data_gives_what_the_whole_image_decode_gives_or_is_declined():
    """Bytes changed anywhere in the entropy-coded data: where the crop decoder answers, the
    whole-image decode it stands in for (`decode_image`, simplejpeg then PIL) gives the same
    pixels in the box, and never raises; the crop decoder never crashes."""
    data = simplejpeg.encode_jpeg(_image(200, 160, 4), quality=90, colorspace="RGB", colorsubsampling="420")
    start = data.index(b"\xff\xda")  # start of scan: the entropy-coded data follows
    rng = np.random.default_rng(9)
    answered = declined = 0
    for _ in range(300):
        damaged = bytearray(data)
        for at in rng.integers(start + 20, len(data) - 2, size=int(rng.integers(1, 4))):
            damaged[int(at)] = int(rng.integers(0, 256))
        damaged = bytes(damaged)
        top, left, h, w = _boxes(200, 160, rng, 1)[-1]
        crop = decode_jpeg_crop(damaged, 200, 160, top, left, h, w)
        if crop is None:
            declined += 1
            continue
        answered += 1
        whole = decode_image(damaged, "RGB")  # raises ImageDecodeError if it cannot
        assert np.array_equal(crop, whole[top:top + h, left:left + w])
    assert answered and declined  # both outcomes were exercised


@needs_decoder
def test_a_marker_after_the_crop_that_stops_a_whole_decode_is_declined():
    """The rows after the crop are not decoded, but what would stop a whole decode there (a
    marker in the middle of the data: PIL then raises "broken data stream") declines."""
    data = simplejpeg.encode_jpeg(_image(200, 160, 4), quality=90, colorspace="RGB", colorsubsampling="420")
    near_end = len(data) - 40
    damaged = data[:near_end] + b"\xff\x39" + data[near_end + 2:]
    assert decode_jpeg_crop(data, 200, 160, 0, 0, 16, 16) is not None
    assert decode_jpeg_crop(damaged, 200, 160, 0, 0, 16, 16) is None
    with pytest.raises(ImageDecodeError):
        decode_image(damaged, "RGB")


@needs_decoder
def test_random_bytes_and_bad_arguments_never_crash():
    decode_crop = _jpegcrop.decode_crop
    rng = np.random.default_rng(1)
    good = simplejpeg.encode_jpeg(_image(32, 32, 0), colorspace="RGB", colorsubsampling="420")
    for _ in range(200):
        junk = good[:int(rng.integers(0, len(good)))] + rng.bytes(int(rng.integers(0, 64)))
        crop = decode_jpeg_crop(junk, 32, 32, 0, 0, 32, 32)
        if crop is not None:  # only a file that still ends in EOI, and then the whole decode's pixels
            assert junk.endswith(b"\xff\xd9")
            assert np.array_equal(crop, decode_image(junk, "RGB"))
    assert decode_jpeg_crop(good, 32, 33, 0, 0, 8, 8) is None  # not the size its header says
    out = np.empty((8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="not inside the image"):
        decode_crop(good, 32, 32, 30, 0, 8, 8, out)
    with pytest.raises(ValueError, match="EXTRA_COLUMNS"):  # no room for the decoded rows
        decode_crop(good, 32, 32, 0, 0, 8, 7, out)
    with pytest.raises(TypeError):  # a strided view is not a writable contiguous buffer
        decode_crop(good, 32, 32, 0, 0, 4, 8, np.empty((8, 8, 3), np.uint8)[::2])
    assert decode_jpeg_crop(np.frombuffer(good, np.uint8)[::1], 32, 32, 0, 0, 8, 8) is not None


def test_decode_crop_flip_gives_the_same_bytes_with_the_crop_decoder_on_or_off():
    """The transform's output never depends on whether the decoder is built or on: images it
    takes and images it declines (a progressive one), both of the transform's paths."""
    samples = []
    for index in range(24):
        image, _ = make_image(index, seed=7)
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, "JPEG", quality=90, progressive=index % 6 == 0)
        samples.append({"image": buffer.getvalue(), "__index__": index})
    transform = DecodeCropFlip(112)

    def outputs() -> tuple[list[np.ndarray], list[np.ndarray]]:
        called, written = [], []
        for i, sample in enumerate(samples):
            called.append(transform(sample, generator=torch.Generator().manual_seed(i))["image"])
            dst = np.empty((112, 112, 3), np.uint8)
            transform.into(sample, dst, torch.Generator().manual_seed(i))
            written.append(dst)
        return called, written

    use_crop_decoder(False)
    off = outputs()
    assert use_crop_decoder(True) == (_jpegcrop is not None)
    answered = []
    if _jpegcrop is not None:  # count the crops it decoded: the comparison must not be vacuous
        real = decode_module._crop_decoder
        decode_module._crop_decoder = lambda *args: answered.append(real(*args)) or answered[-1]
    on = outputs()
    for a, b in zip(off[0] + off[1], on[0] + on[1]):
        assert np.array_equal(a, b)
    if _jpegcrop is not None:
        decoded = sum(result is not None for result in answered)
        assert 0 < decoded < len(answered)  # most crops decoded; the progressive ones declined


def test_a_damaged_image_still_raises_naming_the_sample():
    data = simplejpeg.encode_jpeg(_image(64, 64, 3), colorspace="RGB", colorsubsampling="420")
    sample = {"image": data[: len(data) // 2], "__index__": 41}
    for enabled in (True, False):
        use_crop_decoder(enabled)
        with pytest.raises(ImageDecodeError, match="__index__=41"):
            DecodeCropFlip(16, scale=(0.01, 0.02))(sample, generator=torch.Generator().manual_seed(0))


@needs_decoder
def test_a_decoder_that_disagrees_with_simplejpeg_is_switched_off_with_a_warning(monkeypatch):
    real = _jpegcrop.decode_crop

    def off_by_one(*args):
        ok = real(*args)
        args[-1][:] ^= 1  # `out`, the last argument
        return ok

    monkeypatch.setattr(_jpegcrop, "decode_crop", off_by_one)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert use_crop_decoder(True) is False
    assert any("other pixels than simplejpeg" in str(w.message) for w in caught)
    assert decode_jpeg_crop(_encoded("420"), 40, 56, 0, 0, 8, 8) is None


def test_the_environment_switches_it_off():
    script = ("from shardloader.transforms.decode import crop_decoder_on\n"
              "print(crop_decoder_on())\n")
    env = dict(os.environ, SHARDLOADER_JPEG_CROP="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_decoder_is_built_where_a_compiler_and_libjpeg_turbo_headers_are():
    """The build of the extension is optional (a machine without them installs without it),
    so a build that broke would only show as skipped tests; here it fails instead."""
    import shutil
    import sysconfig

    headers = [os.path.join(d, "jpeglib.h") for d in ("/usr/include", "/usr/local/include")]
    if not shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or \
            not any(os.path.exists(h) for h in headers):
        pytest.skip("no C compiler or no libjpeg headers here: the decoder is optional")
    assert _jpegcrop is not None, "pip install built no shardloader.transforms._jpegcrop"
    assert _jpegcrop.LIBJPEG_TURBO_VERSION_NUMBER >= 1005000  # jpeg_crop_scanline: 1.5
