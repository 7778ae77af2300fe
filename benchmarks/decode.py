"""Samples/s per core for the standard image augmentation: decode a 128-256 px JPEG,
random-resized-crop to 112 px, random horizontal flip.

Compares, in one process on one thread (OpenCV and torch set to 1 thread):

* pil              PIL decode + PIL bilinear (antialiased) resize of the crop box + transpose
                   (what torchvision's PIL path does)
* cv2-linear       DecodeImage (simplejpeg) + RandomResizedCrop(antialias=False, INTER_LINEAR)
                   + RandomHorizontalFlip
* cv2-area         simplejpeg + crop + cv2.resize INTER_AREA when downscaling + flip
* cv2-antialias    DecodeImage + RandomResizedCrop(antialias=True) + RandomHorizontalFlip
                   (antialias_method="adaptive", the default)
* cv2-k-area       the same with antialias_method="k-area" (the method before "adaptive")
* fused            DecodeCropFlip (reduced DCT decode when the crop allows, antialias=True,
                   antialias_method="adaptive")
* fused-k-area     DecodeCropFlip(antialias_method="k-area")
* fused-linear     DecodeCropFlip(antialias=False)
* fused-fast       DecodeCropFlip(fastdct=True, fastupsample=True)
* fused-up1.5      DecodeCropFlip(max_upscale=1.5): reduced decode also when the reduced crop
                   must then be upscaled up to 1.5x (trades detail for decode time)
* fused-up2        DecodeCropFlip(max_upscale=2.0)

Every method draws the same crop box and flip for sample i (one generator seeded with i), so
outputs are comparable pixel by pixel: the table also gives the mean absolute difference from
the PIL output in levels of 255. Speed is samples per CPU-second of this process (time.process_time),
the median over repeats (methods interleaved per repeat), with the ratio to PIL.

    .venv/bin/python benchmarks/decode.py [--n 2000] [--repeats 5] [--json out.json]
    .venv/bin/python benchmarks/decode.py --min-size 384 --max-size 640 --n 500   # large images
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np
import simplejpeg
import torch
from PIL import Image

from shardloader.synthetic import make_image_samples
from shardloader.transforms import (
    Compose,
    DecodeCropFlip,
    DecodeImage,
    RandomHorizontalFlip,
    RandomResizedCrop,
    sample_crop_box,
)
from shardloader.transforms.geometry import draw_flip

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


def pil_method(size: int) -> Callable[[dict[str, Any], torch.Generator], np.ndarray]:
    def run(sample: dict[str, Any], g: torch.Generator) -> np.ndarray:
        with Image.open(io.BytesIO(sample["image"])) as img:
            img = img.convert("RGB")
            top, left, h, w = sample_crop_box(img.height, img.width, SCALE, RATIO, g)
            out = img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
        if draw_flip(0.5, g):
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(out)

    return run


def cv2_area_method(size: int) -> Callable[[dict[str, Any], torch.Generator], np.ndarray]:
    def run(sample: dict[str, Any], g: torch.Generator) -> np.ndarray:
        img = simplejpeg.decode_jpeg(sample["image"])
        top, left, h, w = sample_crop_box(img.shape[0], img.shape[1], SCALE, RATIO, g)
        crop = img[top : top + h, left : left + w]
        down = h > size and w > size
        out = cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA if down else cv2.INTER_LINEAR)
        if draw_flip(0.5, g):
            out = cv2.flip(out, 1)
        return out

    return run


def transform_method(transform: Callable[..., dict[str, Any]]) -> Callable[[dict[str, Any], torch.Generator], np.ndarray]:
    def run(sample: dict[str, Any], g: torch.Generator) -> np.ndarray:
        return transform(sample, generator=g)["image"]

    return run


def methods(size: int) -> dict[str, Callable[[dict[str, Any], torch.Generator], np.ndarray]]:
    def compose(antialias: bool, method: str = "adaptive") -> Compose:
        return Compose([
            DecodeImage(),
            RandomResizedCrop(size, SCALE, RATIO, antialias=antialias, antialias_method=method),
            RandomHorizontalFlip(0.5),
        ])

    return {
        "pil": pil_method(size),
        "cv2-linear": transform_method(compose(antialias=False)),
        "cv2-area": cv2_area_method(size),
        "cv2-antialias": transform_method(compose(antialias=True)),
        "cv2-k-area": transform_method(compose(antialias=True, method="k-area")),
        "fused": transform_method(DecodeCropFlip(size, SCALE, RATIO)),
        "fused-k-area": transform_method(DecodeCropFlip(size, SCALE, RATIO, antialias_method="k-area")),
        "fused-linear": transform_method(DecodeCropFlip(size, SCALE, RATIO, antialias=False)),
        "fused-fast": transform_method(
            DecodeCropFlip(size, SCALE, RATIO, fastdct=True, fastupsample=True)
        ),
        "fused-up1.5": transform_method(DecodeCropFlip(size, SCALE, RATIO, max_upscale=1.5)),
        "fused-up2": transform_method(DecodeCropFlip(size, SCALE, RATIO, max_upscale=2.0)),
    }


def time_method(fn: Callable[[dict[str, Any], torch.Generator], np.ndarray], samples: list[dict[str, Any]]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) to run `fn` over all samples."""
    g = torch.Generator()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i, sample in enumerate(samples):
        g.manual_seed(i)
        fn(sample, g)
    return time.process_time() - cpu0, time.perf_counter() - wall0


