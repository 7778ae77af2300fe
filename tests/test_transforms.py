"""Image transforms: augmentation is a pure function of the generator (I3), torchvision
semantics, decoding of every format with clear errors (I9), the OpenCV path stays close to the
PIL reference, the fused path reproduces the composed one, and versions identify pipelines."""

from __future__ import annotations

import functools
import io
import pickle

import cv2
import numpy as np
import pytest
import simplejpeg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shardloader.errors import ShardloaderError
from shardloader.loader.collate import collate
from shardloader.synthetic import make_image, make_image_samples
from shardloader.transforms import (
    CenterCrop,
    Compose,
    DecodeCropFlip,
    DecodeImage,
    ImageDecodeError,
    Lambda,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
    Transform,
    TransformError,
    accepts_generator,
    decode_image,
    resize_cv2,
    sample_crop_box,
    set_opencv_threads,
    transform_version,
)
from shardloader.transforms.fused import snap_box
from shardloader.transforms.geometry import flip_hwc, flip_hwc_in_place
from shardloader.transforms.tensor import copy_into, hwc_to_chw


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def jpegs() -> list[dict]:
    """120 synthetic JPEG samples, 128-256 px, with sample identities like a Dataset's."""
    samples = list(make_image_samples(120, seed=11))
    for i, s in enumerate(samples):
        s["__index__"] = i
    return samples


def train_pipeline(backend: str = "cv2", antialias: bool = True) -> Compose:
    decode_backend = "pil" if backend == "pil" else "auto"
    return Compose([
        DecodeImage(backend=decode_backend),
        RandomResizedCrop(112, backend=backend, antialias=antialias),
        RandomHorizontalFlip(),
    ])


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# -- determinism (I3) -------------------------------------------------------------------------


def test_same_generator_seed_gives_identical_bytes_and_other_seeds_differ(jpegs):
    pipeline = Compose([train_pipeline(), ToTensor()])
    for sample in jpegs[:20]:
        a = pipeline(sample, generator=gen(5))["image"]
        torch.rand(50)  # global RNG use in between must not matter
        b = pipeline(sample, generator=gen(5))["image"]
        assert torch.equal(a, b)
    outputs = [pipeline(jpegs[0], generator=gen(seed))["image"] for seed in range(20)]
    distinct = {out.numpy().tobytes() for out in outputs}
    assert len(distinct) == 20


def test_crop_box_is_a_pure_function_of_the_generator_and_varies_with_its_seed():
    boxes = [sample_crop_box(200, 300, generator=gen(seed)) for seed in range(200)]
    assert boxes == [sample_crop_box(200, 300, generator=gen(seed)) for seed in range(200)]
    assert len(set(boxes)) >= 195


def test_generator_none_uses_the_global_torch_rng(jpegs):
    pipeline = train_pipeline()
    torch.manual_seed(3)
    a = pipeline(jpegs[0])["image"]
    torch.manual_seed(3)
    b = pipeline(jpegs[0])["image"]
    assert np.array_equal(a, b)


def test_transforms_do_not_mutate_their_input(jpegs):
    sample = dict(jpegs[0])
    before = dict(sample)
    out = Compose([train_pipeline(), ToTensor(torch.float32), Normalize([0.5] * 3, [0.2] * 3)])(
        sample, generator=gen(0)
    )
    assert sample == before
    assert out["label"] == sample["label"] and out["__index__"] == 0


