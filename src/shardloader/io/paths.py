"""Paths and URLs: validation of paths that come from untrusted data (index entries, tar member
names), joining a root and a relative path, and telling local paths from fsspec URLs."""

from __future__ import annotations

import posixpath

from shardloader.errors import UnsafePathError


def safe_relative_path(path: str, *, what: str) -> str:
    """Return `path` normalised, or raise if it could escape the directory it is relative to.

    Rejects absolute paths, drive letters, backslashes, NUL bytes, empty names and any `..`
    component. `what` names where the path came from, for the error message.
    """
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{what}: empty or non-string path {path!r}")
    if "\x00" in path:
        raise UnsafePathError(f"{what}: path {path!r} contains a NUL byte")
    if "\\" in path:
        raise UnsafePathError(f"{what}: path {path!r} contains a backslash")
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        raise UnsafePathError(f"{what}: path {path!r} is absolute; it must be relative to the root")
    parts = path.split("/")
    if ".." in parts:
        raise UnsafePathError(f"{what}: path {path!r} escapes its root with '..'")
    normalised = posixpath.normpath(path)
    if normalised in (".", "") or normalised.startswith("../"):
        raise UnsafePathError(f"{what}: path {path!r} does not name a file under the root")
    return normalised


def join_url(root: str, relative: str) -> str:
    """Join a root (local path or fsspec URL) and a validated relative path."""
    return root.rstrip("/") + "/" + relative


def is_local(url: str) -> bool:
    """True for plain paths and file:// URLs."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return protocol in ("file", "local")


def strip_file_scheme(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url
