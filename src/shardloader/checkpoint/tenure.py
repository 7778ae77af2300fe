"""One open Checkpointer per checkpoint root in a process: a newer one takes over.

A notebook cell that makes `Checkpointer(root)`, run a second time, makes a second one on the
same root while the first, never closed, is still open. Two writers of one root delete each
other's checkpoints (retention keeps the newest `keep` of the root, whoever wrote them), and the
newer one's start-up cleanup removes the older one's staged files. Between processes the second
job is refused (`job.refuse_if_in_use`); within one process the newer object is the one the
user means to use, so it takes over:

- the older one stands down: it is closed (its save in flight finishes first), and every later
  `save()` or `load()` through it raises a CheckpointError that says a newer one took over;
- its retention is retired at once (`retired`, checked by the commit protocol before it deletes
  anything): a save of the older one still in flight commits but deletes nothing. That covers
  an older object that was garbage-collected without being closed, which cannot be reached any
  more but can still have a save in flight on its writer thread.

The registry holds the Checkpointers weakly (a dropped one is collected as before) and their
`retired` events strongly (a few bytes each, one per root used in the process).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from shardloader.checkpoint.storage import LocalStore, Store

_HOLDERS: dict[str, tuple[weakref.ref, threading.Event]] = {}
_GUARD = threading.Lock()


def root_key(store: Store) -> str:
    """One key per root however it is spelled: the real path of a local root, else its URL."""
    if isinstance(store, LocalStore):
        return os.path.realpath(store.root)
    return store.url


def take_over(store: Store, newcomer: Any, retired: threading.Event) -> None:
    """Make `newcomer` the one Checkpointer of `store`'s root in this process: retire the
    older one's retention (`retired` is the newcomer's own, for the next one) and make the older
    one stand down (`newcomer` calls it before its start-up cleanup touches the root)."""
    key = root_key(store)
    with _GUARD:
        older = _HOLDERS.get(key)
        _HOLDERS[key] = (weakref.ref(newcomer), retired)
    if older is None:
        return
    ref, older_retired = older
    older_retired.set()
    earlier = ref()
    if earlier is not None:
        earlier._stand_down()
