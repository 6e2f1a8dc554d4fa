"""Renaming a directory onto a name only if that name is free, in one atomic step: ``renameat2(RENAME_NOREPLACE)``.

May import: the standard library only.

Linux (3.15+) with glibc 2.28+ and a file system that supports the flag (ext4, xfs, btrfs, tmpfs, overlayfs...).
Elsewhere :func:`rename_noreplace` answers False and the caller falls back to a lock around a check and a plain
rename (``Store._publish``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any

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
