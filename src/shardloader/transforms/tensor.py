"""From numpy images to normalised torch tensors."""

from __future__ import annotations

from collections.abc import Sequence
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


def hwc_to_chw(hwc: np.ndarray, chw: np.ndarray) -> None:
    """Copy the C-contiguous HWC image `hwc` into the C-contiguous CHW array `chw` (same dtype):
    OpenCV's split into its planes, numpy's transposing copy where OpenCV would not write in
    place (one channel, a dtype OpenCV lacks). The fused batch path writes each image's planes
    into the batch with it: 5.6 us against 14 for numpy's copy (112x112x3 uint8, warm rows)."""
    planes = list(chw)
    try:
        split = opencv().split(hwc, planes) if hwc.ndim == 3 and hwc.shape[2] > 1 else ()
    except Exception:  # noqa: BLE001 - a dtype or layout OpenCV does not take: numpy copies it
        split = ()
    if len(split) != len(planes) or not all(out is plane for out, plane in zip(split, planes)):
        np.copyto(chw, hwc.transpose(2, 0, 1))


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`np.copyto(dst, src)` for a C-contiguous `dst`, with a fast path for the layout that
    `ToTensor` (and `torch.from_numpy(hwc).permute(2, 0, 1)` in users' code) returns: a CHW
    view of a C-contiguous HWC image, whose transposing copy goes through OpenCV's split
    (`hwc_to_chw`: ~4 us against numpy's ~13 for 112x112x3 uint8, measured in a worker's loop).
    Any other layout is numpy's copy. The bytes are the same either way."""
    if src.ndim == 3 and src.shape[0] > 1:
        channels, height, width = src.shape
        item = src.itemsize
        if src.strides == (item, width * channels * item, channels * item):
            hwc_to_chw(src.transpose(1, 2, 0), dst)
            return
    np.copyto(dst, src)


def chw_view(image: np.ndarray) -> torch.Tensor:
    """The CHW tensor of the HWC numpy `image`: a view of its memory (no copy) where `image` is
    C-contiguous and writable, else of a C-contiguous copy of it. Not contiguous itself (its
    strides are the HWC buffer's, as torchvision's `PILToTensor` returns); a collate that
    stacks it copies each image once, through `copy_into`."""
    if not (image.flags.c_contiguous and image.flags.writeable):
        image = np.array(image, order="C", copy=True)
    return torch.from_numpy(image.transpose(2, 0, 1))  # one torch call: half the time of a permute


class ToTensor(Transform):
    """HWC numpy image -> CHW tensor.

    `dtype=torch.uint8` (the default) keeps the bytes (4x smaller to move between processes;
    convert and normalise on the accelerator); a floating `dtype` scales to [0, 1] like
    torchvision's ToTensor, into a contiguous tensor. A tensor input is only converted to
    `dtype`.

    Where no dtype changes (a uint8 image to uint8, the default), the tensor of a numpy image
    is a CHW *view* of the HWC pixels (`chw_view`, as torchvision's `PILToTensor`), not a
    contiguous copy: the batch's collate copies each image
    once anyway, and a per-sample copy here cost ~25 us a sample in a worker (issue 24: a
    user's function around DecodeCropFlip and ToTensor ran at 0.85 of the fused path). Code
    that needs a contiguous sample calls `.contiguous()`; `.view()` on it asks for that, and
    `.reshape()` works either way. docs/migration.md lists this.
    """

    def __init__(self, dtype: torch.dtype = torch.uint8, field: str = "image") -> None:
        if dtype != torch.uint8 and not dtype.is_floating_point:
            raise ValueError(f"ToTensor: dtype must be torch.uint8 or a float type, got {dtype}")
        self.dtype, self.field = dtype, field

    def __call__(self, sample: Sample) -> Sample:
        image = get_field(sample, self.field, "ToTensor")
        if isinstance(image, np.ndarray):
            if image.ndim == 2:
                image = image[:, :, None]
            if image.ndim != 3:
                raise TransformError(
                    f"ToTensor: field {self.field!r} must be an HWC image, got shape {image.shape}"
                )
            tensor = chw_view(image)
        elif isinstance(image, torch.Tensor):
            tensor = image
        else:
            raise TransformError(
                f"ToTensor: field {self.field!r} must be a numpy image or a tensor, got "
                f"{type(image).__name__}"
            )
        if tensor.dtype != self.dtype:
            if self.dtype.is_floating_point and tensor.dtype == torch.uint8:
                tensor = tensor.to(self.dtype, memory_format=torch.contiguous_format).div_(255.0)
            else:
                tensor = tensor.to(self.dtype, memory_format=torch.contiguous_format)
        return with_field(sample, self.field, tensor)

    def params(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype), "field": self.field}


class Normalize(Transform):
    """`(x - mean) / std` per channel of a float CHW tensor."""

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], field: str = "image", inplace: bool = False
    ) -> None:
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"Normalize: mean and std need the same non-zero length, got {mean!r}, {std!r}")
        if any(s == 0 for s in self.std):
            raise ValueError(f"Normalize: std must not contain 0, got {std!r}")
        self.field, self.inplace = field, inplace

    def __call__(self, sample: Sample) -> Sample:
        x = get_field(sample, self.field, "Normalize")
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TransformError(
                f"Normalize: field {self.field!r} must be a float tensor, got {what} (put "
                f"ToTensor(dtype=torch.float32) before Normalize)"
            )
        if x.ndim < 3 or x.shape[-3] != len(self.mean):
            raise TransformError(
                f"Normalize: field {self.field!r} has shape {tuple(x.shape)}; expected (..., "
                f"{len(self.mean)}, H, W) for {len(self.mean)} channel means"
            )
        mean = torch.tensor(self.mean, dtype=x.dtype).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype).view(-1, 1, 1)
        out = x.sub_(mean).div_(std) if self.inplace else (x - mean) / std
        return with_field(sample, self.field, out)

    def params(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "field": self.field, "inplace": self.inplace}
