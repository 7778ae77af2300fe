"""shardloader: sharded, cached, prefetched and exactly resumable data loading for PyTorch."""

from shardloader._version import __version__
from shardloader.dataset import Dataset
from shardloader.format.writer import write_shards
from shardloader.loader import Loader

__all__ = ["Dataset", "Loader", "__version__", "write_shards"]
