"""The file-level steps of a lock-free commit (``local.Store.commit``): a private tree of hard links, published by a
rename that never replaces.

May import: the standard library only.

:func:`rename_noreplace` renames a directory onto a name only if that name is free, in one atomic step:
``renameat2(RENAME_NOREPLACE)``, on Linux (3.15+) with glibc 2.28+ and a file system that supports the flag
(ext4, xfs, btrfs, tmpfs, overlayfs...). Elsewhere it answers False and the caller falls back to a lock around a
check and a plain rename (``Store._publish``). :func:`link_tree` hard-links a staged part into a tree; where the
file system has no hard links it copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

AT_FDCWD = -100
RENAME_NOREPLACE = 1
UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)  # the kernel or this file system lacks the flag


def _load() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl < 1.2.? builds)
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load()


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (then ``FileExistsError``; nothing moved). False: this
    platform or file system cannot do it atomically (nothing moved; use a fallback)."""
    if _renameat2 is None:
        return False
    if _renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code in UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), os.fspath(src), None, os.fspath(dst))  # EEXIST: FileExistsError


@contextlib.contextmanager
def open_dir(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


NO_LINK = (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK)  # no hard link here: copy instead


def link_at(src_dir: int, dst_dir: int, name: str) -> None:
    """Hard-link the file ``name`` of the directory ``src_dir`` into ``dst_dir`` (descriptors); where the file
    system cannot, copy it, durably."""
    try:
        os.link(name, name, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
        return
    except OSError as e:
        if e.errno not in NO_LINK:
            raise
    src = os.open(name, os.O_RDONLY, dir_fd=src_dir)
    with os.fdopen(src, "rb") as fsrc, \
            os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dst_dir), "wb") as fdst:
        shutil.copyfileobj(fsrc, fdst, 1 << 20)
        fdst.flush()
        os.fsync(fdst.fileno())


def link_tree(staging: int, part: str, tree: Path, made: list[str]) -> set[str]:
    """Hard-link (where the file system cannot: copy) every file under ``part/`` of the directory ``staging`` (a
    descriptor) to ``tree/part/``; the files' paths relative to ``tree``. The directories it makes are added to
    ``made`` (not fsynced yet)."""
    def fail(error: OSError) -> None:
        raise error

    linked: set[str] = set()
    for rel, _, files, rel_fd in os.fwalk(part, dir_fd=staging, onerror=fail):
        (tree / rel).mkdir()
        made.append(rel)
        with open_dir(tree / rel) as dest:
            for name in files:
                link_at(rel_fd, dest, name)
        linked.update(f"{rel}/{name}" for name in files)
    return linked