# -- RandomResizedCrop semantics ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 600),
    width=st.integers(1, 600),
    lo=st.floats(0.01, 1.0),
    span=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_crop_box_lies_inside_the_image_and_respects_scale_and_ratio(height, width, lo, span, seed):
    scale = (lo, min(lo + span, 1.0))
    ratio = (3 / 4, 4 / 3)
    top, left, h, w = sample_crop_box(height, width, scale, ratio, gen(seed))
    assert 0 < h <= height and 0 < w <= width
    assert 0 <= top <= height - h and 0 <= left <= width - w
    central = (top, left) == ((height - h) // 2, (width - w) // 2)
    if not central and min(height, width) >= 20:
        # A drawn box (not the fallback): area and aspect within the ranges, up to rounding.
        area = h * w / (height * width)
        tol_area = (h + w + 1) / (height * width)
        assert scale[0] - tol_area <= area <= scale[1] + tol_area
        assert ratio[0] * (1 - 1 / h) - 1 / h <= w / h <= ratio[1] * (1 + 1 / h) + 1 / h


def test_crop_box_falls_back_to_a_central_crop_clamped_to_the_ratio():
    # An area larger than the image never fits: the fallback is torchvision's.
    assert sample_crop_box(100, 400, (2.0, 3.0), (3 / 4, 4 / 3), gen(0)) == (0, 133, 100, 133)
    assert sample_crop_box(400, 100, (2.0, 3.0), (3 / 4, 4 / 3), gen(0)) == (133, 0, 133, 100)
    assert sample_crop_box(90, 100, (2.0, 3.0), (3 / 4, 4 / 3), gen(0)) == (0, 0, 90, 100)


def test_random_resized_crop_output_is_the_resized_box_drawn_from_the_same_generator():
    image, _ = make_image(3, seed=1)
    rrc = RandomResizedCrop((64, 96), scale=(0.2, 0.9))
    out = rrc({"image": image}, generator=gen(9))["image"]
    assert out.shape == (64, 96, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    top, left, h, w = sample_crop_box(*image.shape[:2], (0.2, 0.9), (3 / 4, 4 / 3), gen(9))
    assert np.array_equal(out, resize_cv2(image[top : top + h, left : left + w], 64, 96))


def test_resize_cv2_is_bilinear_upscaling_and_block_averaging_downscaling():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    small = image[:50, :70]
    linear = cv2.resize(small, (112, 112), interpolation=cv2.INTER_LINEAR)
    assert np.array_equal(resize_cv2(small, 112, 112), linear)  # upscaling: plain bilinear
    assert np.array_equal(
        resize_cv2(image, 112, 112, antialias=False),
        cv2.resize(image, (112, 112), interpolation=cv2.INTER_LINEAR),
    )
    # An exact 2x downscale with antialias is the mean of each 2x2 block.
    blocks = image.reshape(112, 2, 112, 2, 3).astype(np.float64).mean(axis=(1, 3))
    assert np.abs(resize_cv2(image, 112, 112).astype(np.float64) - blocks).max() <= 0.5 + 1e-9
    # A non-integer downscale is antialiased: a one-pixel checkerboard averages to grey
    # instead of aliasing into high-contrast patterns.
    checker = (np.indices((300, 300)).sum(axis=0) % 2 * 255).astype(np.uint8)[:, :, None]
    smooth = resize_cv2(checker, 112, 112).astype(int)
    aliased = resize_cv2(checker, 112, 112, antialias=False).astype(int)
    assert np.abs(smooth - 127).max() <= 12
    assert np.abs(aliased - 127).max() > 60


def test_random_resized_crop_keeps_a_single_channel():
    gray = np.arange(50 * 60, dtype=np.uint8).reshape(50, 60, 1)
    for backend in ("cv2", "pil"):
        out = RandomResizedCrop(32, backend=backend)({"image": gray}, generator=gen(1))["image"]
        assert out.shape == (32, 32, 1)


def test_geometric_transforms_reject_undecoded_images(jpegs):
    with pytest.raises(TransformError, match="field 'image' must be an HWC numpy image"):
        RandomResizedCrop(32)(jpegs[0], generator=gen(0))
    with pytest.raises(TransformError, match="__index__=0 has no field 'img'"):
        RandomResizedCrop(32, field="img")(jpegs[0], generator=gen(0))
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCrop(32, scale=(0.9, 0.1))


# -- other transforms ----------------------------------------------------------------------------


def test_horizontal_flip_mirrors_exactly_and_with_probability_p():
    image, _ = make_image(0, seed=2)
    flipped = RandomHorizontalFlip(p=1.0)({"image": image}, generator=gen(0))["image"]
    assert np.array_equal(flipped, image[:, ::-1]) and flipped.flags.c_contiguous
    kept = RandomHorizontalFlip(p=0.0)({"image": image}, generator=gen(0))["image"]
    assert np.array_equal(kept, image)
    gray = image[:, :, :1].copy()
    assert np.array_equal(RandomHorizontalFlip(1.0)({"image": gray})["image"], gray[:, ::-1])
    tensor = torch.arange(24).reshape(2, 3, 4)
    out = RandomHorizontalFlip(1.0)({"image": tensor})["image"]
    assert torch.equal(out, tensor.flip(-1))
    flips = [
        not np.array_equal(RandomHorizontalFlip(0.5)({"image": image}, generator=gen(s))["image"], image)
        for s in range(200)
    ]
    assert 70 <= sum(flips) <= 130


def test_center_crop_slices_the_middle_and_pads_small_images():
    image = np.arange(10 * 12 * 3, dtype=np.uint8).reshape(10, 12, 3)
    out = CenterCrop((4, 6))({"image": image})["image"]
    assert np.array_equal(out, image[3:7, 3:9])
    padded = CenterCrop((14, 12))({"image": image})["image"]
    assert padded.shape == (14, 12, 3)
    assert np.array_equal(padded[2:12], image)
    assert not padded[:2].any() and not padded[12:].any()


def test_resize_matches_the_shorter_side_or_an_exact_size():
    image = np.zeros((100, 250, 3), np.uint8)
    assert Resize(40)({"image": image})["image"].shape == (40, 100, 3)
    assert Resize(40)({"image": image.transpose(1, 0, 2)})["image"].shape == (100, 40, 3)
    assert Resize((30, 70))({"image": image})["image"].shape == (30, 70, 3)
    assert Resize(33, backend="pil")({"image": image})["image"].shape == (33, 82, 3)


def test_to_tensor_gives_chw_bytes_or_floats_in_unit_range():
    image = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    t = ToTensor()({"image": image})["image"]
    assert t.dtype == torch.uint8 and t.shape == (3, 5, 7)
    assert np.array_equal(t.numpy(), image.transpose(2, 0, 1))
    f = ToTensor(torch.float32)({"image": image})["image"]
    assert f.dtype == torch.float32 and f.is_contiguous()  # as torchvision's ToTensor
    assert torch.allclose(f, torch.from_numpy(image.transpose(2, 0, 1).astype(np.float32) / 255))
    assert 0.0 <= f.min() and f.max() <= 1.0


def test_to_tensor_bytes_are_a_chw_view_of_the_pixels_and_copy_only_what_it_must():
    """uint8: a CHW view of the HWC array (no per-sample copy; docs/migration.md), as
    torchvision's PILToTensor; a read-only or strided image is copied first, so the tensor is
    always writable and never aliases memory the sample does not own."""
    image = np.random.default_rng(1).integers(0, 256, (6, 9, 3), dtype=np.uint8)
    t = ToTensor()({"image": image})["image"]
    assert np.shares_memory(t.numpy(), image) and not t.is_contiguous()
    assert t.stride() == (1, 27, 3)
    assert torch.equal(t.contiguous(), torch.from_numpy(image.transpose(2, 0, 1).copy()))
    assert t.reshape(-1).shape == (162,)
    read_only = image.copy()
    read_only.flags.writeable = False
    r = ToTensor()({"image": read_only})["image"]
    assert not np.shares_memory(r.numpy(), read_only) and torch.equal(r, t)
    r.add_(1)  # writable: the copy is ours
    strided = np.ascontiguousarray(np.concatenate([image, image], axis=1))[:, ::2]
    s = ToTensor()({"image": strided})["image"]
    assert not np.shares_memory(s.numpy(), strided)
    assert np.array_equal(s.numpy(), strided.transpose(2, 0, 1))
    gray = ToTensor()({"image": image[:, :, 0].copy()})["image"]
    assert gray.shape == (1, 6, 9) and np.array_equal(gray.numpy()[0], image[:, :, 0])


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int16, np.float64])
def test_copy_into_writes_the_same_bytes_as_numpy_for_every_layout(dtype):
    """The collate's copy: OpenCV's split for CHW views of HWC images, numpy's copy for the
    rest; the bytes must be numpy's for each."""
    rng = np.random.default_rng(2)
    hwc = (rng.random((5, 7, 4)) * 100).astype(dtype)
    sources = [hwc.transpose(2, 0, 1), hwc[:, :, :3].transpose(2, 0, 1), hwc[:, :, :1].transpose(2, 0, 1),
               np.ascontiguousarray(hwc.transpose(2, 0, 1)), hwc.transpose(2, 1, 0), hwc[::2].transpose(2, 0, 1)]
    for src in sources:
        dst = np.zeros(src.shape, dtype)
        copy_into(dst, src)
        assert np.array_equal(dst, src), src.strides


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.uint16])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_flip_in_place_equals_the_flip_into_a_new_array(dtype, channels):
    rng = np.random.default_rng(3)
    for h, w in [(1, 1), (2, 3), (112, 112), (113, 111), (7, 1000)]:
        image = (rng.random((h, w, channels)) * 200).astype(dtype)
        expected = flip_hwc(image.copy())
        out = flip_hwc_in_place(image)
        assert out.shape == expected.shape and np.array_equal(out, expected), (h, w)
        if dtype != np.uint16:  # OpenCV's types: written over the input
            assert np.shares_memory(out, image)