def fidelity(fn: Callable[[dict[str, Any], torch.Generator], np.ndarray], reference: list[np.ndarray], samples: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean, worst per-sample) mean absolute difference from the reference outputs."""
    g = torch.Generator()
    diffs = []
    for i, (sample, ref) in enumerate(zip(samples, reference, strict=True)):
        g.manual_seed(i)
        out = fn(sample, g)
        diffs.append(float(np.abs(out.astype(np.int16) - ref.astype(np.int16)).mean()))
    return float(np.mean(diffs)), float(np.max(diffs))


def run(
    n: int = 2000,
    repeats: int = 5,
    size: int = 112,
    seed: int = 0,
    only: list[str] | None = None,
    min_size: int = 128,
    max_size: int = 256,
) -> dict[str, Any]:
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    cpu0 = time.process_time()
    samples = list(make_image_samples(n, min_size=min_size, max_size=max_size, seed=seed))
    generate_cpu_s = time.process_time() - cpu0
    table = methods(size)
    if only:
        unknown = set(only) - set(table)
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(table)}")
        table = {name: fn for name, fn in table.items() if name == "pil" or name in only}

    pil = table["pil"]
    g = torch.Generator()
    reference = []
    for i, sample in enumerate(samples):
        g.manual_seed(i)
        reference.append(pil(sample, g))

    for fn in table.values():  # warm up (imports, OpenCV init, caches)
        time_method(fn, samples[:100])
    cpu: dict[str, list[float]] = {name: [] for name in table}
    wall: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(repeats):
        for name, fn in table.items():
            c, w = time_method(fn, samples)
            cpu[name].append(c)
            wall[name].append(w)

    fused = DecodeCropFlip(size, SCALE, RATIO)
    g = torch.Generator()
    reduced = 0
    for i in range(n):
        g.manual_seed(i)
        h, w = simplejpeg.decode_jpeg_header(samples[i]["image"])[:2]
        box = sample_crop_box(h, w, SCALE, RATIO, g)
        reduced += fused.reduction(box[2], box[3]) > 1

    results: dict[str, Any] = {
        "n": n, "repeats": repeats, "size": size, "reduced_decode_fraction": reduced / n,
        "min_size": min_size, "max_size": max_size,
        "synthetic_images_per_cpu_s": n / generate_cpu_s,
        "mean_jpeg_bytes": float(np.mean([len(s["image"]) for s in samples])),
        "methods": {},
    }
    pil_rate = n / statistics.median(cpu["pil"])
    for name, fn in table.items():
        rate = n / statistics.median(cpu[name])
        mean_diff, worst_diff = fidelity(fn, reference, samples) if name != "pil" else (0.0, 0.0)
        results["methods"][name] = {
            "samples_per_cpu_s": rate,
            "samples_per_wall_s": n / statistics.median(wall[name]),
            "ratio_to_pil": rate / pil_rate,
            "cpu_s_repeats": cpu[name],
            "mean_abs_diff_vs_pil": mean_diff,
            "worst_sample_mean_abs_diff_vs_pil": worst_diff,
        }
    return results


def print_table(results: dict[str, Any]) -> None:
    print(
        f"decode + RandomResizedCrop({results['size']}) + flip, {results['n']} synthetic JPEGs "
        f"({results['min_size']}-{results['max_size']} px, q90, 4:2:0), median of "
        f"{results['repeats']} repeats, 1 thread"
    )
    print(f"{'method':15s} {'samples/s/core':>15s} {'x PIL':>7s} {'wall/s':>9s} {'|diff| vs PIL':>14s} {'worst':>7s}")
    for name, m in results["methods"].items():
        print(
            f"{name:15s} {m['samples_per_cpu_s']:15.0f} {m['ratio_to_pil']:7.2f} "
            f"{m['samples_per_wall_s']:9.0f} {m['mean_abs_diff_vs_pil']:14.3f} "
            f"{m['worst_sample_mean_abs_diff_vs_pil']:7.3f}"
        )
    print(f"fused: reduced (DCT-scaled) decode used for {results['reduced_decode_fraction']:.1%} of samples")
    print(
        f"synthetic generation: {results['synthetic_images_per_cpu_s']:.0f} images/s per core "
        f"(mean JPEG {results['mean_jpeg_bytes'] / 1024:.1f} KiB)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=112, help="output side of the crop")
    parser.add_argument("--min-size", type=int, default=128, help="smallest image side")
    parser.add_argument("--max-size", type=int, default=256, help="largest image side")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--methods", help="comma-separated subset of methods (pil is always run)")
    args = parser.parse_args(argv)
    only = args.methods.split(",") if args.methods else None
    results = run(
        args.n, args.repeats, args.size, only=only, min_size=args.min_size, max_size=args.max_size
    )
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
