"""The "dcp" layout: model and optimizer through torch.distributed.checkpoint, a part per rank.

Files of a multi-rank checkpoint:

- `.metadata`, `__<rank>_<n>.distcp`: model and optimizer through `torch.distributed.checkpoint`
  (sharded states such as FSDP's DTensors are written once, shard by shard; replicated DDP
  states once in total: DCP deduplicates replicas), loadable with a different world size.
- `rank-<r>.safetensors`, `rank-<r>.json`: each rank's own loader state, RNG states and extras.

DCP writes non-tensor values (optimizer hyper-parameters, ...) with `torch.save` and reads
them back with `torch.load(weights_only=False)`, and its `.metadata` is a pickle. Here, every
non-tensor value must be plain data when it is saved (`untrusted.check_plain`, an error naming
the key), `.metadata` is read by a restricted unpickler and values by `PlainDataLoadPlanner`
(`untrusted`), so loading never runs code from the checkpoint's bytes. `verify` decodes every
item of the data files the same way, so `latest()` and `load()` agree on what is usable.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import shardloader.checkpoint.capture as capture
from shardloader.checkpoint.catalog import CatalogEntry, warn
from shardloader.checkpoint.fields import is_nonneg_int
from shardloader.checkpoint.layout import CheckpointLayout, DamagedCheckpoint, LayoutContext
from shardloader.checkpoint.manifest import FileEntry
from shardloader.checkpoint.parts import Staged, stage_part, verify_part_file
from shardloader.checkpoint.staging import StagingPool, plan_rounds, pool_bytes_needed
from shardloader.checkpoint.storage import LocalStore, Store
from shardloader.checkpoint.tensorfile import plan_layout
from shardloader.checkpoint.untrusted import (
    PlainDataLoadPlanner,
    check_plain_leaves,
    decode_plain,
    decode_tensor,
    read_dcp_metadata,
)
from shardloader.checkpoint.writer import write_part
from shardloader.errors import CheckpointError, StateError
from shardloader.io.checksum import checksum_file, new_hasher, parse_checksum

DCP_METADATA = ".metadata"
_CHUNK = 8 << 20


def rank_base(rank: int) -> str:
    return f"rank-{rank:05d}"


class DcpLayout(CheckpointLayout):
    """torch.distributed: model and optimizer through DCP, a part per rank (see the module doc)."""

    name = "dcp"

    def __init__(self, ctx: LayoutContext) -> None:
        super().__init__(ctx)
        # DCP writes a state in one piece: it cannot stream through a pool smaller than the state.
        self.dcp_pool = StagingPool(cap_bytes=None, memory_fraction=1.0)

    def close(self) -> None:
        self.dcp_pool.release()

    # -------------------------------------------------------------------------------- save
    def stage(self, ckpt_id: str, step: int, model: Any, optimizer: Any, loader: Any,
              extra: dict[str, Any]) -> Staged:
        model_optim = model_optim_state(model, optimizer)
        check_plain_leaves(model_optim, "state")  # refused here, naming the key, not at load
        local = capture.capture_local(loader, extra)
        staged = stage_part(self.ctx.pool, rank_base(self.ctx.group.rank), ckpt_id, step, local,
                            capture.loader_fingerprint(local))
        staged.payload["dcp"], nbytes = stage_dcp_state(model_optim, self.dcp_pool)
        staged.nbytes += nbytes
        return staged

    def write(self, staged: Staged, directory: str) -> dict[str, FileEntry]:
        try:
            dcp.save(
                staged.payload["dcp"],
                storage_writer=FileSystemWriter(directory, sync_files=True),
                # Replicated tensors (a DDP model) are written once. DCP's default picks the
                # least-loaded rank's copy, but DDP replicas are not identical: buffers such as
                # BatchNorm's running stats are updated per rank and re-broadcast from rank 0 at
                # the next forward. Rank 0's copy is the authoritative one, and the only one that
                # makes a resumed run bit-identical.
                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                process_group=self.ctx.group.bg,
            )
        except CheckpointException as exc:  # a BaseException: make it an ordinary error
            raise CheckpointError(f"DCP could not save: {exc}") from exc
        finally:
            staged.payload.clear()
        dcp_files = sorted(os.listdir(directory))
        files = write_part(directory, staged.part, self.ctx.pool, staged.handoff)
        for name in dcp_files:  # read back from the page cache: DCP wrote these itself
            checksum, size = checksum_file(os.path.join(directory, name))
            files[name] = FileEntry(size, checksum)
        return files

    # -------------------------------------------------------------------------------- verify
    def verify(self, entry: CatalogEntry, names: list[str] | None = None) -> None:
        """Checksums, and every DCP item decodes as data (values plain, tensors tensors)."""
        store = self.ctx.store
        files = entry.manifest.files
        names = sorted(files) if names is None else names
        metadata = self.metadata(entry)
        items = data_items(metadata, entry, store.url_of(entry.id))
        for name in names:
            if name in items:
                verify_data_file(store, entry, name, items[name])
            elif name != DCP_METADATA:  # read and verified by self.metadata()
                verify_part_file(store, entry, name)

    def metadata(self, entry: CatalogEntry) -> Any:
        files = entry.manifest.files
        source = self.ctx.store.url_of(f"{entry.id}/{DCP_METADATA}")
        if DCP_METADATA not in files:
            raise CheckpointError(f"{source}: the manifest lists no DCP metadata")
        raw = self.ctx.store.read_verified(entry.id, DCP_METADATA, files[DCP_METADATA])
        return read_dcp_metadata(io.BytesIO(raw.numpy().tobytes()), source)

    # -------------------------------------------------------------------------------- load
    def restore(self, entry: CatalogEntry, name: str, model: Any, optimizer: Any, loader: Any,
                extra: dict[str, Any]) -> dict[str, Any]:
        rank, world_size = self.ctx.group.rank, self.ctx.group.world_size
        saved_world = entry.manifest.world_size
        own = rank if rank < saved_world else 0
        local = self.read(entry, rank_base(own))
        if saved_world != world_size and loader is not None:
            # The loader's state is a global cursor (invariant I4): rank 0's fits every rank.
            local["loader"] = self.read(entry, rank_base(0)).get("loader")
        if own != rank:
            warn(f"{name} was saved by {saved_world} ranks; rank {rank} restores the RNG and "
                 f"extras of rank {own}, so its random draws differ from an uninterrupted run")
        capture.check_restorable(local, name, loader=loader, extra=extra, wants={})
        template = model_optim_state(model, optimizer)
        if template:
            try:
                metadata = self.metadata(entry)
            except CheckpointError as exc:
                raise DamagedCheckpoint(str(exc)) from None
            check_fits(template, metadata, name)
        capture.restore_loader(loader, local, name)
        if template:
            reader = storage_reader(self.ctx.store, entry.id, self.ctx.storage_options)
            planner = PlainDataLoadPlanner()
            try:
                if world_size == 1:
                    with warnings.catch_warnings():  # "assuming ... load in a single process": yes
                        warnings.filterwarnings("ignore", message=".*single process",
                                                category=UserWarning)
                        dcp.load(template, storage_reader=reader, planner=planner, no_dist=True)
                else:
                    dcp.load(template, storage_reader=reader, planner=planner,
                             process_group=self.ctx.group.ctl)
            except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
                raise DamagedCheckpoint(f"{name}: DCP could not read the model/optimizer state: "
                                        f"{type(exc).__name__}: {_first_line(exc)}") from exc
            if model is not None:
                set_model_state_dict(model, template["model"])
            if optimizer is not None:
                set_optimizer_state_dict(model, optimizer, template["optimizer"])
        return local


def check_fits(template: dict[str, Any], metadata: Any, name: str) -> None:
    """The live model/optimizer fit the checkpoint (keys present, shapes equal), checked by DCP's
    own planning before anything is read: a misfit is the caller's error, not damage."""
    held = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
    for key in template:
        if key not in held:
            raise CheckpointError(f"{name} holds no {key} state (it was saved without {key}=...)")
    planner = PlainDataLoadPlanner()
    try:
        planner.set_up_planner(template, metadata, is_coordinator=False)
        planner.create_local_plan()
    except Exception as exc:
        raise StateError(f"{name}: the model/optimizer state does not fit: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else ""


# ------------------------------------------------------------------------------ data files
def data_items(metadata: Any, entry: CatalogEntry,
               source: str) -> dict[str, list[tuple[int, int, bool, str]]]:
    """Per data file: (offset, length, is_value, fqn) of each item, validated against the
    manifest. An item outside the checkpoint's files or past a file's end is damage."""
    files = entry.manifest.files
    try:
        storage = dict(metadata.storage_data)
        kinds = dict(metadata.state_dict_metadata)
    except (AttributeError, TypeError) as exc:
        raise CheckpointError(f"{source}/{DCP_METADATA}: malformed DCP metadata: {exc}") from None
    out: dict[str, list[tuple[int, int, bool, str]]] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        path = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        where = f"{source}/{DCP_METADATA}: item {fqn!r}"
        if not isinstance(path, str) or path not in files or path == DCP_METADATA:
            raise CheckpointError(f"{where} refers to {path!r}, not a data file of this checkpoint")
        if not (is_nonneg_int(offset) and is_nonneg_int(length)) or offset + length > files[path].bytes:
            raise CheckpointError(f"{where}: bytes [{offset!r}, +{length!r}) are not inside "
                                  f"{path} ({files[path].bytes} bytes)")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} uses storage transforms {info.transform_descriptors!r},"
                                  " which this library never writes")
        is_value = isinstance(kinds.get(fqn), BytesStorageMetadata)
        out.setdefault(path, []).append((offset, length, is_value, str(fqn)))
    return out