def test_normalize_computes_per_channel_standard_scores():
    x = torch.rand(3, 4, 5)
    before = x.clone()
    mean, std = [0.1, 0.5, 0.9], [0.2, 0.3, 0.4]
    out = Normalize(mean, std)({"image": x})["image"]
    for c in range(3):
        assert torch.allclose(out[c], (before[c] - mean[c]) / std[c])
    assert torch.equal(x, before)  # input untouched (not in place)
    Normalize(mean, std, inplace=True)({"image": x})
    assert torch.allclose(x, out)
    with pytest.raises(TransformError, match="float tensor"):
        Normalize(mean, std)({"image": torch.zeros(3, 2, 2, dtype=torch.uint8)})
    with pytest.raises(TransformError, match="3 channel means"):
        Normalize(mean, std)({"image": torch.zeros(1, 2, 2)})
    with pytest.raises(ValueError, match="std must not contain 0"):
        Normalize([0.0], [0.0])


# -- decoding ---------------------------------------------------------------------------------


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(buf, "PNG")
    return buf.getvalue()


def test_decode_jpeg_matches_pil_bit_for_bit(jpegs):
    for sample in jpegs[:10]:
        fast = decode_image(sample["image"])
        reference = decode_image(sample["image"], backend="pil")
        assert fast.dtype == np.uint8 and fast.ndim == 3 and fast.shape[2] == 3
        assert np.array_equal(fast, reference)
    assert np.array_equal(decode_image(memoryview(jpegs[0]["image"])), decode_image(jpegs[0]["image"]))


