"""The resumable Loader and its parts (batch production, worker pools, state)."""

from shardloader.loader.loader import Loader

__all__ = ["Loader"]