def verify_data_file(store: Store, entry: CatalogEntry, name: str,
                     items: list[tuple[int, int, bool, str]]) -> None:
    """One pass over a `.distcp` file: hash every byte, decode every item as data."""
    file_entry = entry.manifest.files[name]
    url = store.url_of(f"{entry.id}/{name}")
    store.checked_size(entry.id, name, file_entry)
    algorithm, _ = parse_checksum(file_entry.checksum)
    hasher = new_hasher(algorithm)
    problem = None
    pos = 0
    with store.open(entry.id, name) as f:
        for offset, length, is_value, fqn in sorted(items):
            if offset < pos:
                problem = problem or f"{url}: DCP items overlap at byte {offset}"
                continue
            _skip(f, offset - pos, hasher, url)
            data = _read(f, length, url)
            hasher.update(data)
            pos = offset + length
            if problem is None:
                try:
                    if is_value:
                        decode_plain(data, f"{url}: value {fqn!r}")
                    else:
                        decode_tensor(data, f"{url}: tensor {fqn!r}")
                except CheckpointError as exc:
                    problem = str(exc)
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    store.check_digest(url, algorithm, hasher, file_entry)  # damage first, then content
    if problem is not None:
        raise CheckpointError(problem)


def _skip(f: Any, n: int, hasher: Any, url: str) -> None:
    while n > 0:
        chunk = _read(f, min(n, _CHUNK), url)
        hasher.update(chunk)
        n -= len(chunk)


