"""Split a state tree into a JSON skeleton and a list of tensors, and join them again, exactly.

Checkpoints never pickle: a state (model and optimizer `state_dict`s, loader state, plain
user state) is written as a JSON skeleton plus raw tensor bytes. The skeleton keeps every
Python type that state dicts use so that loading gives back an equal object: dicts with
non-string keys (optimizer state is keyed by int), tuples (Adam's betas, `random.getstate()`),
non-finite floats, bytes, numpy arrays and scalars, torch dtypes. Anything else is refused
with an error that names where in the state it sits, instead of being pickled.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import torch

from shardloader.errors import CheckpointError

TENSOR = "__tensor__"
NDARRAY = "__ndarray__"
TUPLE = "__tuple__"
DICT = "__dict__"
BYTES = "__bytes__"
FLOAT = "__float__"
NPSCALAR = "__npscalar__"
DTYPE = "__torch_dtype__"
MARKERS = frozenset({TENSOR, NDARRAY, TUPLE, DICT, BYTES, FLOAT, NPSCALAR, DTYPE})

_DTYPES_BY_NAME = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def flatten(obj: Any, *, where: str = "state") -> tuple[Any, list[torch.Tensor], list[str]]:
    """Return `(skeleton, tensors, paths)`: a JSON-able skeleton whose tensor leaves are
    replaced by `{"__tensor__": i}`, the tensors in order, and a readable path for each.

    `where` names the root in error messages (e.g. "model").
    """
    tensors: list[torch.Tensor] = []
    paths: list[str] = []

    def enc(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {FLOAT: repr(value)}  # 'nan', 'inf', '-inf'
        if isinstance(value, torch.Tensor):
            tensors.append(_plain_tensor(value, path))
            paths.append(path)
            return {TENSOR: len(tensors) - 1}
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise CheckpointError(f"{path}: numpy array of dtype object cannot be saved")
            raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
            tensors.append(torch.from_numpy(raw.copy()))
            paths.append(path)
            return {NDARRAY: len(tensors) - 1, "dtype": value.dtype.str, "shape": list(value.shape)}
        if isinstance(value, np.generic):
            if value.dtype.hasobject:
                raise CheckpointError(f"{path}: numpy object scalar cannot be saved")
            return {NPSCALAR: [value.dtype.str, enc(value.item(), path)]}
        if isinstance(value, torch.dtype):
            return {DTYPE: str(value).removeprefix("torch.")}
        if isinstance(value, (bytes, bytearray)):
            return {BYTES: base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, tuple):
            return {TUPLE: [enc(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not MARKERS.intersection(value):
                return {k: enc(v, f"{path}[{k!r}]") for k, v in value.items()}
            return {DICT: [[_enc_key(k, path), enc(v, f"{path}[{k!r}]")] for k, v in value.items()]}
        raise CheckpointError(
            f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be "
            "saved without pickle; give its owner a state_dict() of plain types and tensors"
        )

    def _enc_key(key: Any, path: str) -> Any:
        if key is None or isinstance(key, (bool, int, str, float, tuple)):
            if isinstance(key, tuple):
                return {TUPLE: [_enc_key(k, path) for k in key]}
            return enc(key, path)
        raise CheckpointError(f"{path}: dict key {key!r} of type {type(key).__name__} cannot be saved")

    skeleton = enc(obj, where)
    return skeleton, tensors, paths


def unflatten(skeleton: Any, tensors: list[torch.Tensor], *, source: str) -> Any:
    """Inverse of `flatten`. `source` names the file for error messages."""

    def dec(node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [dec(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            raise CheckpointError(f"{source}: {path}: unexpected JSON value {node!r}")
        marker = next((k for k in node if k in MARKERS), None)
        if marker is None:
            return {k: dec(v, f"{path}[{k!r}]") for k, v in node.items()}
        body = node[marker]
        try:
            if marker == TENSOR:
                return tensors[_index(body, len(tensors))]
            if marker == NDARRAY:
                raw = tensors[_index(body, len(tensors))].numpy()
                return raw.view(np.dtype(node["dtype"])).reshape(node["shape"]).copy()
            if marker == TUPLE:
                return tuple(dec(v, f"{path}[{i}]") for i, v in enumerate(body))
            if marker == DICT:
                return {dec(k, path): dec(v, f"{path}[{k!r}]") for k, v in body}
            if marker == BYTES:
                return base64.b64decode(body, validate=True)
            if marker == FLOAT:
                if body not in ("nan", "inf", "-inf"):
                    raise ValueError(f"not a non-finite float: {body!r}")
                return float(body)
            if marker == NPSCALAR:
                dtype, value = body
                return np.dtype(dtype).type(dec(value, path))
            if marker == DTYPE:
                return _DTYPES_BY_NAME[body]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: {path}: malformed {marker} entry {node!r}: {exc}") from None
        raise AssertionError(marker)

    return dec(skeleton, "state")


def _index(body: Any, n: int) -> int:
    if not isinstance(body, int) or isinstance(body, bool) or not 0 <= body < n:
        raise IndexError(f"tensor index {body!r} out of range (0..{n - 1})")
    return body


def _plain_tensor(t: torch.Tensor, path: str) -> torch.Tensor:
    """A plain strided tensor with the same values, or a clear error for layouts we cannot save."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        # DTensor and other subclasses are saved through torch.distributed.checkpoint.
        raise CheckpointError(
            f"{path}: tensor subclass {type(t).__name__} needs the distributed checkpoint path "
            "(run under torch.distributed with world size > 1)"
        )
    if t.layout != torch.strided:
        raise CheckpointError(f"{path}: tensors with layout {t.layout} cannot be saved")
    if t.is_meta:
        raise CheckpointError(f"{path}: meta tensors have no data to save")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t
