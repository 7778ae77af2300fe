"""The Loader's state: a small plain dict, and its validation on load (invariants I4, I5).

    {"format": "shardloader-loader-state", "version": 1,
     "epoch": 3, "position": 4096,              # global positions consumed in the epoch
     "fingerprint": {"index": "...", "seed": 0, "shuffle": true, "partitions": 8,
                     "window": 2, "order": 2, "global_batch_size": 64, "tail": "pad",
                     "transform_version": null}}

`order` is the version of the order algorithm (`shardloader.order.ORDER_VERSION`). States
saved before it existed carry none and are order version 1. A state of another order version
is refused like any other fingerprint difference: its position would name different samples.

`position` counts only batches the caller received (batches, for a `batch_sampler=`).
Resuming is O(1): the order of any position is computable directly, so loading replays nothing.

Optional keys (issue 38; states without them load as before):

    "sampler": {...}    # a sampler's own state: a stateful sampler's state_dict() as of the
                        # last delivered batch, or a PureSampler's order_state(epoch, position)
    "dataset": {...}    # the dataset's state_dict() (a map-style dataset with a state), as the
                        # process that made the last delivered batch left it

    "length": 10        # a map-style dataset's length in the saved epoch (its len(dataset) when
                        # the epoch started; the dataset may have grown since)

and the fingerprint's `sampler`: the order's identity (a PureSampler's `fingerprint`, another
sampler's class and len(); None, implied when absent, for the Loader's own order).

A Loader of an iterable dataset (`shardloader.loader.iterable`) saves the same fields (its
`position` is the batches delivered in the epoch) and an `iterable` section, per worker as
torchdata's StatefulDataLoader keeps it (`validate_iterable`)::

    "iterable": {"num_workers": 2, "next_worker": 1,   # whose turn the next batch is
                 "workers": [{"batches": 4, "ended": false, "state": {...}},   # worker 0
                             {"batches": 3, "ended": false, "state": {...}}]}  # worker 1

`state` is the worker's dataset's own `state_dict()` after its last delivered batch, or None
for a dataset without state (it then resumes by fast-forward: `batches` are re-read).
"""

from __future__ import annotations

from typing import Any

from shardloader.errors import StateError

STATE_FORMAT = "shardloader-loader-state"
STATE_VERSION = 1
FINGERPRINT_FIELDS = (
    "index", "seed", "shuffle", "partitions", "window", "order", "global_batch_size", "tail",
    "transform_version", "sampler",
)
# Fields a valid state may lack, and the value such a state means (saved by an older release).
_IMPLIED = {"order": 1, "sampler": None}
#: Optional top-level keys, each a dict when present (see the module doc).
OPTIONAL_STATES = ("sampler", "dataset")


def make_state(epoch: int, position: int, fingerprint: dict[str, Any],
               **optional: Any) -> dict[str, Any]:
    """The state dict; `optional`: the OPTIONAL_STATES that are not None."""
    state = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "position": int(position),
        "fingerprint": dict(fingerprint),
    }
    state.update({key: value for key, value in optional.items() if value is not None})
    return state


def validate_state(state: Any) -> dict[str, Any]:
    """Check the shape and types of a loader state; return it. Raises StateError."""
    if not isinstance(state, dict):
        raise StateError(f"loader state must be a dict, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise StateError(f"not a shardloader loader state (format={state.get('format')!r})")
    if state.get("version") != STATE_VERSION:
        raise StateError(f"loader state version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
    for key in ("epoch", "position"):
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StateError(f"loader state field {key!r} must be a non-negative integer, got {value!r}")
    fingerprint = state.get("fingerprint")
    if not isinstance(fingerprint, dict):
        raise StateError("loader state field 'fingerprint' must be a dict")
    missing = [f for f in FINGERPRINT_FIELDS if f not in fingerprint and f not in _IMPLIED]
    if missing:
        raise StateError(f"loader state fingerprint lacks {', '.join(missing)}")
    length = state.get("length")  # a map-style dataset's epoch length (shardloader.loader.growth)
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 0):
        raise StateError(f"loader state field 'length' must be a non-negative integer, got {length!r}")
    for key in OPTIONAL_STATES:
        if key in state and not isinstance(state[key], dict):
            raise StateError(f"loader state field {key!r} must be a dict (the {key}'s own "
                             f"state_dict()), got {type(state[key]).__name__}")
    return state


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable lines, one per fingerprint field that differs."""
    lines = []
    for field in FINGERPRINT_FIELDS:
        was, now = saved.get(field, _IMPLIED.get(field)), current.get(field, _IMPLIED.get(field))
        if was == now:
            continue
        if field == "order":
            lines.append(
                f"order: the state was saved with order version {was!r}, this loader computes "
                f"order version {now!r}; the same position names different samples in it, so "
                "resuming would silently change the sequence (resume with the shardloader "
                "release that saved the state, or restart the epoch)"
            )
        else:
            lines.append(f"{field}: saved {was!r}, now {now!r}")
    return lines


def validate_iterable(state: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """Check the `iterable` section of a (validated) loader state for a Loader with
    `num_workers`; return it. Raises StateError naming what is wrong."""
    section = state.get("iterable")
    if not isinstance(section, dict):
        raise StateError("loader state has no 'iterable' section: it was saved by a Loader of a "
                         "map-style dataset, and this Loader reads an iterable dataset")
    per_worker = section.get("workers")
    if not isinstance(per_worker, list) or not per_worker:
        raise StateError("loader state field 'iterable.workers' must be a non-empty list")
    saved = section.get("num_workers")
    if saved != num_workers:
        raise StateError(
            f"loader state was saved with num_workers={saved!r}, and this Loader has "
            f"num_workers={num_workers}: an iterable dataset splits its stream by "
            f"get_worker_info(), so each worker's saved position resumes only that worker's "
            f"split. Resume with num_workers={saved!r}"
        )
    workers = max(1, num_workers)
    if len(per_worker) != workers:
        raise StateError(f"loader state field 'iterable.workers' holds {len(per_worker)} "
                         f"positions for num_workers={num_workers}; expected {workers}")
    turn = section.get("next_worker")
    if not isinstance(turn, int) or isinstance(turn, bool) or not 0 <= turn < workers:
        raise StateError(f"loader state field 'iterable.next_worker' must be a worker id below "
                         f"{workers}, got {turn!r}")
    steps_before = section.get("steps_before", 0)  # absent from states saved before it was kept
    if not isinstance(steps_before, int) or isinstance(steps_before, bool) or steps_before < 0:
        raise StateError(f"loader state field 'iterable.steps_before' must be a non-negative "
                         f"integer, got {steps_before!r}")
    for i, worker in enumerate(per_worker):
        where = f"loader state field 'iterable.workers[{i}]'"
        if not isinstance(worker, dict):
            raise StateError(f"{where} must be a dict, got {type(worker).__name__}")
        batches = worker.get("batches")
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 0:
            raise StateError(f"{where}.batches must be a non-negative integer, got {batches!r}")
        if not isinstance(worker.get("ended"), bool):
            raise StateError(f"{where}.ended must be true or false, got {worker.get('ended')!r}")
        if worker.get("state") is not None and not isinstance(worker["state"], dict):
            raise StateError(f"{where}.state must be the dataset's state_dict() (a dict) or null, "
                             f"got {type(worker['state']).__name__}")
    delivered = sum(worker["batches"] for worker in per_worker)
    if delivered != state["position"]:
        raise StateError(f"loader state position {state['position']} is not the {delivered} "
                         f"batches its workers delivered")
    return section