def _read(f: Any, n: int, url: str) -> bytes:
    parts, left = [], n
    while left:
        chunk = f.read(left)
        if not chunk:
            raise CheckpointError(f"{url}: file ends early (truncated)")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# ------------------------------------------------------------------------------ DCP readers
class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return _safe_read_metadata(self)


def _safe_read_metadata(reader: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader.fs.concat_path(reader.path, DCP_METADATA)
    with reader.fs.create_stream(path, "rb") as f:
        metadata = read_dcp_metadata(f, str(path))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def storage_reader(store: Store, ckpt_id: str, storage_options: dict[str, Any] | None) -> Any:
    """A DCP storage reader for checkpoint `ckpt_id` that never unpickles arbitrary objects."""
    if isinstance(store, LocalStore):
        return SafeFileSystemReader(os.path.join(store.root, ckpt_id))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class SafeFsspecReader(FsspecReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return _safe_read_metadata(self)

    return SafeFsspecReader(store.url_of(ckpt_id), **(storage_options or {}))


# ------------------------------------------------------------------------------ DCP staging
def model_optim_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer state in DCP's FQN-keyed form (handles DDP and FSDP wrappers)."""
    if optimizer is not None and model is None:
        raise ValueError("a distributed checkpoint of an optimizer needs model=... too")
    state: dict[str, Any] = {}
    if model is not None:
        state["model"] = get_model_state_dict(model)
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def _tensor_leaves(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensor_leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_leaves(v, out)


def _rebuild(obj: Any, replace: dict[int, torch.Tensor]) -> Any:
    """Copy of the container tree with tensors swapped for their staged copies."""
    if isinstance(obj, torch.Tensor):
        return replace[id(obj)]
    if isinstance(obj, dict):
        return {k: _rebuild(v, replace) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, replace) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, replace) for v in obj)
    return obj


def stage_dcp_state(state: dict[str, Any], pool: StagingPool) -> tuple[dict[str, Any], int]:
    """Copy every tensor (DTensor: its local shard) of `state` into `pool`; return the copy.

    The pool is sized to the whole state and reused by later saves.
    """
    from torch.distributed.tensor import DTensor

    leaves: list[torch.Tensor] = []
    _tensor_leaves(state, leaves)
    locals_ = [t.to_local() if isinstance(t, DTensor) else t.detach() for t in leaves]
    metas = plan_layout([str(i) for i in range(len(locals_))], locals_)
    needed = pool_bytes_needed(metas)
    (round_,) = plan_rounds(metas, needed)
    pool.reserve(needed)
    pool.copy_in(round_, locals_)
    replace: dict[int, torch.Tensor] = {}
    assert pool.buffer is not None
    for i, meta in enumerate(metas):
        if not meta.nbytes:  # nothing to copy: an empty tensor of the same shape will do
            replace[id(leaves[i])] = _wrap_like(leaves[i], torch.empty(locals_[i].shape, dtype=meta.dtype))
    for seg in round_.segments:
        src = leaves[seg.index]
        local = locals_[seg.index]
        view = pool.buffer[seg.pool_offset : seg.pool_offset + seg.nbytes].view(local.dtype).view(local.shape)
        replace[id(src)] = _wrap_like(src, view)
    return _rebuild(state, replace), sum(m.nbytes for m in metas)


def _wrap_like(src: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as the staged copy of `src`: a DTensor with `src`'s sharding when it is one."""
    from torch.distributed.tensor import DTensor

    if isinstance(src, DTensor):
        return DTensor(local, src._spec, requires_grad=False)
    return local
