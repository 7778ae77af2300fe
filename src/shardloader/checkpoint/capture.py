"""Collect every state at a step boundary, and put it back, in the right order.

One save captures the model, the optimizer, the loader, the global RNGs and any extra state at
the same step (invariant I8). One load restores them all, checking first that everything asked
for is in the checkpoint and can be restored, so a failed load does not leave half the objects
restored: `shardloader.checkpoint.restore` checks every part against the live objects and
snapshots them first, applies the loader last (its `load_state_dict` refuses a fingerprint
difference before it changes anything) and puts everything back if any part fails.
"""

from __future__ import annotations

import json
from typing import Any

import torch

import shardloader.checkpoint.rng as rng
from shardloader.errors import CheckpointError, StateError


def is_stateful(obj: Any) -> bool:
    """True for objects with callable `state_dict` and `load_state_dict` (torch's Stateful)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def capture_local(loader: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The per-process part of a state: global RNGs, the loader's state and the extras."""
    state: dict[str, Any] = {"rng": rng.capture()}
    if loader is not None:
        state["loader"] = loader.state_dict()
    state["extra"] = {k: (v.state_dict() if is_stateful(v) else v) for k, v in extra.items()}
    return state


def loader_fingerprint(state: dict[str, Any]) -> Any:
    """The loader state's fingerprint, JSON-safe, for the manifest (None when it has none)."""
    loader = state.get("loader")
    if not isinstance(loader, dict) or "fingerprint" not in loader:
        return None
    fingerprint = loader["fingerprint"]
    try:
        json.dumps(fingerprint, allow_nan=False)
        return fingerprint
    except (TypeError, ValueError):
        return repr(fingerprint)


def check_restorable(state: dict[str, Any], name: str, *, loader: Any, extra: dict[str, Any],
                     wants: dict[str, Any]) -> None:
    """Raise before anything is touched when a requested part is missing or not restorable."""
    for key, obj in wants.items():
        if obj is not None and key not in state:
            raise CheckpointError(f"{name} holds no {key} state (it was saved without {key}=...)")
    if loader is not None and "loader" not in state:
        raise CheckpointError(f"{name} holds no loader state (it was saved without loader=...)")
    saved_extra = state.get("extra", {})
    for key, obj in extra.items():
        if key not in saved_extra:
            raise CheckpointError(
                f"{name} holds no extra state {key!r} (saved extras: {sorted(saved_extra)})"
            )
        if not (is_stateful(obj) or isinstance(obj, (dict, list))):
            raise TypeError(
                f"extra {key!r}: a {type(obj).__name__} cannot be restored in place; pass a dict, "
                f"a list or an object with load_state_dict, or read checkpointer.loaded_extra[{key!r}]"
            )


def restore_loader(loader: Any, state: dict[str, Any], name: str) -> None:
    if loader is None:
        return
    try:
        loader.load_state_dict(state["loader"])
    except StateError as exc:
        raise StateError(f"{name}: the loader's saved state does not fit this loader: {exc}") from exc


def restore_extra(extra: dict[str, Any], state: dict[str, Any], name: str) -> None:
    saved = state.get("extra", {})
    for key, obj in extra.items():
        value = saved[key]
        try:
            if is_stateful(obj):
                obj.load_state_dict(value)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(value)
            else:
                obj[:] = value
        except StateError as exc:
            raise StateError(f"{name}: extra state {key!r} does not fit: {exc}") from exc


def restore_module(model: torch.nn.Module, state: dict[str, Any], name: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise StateError(f"{name}: the model's saved state does not fit this model: {exc}") from exc


def restore_optimizer(optimizer: Any, state: dict[str, Any], name: str) -> None:
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise StateError(f"{name}: the optimizer's saved state does not fit: {exc}") from exc
