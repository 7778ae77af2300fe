"""Multi-rank checkpoints under torch.distributed: DCP for model and optimizer, a part per rank.

Layout of a multi-rank checkpoint ("dcp" in the manifest):

- `.metadata`, `__<rank>_<n>.distcp`: model and optimizer through `torch.distributed.checkpoint`
  (sharded states such as FSDP's DTensors are written once, shard by shard; replicated DDP
  states once in total: DCP deduplicates replicas), loadable with a different world size.
- `rank-<r>.safetensors`, `rank-<r>.json`: each rank's own loader state, RNG states and extras.

Coordination never touches the training process group. At construction (collective, main
thread) we create two gloo groups: `ctl`, used only from the main thread (agreeing on skips,
the checkpoint nonce, which checkpoint to load), and `bg`, used only by the background writer
thread (DCP's planning collectives, then gathering every rank's part description to rank 0).
Rank 0 writes the manifest only after every rank reported its files written, fsynced and put
at the destination; the outcome is broadcast so every rank's handle agrees.

DCP's `.metadata` is a pickle. We read it with an unpickler that only builds DCP's metadata
classes (and torch dtypes, sizes, paths), after checking its checksum against the manifest, so
loading a checkpoint never runs code from its bytes.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardloader.checkpoint import capture, catalog, rng
from shardloader.checkpoint.catalog import Entry, warn
from shardloader.checkpoint.manifest import FileEntry, Manifest
from shardloader.checkpoint.staging import StagingPool, plan_rounds, pool_bytes_needed
from shardloader.checkpoint.storage import LocalStore, Store
from shardloader.checkpoint.tensorfile import plan_layout
from shardloader.checkpoint.tree import flatten
from shardloader.checkpoint.writer import RoundHandoff, StagedPart, write_part
from shardloader.errors import CheckpointError
from shardloader.format.checksum import checksum_file

if TYPE_CHECKING:
    from shardloader.checkpoint.checkpointer import Checkpointer, CheckpointHandle

DCP_METADATA = ".metadata"


def rank_base(rank: int) -> str:
    return f"rank-{rank:05d}"


# ------------------------------------------------------------------------------ safe metadata
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata objects only; any other global in the pickle is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == _METADATA_MODULE:
                return obj
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not allowed")


def _safe_read_metadata(reader: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader.fs.concat_path(reader.path, DCP_METADATA)
    with reader.fs.create_stream(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise CheckpointError(f"{path}: DCP metadata cannot be read safely: {exc}") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return _safe_read_metadata(self)


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

    The pool is sized to the whole state (DCP writes a state in one piece, so it cannot
    stream through a smaller pool) and reused by later saves.
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


# ------------------------------------------------------------------------------ context
@dataclass
class DistJob:
    part: StagedPart
    handoff: RoundHandoff
    dcp_state: dict[str, Any]
    fingerprint: Any


class DistContext:
    """Gloo groups for coordination and the distributed save and load procedures."""

    def __init__(self, *, timeout: timedelta) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("distributed checkpointing needs an initialised process group")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Collective: every rank creates its Checkpointer at the same point, in the same order.
        self.ctl = dist.new_group(backend="gloo", timeout=timeout)
        self.bg = dist.new_group(backend="gloo", timeout=timeout)
        self.dcp_pool = StagingPool(cap_bytes=None, memory_fraction=1.0)

    # main-thread coordination (ctl group)
    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.ctl)

    def close(self) -> None:
        self.dcp_pool.release()

    # save -------------------------------------------------------------------------------
    def stage(self, ckpt: Checkpointer, handle: CheckpointHandle, model: Any, optimizer: Any,
              loader: Any, extra: dict[str, Any]) -> DistJob:
        """Main thread: capture and copy this rank's states; returns the background job."""
        local = capture.capture_local(loader, extra)
        skeleton, tensors, paths = flatten(local)
        part, handoff = ckpt._stage_part(rank_base(self.rank), handle, skeleton, tensors, paths)
        staged, nbytes = stage_dcp_state(model_optim_state(model, optimizer), self.dcp_pool)
        handle.nbytes += nbytes
        return DistJob(part, handoff, staged, capture.loader_fingerprint(local))

    def write(self, ckpt: Checkpointer, handle: CheckpointHandle, job: DistJob) -> None:
        """Background thread: DCP + own part to local staging, upload, then commit on rank 0."""
        stage_dir = os.path.join(ckpt._staging, handle.id)
        files: dict[str, FileEntry] = {}
        error: str | None = None
        t0 = time.perf_counter()
        try:
            ckpt._phase("write", handle)
            os.makedirs(stage_dir)
            try:
                dcp.save(
                    job.dcp_state,
                    storage_writer=FileSystemWriter(stage_dir, sync_files=True),
                    # Replicated tensors (a DDP model) are written once. DCP's default picks
                    # the least-loaded rank's copy, but DDP replicas are not identical: buffers
                    # such as BatchNorm's running stats are updated per rank and re-broadcast
                    # from rank 0 at the next forward. Rank 0's copy is the authoritative one,
                    # and the only one that makes a resumed run bit-identical.
                    planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                    process_group=self.bg,
                )
            finally:
                job.dcp_state = {}
            dcp_files = sorted(os.listdir(stage_dir))
            try:
                files = write_part(stage_dir, job.part, ckpt._pool, job.handoff)
            except BaseException:
                job.handoff.fail()
                raise
            for name in dcp_files:  # read back from the page cache: DCP wrote these itself
                checksum, size = checksum_file(os.path.join(stage_dir, name))
                files[name] = FileEntry(size, checksum)
            t1 = time.perf_counter()
            handle.timings["write_s"] = t1 - t0
            ckpt._phase("upload", handle)
            ckpt._store.make_dir(handle.id, exist_ok=True)
            for name in sorted(files):
                ckpt._store.put(os.path.join(stage_dir, name), handle.id, name, move=ckpt._move)
            ckpt._store.seal_dir(handle.id)
            handle.timings["upload_s"] = time.perf_counter() - t1
        except BaseException as exc:  # still take part in the commit round, reporting failure
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            first_error: BaseException | None = exc
        else:
            first_error = None
        finally:
            shutil.rmtree(stage_dir, ignore_errors=True)
        ckpt._phase("commit", handle)
        handle._staged.wait()  # save() returned on this rank: its stage timings are final
        t2 = time.perf_counter()
        parts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object((error, {k: (v.bytes, v.checksum) for k, v in files.items()}),
                           parts, dst=0, group=self.bg)
        outcome = None
        if self.rank == 0:
            assert parts is not None
            errors = [e for e, _ in parts if e is not None]
            if errors:
                outcome = "; ".join(errors)
            else:
                merged = {}
                for _, part_files in parts:
                    merged.update({k: FileEntry(*v) for k, v in part_files.items()})
                try:
                    manifest = Manifest(
                        id=handle.id, step=handle.step,
                        sequence=catalog.next_sequence(ckpt._store), layout="dcp",
                        world_size=self.world_size, files=merged,
                        loader_fingerprint=job.fingerprint,
                        timings={k: round(v, 6) for k, v in handle.timings.items()},
                    )
                    ckpt._store.write_manifest(handle.id, manifest.to_json())
                except BaseException as exc:
                    outcome = f"rank 0 could not write the manifest: {type(exc).__name__}: {exc}"
                    first_error = first_error or exc
            if outcome is not None:
                ckpt._discard(handle.id)
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=self.bg)
        handle.timings["commit_s"] = time.perf_counter() - t2
        if first_error is not None:
            raise first_error
        if box[0] is not None:
            raise CheckpointError(f"another rank failed: {box[0]}")

    # load -------------------------------------------------------------------------------
    def load(self, ckpt: Checkpointer, step: int | None, model: Any, optimizer: Any,
             loader: Any, extra: dict[str, Any]) -> int:
        """Collective: every rank picks the same checkpoint, verifies its share, restores."""
        if self.rank == 0:
            try:
                offer: Any = [(e.id, e.manifest.to_json()) for e in ckpt._candidates(step)]
            except CheckpointError as exc:
                offer = str(exc)
        else:
            offer = None
        offer = self.broadcast(offer)
        if isinstance(offer, str):
            raise CheckpointError(offer)
        for ckpt_id, manifest_bytes in offer:
            source = ckpt._store.url_of(ckpt_id)
            entry = Entry(ckpt_id, Manifest.from_json(manifest_bytes, source=source))
            names = sorted(entry.manifest.files)
            mine = [n for i, n in enumerate(names) if i % self.world_size == self.rank]
            problem = None
            try:
                catalog.verify_entry(ckpt._store, entry, mine)
            except CheckpointError as exc:
                problem = str(exc)
            if self.any(problem is not None):
                if self.rank == 0 or problem is not None:
                    message = f"skipping checkpoint {source}: {problem or 'another rank found damage'}"
                    if step is not None:
                        raise CheckpointError(message.replace("skipping", "cannot load"))
                    if problem is not None:
                        warn(message)
                continue
            if entry.manifest.layout == "single":
                # Saved by one process: every rank reads the whole state (plain or DDP models).
                name = f"checkpoint {source} (step {entry.step})"
                if self.rank == 0:
                    warn(f"{name} was saved by one process: all {self.world_size} ranks restore "
                         "its single RNG state and extras")
                ckpt._restore(entry, name, ckpt.read_state(entry), model, optimizer, loader, extra)
            else:
                restore_entry(ckpt, entry, model, optimizer, loader, extra, rank=self.rank,
                              world_size=self.world_size, process_group=self.ctl)
            return entry.step
        raise CheckpointError(f"{ckpt.root}: no complete checkpoint that verifies")


