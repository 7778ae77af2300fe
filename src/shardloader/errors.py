"""The exceptions shardloader raises. Every message names the file, shard or field at fault."""


class ShardloaderError(Exception):
    """Base class for every error shardloader raises on purpose."""


class DatasetIndexError(ShardloaderError):
    """`index.json` is missing, malformed, of an unknown version, or inconsistent."""


class ShardError(ShardloaderError):
    """A shard is missing, truncated, corrupt, or does not match its index entry."""


class ShardChangedError(ShardError):
    """A shard file changed (replaced, truncated, rewritten) after it was verified or opened."""


class ChecksumMismatch(ShardError):
    """A shard's bytes do not hash to the checksum recorded in the index."""


class UnsafePathError(ShardloaderError):
    """A path taken from an index or a tar member would escape its root."""


class SchemaError(ShardloaderError):
    """Samples or shards disagree on the fields and types of the schema."""


class StateError(ShardloaderError):
    """A saved state does not fit the object it is loaded into (fingerprint or shape differs)."""


class FetchError(ShardloaderError):
    """A remote object could not be fetched (permanent error, or retries exhausted)."""


class CacheFullError(ShardloaderError):
    """The cache limit is smaller than what must be resident at once."""


class CacheDiskError(ShardloaderError):
    """The node cache's directory cannot be written: its filesystem is read-only or full, or
    this user may not write there. The message names the directory, what was being written and
    the filesystem's free space."""


class WorkerError(ShardloaderError, RuntimeError):
    """A worker process died, timed out (`timeout=`) or raised while producing a batch: a
    RuntimeError, as DataLoader's errors for the same events are."""


class CheckpointError(ShardloaderError):
    """A checkpoint could not be written, or does not verify."""



class DatasetChangedError(ShardloaderError, RuntimeError):
    """A dataset's length changed under a Loader made for another length."""
