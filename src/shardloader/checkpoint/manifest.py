"""The checkpoint manifest: written last, it is what makes a checkpoint complete.

A checkpoint directory `step-<step>-<nonce>` is complete when it holds `manifest.json`. The
manifest lists every file of the checkpoint with its size and xxh3-128 checksum, the step, the
commit sequence number (commit order, which `latest()` follows), the time, the library version
and the loader's fingerprint. It carries a checksum of its own content, so a damaged manifest is
detected like a damaged data file.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from shardloader._version import __version__
from shardloader.checkpoint.fields import is_nonneg_int
from shardloader.errors import CheckpointError, UnsafePathError
from shardloader.io.checksum import checksum_bytes, parse_checksum
from shardloader.io.jsondata import parse_json
from shardloader.io.paths import safe_relative_path

MANIFEST_NAME = "manifest.json"
FORMAT = "shardloader-checkpoint"
FORMAT_VERSION = 1
LAYOUTS = ("single", "dcp")
_ID_RE = re.compile(r"^step-(\d{10,})-([0-9a-f]{8,32})$")


def checkpoint_id(step: int, nonce: str) -> str:
    """The directory name of the checkpoint of `step`; `nonce` makes it unique (never reused)."""
    return f"step-{step:010d}-{nonce}"


def parse_id(name: str) -> int | None:
    """The step encoded in a checkpoint directory name, or None when `name` is not one."""
    m = _ID_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass
class FileEntry:
    bytes: int
    checksum: str


@dataclass
class Manifest:
    id: str
    step: int
    sequence: int
    layout: str
    world_size: int
    files: dict[str, FileEntry]
    loader_fingerprint: Any = None
    created_at: float = field(default_factory=time.time)
    library_version: str = __version__
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "id": self.id,
            "step": self.step,
            "sequence": self.sequence,
            "layout": self.layout,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "created_at_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_at)),
            "library_version": self.library_version,
            "loader_fingerprint": self.loader_fingerprint,
            "timings": self.timings,
            "files": {
                name: {"bytes": e.bytes, "checksum": e.checksum}
                for name, e in sorted(self.files.items())
            },
        }
        body["manifest_checksum"] = checksum_bytes(_canonical(body))
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> Manifest:
        """Parse and validate a manifest; any damage raises CheckpointError naming `source`."""
        body = parse_json(data, what=source, error=CheckpointError)
        if not isinstance(body, dict):
            raise CheckpointError(f"{source}: manifest is not a JSON object")
        claimed = body.pop("manifest_checksum", None)
        if not isinstance(claimed, str):
            raise CheckpointError(f"{source}: manifest has no manifest_checksum")
        if checksum_bytes(_canonical(body)) != claimed:
            raise CheckpointError(f"{source}: manifest content does not match its checksum (damaged)")
        if body.get("format") != FORMAT or body.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{source}: unknown manifest format {body.get('format')!r} "
                f"version {body.get('format_version')!r} (expected {FORMAT!r} {FORMAT_VERSION})"
            )
        try:
            files = {}
            for name, entry in body["files"].items():
                safe = safe_relative_path(name, what=f"{source}: files")
                if safe != name:
                    raise CheckpointError(f"{source}: file name {name!r} is not normalised")
                if not is_nonneg_int(entry["bytes"]):
                    raise CheckpointError(f"{source}: file {name!r} has bad size {entry['bytes']!r}")
                parse_checksum(entry["checksum"])
                files[name] = FileEntry(entry["bytes"], entry["checksum"])
            manifest = cls(
                id=_typed(body, "id", str, source),
                step=_typed(body, "step", int, source),
                sequence=_typed(body, "sequence", int, source),
                layout=_typed(body, "layout", str, source),
                world_size=_typed(body, "world_size", int, source),
                files=files,
                loader_fingerprint=body.get("loader_fingerprint"),
                created_at=float(body["created_at"]),
                library_version=_typed(body, "library_version", str, source),
                timings=dict(body.get("timings") or {}),
            )
        except (KeyError, TypeError, AttributeError, ValueError, UnsafePathError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{source}: malformed manifest ({type(exc).__name__}: {exc})") from None
        if manifest.layout not in LAYOUTS:
            raise CheckpointError(f"{source}: unknown layout {manifest.layout!r}")
        if parse_id(manifest.id) != manifest.step:
            raise CheckpointError(f"{source}: id {manifest.id!r} does not encode step {manifest.step}")
        return manifest


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _typed(body: dict[str, Any], key: str, kind: type, source: str) -> Any:
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{source}: manifest field {key!r} is {value!r}, not a {kind.__name__}")
    return value
