"""Paths and URLs: validation of paths that come from untrusted data (index entries, tar member
names), local files that must stay inside their root through links (`resolve_inside_root`),
joining a root and a relative path, and telling local paths from fsspec URLs."""

from __future__ import annotations

import os
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


def resolve_inside_root(root: str, relative: str, *, what: str, allow_outside: bool = False) -> str:
    """The real path of the local file `root/relative`, after checking that the symbolic links
    on the way (the file's own, or a directory's) keep it inside `root`'s real path.

    A link that leads out of the root is an UnsafePathError naming `what` (the shard), the link
    and where it points, unless `allow_outside`. Links that stay inside the root, and a root
    that is itself a link, are fine. Why: the index says which files belong to a dataset, and a
    link makes any readable file (another user's data, /etc/...) pass as one of them, verified.
    """
    real_root = os.path.realpath(root)
    path = os.path.join(root, relative)
    real = os.path.realpath(path)
    if allow_outside or _is_inside(real, real_root):
        return real
    step = root
    for part in relative.split("/"):
        step = os.path.join(step, part)
        if os.path.islink(step) and not _is_inside(os.path.realpath(step), real_root):
            link, target = step, os.readlink(step)
            break
    else:  # no single link leaves, the chain does: name the file's own resolution
        link, target = path, real
    raise UnsafePathError(
        f"{what}: {link} is a symbolic link to {target!r} ({os.path.realpath(link)}), outside "
        f"the dataset root {real_root}; a shard must lie inside its root (pass "
        "allow_links_outside_root=True to Dataset or verify_dataset, or "
        "--allow-links-outside-root to `shardloader verify`, to read it anyway)"
    )


def _is_inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