def test_decode_png_is_lossless_for_rgb_gray_and_rgba():
    rgb, _ = make_image(1, min_size=40, max_size=60)
    for backend in ("auto", "pil"):
        assert np.array_equal(decode_image(_png(rgb), backend=backend), rgb)
    gray = rgb[:, :, 1:2].copy()
    for backend in ("auto", "pil"):
        assert np.array_equal(decode_image(_png(gray), "L", backend=backend), gray)
        as_rgb = decode_image(_png(gray), "RGB", backend=backend)
        assert as_rgb.shape == rgb.shape and all(np.array_equal(as_rgb[..., c], gray[..., 0]) for c in range(3))
    rgba = np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), 77, np.uint8)], axis=2)
    assert np.array_equal(decode_image(_png(rgba), "RGBA"), rgba)
    assert np.array_equal(decode_image(_png(rgba), "RGB"), rgb)


def test_decode_grayscale_and_cmyk_jpegs():
    rgb, _ = make_image(2, min_size=64, max_size=80)
    gray_jpeg = simplejpeg.encode_jpeg(np.ascontiguousarray(rgb[:, :, :1]), quality=95, colorspace="GRAY")
    gray = decode_image(gray_jpeg, "L")
    assert gray.shape == rgb.shape[:2] + (1,)
    as_rgb = decode_image(gray_jpeg, "RGB")
    assert np.array_equal(as_rgb[..., 0], gray[..., 0]) and np.array_equal(as_rgb[..., 2], gray[..., 0])
    buf = io.BytesIO()
    Image.new("CMYK", (40, 30), (10, 200, 30, 0)).save(buf, "JPEG")
    cmyk = decode_image(buf.getvalue())
    assert cmyk.shape == (30, 40, 3)
    reference = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert np.abs(cmyk.astype(int) - reference.astype(int)).max() <= 2  # rounding differs by 1


@pytest.mark.parametrize(
    "bad",
    [b"", b"not an image at all", b"\xff\xd8\xff\xe0garbage", b"\x89PNG\r\n\x1a\n\x00\x00"],
    ids=["empty", "text", "jpeg-magic-garbage", "png-magic-garbage"],
)
def test_corrupt_bytes_raise_a_clear_error_naming_field_and_sample(bad):
    sample = {"jpg": bad, "__index__": 17, "__key__": "shard-3/000017"}
    for transform in (
        DecodeImage(field="jpg"),
        DecodeImage(field="jpg", backend="pil"),
        DecodeCropFlip(64, field="jpg"),
    ):
        with pytest.raises(ImageDecodeError) as info:
            transform(sample, generator=gen(0)) if isinstance(transform, DecodeCropFlip) else transform(sample)
        message = str(info.value)
        assert "field 'jpg'" in message and "__index__=17" in message and "shard-3/000017" in message
        assert isinstance(info.value, ShardloaderError)
        assert " at 0x" not in message


