"""Tensor files in the safetensors layout, written in a stream and read without pickle.

Layout (the published safetensors format, so `safetensors` and its tools can open our files):
an 8-byte little-endian header length, a JSON header padded with spaces to a multiple of 8
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}}`), then the tensors' raw bytes,
packed without holes. We write it ourselves instead of calling `safetensors.torch.save`
because the writer streams bytes from the staging pool in pieces (the header depends only on
dtypes and shapes, so it is written first), and hashes them on the way.

Tensors are laid out in order of decreasing element size, so that every tensor starts at an
offset aligned to its element size and can be viewed in place after reading.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from shardloader.checkpoint.fields import is_nonneg_int
from shardloader.errors import CheckpointError
from shardloader.io.jsondata import parse_json

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
    torch.complex128: "C128",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_MAX_HEADER = 100 << 20
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor's bytes sit in the data section of a tensor file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offset into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def dtype_code(dtype: torch.dtype, *, where: str) -> str:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise CheckpointError(f"{where}: tensors of dtype {dtype} cannot be saved") from None


def plan_layout(names: list[str], tensors: list[torch.Tensor]) -> list[TensorMeta]:
    """Metas in file order: decreasing element size, then the given order (stable)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    metas = [None] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        dtype_code(t.dtype, where=names[i])
        nbytes = t.numel() * t.element_size()
        metas[i] = TensorMeta(names[i], t.dtype, tuple(t.shape), offset, offset + nbytes)
        offset += nbytes
    return metas  # type: ignore[return-value]


def file_order(metas: list[TensorMeta]) -> list[int]:
    """Indices of `metas` in the order their bytes appear in the file."""
    return sorted(range(len(metas)), key=lambda i: metas[i].begin)


def encode_header(metas: list[TensorMeta], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length prefix and the padded JSON header."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for m in metas:
        header[m.name] = {
            "dtype": _DTYPE_CODES[m.dtype],
            "shape": list(m.shape),
            "data_offsets": [m.begin, m.end],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def data_size(metas: list[TensorMeta]) -> int:
    return max((m.end for m in metas), default=0)


def decode_header(prefix: bytes, *, source: str, file_size: int) -> tuple[int, list[TensorMeta]]:
    """Parse and validate the header from the first bytes of a file of `file_size` bytes.

    Returns `(data_start, metas)`. `prefix` must hold at least the header; call
    `header_length` first to know how much to read.
    """
    n = header_length(prefix[:8], source=source, file_size=file_size)
    header = parse_json(bytes(prefix[8 : 8 + n]), what=f"{source}: tensor file header",
                        error=CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{source}: tensor file header is not a JSON object")
    header.pop("__metadata__", None)
    metas = []
    for name, entry in header.items():
        where = f"{source}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where}: header entry must have dtype, shape, data_offsets")
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{where}: unknown dtype {entry['dtype']!r}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(is_nonneg_int(s) for s in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_nonneg_int, offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        meta = TensorMeta(name, dtype, tuple(shape), offsets[0], offsets[1])
        numel = 1
        for s in shape:
            numel *= s
        if meta.end < meta.begin or meta.nbytes != numel * meta.itemsize:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} hold {meta.end - meta.begin} bytes, "
                f"shape {shape} of {dtype} needs {numel * meta.itemsize}"
            )
        metas.append(meta)
    expected = 0
    for m in sorted(metas, key=lambda m: (m.begin, m.end)):
        if m.begin != expected:
            raise CheckpointError(
                f"{source}: tensor {m.name!r} starts at byte {m.begin} of the data section, "
                f"expected {expected} (overlap or hole)"
            )
        expected = m.end
    data_start = 8 + n
    if data_start + expected != file_size:
        raise CheckpointError(
            f"{source}: header describes {expected} data bytes, the file holds "
            f"{file_size - data_start} (truncated or padded file)"
        )
    return data_start, metas


def header_length(first8: bytes, *, source: str, file_size: int) -> int:
    if len(first8) < 8:
        raise CheckpointError(f"{source}: tensor file is {file_size} bytes, too short for a header")
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > _MAX_HEADER or 8 + n > file_size:
        raise CheckpointError(f"{source}: tensor file header length {n} is impossible")
    return n


def read_tensor_file(f, *, size: int, hasher, source: str) -> dict[str, torch.Tensor]:
    """Read a whole tensor file from the binary stream `f` of `size` bytes, hashing every byte.

    Each tensor gets its own allocation (so a caller that keeps one tensor does not keep the
    whole file alive). The caller must compare the hash before using the tensors.
    """
    _, metas = read_header(f, size=size, hasher=hasher, source=source)
    out = {}
    for m in sorted(metas, key=lambda m: m.begin):
        t = torch.empty(m.shape, dtype=m.dtype)
        if m.nbytes:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < m.nbytes:
                k = f.readinto(view[done : done + _READ_CHUNK])
                if not k:
                    raise CheckpointError(f"{source}: file ends inside tensor {m.name!r} (truncated)")
                hasher.update(view[done : done + k])
                done += k
        out[m.name] = t
    if f.read(1):
        raise CheckpointError(f"{source}: file has bytes after its last tensor")
    return out


def read_header(f, *, size: int, hasher, source: str) -> tuple[int, list[TensorMeta]]:
    """Read and validate the header at the start of the stream `f` (hashing it):
    `(data_start, metas)`, the stream left at the start of the data section."""
    first8 = _read_exact(f, 8, source, hasher)
    n = header_length(first8, source=source, file_size=size)
    header = _read_exact(f, n, source, hasher)
    return decode_header(first8 + header, source=source, file_size=size)


def _read_exact(f, n: int, source: str, hasher) -> bytes:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            raise CheckpointError(f"{source}: file ends inside its header (truncated)")
        data += chunk
    hasher.update(data)
    return data
