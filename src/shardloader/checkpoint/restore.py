"""Choosing a checkpoint and restoring it, with fallback to the previous complete one.

`latest()` and `load()` agree on what is usable, through one verification (`_problem`): a
complete checkpoint (`catalog`) whose manifest lists every file its layout reads and whose
files match the manifest and decode as data (the layout's `verify`). With no step asked for, a
damaged checkpoint is skipped with a CheckpointWarning naming it and the one committed before it
is tried; with an explicit step it is a CheckpointError. A checkpoint that verifies but does not
fit the objects passed in (another model, a missing state, another loader fingerprint) is an
error, not a fallback: the caller, not the checkpoint, is at fault.

A load is all or nothing: what this process will restore is checked against the live objects
first (`check_fit`: keys and shapes of the model (dtypes are cast, as torch's load_state_dict casts them), the optimizer's groups and buffer
shapes, extras, RNG), then every object is snapshotted (`Snapshots`) and applied, the loader
last; if anything still fails, every object is put back, so a caller that catches the error
goes on exactly where it was.

Under torch.distributed every rank tries the same checkpoints in the same order (rank 0 lists
them and broadcasts their manifests), each rank verifies a share of the files, and every rank
learns every rank's verdict, so all ranks restore the same checkpoint or fall back together.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

import shardloader.checkpoint.capture as capture
import shardloader.checkpoint.catalog as catalog
import shardloader.checkpoint.rng as rng
from shardloader.checkpoint.catalog import CatalogEntry, warn
from shardloader.checkpoint.group import DistGroup, LocalGroup
from shardloader.checkpoint.layout import CheckpointLayout, DamagedCheckpoint
from shardloader.checkpoint.manifest import Manifest
from shardloader.checkpoint.parts import STATE_JSON_DEPTH, part_names
from shardloader.checkpoint.single_layout import SINGLE_BASE, unwrap
from shardloader.checkpoint.storage import Store
from shardloader.checkpoint.tensorfile import read_header
from shardloader.checkpoint.tree import unflatten
from shardloader.errors import CheckpointError, StateError
from shardloader.io.checksum import new_hasher
from shardloader.io.jsondata import parse_json

#: The layout that reads checkpoints whose manifest names it ("single", "dcp").
LayoutNamed = Callable[[str], CheckpointLayout]


def newest_usable(store: Store, layout_named: LayoutNamed, *, verify: bool) -> int | None:
    """The step of the newest complete checkpoint (verified, with `verify`), or None; every
    checkpoint skipped on the way is a CheckpointWarning naming it. Not collective."""
    for entry in reversed(catalog.list_complete(store)):
        problem = _problem(layout_named, entry, None) if verify else _unlisted(entry)
        if problem is None:
            return entry.step
        # stacklevel: attributed to the code that called Checkpointer.latest()
        warn(f"skipping checkpoint {store.url_of(entry.id)}: {problem}", stacklevel=4)
    return None


def load(store: Store, group: LocalGroup | DistGroup, layout_named: LayoutNamed,
         step: int | None, model: Any, optimizer: Any, loader: Any, extra: dict[str, Any]
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore every state from checkpoint `step` (None: the newest usable), on every rank,
    all or nothing: a load that raises leaves every object as it was before the call.

    Returns what was loaded (`{"step", "id", "url"}`) and every saved extra.
    """
    offer: Any = None
    if group.rank == 0:
        try:
            offer = [(e.id, e.manifest.to_json()) for e in _candidates(store, step)]
        except CheckpointError as exc:
            offer = str(exc)
    offer = group.broadcast(offer)
    if isinstance(offer, str):
        raise CheckpointError(offer)
    for ckpt_id, manifest_bytes in offer:
        source = store.url_of(ckpt_id)
        entry = CatalogEntry(ckpt_id, Manifest.from_json(manifest_bytes, source=source))
        local = _restore_entry(store, group, layout_named, entry, step, model, optimizer,
                               loader, extra)
        if local is not None:
            return {"step": entry.step, "id": entry.id, "url": source}, local.get("extra", {})
    raise CheckpointError(f"{store.url}: no complete checkpoint that verifies")


