"""The resumable Loader and its parts (batch production, worker pools, state)."""

import shardloader.loader.iterable  # noqa: F401 - registers the Loader of iterable datasets
from shardloader.loader.loader import Loader

__all__ = ["Loader"]
