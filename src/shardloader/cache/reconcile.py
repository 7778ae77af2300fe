"""Making the ledger agree with the files of a cache directory.

The files under `data/` are the truth and the ledger is bookkeeping (see `ledger.py`); a process
killed between a rename and its bookkeeping, or in the middle of a download, leaves the two
apart. `reconcile` runs once per process, when the store opens its ledger. It is safe while
other processes use the cache: it takes the same kernel-held locks as readers and downloaders,
and skips downloads in progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from shardloader.cache.layout import COMPANION_SUFFIXES, CacheLayout, temp_owner
from shardloader.cache.ledger import Ledger, LedgerEntry
from shardloader.cache.locks import close_fd, exclusive, held_elsewhere, open_fd
from shardloader.cache.shard_files import remove_temps


def reconcile(layout: CacheLayout, ledger: Ledger) -> None:
    """Make `ledger` agree with the files of the cache at `layout`: add shards it lacks (a
    process killed between rename and bookkeeping), drop entries whose file is gone, remove
    companion files whose shard is gone, and remove temp files whose downloader is dead."""
    with exclusive(layout.bookkeeping_lock):
        present: dict[str, os.stat_result] = {}
        for name, path in layout.data_files():
            with contextlib.suppress(FileNotFoundError):
                present[name] = os.stat(path)
        known = ledger.entries()
        for name in known:
            if name not in present:
                ledger.forget(name)
        added = 0
        for name, st in present.items():
            if name not in known:
                size = st.st_size
                for suffix in COMPANION_SUFFIXES:
                    with contextlib.suppress(FileNotFoundError):
                        size += os.stat(layout.path_of(name) + suffix).st_size
                ledger.commit(name, LedgerEntry(size, st.st_mtime))
                added += size
        if added:
            ledger.note_usage(sum(e.bytes for e in ledger.entries().values()))
        for name, path in layout.companion_files():
            if not os.path.exists(layout.path_of(name)) and not held_elsewhere(layout.lock_of(name)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    for entry in os.listdir(layout.tmp_dir):
        name = temp_owner(entry)
        if name is None:
            continue
        try:
            fd = open_fd(layout.lock_of(name), os.O_RDWR | os.O_CREAT)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            remove_temps(layout, name)
        except BlockingIOError:
            pass  # being downloaded right now
        finally:
            close_fd(fd)
