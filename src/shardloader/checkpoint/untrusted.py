"""Reading checkpoint bytes as data, never as code: the one place that decodes pickles.

A checkpoint directory may come from anyone (a shared bucket, a colleague, an attacker who can
also fix up the manifest's checksums: a checksum is not a signature). Our own files are JSON and
the safetensors layout (`tree`, `tensorfile`), which hold no code. Two kinds of bytes written by
`torch.distributed.checkpoint` (DCP) are pickles, and they are decoded here only:

- `.metadata`: read by `MetadataUnpickler`, which builds DCP's metadata classes, torch sizes and
  dtypes and nothing else.
- non-tensor values of the model/optimizer state (DCP stores each with `torch.save` and its
  default load planner reads them back with `torch.load(weights_only=False)`, which runs any
  code a pickle names). `decode_plain` reads them with `torch.load(weights_only=True)` and then
  accepts only plain data (`check_plain`); `PlainDataLoadPlanner` is DCP's planner with that
  decoder. `check_plain` is also the rule applied at save time, so a value that would not load
  is refused when it is saved, naming its key.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from shardloader.errors import CheckpointError

PLAIN_SCALARS = (type(None), bool, int, float, str, bytes, torch.dtype)


def check_plain(value: Any, path: str) -> None:
    """Raise CheckpointError naming `path` unless `value` is plain data.

    Plain: None, bool, int, float, str, bytes, torch dtypes, and tuples (torch.Size included),
    lists and dicts of plain data with plain scalar keys. These survive a round trip through
    `torch.save` and `torch.load(weights_only=True)` unchanged.
    """
    if isinstance(value, PLAIN_SCALARS):
        return
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            check_plain(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{path} key {k!r}")
            check_plain(v, f"{path}[{k!r}]")
        return
    raise CheckpointError(
        f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} is not plain "
        "data (None, bool, int, float, str, bytes, dtype, or lists/tuples/dicts of them) and "
        "cannot be stored in a checkpoint without pickle; store it as a tensor or plain data"
    )


def check_plain_leaves(state: Any, path: str) -> None:
    """`check_plain` on every non-tensor leaf of a (nested dict/list) DCP state."""
    if isinstance(state, torch.Tensor):
        return
    if isinstance(state, dict):
        for k, v in state.items():
            check_plain(k, f"{path} key")
            check_plain_leaves(v, f"{path}.{k}")
    elif isinstance(state, (list, tuple)) and _holds_tensor(state):
        for i, v in enumerate(state):
            check_plain_leaves(v, f"{path}[{i}]")
    else:
        check_plain(state, path)


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def decode_plain(raw: bytes | io.BytesIO, source: str) -> Any:
    """A non-tensor value DCP stored with `torch.save`, read as plain data only.

    `torch.load(weights_only=True)` refuses any global outside torch's allow-list (so nothing
    runs); `check_plain` then refuses the allow-listed types that are not plain data.
    """
    stream = io.BytesIO(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    try:
        value = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{source}: stored value is not plain data, refused without running it "
            f"({type(exc).__name__}: {first[:300]})"
        ) from None
    check_plain(value, source)
    return value


def decode_tensor(raw: bytes, source: str) -> torch.Tensor:
    """A tensor item of a DCP data file, read the way DCP reads it (`weights_only=True`)."""
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{source}: tensor item does not decode ({type(exc).__name__}: "
                              f"{first[:300]})") from None
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{source}: tensor item holds a {type(value).__name__}")
    return value


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are read as plain data only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        obj = decode_plain(value, f"DCP value {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# ------------------------------------------------------------------------------ DCP metadata
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


class MetadataUnpickler(pickle.Unpickler):
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


def read_dcp_metadata(stream: Any, source: str) -> Any:
    """DCP's `Metadata` from a `.metadata` stream, refusing anything but metadata classes."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = MetadataUnpickler(stream).load()
    except Exception as exc:  # UnpicklingError, EOFError, AttributeError, TypeError, ...
        raise CheckpointError(f"{source}: DCP metadata cannot be read safely: "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{source}: DCP metadata holds a {type(metadata).__name__}, "
                              "not DCP's Metadata")
    return metadata
