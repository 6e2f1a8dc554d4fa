"""Checks that FUSE can be used and that a mount point is free, with errors that say what to do.

May import: ``fuse_vfs`` (errors, binding), mfusepy (only to say whether it loads) and the standard library.
"""

from __future__ import annotations

import errno
import os
import shutil

from . import binding
from .errors import FALLBACK_HINT, FuseUnavailableError, VfsError


def fusermount() -> str | None:
    """The fusermount binary to unmount with (fusermount3 for libfuse3), or None."""
    return shutil.which("fusermount3") or shutil.which("fusermount")


def fuse_unavailable_reason() -> str | None:
    """Why FUSE cannot be used here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE kernel support, or a container without --device /dev/fuse)"
    if fusermount() is None:
        return "neither fusermount3 nor fusermount is installed (apt-get install fuse3)"
    try:
        binding.select()
    except ValueError as e:
        return str(e)
    try:
        import mfusepy  # noqa: F401
    except ImportError:
        try:
            import fuse  # noqa: F401
        except (ImportError, OSError) as e:
            return f"no FUSE binding: pip install mfusepy ({e})"
    except OSError as e:
        return f"the libfuse library cannot be loaded: {e} (apt-get install fuse3)"
    return None


def check_fuse() -> None:
    why = fuse_unavailable_reason()
    if why:
        raise FuseUnavailableError(f"FUSE is unavailable: {why}; {FALLBACK_HINT}")


def check_mountpoint(mountpoint: str | os.PathLike) -> None:
    """Refuse a missing, non-directory, already mounted, dead or non-empty mount point."""
    path = os.fspath(mountpoint)
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        raise VfsError(f"mount point {path} does not exist; create it (mkdir -p {path})") from None
    except NotADirectoryError:
        raise VfsError(f"mount point {path} is not a directory") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise VfsError(f"mount point {path} is a dead FUSE mount (its server exited); run "
                           f"`tenplex vfs unmount {path}` first") from None
        raise VfsError(f"mount point {path} cannot be used: {e}; {FALLBACK_HINT}") from None
    if os.path.ismount(path):
        raise VfsError(f"mount point {path} is in use (already a mount point); unmount it with "
                       f"`tenplex vfs unmount {path}` or choose another; {FALLBACK_HINT}")
    if entries:
        raise VfsError(f"mount point {path} is not empty ({len(entries)} entries); use an empty directory")
