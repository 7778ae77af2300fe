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

and the fingerprint's `sampler`: the order's identity (a PureSampler's `fingerprint`, another
sampler's class and len(); None, implied when absent, for the Loader's own order).
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
               **optional: dict[str, Any] | None) -> dict[str, Any]:
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
