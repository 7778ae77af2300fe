"""`Checkpointer`: asynchronous, verified checkpoints of model, optimizer, loader and RNG.

`save()` captures every state at the step boundary, copies its tensors into the staging pool
and returns; a background thread writes the local staging files (fsynced, hashed from memory),
puts them at the destination, writes the manifest last and applies retention. The commit
protocol and what "complete" means are in docs/checkpoint.md.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from shardloader.checkpoint import capture, catalog, rng
from shardloader.checkpoint.catalog import Entry, warn
from shardloader.checkpoint.manifest import Manifest, checkpoint_id
from shardloader.checkpoint.staging import StagingPool, plan_rounds, pool_bytes_needed
from shardloader.checkpoint.storage import LocalStore, Store, open_store
from shardloader.checkpoint.tensorfile import encode_header, plan_layout, read_tensor_file
from shardloader.checkpoint.tree import flatten, unflatten
from shardloader.checkpoint.writer import RoundHandoff, StagedPart, write_part
from shardloader.errors import CheckpointError
from shardloader.format.checksum import new_hasher, parse_checksum

log = logging.getLogger(__name__)

ON_BUSY = ("wait", "skip")
SINGLE_BASE = "state"
PHASES = ("stage", "write", "upload", "commit", "retention")

PhaseHook = Callable[[str, str, int], None]


class CheckpointHandle:
    """One `save()`: `done()`, `wait()`, and its phase timings once finished."""

    def __init__(self, step: int, ckpt_id: str | None, url: str | None, *, skipped: bool = False):
        self.step = step
        self.id = ckpt_id
        self.url = url
        self.skipped = skipped
        self.timings: dict[str, float] = {}
        self.nbytes = 0
        self._future: concurrent.futures.Future | None = None
        self._reported = False
        self._t_start = time.perf_counter()
        self._staged = threading.Event()  # save() returned: its timings are final

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete; raise CheckpointError if it failed."""
        if self._future is None:
            return
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"checkpoint {self.url} not complete after {timeout} s") from None
        except BaseException:
            self._reported = True
            raise

    @property
    def error(self) -> BaseException | None:
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    def __repr__(self) -> str:
        status = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"CheckpointHandle(step={self.step}, id={self.id!r}, {status})"


