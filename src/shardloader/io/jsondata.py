"""Parsing JSON that comes from data or checkpoints: bounded nesting, one clear error.

`index.json`, sidecar headers, a tar shard's `.json` members, a checkpoint's manifest and its
`state.json` may come from anyone. Python's `json` parses nesting by recursion, so a document
of a few hundred kilobytes of `[` raises `RecursionError`, which no caller expects (and which
escaped the checkpoint fallback). `parse_json` measures the nesting first with a linear scan
(brackets outside strings) and refuses a document nested deeper than `MAX_JSON_DEPTH` levels
before `json` sees it; any decoding failure becomes the caller's own error class, naming the
file or field (`what`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

#: The deepest nesting (arrays and objects inside each other) read from data or checkpoints.
#: Our own files nest a few levels; a checkpoint's state tree nests about three JSON levels per
#: level of the saved state (callers that read those pass a larger `max_depth`).
MAX_JSON_DEPTH = 64

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)


def json_depth(data: bytes) -> int:
    """How deep arrays and objects nest in the JSON text `data` (UTF-8): 0 for a scalar.

    Linear: strings are removed, then the running count of open brackets is taken. On
    malformed text it is an upper bound of what a parser would reach before failing.
    """
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where(np.isin(codes, _OPENERS), 1, -1).astype(np.int64)
    return int(max(0, np.cumsum(steps).max()))


def parse_json(data: str | bytes | bytearray | memoryview, *, what: str,
               error: type[Exception] = ValueError, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value in `data`, or `error("<what>: ...")` saying what is wrong with it.

    `what` names the file or field (it starts the message). Refused before parsing: nesting
    deeper than `max_depth`. Refused while parsing: bytes that are not UTF-8 or text that is
    not JSON. `RecursionError` never escapes.
    """
    if isinstance(data, str):
        raw = data.encode("utf-8", "surrogatepass")
    else:
        raw = bytes(data)
        if raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not valid JSON (not UTF-8: {exc})") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # else it cannot nest deeper
        depth = json_depth(raw)
        if depth > max_depth:
            raise error(
                f"{what}: JSON nested {depth} levels deep, more than the {max_depth} levels "
                "shardloader reads (refused before parsing: damaged or hostile data)"
            )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise error(f"{what}: not valid JSON ({type(exc).__name__}: {exc})") from None