def restore_entry(ckpt: Checkpointer, entry: Entry, model: Any, optimizer: Any, loader: Any,
                  extra: dict[str, Any], *, rank: int, world_size: int,
                  process_group: Any = None) -> None:
    """Restore a "dcp" checkpoint (any world size, including a plain process)."""
    name = f"checkpoint {ckpt._store.url_of(entry.id)} (step {entry.step})"
    saved_world = entry.manifest.world_size
    own = rank if rank < saved_world else 0
    local = ckpt.read_state(entry, rank_base(own))
    if saved_world != world_size and loader is not None:
        # The loader's state is a global cursor (invariant I4): rank 0's fits every rank.
        local["loader"] = ckpt.read_state(entry, rank_base(0)).get("loader")
    if own != rank:
        warn(f"{name} was saved by {saved_world} ranks; rank {rank} restores the RNG and extras "
             f"of rank {own}, so its random draws differ from an uninterrupted run")
    wants = {"model": model, "optimizer": optimizer}
    capture.check_restorable(local, name, loader=loader, extra=extra, wants={})
    capture.restore_loader(loader, local, name)
    template = model_optim_state(model, optimizer)
    if template:
        reader = storage_reader(ckpt._store, entry.id, ckpt._storage_options)
        try:
            if process_group is None:
                with warnings.catch_warnings():  # "assuming ... load in a single process": yes
                    warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                    dcp.load(template, storage_reader=reader, no_dist=True)
            else:
                dcp.load(template, storage_reader=reader, process_group=process_group)
        except Exception as exc:
            missing = [k for k, v in wants.items() if v is not None]
            raise CheckpointError(f"{name}: DCP could not load {missing}: {exc}") from exc
        if model is not None:
            set_model_state_dict(model, template["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, template["optimizer"])
    capture.restore_extra(extra, local, name)
    ckpt.loaded_extra = local.get("extra", {})
    ckpt.loaded = {"step": entry.step, "id": entry.id, "url": ckpt._store.url_of(entry.id)}
    rng.restore(local["rng"], source=name)
