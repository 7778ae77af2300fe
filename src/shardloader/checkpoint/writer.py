"""Background writing of one staged part: pool bytes to local staging files, hashed, fsynced.

A part is one rank's tensors (a tensor file in the safetensors layout) plus its JSON skeleton.
The writer thread streams the pool's bytes into the staging file and hashes them from the same
memory, so checksums cost no second read. When a state is larger than the pool, the saving
thread and the writer take turns through a `RoundHandoff`: the saver fills the pool with round
k, the writer drains it, the saver fills round k+1.

Why a thread and not a process: the writer spends its time in `write()`, `fsync()` and xxh3,
all of which release the GIL, and it writes and hashes a whole round with one call each (the pool
holds a round exactly as the file does), so it needs the GIL a handful of times per save.
`benchmarks/checkpoint_writer.py` measures the training time a writer takes away per GiB written:
a separate process reading the pool from shared memory cost 30-40% more than this thread on the
2-core test machine (figures in docs/checkpoint.md), and would need the pool in shared memory and
its own error channel and crash cleanup.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from shardloader.checkpoint.manifest import FileEntry
from shardloader.checkpoint.staging import Round, StagingPool
from shardloader.checkpoint.tensorfile import TensorMeta
from shardloader.io.checksum import DEFAULT_ALGORITHM, format_checksum, new_hasher
from shardloader.io.files import fsync_dir


@dataclass
class StagedPart:
    """What a save hands to the writer for one rank's own files."""

    base: str  # file name stem: "<base>.safetensors" and "<base>.json"
    metas: list[TensorMeta]
    rounds: list[Round]
    header: bytes
    skeleton: bytes

    @property
    def names(self) -> list[str]:
        return [f"{self.base}.safetensors", f"{self.base}.json"]


class RoundHandoff:
    """Turn-taking over the pool between the saving thread and the writer (streaming saves)."""

    def __init__(self, n_rounds: int) -> None:
        self.n_rounds = n_rounds
        self._cond = threading.Condition()
        self._ready = 1  # rounds staged in the pool so far (round 0 before the job starts)
        self._drained = 0  # rounds the writer has written out of the pool
        self._failed = False

    # saver side
    def wait_drained(self, k: int) -> bool:
        """Block until round k has been written out; False when the writer failed instead."""
        with self._cond:
            self._cond.wait_for(lambda: self._drained > k or self._failed)
            return not self._failed

    def staged(self) -> None:
        with self._cond:
            self._ready += 1
            self._cond.notify_all()

    def abort(self) -> None:
        """The saver failed mid-stream: make the writer stop waiting."""
        self.fail()

    # writer side
    def wait_staged(self, k: int) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._ready > k or self._failed)
            return not self._failed

    def drained(self) -> None:
        with self._cond:
            self._drained += 1
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


class StreamAborted(RuntimeError):
    """The saving thread stopped staging rounds (it raised); the partial part is discarded."""


def write_part(
    directory: str, part: StagedPart, pool: StagingPool, handoff: RoundHandoff
) -> dict[str, FileEntry]:
    """Write `part` into the local `directory` from the pool; return its files' entries.

    Files are created exclusively (never overwritten), fsynced, and the directory is fsynced.
    """
    tensor_name, json_name = part.names
    entries = {}
    path = os.path.join(directory, tensor_name)
    hasher = new_hasher(DEFAULT_ALGORITHM)
    size = 0
    try:
        with open(path, "xb", buffering=0) as f:
            size += _write_all(f, memoryview(part.header), hasher)
            for k, round_ in enumerate(part.rounds):
                if not handoff.wait_staged(k):
                    raise StreamAborted(f"staging stopped before round {k} of {path}")
                if round_.nbytes:
                    size += _write_all(f, pool.view(round_), hasher)
                handoff.drained()
            os.fsync(f.fileno())
    except BaseException:
        handoff.fail()
        raise
    entries[tensor_name] = FileEntry(size, format_checksum(DEFAULT_ALGORITHM, hasher.hexdigest()))
    path = os.path.join(directory, json_name)
    hasher = new_hasher(DEFAULT_ALGORITHM)
    with open(path, "xb", buffering=0) as f:
        size = _write_all(f, memoryview(part.skeleton), hasher)
        os.fsync(f.fileno())
    entries[json_name] = FileEntry(size, format_checksum(DEFAULT_ALGORITHM, hasher.hexdigest()))
    fsync_dir(directory)
    return entries


def _write_all(f, view: memoryview, hasher) -> int:
    """Write every byte of `view` (unbuffered writes may be short) and hash it."""
    hasher.update(view)
    done = 0
    n = len(view)
    while done < n:
        done += f.write(view[done:])
    return n