class Checkpointer:
    """Asynchronous checkpoints under `root` (a local path or any fsspec URL).

    keep: how many complete checkpoints retention keeps (None: all).
    staging_dir: local directory (NVMe) for staging files; default: `<root>/.staging` for a
        local root, else a directory under the system temp dir.
    on_busy: what `save()` does while the previous save is still in flight: "wait" (block,
        the wait is measured) or "skip" (drop the new save, counted).
    storage_options: passed to fsspec for the root.
    telemetry: any object with `log_metrics(dict, step)`; gets every save's phase timings.
    staging_bytes: hard cap on the staging pool (default: the state's size, bounded by
        `memory_fraction` of the available memory); larger states stream through it.
    distributed: use torch.distributed (default: when a process group of world size > 1 is
        initialised). Then construction is collective: every rank must create its Checkpointer
        in the same order, and save/load must be called on every rank.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int | None = 3,
        staging_dir: str | os.PathLike | None = None,
        on_busy: str = "wait",
        storage_options: dict[str, Any] | None = None,
        telemetry: Any = None,
        staging_bytes: int | None = None,
        memory_fraction: float = 0.5,
        pin_memory: bool | None = None,
        distributed: bool | None = None,
        timeout: timedelta = timedelta(minutes=30),
        _phase_hook: PhaseHook | None = None,
    ) -> None:
        if on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {ON_BUSY}, got {on_busy!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        if telemetry is not None and not callable(getattr(telemetry, "log_metrics", None)):
            raise TypeError("telemetry must have a log_metrics(dict, step) method")
        self.keep = keep
        self.on_busy = on_busy
        self.telemetry = telemetry
        self._hook = _phase_hook
        self._storage_options = storage_options
        self._store: Store = open_store(os.fspath(root), storage_options)
        self.root = self._store.url
        self._pool = StagingPool(
            cap_bytes=staging_bytes, memory_fraction=memory_fraction, pin_memory=pin_memory
        )
        self._dist = None
        if distributed is None:
            distributed = _dist_world_size() > 1
        if distributed:
            from shardloader.checkpoint.distributed import DistContext

            self._dist = DistContext(timeout=timeout)
        self.rank = self._dist.rank if self._dist else 0
        self.world_size = self._dist.world_size if self._dist else 1
        nonce = secrets.token_hex(4)
        self._nonce = self._dist.broadcast(nonce) if self._dist else nonce
        self._counter = 0
        self._staging = self._staging_root(staging_dir)
        self._move = isinstance(self._store, LocalStore) and self._store.same_device(self._staging)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardloader-ckpt")
        self._lock = threading.Lock()
        # Retention (background) never deletes a checkpoint while latest()/load() is reading
        # the catalog in this process (they would see the newest vanish mid-verification).
        self._catalog_lock = threading.Lock()
        self._inflight: CheckpointHandle | None = None
        self._closed = False
        self._stats: dict[str, Any] = {
            "started": 0, "committed": 0, "failed": 0, "skipped": 0,
            "busy_waits": 0, "busy_wait_s_total": 0.0, "retention_errors": 0,
            "last": {},
        }
        self.loaded_extra: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None
        self._startup_cleanup()

    # ------------------------------------------------------------------------------ setup
    def _staging_root(self, staging_dir: str | os.PathLike | None) -> str:
        key = hashlib.sha1(self.root.encode()).hexdigest()[:12]
        if staging_dir is not None:
            base = os.path.join(os.path.abspath(os.fspath(staging_dir)), key)
        elif isinstance(self._store, LocalStore):
            base = os.path.join(self._store.root, ".staging")
        else:
            base = os.path.join(tempfile.gettempdir(), "shardloader-checkpoint-staging", key)
        path = os.path.join(base, f"rank-{self.rank:05d}")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot create the staging directory: {exc}") from exc
        return path

    def _startup_cleanup(self) -> None:
        """Remove what crashed runs left: staged files, and checkpoints without a manifest."""
        for name in os.listdir(self._staging):
            shutil.rmtree(os.path.join(self._staging, name), ignore_errors=True)
        if self.rank == 0:
            removed = catalog.clean_incomplete(self._store)
            if removed:
                log.info("removed %d incomplete checkpoints under %s: %s", len(removed), self.root, removed)
        if self._dist:
            self._dist.barrier()

    # ------------------------------------------------------------------------------ save
    def save(self, step: int, *, model: Any = None, optimizer: Any = None, loader: Any = None,
             **extra: Any) -> CheckpointHandle:
        """Capture every state at this step boundary, stage its tensors, return a handle.

        Blocks for the copy into the staging pool (and, with on_busy="wait", for a previous
        save still in flight). Raises the error of a failed previous save instead of saving.
        """
        t_call = time.perf_counter()
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._raise_pending()
        busy = self._inflight is not None and not self._inflight.done()
        if self.on_busy == "skip" and self._dist:
            busy = self._dist.any(busy)  # every rank skips the same saves
        if busy and self.on_busy == "skip":
            with self._lock:
                self._stats["skipped"] += 1
            self._log_metrics({"checkpoint/skipped": 1.0}, step)
            return CheckpointHandle(step, None, None, skipped=True)
        busy_wait = 0.0
        if self._inflight is not None:
            t0 = time.perf_counter()
            self._wait_inflight()
            busy_wait = time.perf_counter() - t0
            if busy:
                with self._lock:
                    self._stats["busy_waits"] += 1
                    self._stats["busy_wait_s_total"] += busy_wait
        self._counter += 1
        ckpt_id = checkpoint_id(step, f"{self._nonce}{self._counter:06x}")
        handle = CheckpointHandle(step, ckpt_id, self._store.url_of(ckpt_id))
        handle._t_start = t_call
        self._phase("stage", handle)
        t_stage = time.perf_counter()
        if self._dist:
            dist_ctx = self._dist
            job = dist_ctx.stage(self, handle, model, optimizer, loader, extra)
            part, handoff = job.part, job.handoff

            def write() -> None:
                dist_ctx.write(self, handle, job)
        else:
            part, handoff, fingerprint = self._stage_single(handle, model, optimizer, loader, extra)

            def write() -> None:
                self._write_single(handle, part, handoff, fingerprint)
        with self._lock:
            self._stats["started"] += 1
        handle._future = self._executor.submit(self._run, handle, write)
        self._inflight = handle
        try:
            self._stream_rest(handle, part, handoff)
        finally:
            handle.timings["stage_s"] = time.perf_counter() - t_stage
            handle.timings["busy_wait_s"] = busy_wait
            handle.timings["blocking_s"] = time.perf_counter() - t_call
            handle._staged.set()
        return handle

    def _stage_single(self, handle, model, optimizer, loader, extra):
        state = capture.capture_local(loader, extra)
        if model is not None:
            state["model"] = _unwrap(model).state_dict()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        skeleton, tensors, paths = flatten(state)
        part, handoff = self._stage_part(SINGLE_BASE, handle, skeleton, tensors, paths)
        return part, handoff, capture.loader_fingerprint(state)

    def _stage_part(self, base: str, handle: CheckpointHandle, skeleton: Any,
                    tensors: list[torch.Tensor], paths: list[str]) -> tuple[StagedPart, RoundHandoff]:
        """Plan the tensor file, size the pool, copy the first round in. Main thread."""
        metas = plan_layout([str(i) for i in range(len(tensors))], tensors)
        doc = {"id": handle.id, "step": handle.step, "paths": paths, "state": skeleton}
        skeleton_bytes = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
        needed = pool_bytes_needed(metas)
        rounds = plan_rounds(metas, self._pool.capacity_for(needed))
        self._pool.reserve(max(16, *(r.nbytes for r in rounds)))
        part = StagedPart(base, metas, rounds, encode_header(metas), skeleton_bytes)
        self._pool.copy_in(rounds[0], tensors)
        handle._tensors = tensors if len(rounds) > 1 else None  # type: ignore[attr-defined]
        handle.nbytes = sum(m.nbytes for m in metas)
        return part, RoundHandoff(len(rounds))

    def _stream_rest(self, handle: CheckpointHandle, part: StagedPart, handoff: RoundHandoff) -> None:
        """Rounds 1.. of a state larger than the pool: wait for the writer to drain, copy.

        When the writer fails meanwhile, streaming stops; its error is raised by the next call.
        """
        tensors = getattr(handle, "_tensors", None)
        try:
            for k in range(1, len(part.rounds)):
                if not handoff.wait_drained(k - 1):
                    break
                self._pool.copy_in(part.rounds[k], tensors)
                handoff.staged()
        except BaseException:
            handoff.abort()
            handle._reported = True  # this call raises; the job's StreamAborted is not news
            raise
        finally:
            handle._tensors = None  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------- background
    def _run(self, handle: CheckpointHandle, job: Callable[[], None]) -> None:
        """Background: run the job, then retention and telemetry. Errors name the checkpoint."""
        try:
            job()
        except BaseException as exc:
            with self._lock:
                self._stats["failed"] += 1
            phase = getattr(handle, "_phase_now", "write")
            raise CheckpointError(
                f"checkpoint of step {handle.step} ({handle.url}) failed during {phase}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if self.rank == 0:  # retention and telemetry are rank 0's job
            self._phase("retention", handle)
            t0 = time.perf_counter()
            try:
                with self._catalog_lock:
                    deleted = catalog.apply_retention(self._store, self.keep)
                if deleted:
                    log.info("retention deleted %s", deleted)
            except Exception as exc:  # the new checkpoint is complete; report, do not fail it
                with self._lock:
                    self._stats["retention_errors"] += 1
                warn(f"retention under {self.root} failed after committing {handle.id}: {exc!r}")
            handle.timings["retention_s"] = time.perf_counter() - t0
        handle._staged.wait()
        handle.timings["total_s"] = time.perf_counter() - handle._t_start
        with self._lock:
            self._stats["committed"] += 1
            self._stats["last"] = {"step": handle.step, "id": handle.id, "bytes": handle.nbytes,
                                   **handle.timings}
        if self.rank == 0:
            self._log_metrics({f"checkpoint/{k}": float(v) for k, v in handle.timings.items()}
                              | {"checkpoint/bytes": float(handle.nbytes)}, handle.step)

    def _write_single(self, handle: CheckpointHandle, part: StagedPart, handoff: RoundHandoff,
                      fingerprint: Any) -> None:
        stage_dir = os.path.join(self._staging, handle.id)
        made_remote = False
        try:
            self._phase("write", handle)
            t0 = time.perf_counter()
            try:
                os.makedirs(stage_dir)
                files = write_part(stage_dir, part, self._pool, handoff)
            except BaseException:
                handoff.fail()  # a saver waiting for the pool must not wait forever
                raise
            t1 = time.perf_counter()
            handle.timings["write_s"] = t1 - t0
            self._phase("upload", handle)
            self._store.make_dir(handle.id, exist_ok=False)
            made_remote = True
            for name in part.names:
                self._store.put(os.path.join(stage_dir, name), handle.id, name, move=self._move)
            self._store.seal_dir(handle.id)
            t2 = time.perf_counter()
            handle.timings["upload_s"] = t2 - t1
            self._phase("commit", handle)
            handle._staged.wait()  # the stage timings go into the manifest too
            manifest = Manifest(
                id=handle.id, step=handle.step, sequence=catalog.next_sequence(self._store),
                layout="single", world_size=1, files=files, loader_fingerprint=fingerprint,
                timings={k: round(v, 6) for k, v in handle.timings.items()},
            )
            self._store.write_manifest(handle.id, manifest.to_json())
            handle.timings["commit_s"] = time.perf_counter() - t2
        except BaseException:
            if made_remote:
                self._discard(handle.id)
            raise
        finally:
            shutil.rmtree(stage_dir, ignore_errors=True)

    def _discard(self, ckpt_id: str) -> None:
        """Best effort removal of a failed checkpoint (it has no manifest: never listed)."""
        try:
            self._store.delete(ckpt_id)
        except Exception as exc:
            log.warning("could not remove failed checkpoint %s (startup cleanup will): %r",
                        self._store.url_of(ckpt_id), exc)

    def _phase(self, phase: str, handle: CheckpointHandle) -> None:
        handle._phase_now = phase  # type: ignore[attr-defined]
        if self._hook is not None:
            self._hook(phase, handle.id, handle.step)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.telemetry is None:
            return
        try:
            self.telemetry.log_metrics(metrics, step)
        except Exception as exc:  # telemetry must never break checkpointing
            log.warning("telemetry.log_metrics failed: %r", exc)

    # ---------------------------------------------------------------------------- errors, wait
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"Checkpointer for {self.root} is closed")

    def _wait_inflight(self) -> None:
        handle = self._inflight
        if handle is None:
            return
        concurrent.futures.wait([handle._future])
        self._raise_pending()

    def _raise_pending(self) -> None:
        """Raise the error of a finished, failed save that was not reported yet."""
        handle = self._inflight
        if handle is None or not handle.done():
            return
        self._inflight = None
        error = handle.error
        if error is not None and not handle._reported:
            handle._reported = True
            raise error

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise if it failed."""
        self._wait_inflight()

    def close(self) -> None:
        """Wait for the save in flight, stop the writer, free the pool. Raises a pending error."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._pool.release()
            if self._dist:
                self._dist.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception as close_exc:
                log.error("closing the checkpointer after an error also failed: %r", close_exc)

    # ---------------------------------------------------------------------------- listing
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (manifest present and intact), in commit order.

        Content is not verified here (see `latest`)."""
        return [e.step for e in catalog.list_complete(self._store)]

    def latest(self, *, verify: bool = True) -> int | None:
        """The step of the newest complete checkpoint whose files verify, or None.

        A checkpoint that fails verification is skipped with a CheckpointWarning naming it.
        """
        entry = self._latest_entry(verify=verify)
        return None if entry is None else entry.step

    def _latest_entry(self, *, verify: bool) -> Entry | None:
        with self._catalog_lock:
            return self._latest_entry_locked(verify=verify)

    def _latest_entry_locked(self, *, verify: bool) -> Entry | None:
        for entry in reversed(catalog.list_complete(self._store)):
            if not verify:
                return entry
            try:
                catalog.verify_entry(self._store, entry)
                return entry
            except CheckpointError as exc:
                warn(f"skipping checkpoint {self._store.url_of(entry.id)}: {exc}")
        return None

    def stats(self) -> dict[str, Any]:
        """Counts (started, committed, failed, skipped, busy waits), the last save's phase
        timings in seconds, and the staging pool's size."""
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
        out["pool_bytes"] = self._pool.size
        out["pool_allocations"] = self._pool.allocations
        out["pinned"] = self._pool.pin_memory
        out["in_flight"] = self._inflight is not None and not self._inflight.done()
        return out

    # ---------------------------------------------------------------------------- load
    def load(self, step: int | None = None, *, model: Any = None, optimizer: Any = None,
             loader: Any = None, **extra: Any) -> int:
        """Restore every state from checkpoint `step` (default: the newest that verifies).

        Model, optimizer, loader, extras (Stateful objects, dicts and lists, in place) and the
        global RNGs are restored, so training continues as if never interrupted. Returns the step.
        """
        self._check_open()
        self._wait_inflight()
        if self._dist:
            return self._dist.load(self, step, model, optimizer, loader, extra)
        with self._catalog_lock:
            return self._load_single_process(step, model, optimizer, loader, extra)

    def _load_single_process(self, step: int | None, model: Any, optimizer: Any, loader: Any,
                             extra: dict[str, Any]) -> int:
        for entry in self._candidates(step):
            name = f"checkpoint {self._store.url_of(entry.id)} (step {entry.step})"
            try:
                if entry.manifest.layout == "single":
                    state = self.read_state(entry)
                else:  # written by several ranks: DCP reads the model/optimizer files itself
                    catalog.verify_entry(self._store, entry)
            except CheckpointError as exc:
                if step is not None:
                    raise
                warn(f"skipping checkpoint {self._store.url_of(entry.id)}: {exc}")
                continue
            if entry.manifest.layout == "single":
                self._restore(entry, name, state, model, optimizer, loader, extra)
            else:
                from shardloader.checkpoint.distributed import restore_entry

                restore_entry(self, entry, model, optimizer, loader, extra, rank=0, world_size=1)
            return entry.step
        raise CheckpointError(f"{self.root}: no complete checkpoint that verifies")

    def _candidates(self, step: int | None) -> list[Entry]:
        entries = list(reversed(catalog.list_complete(self._store)))
        if step is None:
            if not entries:
                raise CheckpointError(f"{self.root}: no complete checkpoint to load")
            return entries
        chosen = [e for e in entries if e.step == step]
        if not chosen:
            raise CheckpointError(
                f"{self.root}: no complete checkpoint of step {step} "
                f"(complete steps: {sorted({e.step for e in entries})})"
            )
        return chosen[:1]

    def read_state(self, entry: Entry, base: str = SINGLE_BASE) -> dict[str, Any]:
        """Read and verify one part (`<base>.safetensors` + `<base>.json`) into a state tree."""
        tensor_name, json_name = f"{base}.safetensors", f"{base}.json"
        files = entry.manifest.files
        for name in (tensor_name, json_name):
            if name not in files:
                raise CheckpointError(f"{self._store.url_of(entry.id)}: manifest lists no {name}")
        tensors = self._read_tensors(entry, tensor_name)
        url = self._store.url_of(f"{entry.id}/{json_name}")
        raw = self._store.read_verified(entry.id, json_name, files[json_name])
        try:
            doc = json.loads(raw.numpy().tobytes())
            skeleton = doc["state"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{url}: state file is malformed: {exc}") from None
        if sorted(tensors, key=int) != [str(i) for i in range(len(tensors))]:
            raise CheckpointError(f"{url}: tensor names are not 0..{len(tensors) - 1}")
        return unflatten(skeleton, [tensors[str(i)] for i in range(len(tensors))], source=url)

    def _read_tensors(self, entry: Entry, name: str) -> dict[str, torch.Tensor]:
        file_entry = entry.manifest.files[name]
        url = self._store.url_of(f"{entry.id}/{name}")
        size = self._store.checked_size(entry.id, name, file_entry)
        algorithm, _ = parse_checksum(file_entry.checksum)
        hasher = new_hasher(algorithm)
        try:
            with self._store.open(entry.id, name) as f:
                tensors = read_tensor_file(f, size=size, hasher=hasher, source=url)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (checkpoint does not verify)") from None
        self._store.check_digest(url, algorithm, hasher, file_entry)
        return tensors

    def _restore(self, entry: Entry, name: str, state: dict[str, Any], model: Any,
                 optimizer: Any, loader: Any, extra: dict[str, Any]) -> None:
        capture.check_restorable(state, name, loader=loader, extra=extra,
                                 wants={"model": model, "optimizer": optimizer})
        capture.restore_loader(loader, state, name)
        if model is not None:
            capture.restore_module(_unwrap(model), state["model"], name)
        if optimizer is not None:
            capture.restore_optimizer(optimizer, state["optimizer"], name)
        capture.restore_extra(extra, state, name)
        self.loaded_extra = state.get("extra", {})
        self.loaded = {"step": entry.step, "id": entry.id, "url": self._store.url_of(entry.id)}
        rng.restore(state["rng"], source=name)

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, keep={self.keep}, on_busy={self.on_busy!r})"


def _unwrap(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel (whose keys lack 'module.')."""
    return getattr(model, "module", model) if type(model).__name__ in (
        "DistributedDataParallel", "DataParallel") else model


def _dist_world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 0
