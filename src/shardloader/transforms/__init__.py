"""Image transforms for training without torchvision.

A transform is `transform(sample: dict) -> dict`; one that accepts a `generator` keyword gets
the sample's `torch.Generator` and draws all its randomness from it (see `base`). Images travel
as HWC uint8 numpy arrays until `ToTensor`. See docs/transforms.md.
"""

from shardloader.transforms.base import (
    Compose,
    Lambda,
    Transform,
    TransformError,
    accepts_generator,
    describe_sample,
    library_versions,
    set_opencv_threads,
    transform_version,
)
from shardloader.transforms.decode import DecodeImage, ImageDecodeError, decode_image, is_jpeg
from shardloader.transforms.fused import DecodeCropFlip
from shardloader.transforms.geometry import (
    CenterCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    resize_cv2,
    resized_crop,
    sample_crop_box,
)
from shardloader.transforms.tensor import Normalize, ToTensor

__all__ = [
    "CenterCrop",
    "Compose",
    "DecodeCropFlip",
    "DecodeImage",
    "ImageDecodeError",
    "Lambda",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToTensor",
    "Transform",
    "TransformError",
    "accepts_generator",
    "decode_image",
    "describe_sample",
    "is_jpeg",
    "library_versions",
    "resize_cv2",
    "resized_crop",
    "sample_crop_box",
    "set_opencv_threads",
    "transform_version",
]
