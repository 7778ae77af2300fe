"""The map-style view over an indexed, sharded dataset: `shardloader.Dataset` (`sharded.py`)."""