def _candidates(store: Store, step: int | None) -> list[CatalogEntry]:
    """Rank 0: the checkpoints to try, newest first (with `step`: the newest of that step)."""
    entries = list(reversed(catalog.list_complete(store)))
    if step is None:
        if not entries:
            raise CheckpointError(f"{store.url}: no complete checkpoint to load")
        return entries
    chosen = [e for e in entries if e.step == step]
    if not chosen:
        raise CheckpointError(
            f"{store.url}: no complete checkpoint of step {step} "
            f"(complete steps: {sorted({e.step for e in entries})})"
        )
    return chosen[:1]


def _restore_entry(store: Store, group: LocalGroup | DistGroup, layout_named: LayoutNamed,
                   entry: CatalogEntry, step: int | None, model: Any, optimizer: Any,
                   loader: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    """Restore everything from `entry` on every rank and return this rank's part, or None (on
    all ranks) when it is damaged and the next one is to be tried.

    All or nothing, in three rounds that every rank agrees on before the next: (1) the files
    verify; (2) what this rank will restore fits the live objects (`check_fit`, nothing
    touched yet); (3) snapshots of every object are taken, then model, optimizer, extras and
    RNG are applied and, last, the loader (whose `load_state_dict` checks before it changes
    anything). Whatever fails in (3), on any rank, puts every object back from its snapshot.
    """
    source = store.url_of(entry.id)
    name = _describe(store, entry)
    names = sorted(entry.manifest.files)
    mine = names[group.rank :: group.world_size]  # each rank verifies a share
    problem = _problem(layout_named, entry, mine)
    problems = [p for p in group.all_gather(problem) if p is not None]
    if problems:
        _skip(source, step, problem, problems[0], group.rank)
        return None
    layout = layout_named(entry.manifest.layout)
    error: BaseException | None = None
    try:
        check_fit(_preview(store, entry, group.rank), entry.manifest.layout, name,
                  model=model, optimizer=optimizer, loader=loader, extra=extra)
    except BaseException as exc:
        error = exc
    if _settle(group, name, step, source, error):
        return None
    undo = Snapshots(model, optimizer, loader, extra)
    deferred = _DeferredLoader() if loader is not None else None
    local: dict[str, Any] = {}
    try:
        undo.model_applied = undo.optimizer_applied = True  # put back even if half applied
        local = layout.restore(entry, name, model, optimizer, deferred, extra)
        for key in extra:  # one by one: only those applied are put back
            undo.extras_applied.append(key)
            capture.restore_extra({key: extra[key]}, local, name)
        undo.rng_applied = True
        rng.restore(local["rng"], source=name)
        if deferred is not None:  # last: it checks before it changes anything
            capture.restore_loader(loader, {"loader": deferred.state}, name)
            undo.loader_applied = True
    except BaseException as exc:
        error = exc
    if _settle(group, name, step, source, error, undo=undo):
        return None
    return local


def _settle(group: LocalGroup | DistGroup, name: str, step: int | None, source: str,
            error: BaseException | None, *, undo: Snapshots | None = None) -> bool:
    """Every rank learns every rank's outcome of a round. Raises this rank's `error`, or the
    first other rank's fatal error, after putting `undo` back; returns True (every rank) when
    the checkpoint turned out damaged and the next one is to be tried."""
    status: tuple[str, str] | None = None
    if isinstance(error, DamagedCheckpoint):
        status = ("damaged", str(error))
    elif error is not None:  # the caller's objects do not fit: not the checkpoint's fault
        status = ("fatal", f"rank {group.rank}: {type(error).__name__}: {error}")
    statuses = [s for s in group.all_gather(status) if s is not None]
    if statuses and undo is not None:
        undo.put_back(name, error)  # this rank's own failure, or another rank's
    fatal = [m for kind, m in statuses if kind == "fatal"]
    if error is not None and (status[0] == "fatal" or step is not None):
        raise error
    if fatal:
        raise CheckpointError(f"{name}: {fatal[0]}")
    if statuses:
        _skip(source, step, status and status[1], statuses[0][1], group.rank)
        return True
    return False


def _problem(layout_named: LayoutNamed, entry: CatalogEntry, names: list[str] | None) -> str | None:
    """Why `entry` is not usable, or None: the one verification `latest()` and `load()` share.

    Its manifest lists every file its layout reads, and its files (all, or `names` of them)
    match the manifest and decode as data (the layout's `verify`)."""
    problem = _unlisted(entry)
    if problem is not None:
        return problem
    try:
        layout_named(entry.manifest.layout).verify(entry, names)
    except CheckpointError as exc:
        return str(exc)
    return None


def _unlisted(entry: CatalogEntry) -> str | None:
    """Which files the layout reads the manifest does not list (read from the manifest only)."""
    unlisted = [n for n in required_files(entry) if n not in entry.manifest.files]
    if not unlisted:
        return None
    holder = ("every checkpoint saved by one process" if entry.manifest.layout == "single"
              else f"a checkpoint saved by {entry.manifest.world_size} ranks")
    return (f"its manifest lists no {', '.join(unlisted)}, which {holder} holds (the checkpoint "
            "cannot be restored)")


def required_files(entry: CatalogEntry) -> list[str]:
    """The files a checkpoint's layout reads whatever it holds: without one of them, `load()`
    could not restore it, so it is as damaged as a checkpoint whose file does not verify.
    (DCP's data files are checked by `verify`: `.metadata` says which exist.)"""
    if entry.manifest.layout == "single":
        return list(part_names(SINGLE_BASE))
    from shardloader.checkpoint.dcp_layout import DCP_METADATA, rank_base

    return [DCP_METADATA] + [n for r in range(entry.manifest.world_size) for n in part_names(rank_base(r))]


def _skip(source: str, step: int | None, mine: str | None, first: str, rank: int) -> None:
    """A damaged checkpoint: an error when it was asked for, else a warning and fallback."""
    if step is not None:
        raise CheckpointError(f"cannot load checkpoint {source}: {mine or first}")
    if mine is not None or rank == 0:
        warn(f"skipping checkpoint {source}: {mine or 'another rank found damage: ' + first}")


def _describe(store: Store, entry: CatalogEntry) -> str:
    """How errors and warnings name a checkpoint."""
    return f"checkpoint {store.url_of(entry.id)} (step {entry.step})"


# ------------------------------------------------------------------------------ all or nothing
class _DeferredLoader:
    """Stands in for the loader while the layout restores: it keeps the state the layout
    hands over, so the real loader is restored last, once everything else is in place."""

    state: Any = None

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class _Held:
    """A tensor of a snapshot: a host copy, and the device it goes back to."""

    __slots__ = ("copy", "device")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.copy = tensor.detach().to("cpu", copy=True)


def _hold(tree: Any) -> Any:
    """A copy of a state tree that nothing can change: tensors copied to host memory (a
    DTensor, a shard of a larger tensor, is cloned where it is), the rest deep-copied."""
    if isinstance(tree, torch.Tensor):
        return _Held(tree) if type(tree) in (torch.Tensor, torch.nn.Parameter) else tree.detach().clone()
    return _map(tree, _hold, copy.deepcopy)


def _unhold(tree: Any) -> Any:
    """The state tree `_hold` copied, tensors back on their devices."""
    if isinstance(tree, _Held):
        return tree.copy.to(tree.device)
    return _map(tree, _unhold, lambda leaf: leaf)


def _map(tree: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], Any]) -> Any:
    """`fn` over a container's items, keeping its type (an OrderedDict's `_metadata`, which
    `load_state_dict` reads, included); `leaf` for anything else."""
    if isinstance(tree, dict):
        out = (OrderedDict if isinstance(tree, OrderedDict) else dict)(
            (k, fn(v)) for k, v in tree.items())
        if hasattr(tree, "_metadata"):
            out._metadata = copy.deepcopy(tree._metadata)
        return out
    if isinstance(tree, list):
        return [fn(v) for v in tree]
    if isinstance(tree, tuple):
        items = [fn(v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return leaf(tree)


class Snapshots:
    """What model, optimizer, extras, RNG and loader were before a load, taken before any of
    them is changed, and put back (`put_back`) when any part of the load fails.

    Costs one host copy of the model's and the optimizer's current state for the duration of
    the load (a fresh optimizer has almost none). The loader is applied last and checks before
    it changes anything, so it is put back (through its `load_state_dict`) only when it was
    restored on this rank and another rank then failed."""

    def __init__(self, model: Any, optimizer: Any, loader: Any, extra: dict[str, Any]) -> None:
        self.model, self.optimizer, self.loader, self.extra = model, optimizer, loader, extra
        self.model_state = None if model is None else _hold(unwrap(model).state_dict())
        self.optimizer_state = None if optimizer is None else _hold(optimizer.state_dict())
        self.loader_state = None if loader is None else copy.deepcopy(loader.state_dict())
        self.extra_state = {key: _hold_extra(obj) for key, obj in extra.items()}
        self.rng_state = rng.capture()
        self.model_applied = self.optimizer_applied = self.rng_applied = self.loader_applied = False
        self.extras_applied: list[str] = []

    def put_back(self, name: str, error: BaseException | None) -> None:
        """Every part applied so far as it was, after `error` (None: another rank's); once."""
        try:
            if self.loader_applied:
                self.loader.load_state_dict(self.loader_state)
            for key in reversed(self.extras_applied):
                _put_back_extra(self.extra[key], self.extra_state[key])
            if self.rng_applied:
                rng.restore(self.rng_state, source="the state before the load")
            if self.optimizer_applied and self.optimizer is not None:
                self.optimizer.load_state_dict(_unhold(self.optimizer_state))
            if self.model_applied and self.model is not None:
                unwrap(self.model).load_state_dict(_unhold(self.model_state))
        except Exception as exc:
            failure = "on another rank" if error is None else f"({type(error).__name__}: {error})"
            raise CheckpointError(
                f"{name}: the load failed {failure}, and putting back the state from before it "
                f"failed too ({type(exc).__name__}: {exc}); model, optimizer, loader and extras "
                "may be partly restored: make them again before loading") from exc
        finally:
            self.model_applied = self.optimizer_applied = self.rng_applied = False
            self.loader_applied = False
            self.extras_applied = []


def _hold_extra(obj: Any) -> Any:
    if capture.is_stateful(obj):
        return _hold(obj.state_dict())
    if isinstance(obj, dict):
        return dict(obj)  # restore_extra replaces the items; the values themselves are kept
    if isinstance(obj, list):
        return list(obj)
    return None  # check_fit refuses it before anything is applied


def _put_back_extra(obj: Any, held: Any) -> None:
    if capture.is_stateful(obj):
        obj.load_state_dict(_unhold(held))
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(held)
    else:
        obj[:] = held


def _preview(store: Store, entry: CatalogEntry, rank: int) -> dict[str, Any]:
    """The part this rank restores, decoded with uninitialised tensors of the saved shapes and
    dtypes (its small JSON file and the tensor file's header are read; no tensor data): what
    `check_fit` compares with the live objects before anything is changed."""
    if entry.manifest.layout == "single":
        base = SINGLE_BASE
    else:
        from shardloader.checkpoint.dcp_layout import rank_base

        base = rank_base(rank if rank < entry.manifest.world_size else 0)
    tensor_name, json_name = part_names(base)
    files = entry.manifest.files
    url = store.url_of(f"{entry.id}/{json_name}")
    try:
        size = store.checked_size(entry.id, tensor_name, files[tensor_name])
        with store.open(entry.id, tensor_name) as f:
            _, metas = read_header(f, size=size, hasher=new_hasher(),
                                   source=store.url_of(f"{entry.id}/{tensor_name}"))
        raw = store.read_verified(entry.id, json_name, files[json_name]).numpy().tobytes()
        by_name = {m.name: m for m in metas}
        placeholders = [torch.empty(by_name[str(i)].shape, dtype=by_name[str(i)].dtype)
                        for i in range(len(metas))]
        doc = parse_json(raw, what=url, error=CheckpointError,
                         max_depth=STATE_JSON_DEPTH)
        state = unflatten(doc["state"], placeholders, source=url)
    except CheckpointError as exc:
        raise DamagedCheckpoint(str(exc)) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise DamagedCheckpoint(f"{url}: state file is malformed: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"{url}: state is not an object")
    return state


def check_fit(state: dict[str, Any], layout: str, name: str, *, model: Any, optimizer: Any,
              loader: Any, extra: dict[str, Any]) -> None:
    """Raise before anything is changed when the checkpoint's part does not fit the live
    objects: a part asked for is missing, an extra cannot be restored in place, the model's
    keys, shapes or dtypes differ, the optimizer's parameter groups or per-parameter state
    shapes differ, or the RNG state names CUDA devices this process lacks. (The loader checks
    its own state, fingerprint included, before it changes anything; under DCP, DCP's planning
    checks model and optimizer.)"""
    wants = {"model": model, "optimizer": optimizer} if layout == "single" else {}
    capture.check_restorable(state, name, loader=loader, extra=extra, wants=wants)
    if model is not None and "model" in wants:
        _check_model(state["model"], unwrap(model).state_dict(), name)
    if optimizer is not None and "optimizer" in wants:
        _check_optimizer(state["optimizer"], optimizer, name)
    try:
        cuda_states = rng.parse(state.get("rng"), source=name)[3]
    except StateError as exc:
        raise DamagedCheckpoint(str(exc)) from None
    if cuda_states and not torch.cuda.is_available():
        raise StateError(f"{name}: the checkpoint holds RNG states for {len(cuda_states)} CUDA "
                         "devices but CUDA is not available here")


def _check_model(saved: Any, live: dict[str, Any], name: str) -> None:
    problems = []
    if not isinstance(saved, dict):
        raise StateError(f"{name}: the saved model state is a {type(saved).__name__}, not a dict")
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"not in this model: {_some(unexpected)}")
    for key in (k for k in live if k in saved):
        was, now = saved[key], live[key]
        if isinstance(was, torch.Tensor) != isinstance(now, torch.Tensor):
            problems.append(f"{key}: saved a {type(was).__name__}, this model has a {type(now).__name__}")
        elif isinstance(was, torch.Tensor) and was.shape != now.shape:  # dtypes cast, as torch does
            problems.append(f"{key}: saved {_kind(was)}, this model has {_kind(now)}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise StateError(f"{name}: the model's saved state does not fit this model: {shown}")


def _check_optimizer(saved: Any, optimizer: Any, name: str) -> None:
    """Parameter groups and their sizes as torch checks them, and what torch does not check:
    each per-parameter buffer (a state tensor with its parameter's number of dimensions:
    momentum, Adam's moments) has its parameter's shape."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(groups, list):
        return  # not torch's format: the optimizer's own load_state_dict decides
    what = f"{name}: the optimizer's saved state does not fit this optimizer"
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise StateError(f"{what}: the checkpoint holds {len(saved_groups)} parameter groups, "
                         f"this optimizer {len(groups)}")
    params: dict[Any, tuple[int, int, torch.Tensor]] = {}
    for g, (was, now) in enumerate(zip(saved_groups, groups)):
        ids, live = was.get("params", []) if isinstance(was, dict) else [], now["params"]
        if len(ids) != len(live):
            raise StateError(f"{what}: parameter group {g} holds {len(ids)} parameters in the "
                             f"checkpoint, {len(live)} in this optimizer (another model's optimizer?)")
        params.update((pid, (g, i, p)) for i, (pid, p) in enumerate(zip(ids, live)))
    saved_state = saved.get("state") if isinstance(saved.get("state"), dict) else {}
    live_state = getattr(optimizer, "state", {})
    for pid, values in saved_state.items():
        if pid not in params or not isinstance(values, dict):
            continue
        g, i, param = params[pid]
        current = live_state.get(param, {}) if hasattr(live_state, "get") else {}
        for key, value in values.items():
            ref = current.get(key) if isinstance(current, dict) else None
            if isinstance(ref, torch.Tensor) and isinstance(value, torch.Tensor):
                expected = ref.shape
            elif isinstance(value, torch.Tensor) and value.dim() == param.dim() > 0:
                expected = param.shape
            else:
                continue
            if value.shape != expected:
                raise StateError(
                    f"{what}: state {key!r} of parameter {i} of group {g} has shape "
                    f"{list(value.shape)} in the checkpoint, the parameter's is {list(expected)} "
                    "(another model's optimizer?)")


def _kind(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def _some(keys: list[str], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")
