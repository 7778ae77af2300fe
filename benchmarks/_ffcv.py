"""FFCV for the peers benchmark: the image set as a .beton file and an FFCV Loader doing the
same work (RandomResizedCrop to `size`, horizontal flip, batches of uint8 HWC images and ids).

FFCV's writer takes decoded images and encodes them itself (OpenCV, JPEG quality 90, as our
generator uses), so the stored bytes are not ours but the images, sizes and quality are.
Imported only where FFCV is installed.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks._images import ImageSet, _build


class _Decoded:
    """An indexable of (HWC uint8 RGB image, id) for FFCV's DatasetWriter."""

    def __init__(self, images: ImageSet) -> None:
        self.images = images

    def __len__(self) -> int:
        return self.images.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import simplejpeg

        return simplejpeg.decode_jpeg(self.images.read_jpeg(i)), i


def prepare_beton(images: ImageSet, log: Any = print) -> str:
    path = images.layout_dir("ffcv")

    def make(tmp: str) -> None:
        from ffcv.fields import IntField, RGBImageField
        from ffcv.writer import DatasetWriter

        writer = DatasetWriter(os.path.join(tmp, "data.beton"), {
            "image": RGBImageField(write_mode="jpg", jpeg_quality=90),
            "id": IntField(),
        }, num_workers=os.cpu_count() or 1)
        writer.from_indexed_dataset(_Decoded(images))

    _build(path, make, "FFCV .beton", log)
    return os.path.join(path, "data.beton")


def ffcv_loader(path: str, batch_size: int, num_workers: int, seed: int, size: int) -> Any:
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor

    return Loader(
        path, batch_size=batch_size, num_workers=num_workers,
        order=OrderOption.RANDOM, seed=seed, drop_last=False, os_cache=True,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((size, size)), RandomHorizontalFlip(),
                      ToTensor()],
            "id": [IntDecoder(), ToTensor()],
        },
    )
