"""The synthetic image dataset: deterministic bytes per (seed, index), real JPEGs of varied
sizes, balanced labels, and classes that differ both in colour and in pattern."""

from __future__ import annotations

import io
import os

import cv2
import numpy as np
import pytest
import simplejpeg
from PIL import Image

from shardloader.synthetic import (
    FAMILIES,
    class_name,
    make_image,
    make_image_samples,
    write_image_folder,
)


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    return list(make_image_samples(500, seed=4))


def test_same_seed_gives_the_same_bytes_and_other_seeds_do_not(samples):
    again = list(make_image_samples(40, seed=4))
    assert [s["image"] for s in again] == [s["image"] for s in samples[:40]]
    other = list(make_image_samples(40, seed=5))
    assert all(a["image"] != b["image"] for a, b in zip(again, other, strict=True))


def test_any_slice_of_the_stream_can_be_made_alone(samples):
    part = list(make_image_samples(7, seed=4, start=93))
    assert [s["image"] for s in part] == [s["image"] for s in samples[93:100]]
    assert [s["label"] for s in part] == [s["label"] for s in samples[93:100]]


def test_samples_are_valid_jpegs_of_varied_sizes_within_bounds(samples):
    shapes = []
    for s in samples[:200]:
        assert set(s) == {"image", "label", "class"}
        height, width, colorspace, subsampling = simplejpeg.decode_jpeg_header(s["image"])
        assert 128 <= height <= 256 and 128 <= width <= 256
        assert (colorspace, subsampling) == ("YCbCr", "420")
        shapes.append((height, width))
    with Image.open(io.BytesIO(samples[0]["image"])) as img:
        assert img.format == "JPEG" and img.size == shapes[0][::-1]
    assert sum(h != w for h, w in shapes) > 150
    assert len(set(shapes)) > 150
    small = next(make_image_samples(1, min_size=32, max_size=40, quality=50))
    assert 32 <= simplejpeg.decode_jpeg_header(small["image"])[0] <= 40


def test_labels_are_balanced_and_class_names_sort_like_labels(samples):
    labels = [s["label"] for s in samples]
    assert labels == [i % 10 for i in range(len(samples))]
    assert all(s["class"] == class_name(s["label"]) for s in samples)
    names = [class_name(label, 10) for label in range(10)]
    assert sorted(names) == names and len(set(names)) == 10
    many = [class_name(label, 1000) for label in range(1000)]
    assert sorted(many) == many and len(set(many)) == 1000
    assert class_name(13, 20).endswith(FAMILIES[3])


