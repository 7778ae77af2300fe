"""The job a checkpoint root belongs to, and this process's attempt of it.

A job is every attempt that trains into one checkpoint root. Its record, `.job/job.json`, is
made by the first attempt (rank 0) and names the job; an attempt that asks for another name
(`Checkpointer(root, job="...")`) is refused before it writes anything, so two jobs never
share a root by accident. Every rank of one launch shares one attempt id (rank 0's, broadcast).

The attempt's records (`shardloader.telemetry.job.recorder`) are written locally: in the
root's `.job/` for a local root, else beside the staging directory, copied to the root's
`.job/` in the background.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import uuid
from typing import Any

from shardloader.checkpoint.storage import LocalStore, Store
from shardloader.errors import CheckpointError, FetchError
from shardloader.io.jsondata import parse_json
from shardloader.runtime.liveness import launch_time
from shardloader.telemetry.job import layout
from shardloader.telemetry.job.live import running_elsewhere
from shardloader.telemetry.job.recorder import AttemptRecorder, open_attempt

JOB_RECORD = f"{layout.JOB_DIR}/{layout.JOB_FILE}"

log = logging.getLogger(__name__)


def _job_record(store: Store, name: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """(the root's job record, made now if it has none; or None and why this job may not
    use the root). Rank 0 only."""
    where = store.url_of(JOB_RECORD)
    data = store.read_small(JOB_RECORD)
    if data is not None:
        try:
            job = parse_json(data, what=where, error=CheckpointError)
            if not isinstance(job, dict) or not isinstance(job.get("job_id"), str) \
                    or not isinstance(job.get("name"), str):
                raise CheckpointError(f"{where}: not a job record (needs job_id and name)")
        except CheckpointError as exc:
            return None, str(exc)
        if name is not None and job["name"] != name:
            return None, (f"{store.url}: this checkpoint root belongs to job {job['name']!r} "
                          f"({where}), not {name!r}; give this job a root of its own (nothing "
                          "was written or deleted)")
        return job, None
    default = store.url.rstrip("/").rsplit("/", 1)[-1] or "job"
    job = {"format": layout.FORMAT, "job_id": uuid.uuid4().hex, "name": name or default,
           "created": time.time()}
    try:
        store.write_small(JOB_RECORD, json.dumps(job).encode())
    except (OSError, FetchError) as exc:  # the first save reports an unwritable root, loudly
        log.warning("%s: could not write the job record yet (%s); the heartbeat writes it later",
                    where, exc)
    return job, None


def refuse_if_in_use(store: Store, group: Any) -> None:
    """Raise CheckpointError, before anything under the root is touched, when another process
    is writing this (local) root now: a second job would delete and load the first's
    checkpoints. Collective under torch.distributed (rank 0 looks, every rank raises)."""
    refusal = None
    if group.rank == 0 and isinstance(store, LocalStore):
        writer = running_elsewhere(os.path.join(store.root, layout.JOB_DIR))
        if writer is not None:
            refusal = (f"{store.url}: another job is writing this checkpoint root now: "
                       f"{writer.describe()}; two jobs in one root would delete and load each "
                       "other's checkpoints. Give this job a root of its own, or wait until "
                       "that one has ended (nothing was written or deleted)")
    refusal = group.broadcast(refusal)
    if refusal is not None:
        raise CheckpointError(refusal)


def open_job(store: Store, group: Any, *, name: str | None, staging_base: str) -> AttemptRecorder:
    """This rank's attempt of the job of `store`'s root (collective under torch.distributed:
    every rank gets rank 0's job and attempt id, or the same refusal)."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"job must be a non-empty name, got {name!r}")
    shared: tuple[Any, ...] = (None, None, None)
    if group.rank == 0:
        job, refusal = _job_record(store, name)
        attempt = layout.new_attempt_id(launch_time() or time.time(), secrets.token_hex(4))
        shared = (job, refusal, attempt)
    job, refusal, attempt = group.broadcast(shared)
    if refusal is not None:
        raise CheckpointError(refusal)
    if isinstance(store, LocalStore):
        job_dir, mirror = os.path.join(store.root, layout.JOB_DIR), None
    else:
        job_dir = os.path.join(staging_base, "job")

        job_bytes = json.dumps(job).encode()

        def mirror(rel: str, data: bytes) -> None:
            if group.rank == 0:  # again: its first write may have failed
                store.write_small(JOB_RECORD, job_bytes)
            store.write_small(f"{layout.JOB_DIR}/{rel}", data)

        if group.rank == 0:  # the local copy of the job record, for a report made here
            os.makedirs(job_dir, exist_ok=True)
            with open(os.path.join(job_dir, layout.JOB_FILE), "w") as f:
                json.dump(job, f)
    return open_attempt(job_dir, job_id=job["job_id"], job_name=job["name"], attempt_id=attempt,
                        rank=group.rank, world_size=group.world_size, mirror=mirror)
