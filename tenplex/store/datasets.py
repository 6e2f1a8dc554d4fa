"""Read-only dataset files under ``<root>/datasets/``, served by relative path.

May import: this package's ``manifest`` and the standard library. Pure path checks: a
request may name only regular files inside the datasets directory.
"""

from __future__ import annotations

import stat
from pathlib import Path

from .manifest import NotFound


def resolve_dataset_path(base: Path, relative: str, host: str) -> Path:
    """The regular file ``relative`` under ``base``; ValueError for malformed paths, PermissionError for
    paths (symlinks included) that lead outside ``base``, NotFound for missing files."""
    if not relative or relative.startswith("/") or "\\" in relative or "\0" in relative:
        raise ValueError(f"dataset path {relative!r} must be a non-empty relative path")
    if any(part in ("..", "") for part in relative.split("/")):
        raise ValueError(f"dataset path {relative!r} may not contain '..' or empty components")
    if len(relative) > 4000 or any(len(part.encode()) > 255 for part in relative.split("/")):
        raise ValueError(f"dataset path {relative[:60]!r}... ({len(relative)} characters) is too long: at most "
                         f"255 bytes per component and 4000 characters in all")
    base = base.resolve()
    path = (base / relative).resolve()
    if base != path and base not in path.parents:
        raise PermissionError(f"dataset path {relative!r} leads outside the datasets directory (symlink?)")
    try:
        st = path.stat()
    except FileNotFoundError:
        raise NotFound(f"no dataset file {relative!r} on host {host}") from None
    if not stat.S_ISREG(st.st_mode):
        raise NotFound(f"dataset path {relative!r} on host {host} is not a regular file")
    return path
