"""One part of a checkpoint: a state tree as `<base>.safetensors` + `<base>.json`, no pickle.

Every layout stores something this way: the single-process layout its whole state (`state.*`),
the DCP layout each rank's loader, RNG and extras (`rank-<r>.*`). `stage_part` plans the tensor
file and copies the first round of tensors into the staging pool (training thread); the writer
turns the pool into files (`writer.write_part`); `read_part` reads a part back, hashing every
byte and using it only when it matches the manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

import shardloader.checkpoint.rng as rng
from shardloader.checkpoint.catalog import CatalogEntry
from shardloader.checkpoint.staging import StagingPool, plan_rounds, pool_bytes_needed
from shardloader.checkpoint.storage import Store
from shardloader.checkpoint.tensorfile import (
    TensorMeta,
    encode_header,
    plan_layout,
    read_header,
    read_tensor_file,
)
from shardloader.checkpoint.tree import flatten, unflatten
from shardloader.checkpoint.writer import RoundHandoff, StagedPart
from shardloader.errors import CheckpointError, StateError
from shardloader.io.checksum import new_hasher, parse_checksum
from shardloader.io.jsondata import json_depth, parse_json

_CHUNK = 8 << 20
#: The deepest JSON a state file may nest (about three levels per level of the saved state):
#: refused at save, so that whatever is saved loads, and before parsing at load.
STATE_JSON_DEPTH = 192


@dataclass
class Staged:
    """What `save()` hands to the writer: one rank's own part, plus whatever its layout adds."""

    part: StagedPart
    handoff: RoundHandoff
    tensors: list[torch.Tensor] | None  # kept only while later rounds must still be copied
    fingerprint: Any
    nbytes: int
    payload: dict[str, Any] = field(default_factory=dict)  # layout-specific (DCP's staged state)


def stage_part(pool: StagingPool, base: str, ckpt_id: str, step: int, state: dict[str, Any],
               fingerprint: Any) -> Staged:
    """Flatten `state` (refusing what is not plain data), plan its tensor file, size the pool
    and copy the first round in. Training thread."""
    skeleton, tensors, paths = flatten(state)
    metas = plan_layout([str(i) for i in range(len(tensors))], tensors)
    doc = {"id": ckpt_id, "step": step, "paths": paths, "state": skeleton}
    skeleton_bytes = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    if json_depth(skeleton_bytes) > STATE_JSON_DEPTH:
        raise CheckpointError(f"{base}: the state nests deeper than a checkpoint stores "
                              f"({STATE_JSON_DEPTH} JSON levels, about three per level of a dict)")
    rounds = plan_rounds(metas, pool.capacity_for(pool_bytes_needed(metas)))
    pool.reserve(max(16, *(r.nbytes for r in rounds)))
    part = StagedPart(base, metas, rounds, encode_header(metas), skeleton_bytes)
    pool.copy_in(rounds[0], tensors)
    return Staged(part, RoundHandoff(len(rounds)), tensors if len(rounds) > 1 else None,
                  fingerprint, sum(m.nbytes for m in metas))


def part_names(base: str) -> tuple[str, str]:
    return f"{base}.safetensors", f"{base}.json"


def read_part(store: Store, entry: CatalogEntry, base: str) -> dict[str, Any]:
    """Read and verify one part into a state tree; CheckpointError names what is wrong."""
    tensor_name, json_name = _listed(store, entry, base)
    tensors = _read_tensors(store, entry, tensor_name)
    raw = store.read_verified(entry.id, json_name, entry.manifest.files[json_name])
    return _decode_state(raw.numpy().tobytes(), tensors, store.url_of(f"{entry.id}/{json_name}"))


def verify_part_file(store: Store, entry: CatalogEntry, name: str) -> None:
    """Raise CheckpointError unless file `name` of a part matches the manifest and decodes
    as `read_part` would decode it (without keeping the tensors: `latest()` uses this)."""
    if name.endswith(".safetensors"):
        _check_tensor_file(store, entry, name)
    elif name.endswith(".json") and name.removesuffix(".json") + ".safetensors" in entry.manifest.files:
        tensor_name = name.removesuffix(".json") + ".safetensors"
        raw = store.read_verified(entry.id, name, entry.manifest.files[name])
        placeholders = {m.name: torch.empty(m.shape, dtype=m.dtype)  # never touched: no memory
                        for m in _tensor_header(store, entry, tensor_name)}
        _decode_state(raw.numpy().tobytes(), placeholders, store.url_of(f"{entry.id}/{name}"))
    else:
        store.verify(entry.id, name, entry.manifest.files[name])


def _listed(store: Store, entry: CatalogEntry, base: str) -> tuple[str, str]:
    names = part_names(base)
    for name in names:
        if name not in entry.manifest.files:
            raise CheckpointError(f"{store.url_of(entry.id)}: manifest lists no {name}")
    return names


def _decode_state(raw: bytes, tensors: dict[str, torch.Tensor], url: str) -> dict[str, Any]:
    try:
        doc = parse_json(raw, what=url, error=CheckpointError,
                         max_depth=STATE_JSON_DEPTH)
        skeleton = doc["state"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{url}: state file is malformed: {exc}") from None
    if sorted(tensors, key=_int_or_none) != [str(i) for i in range(len(tensors))]:
        raise CheckpointError(f"{url}: tensor names are not 0..{len(tensors) - 1}")
    state = unflatten(skeleton, [tensors[str(i)] for i in range(len(tensors))], source=url)
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        raise CheckpointError(f"{url}: state is not an object holding an RNG state")
    try:
        rng.parse(state["rng"], source=url)
    except StateError as exc:
        raise CheckpointError(str(exc)) from None
    return state


def _int_or_none(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (-1, name)


def _read_tensors(store: Store, entry: CatalogEntry, name: str) -> dict[str, torch.Tensor]:
    file_entry = entry.manifest.files[name]
    url = store.url_of(f"{entry.id}/{name}")
    size = store.checked_size(entry.id, name, file_entry)
    algorithm, _ = parse_checksum(file_entry.checksum)
    hasher = new_hasher(algorithm)
    try:
        with store.open(entry.id, name) as f:
            tensors = read_tensor_file(f, size=size, hasher=hasher, source=url)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (checkpoint does not verify)") from None
    store.check_digest(url, algorithm, hasher, file_entry)
    return tensors


def _check_tensor_file(store: Store, entry: CatalogEntry, name: str) -> None:
    """Header valid, every byte hashed, no tensor allocated."""
    file_entry = entry.manifest.files[name]
    url = store.url_of(f"{entry.id}/{name}")
    size = store.checked_size(entry.id, name, file_entry)
    algorithm, _ = parse_checksum(file_entry.checksum)
    hasher = new_hasher(algorithm)
    problem = None
    with store.open(entry.id, name) as f:
        try:
            read_header(f, size=size, hasher=hasher, source=url)
        except CheckpointError as exc:
            problem = f"{exc} (checkpoint does not verify)"
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    store.check_digest(url, algorithm, hasher, file_entry)
    if problem is not None:
        raise CheckpointError(problem)


def _tensor_header(store: Store, entry: CatalogEntry, name: str) -> list[TensorMeta]:
    if name not in entry.manifest.files:
        raise CheckpointError(f"{store.url_of(entry.id)}: manifest lists no {name}")
    url = store.url_of(f"{entry.id}/{name}")
    size = store.checked_size(entry.id, name, entry.manifest.files[name])
    with store.open(entry.id, name) as f:
        return read_header(f, size=size, hasher=new_hasher(), source=url)[1]