def test_truncated_jpeg_raises_instead_of_returning_a_partial_image(jpegs):
    data = jpegs[0]["image"]
    sample = {"image": data[: len(data) // 2], "__index__": 0}
    with pytest.raises(ImageDecodeError, match="field 'image' of sample __index__=0") as info:
        DecodeImage()(sample)
    assert "Premature end of JPEG file" in str(info.value) and "truncated" in str(info.value)
    with pytest.raises(ImageDecodeError, match="field 'image'"):
        DecodeCropFlip(112)(sample, generator=gen(0))


# -- the OpenCV path against the PIL reference --------------------------------------------------


def test_opencv_path_is_close_to_the_pil_reference_for_the_same_crop_box(jpegs):
    """Measured on these 120 samples: mean |diff| 0.58 levels of 255 with antialias (worst
    sample 2.7), 1.03 without (worst 7.5). The bounds leave room for library versions."""
    reference = train_pipeline("pil")
    results = {}
    for antialias in (True, False):
        fast = train_pipeline("cv2", antialias=antialias)
        diffs = [
            mean_abs_diff(fast(s, generator=gen(i))["image"], reference(s, generator=gen(i))["image"])
            for i, s in enumerate(jpegs)
        ]
        results[antialias] = (float(np.mean(diffs)), float(np.max(diffs)))
    assert results[True][0] < 1.0 and results[True][1] < 6.0
    assert results[False][0] < 2.5
    assert results[True][0] < results[False][0]  # antialiasing is what brings it closer


def test_fused_path_is_bit_identical_to_the_composed_path_without_reduced_decode(jpegs):
    composed = train_pipeline("cv2")
    fused = DecodeCropFlip(112, reduced_decode=False)
    for i, sample in enumerate(jpegs[:60]):
        a = composed(sample, generator=gen(i))["image"]
        b = fused(sample, generator=gen(i))["image"]
        assert np.array_equal(a, b), i
    # And the same for non-JPEG input, which takes the decode-then-crop branch.
    png = {"image": _png(decode_image(jpegs[0]["image"]))}
    assert np.array_equal(composed(png, generator=gen(4))["image"], fused(png, generator=gen(4))["image"])


def test_fused_reduced_decode_is_used_for_large_crops_and_stays_close_to_pil():
    """On 480-900 px images with crops of 30-100% of the area every sample decodes at 1/2 or
    1/4 size; the crop box is then snapped to the reduced pixel grid. Measured mean |diff| from
    PIL: 1.04 levels against the snapped box (worst 3.1; a full decode gives 1.1), 2.4 against
    the unsnapped box (worst 7.7)."""
    samples = list(make_image_samples(30, min_size=480, max_size=900, seed=3))
    scale = (0.3, 1.0)
    fused = DecodeCropFlip(112, scale=scale, p=0.0)
    reductions, snapped_diffs, raw_diffs = [], [], []
    for i, sample in enumerate(samples):
        full = decode_image(sample["image"], backend="pil")
        height, width = full.shape[:2]
        top, left, h, w = sample_crop_box(height, width, scale, (3 / 4, 4 / 3), gen(i))
        k = fused.reduction(h, w)
        reductions.append(k)
        out = fused(sample, generator=gen(i))["image"]
        assert out.shape == (112, 112, 3)
        y0, x0, y1, x1 = snap_box((top, left, h, w), k, -(-height // k), -(-width // k))
        assert max(abs(y0 * k - top), abs(x0 * k - left)) <= k / 2
        assert max(abs(y1 * k - (top + h)), abs(x1 * k - (left + w))) <= k / 2
        snapped = (x0 * k, y0 * k, min(x1 * k, width), min(y1 * k, height))
        raw = (left, top, left + w, top + h)
        pil = Image.fromarray(full)
        snapped_diffs.append(mean_abs_diff(out, np.asarray(pil.resize((112, 112), Image.BILINEAR, box=snapped))))
        raw_diffs.append(mean_abs_diff(out, np.asarray(pil.resize((112, 112), Image.BILINEAR, box=raw))))
    assert all(k in (2, 4) for k in reductions)
    assert float(np.mean(snapped_diffs)) < 2.0 and max(snapped_diffs) < 6.0
    assert float(np.mean(raw_diffs)) < 3.0


def test_fused_reduction_never_upscales_unless_allowed():
    fused = DecodeCropFlip(112)
    assert fused.reduction(223, 500) == 1
    assert fused.reduction(224, 224) == 2
    assert fused.reduction(500, 460) == 4
    assert fused.reduction(900, 900) == 8
    assert DecodeCropFlip(112, reduced_decode=False).reduction(900, 900) == 1
    assert DecodeCropFlip(112, max_upscale=1.5).reduction(149, 300) == 1  # 149 / 2 * 1.5 < 112
    assert DecodeCropFlip(112, max_upscale=1.5).reduction(150, 300) == 2


# -- composition, generator forwarding, versions --------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[object] = []

    def __call__(self, sample: dict, generator: torch.Generator | None = None) -> dict:
        self.seen.append(generator)
        return {**sample, "draw": torch.rand((), generator=generator).item()}


def _no_generator(sample: dict) -> dict:
    return {**sample, "plain": True}


def _kwargs_only(sample: dict, **kwargs) -> dict:
    assert not kwargs  # must not be handed the generator
    return {**sample, "kw": True}


def test_compose_forwards_the_generator_only_to_members_that_accept_it():
    recorder = _Recorder()
    g = gen(1)
    out = Compose([_no_generator, recorder, _kwargs_only, Lambda(lambda s: {**s, "lam": 1})])({"x": 0}, generator=g)
    assert recorder.seen == [g]
    assert out["plain"] and out["kw"] and out["lam"] == 1
    assert out["draw"] == torch.rand((), generator=gen(1)).item()
    lam = Lambda(lambda s, generator=None: {**s, "d": torch.rand((), generator=generator).item()})
    assert lam({}, generator=gen(2))["d"] == torch.rand((), generator=gen(2)).item()


def test_accepts_generator_reads_signatures():
    assert accepts_generator(_Recorder())
    assert accepts_generator(lambda s, *, generator: s)
    assert not accepts_generator(_no_generator)
    assert not accepts_generator(_kwargs_only)
    assert not accepts_generator(dict)
    assert accepts_generator(functools.partial(lambda s, k, generator=None: s, k=1))
    assert accepts_generator(RandomResizedCrop(8)) and not accepts_generator(CenterCrop(8))
    assert accepts_generator(Compose([]))


def test_versions_name_every_member_and_parameter_and_change_with_them():
    pipeline = Compose([DecodeImage(), RandomResizedCrop(112, scale=(0.2, 1.0)), RandomHorizontalFlip(0.3), ToTensor()])
    version = transform_version(pipeline)
    for part in ("DecodeImage", "RandomResizedCrop", "scale=(0.2, 1.0)", "p=0.3", "ToTensor", "#impl1"):
        assert part in version
    assert " at 0x" not in version
    same = Compose([DecodeImage(), RandomResizedCrop(112, scale=(0.2, 1.0)), RandomHorizontalFlip(0.3), ToTensor()])
    assert transform_version(same) == version
    changed = Compose([DecodeImage(), RandomResizedCrop(112, scale=(0.25, 1.0)), RandomHorizontalFlip(0.3), ToTensor()])
    assert transform_version(changed) != version
    assert transform_version(pickle.loads(pickle.dumps(pipeline))) == version
    assert transform_version(_no_generator) == f"{__name__}._no_generator"
    assert "version='v2'" in transform_version(Lambda(_no_generator, version="v2"))
    assert transform_version(Lambda(_no_generator, version="v2")) != transform_version(Lambda(_no_generator, version="v3"))
    assert "opencv=" in transform_version(pipeline, libraries=True)
    assert transform_version(DecodeCropFlip(112)) != transform_version(DecodeCropFlip(112, antialias=False))


def test_every_builtin_transform_describes_every_constructor_argument():
    """A parameter missing from `params()` would let a resume with another value pass the
    Loader's fingerprint check silently."""
    import inspect

    import shardloader.transforms as transforms

    builtins = [getattr(transforms, name) for name in transforms.__all__]
    builtins = [c for c in builtins if isinstance(c, type) and issubclass(c, Transform)
                and c not in (Transform, Compose, Lambda)]
    assert len(builtins) >= 8
    for cls in builtins:
        arguments = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
        required = {"size": 16, "mean": (0.5, 0.5, 0.5), "std": (0.2, 0.2, 0.2)}
        instance = cls(**{n: v for n, v in required.items() if n in arguments})
        # `unversioned`: arguments that change no output (a bound on the input: max_pixels)
        missing = set(arguments) - set(instance.params()) - set(getattr(cls, "unversioned", ()))
        assert not missing, f"{cls.__name__}.params() lacks {sorted(missing)}"
        assert instance.version.startswith(f"{cls.__name__}(") and "#impl" in instance.version


class _ReprTransform:
    """Like a torchvision transform: a callable object whose repr shows its parameters."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, sample):
        return sample

    def __repr__(self) -> str:
        return f"_ReprTransform(size={self.size})"


class _PlainCallable:
    def __call__(self, sample):
        return sample


def test_other_callables_are_described_by_name_and_their_own_repr():
    assert transform_version(_ReprTransform(64)) == f"{__name__}._ReprTransform = _ReprTransform(size=64)"
    assert transform_version(_ReprTransform(64)) != transform_version(_ReprTransform(48))
    assert transform_version(_PlainCallable()) == f"{__name__}._PlainCallable"  # no address
    assert transform_version(functools.partial(_no_generator)) == f"partial({__name__}._no_generator, )"


def test_pickled_pipeline_gives_identical_output(jpegs):
    pipeline = Compose([DecodeCropFlip(112), ToTensor(torch.float32), Normalize([0.5] * 3, [0.25] * 3)])
    clone = pickle.loads(pickle.dumps(pipeline))
    for i in range(5):
        assert torch.equal(pipeline(jpegs[i], generator=gen(i))["image"], clone(jpegs[i], generator=gen(i))["image"])


def test_opencv_runs_single_threaded_inside_transforms(jpegs):
    try:
        cv2.setNumThreads(4)
        set_opencv_threads(1)  # re-arm: the next transform call configures OpenCV again
        DecodeCropFlip(112)(jpegs[0], generator=gen(0))
        assert cv2.getNumThreads() == 1
        set_opencv_threads(None)
        cv2.setNumThreads(3)
        RandomResizedCrop(32)({"image": np.zeros((40, 40, 3), np.uint8)}, generator=gen(0))
        assert cv2.getNumThreads() == 3  # None leaves OpenCV alone
    finally:
        set_opencv_threads(1)
        cv2.setNumThreads(1)


def test_grayscale_pipeline_end_to_end(jpegs):
    pipeline = Compose([DecodeImage(mode="L"), RandomResizedCrop(48), RandomHorizontalFlip(), ToTensor(torch.float32)])
    out = pipeline(jpegs[0], generator=gen(0))["image"]
    assert out.shape == (1, 48, 48)
    fused = DecodeCropFlip(48, mode="L", reduced_decode=False)(jpegs[0], generator=gen(0))["image"]
    assert torch.equal(ToTensor(torch.float32)({"image": fused})["image"], out)


def test_uses_global_rng_is_false_only_when_every_member_draws_from_the_generator():
    assert not Compose([DecodeCropFlip(112), ToTensor()]).uses_global_rng
    assert not RandomResizedCrop(32).uses_global_rng
    assert Compose([DecodeImage(), _no_generator]).uses_global_rng  # a plain function may
    assert Compose([Lambda(_no_generator)]).uses_global_rng
    assert Compose([Compose([ToTensor()]), Compose([RandomHorizontalFlip(), _Recorder()])]).uses_global_rng


# -- the fast paths: one draw call, resizing into a batch, the antialias methods ----------------


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_one_draw_call_gives_the_crop_box_and_flip_of_two_calls(p):
    """`sample_crop_box_and_flip` must consume and use the generator's stream exactly as
    `sample_crop_box` followed by `draw_flip` do (every earlier version's bytes rest on it)."""
    from shardloader.transforms.geometry import draw_flip, sample_crop_box_and_flip

    sizes = [(128, 256), (256, 128), (17, 400), (3, 3), (224, 224), (1, 1)]
    for seed in range(3000):
        height, width = sizes[seed % len(sizes)]
        two = gen(seed)
        expected = (sample_crop_box(height, width, (0.08, 1.0), (3 / 4, 4 / 3), two), draw_flip(p, two))
        one = gen(seed)
        assert sample_crop_box_and_flip(height, width, (0.08, 1.0), (3 / 4, 4 / 3), p, one) == expected, seed
        assert torch.equal(one.get_state(), two.get_state())  # the stream is left in the same place


@pytest.mark.parametrize("method", ["k-area", "adaptive"])
@pytest.mark.parametrize("antialias", [True, False])
def test_resize_into_dst_writes_the_same_bytes(jpegs, method, antialias):
    image = decode_image(jpegs[3]["image"])
    dst = np.full((4, 112, 112, 3), 7, np.uint8)
    for i, (top, left, h, w) in enumerate([(0, 0, 112, 112), (5, 9, 60, 80), (0, 0, 150, 140),
                                           (3, 2, image.shape[0] - 3, image.shape[1] - 2)]):
        crop = image[top:top + h, left:left + w]
        out = resize_cv2(crop, 112, 112, antialias, method, dst=dst[i])
        assert out is dst[i] or np.shares_memory(out, dst)
        assert np.array_equal(dst[i], resize_cv2(crop, 112, 112, antialias, method)), (i, h, w)


@pytest.mark.parametrize("kwargs", [{}, {"antialias": False}, {"antialias_method": "k-area"},
                                    {"p": 1.0}, {"p": 0.0}, {"size": (40, 56)},
                                    {"scale": (0.9, 1.0), "max_upscale": 2.0}])
def test_fused_into_writes_what_call_returns(jpegs, kwargs):
    kwargs = {"size": 112, **kwargs}
    fused = DecodeCropFlip(**kwargs)
    shape = fused.batch_shape()
    assert shape == (*fused.size, 3)
    png = {"image": _png(decode_image(jpegs[0]["image"])), "__index__": 999}  # not a JPEG
    samples = [*jpegs[:40], png]
    batch = np.zeros((len(samples), *shape), np.uint8)
    scratch = np.empty(shape, np.uint8)
    for i, sample in enumerate(samples):
        fused.into(sample, batch[i], gen(i), scratch if i % 2 else None)
        assert np.array_equal(batch[i], fused(sample, generator=gen(i))["image"]), i
    assert DecodeCropFlip(32, mode="L").batch_shape() is None  # into() writes RGB only


def test_adaptive_antialias_is_closer_to_pil_than_k_area_and_a_new_version(jpegs):
    """'adaptive' resizes linearly up to a 1.25x downscale, where the k-area method's upscale
    to 2x and average blurs more than PIL does. On these samples: mean |diff| from PIL 0.54
    (adaptive) vs 0.58 (k-area), worst 2.7 both; measured on 2,000 samples 0.500 vs 0.513, with the resize
    51 us vs 62 us (benchmarks/decode.py)."""
    diffs: dict[str, list[float]] = {"adaptive": [], "k-area": []}
    pil = train_pipeline("pil")
    for method in diffs:
        fast = Compose([DecodeImage(), RandomResizedCrop(112, antialias_method=method), RandomHorizontalFlip()])
        for i, sample in enumerate(jpegs):
            diffs[method].append(mean_abs_diff(fast(sample, generator=gen(i))["image"],
                                               pil(sample, generator=gen(i))["image"]))
    assert np.mean(diffs["adaptive"]) < np.mean(diffs["k-area"])
    assert max(diffs["adaptive"]) < 4.0
    # Different pixels, so a different version; "k-area" keeps the version string it had
    # before antialias methods existed (states saved then still resume into it).
    old = ("DecodeCropFlip(size=(112, 112), scale=(0.08, 1.0), ratio=(0.75, 1.333333333333), "
           "p=0.5, field='image', out='image', mode='RGB', antialias=True, reduced_decode=True, "
           "fastdct=False, fastupsample=False, max_upscale=1.0)#impl1")
    assert DecodeCropFlip(112, antialias_method="k-area").version == old
    assert DecodeCropFlip(112).version == old.replace(
        "max_upscale=1.0)", "max_upscale=1.0, antialias_method='adaptive')")
    # Without antialiasing the method decides nothing, and the version does not name it.
    assert (DecodeCropFlip(112, antialias=False).version
            == DecodeCropFlip(112, antialias=False, antialias_method="k-area").version)
    assert "antialias_method" not in RandomResizedCrop(112, antialias_method="k-area").version
    assert "antialias_method='adaptive'" in RandomResizedCrop(112).version
    assert "antialias_method='adaptive'" in Resize(64).version
    with pytest.raises(ValueError, match="unknown antialias_method 'area'.*k-area, adaptive"):
        DecodeCropFlip(112, antialias_method="area")


@pytest.mark.parametrize("image", [
    np.arange(7 * 5 * 3, dtype=np.uint8).reshape(7, 5, 3),
    np.arange(6 * 4, dtype=np.uint8).reshape(6, 4),  # gray: one channel
    np.arange(3 * 2 * 4, dtype=np.uint8).reshape(3, 2, 4),  # RGBA
    np.arange(4 * 4 * 3, dtype=np.float32).reshape(4, 4, 3) / 7,
    np.arange(4 * 4 * 3, dtype=np.int64).reshape(4, 4, 3),  # a dtype OpenCV does not split
    np.arange(9 * 8 * 3, dtype=np.uint8).reshape(9, 8, 3)[1:8:2, ::3],  # strided
], ids=["rgb", "gray", "rgba", "float32", "int64", "strided"])
def test_to_tensor_and_the_planes_copy_are_the_permuted_copy_for_every_layout(image):
    """ToTensor, and `hwc_to_chw` (OpenCV's split, numpy's copy where OpenCV would not) that the
    fused batch path uses in its place, give torch's permuted contiguous copy byte for byte
    (ToTensor's own output is a view of them where no dtype changes; collate copies it)."""
    hwc = image[:, :, None] if image.ndim == 2 else image
    expected = torch.from_numpy(np.ascontiguousarray(hwc)).permute(2, 0, 1).contiguous()
    got = ToTensor(dtype=torch.uint8 if image.dtype == np.uint8 else torch.float32)({"image": image})["image"]
    if image.dtype != np.uint8:
        expected = expected.to(torch.float32)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.contiguous().numpy().tobytes() == expected.numpy().tobytes()
    batch = collate([{"image": got}, {"image": got}])["image"]  # the collate's copy of the view
    assert batch.numpy().tobytes() == expected.numpy().tobytes() * 2
    planes = np.empty((hwc.shape[2], hwc.shape[0], hwc.shape[1]), dtype=hwc.dtype)
    hwc_to_chw(np.ascontiguousarray(hwc), planes)
    assert planes.tobytes() == torch.from_numpy(np.ascontiguousarray(hwc)).permute(2, 0, 1).contiguous().numpy().tobytes()