def _train_test_accuracy(features: np.ndarray, labels: np.ndarray, n_train: int) -> float:
    """Nearest class mean, fit on the first n_train samples, scored on the rest."""
    train_x, train_y = features[:n_train], labels[:n_train]
    mu, sigma = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mu) / sigma, (features[n_train:] - mu) / sigma
    means = np.stack([train_x[train_y == c].mean(0) for c in range(10)])
    pred = np.argmin(((test_x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    return float((pred == labels[n_train:]).mean())


def test_class_mean_images_separate_the_classes(samples):
    """Measured: 0.80 nearest-class-mean accuracy on 16x16 thumbnails (chance 0.10)."""
    thumbs = np.stack([
        cv2.resize(simplejpeg.decode_jpeg(s["image"]), (16, 16), interpolation=cv2.INTER_AREA)
        .astype(np.float32).ravel()
        for s in samples
    ])
    labels = np.array([s["label"] for s in samples])
    means = np.stack([thumbs[labels == c].mean(0) for c in range(10)])
    distances = np.linalg.norm(means[:, None] - means[None], axis=-1)
    assert distances[~np.eye(10, dtype=bool)].min() > 100  # every pair of class means differs
    assert _train_test_accuracy(thumbs, labels, 350) >= 0.65


def _texture_features(jpeg: bytes) -> np.ndarray:
    gray = simplejpeg.decode_jpeg(jpeg, colorspace="GRAY")[:, :, 0].astype(np.float32)
    gray = cv2.resize(gray, (128, 128), interpolation=cv2.INTER_AREA)
    gx, gy = cv2.Sobel(gray, cv2.CV_32F, 1, 0), cv2.Sobel(gray, cv2.CV_32F, 0, 1)
    magnitude = np.sqrt(gx * gx + gy * gy)
    angle = np.arctan2(gy, gx) % np.pi
    bins = np.clip((angle / np.pi * 8).astype(int), 0, 7).ravel()
    orientations = np.bincount(bins, weights=magnitude.ravel(), minlength=8)
    orientations = np.sort(orientations / (orientations.sum() + 1e-6))  # rotation-invariant
    spectrum = np.abs(np.fft.rfft2(gray - gray.mean()))
    radius = np.hypot(np.fft.rfftfreq(128)[None, :], np.fft.fftfreq(128)[:, None])
    edges = np.linspace(0, 0.5, 9)
    radial = np.array([spectrum[(radius >= a) & (radius < b)].sum() for a, b in zip(edges[:-1], edges[1:], strict=True)])
    radial /= radial.sum() + 1e-6
    return np.concatenate([orientations, radial, [(magnitude > magnitude.mean()).mean()]])


def test_patterns_alone_separate_the_classes_without_colour(samples):
    """Grey-level texture statistics (orientation histogram, frequency profile), no colour:
    measured 0.60 nearest-class-mean accuracy (chance 0.10)."""
    features = np.stack([_texture_features(s["image"]) for s in samples])
    labels = np.array([s["label"] for s in samples])
    assert _train_test_accuracy(features, labels, 350) >= 0.4


def test_make_image_is_the_image_that_gets_encoded():
    image, label = make_image(12, seed=9, min_size=64, max_size=80)
    sample = next(make_image_samples(1, seed=9, min_size=64, max_size=80, start=12, quality=100))
    assert label == 12 % 10 == sample["label"]
    assert simplejpeg.decode_jpeg(sample["image"]).shape == image.shape
    # Luma is stored at full resolution (chroma is subsampled 2x2), so at quality 100 the
    # decoded luma is the drawn image's luma up to rounding.
    luma = simplejpeg.decode_jpeg(sample["image"], colorspace="GRAY")[:, :, 0].astype(int)
    drawn = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(int)
    assert np.abs(luma - drawn).mean() < 2


def test_more_classes_than_pattern_families_stay_distinct():
    a = [make_image(i, num_classes=20, seed=1)[0] for i in (3, 13)]  # same family, other hue
    assert [make_image(i, num_classes=20, seed=1)[1] for i in (3, 13)] == [3, 13]
    hue = [cv2.cvtColor(img, cv2.COLOR_RGB2HSV)[..., 0] for img in a]
    saturated = [cv2.cvtColor(img, cv2.COLOR_RGB2HSV)[..., 1] > 120 for img in a]
    assert abs(float(np.median(hue[0][saturated[0]])) - float(np.median(hue[1][saturated[1]]))) > 40


def test_write_image_folder_writes_class_directories_in_sample_order(tmp_path):
    written = write_image_folder(tmp_path, 25, seed=2)
    expected = list(make_image_samples(25, seed=2))
    assert sorted(os.listdir(tmp_path)) == [class_name(c) for c in range(10)]
    for i, ((path, label), sample) in enumerate(zip(written, expected, strict=True)):
        assert path == os.path.join(tmp_path, sample["class"], f"{i:06d}.jpg")
        assert label == sample["label"]
        with open(path, "rb") as f:
            assert f.read() == sample["image"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": -1}, "n must be"),
        ({"n": 1, "num_classes": 0}, "num_classes"),
        ({"n": 1, "min_size": 300, "max_size": 200}, "min_size"),
        ({"n": 1, "quality": 0}, "quality"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        list(make_image_samples(**kwargs))
