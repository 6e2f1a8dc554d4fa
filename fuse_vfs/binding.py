"""Which libfuse the server runs on, and the server-process tuning that makes large reads cheap.

May import: the standard library only (it must run before mfusepy is imported).

mfusepy loads its libfuse once, when it is imported, from ``FUSE_LIBRARY_PATH``
(else libfuse2, else libfuse3). We prefer libfuse3: it negotiates read
requests of up to 1 MiB with the kernel (FUSE_MAX_PAGES; we use 896 KiB, see
``fs.MAX_READ``), where libfuse2 stops at 128 KiB, so each Python call serves
7x the bytes. ``TENPLEX_LIBFUSE`` chooses:
``auto`` (default: libfuse3 when installed, else libfuse2), ``3`` or ``2``. An
explicit ``FUSE_LIBRARY_PATH`` or ``FUSE_LIBRARY_NAME`` always wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

LIBFUSE_ENV = "TENPLEX_LIBFUSE"
CHOICES = ("auto", "3", "2")
_NAMES = {"3": "fuse3", "2": "fuse"}

# mallopt parameters (malloc.h). libfuse allocates (posix_memalign) and frees a reply buffer of
# the request size for every read; glibc serves 1 MiB with a fresh mmap by default, and faulting
# in and zeroing those pages cost more than the copy itself. Keep such buffers on the heap.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 8 << 20
_TRIM_THRESHOLD = 64 << 20


def library_path(choice: str | None = None) -> str | None:
    """The libfuse to load for ``choice`` (default: ``$TENPLEX_LIBFUSE`` or auto); None if auto finds none.

    Raises ValueError for an unknown choice, or an explicit one that is not installed.
    """
    choice = choice or os.environ.get(LIBFUSE_ENV) or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{LIBFUSE_ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    order = ("3", "2") if choice == "auto" else (choice,)
    for major in order:
        path = ctypes.util.find_library(_NAMES[major])
        if path:
            return path
    if choice != "auto":
        raise ValueError(f"{LIBFUSE_ENV}={choice} but lib{_NAMES[choice]} is not installed (apt-get install "
                         f"{'fuse3' if choice == '3' else 'libfuse2'}), or unset {LIBFUSE_ENV}")
    return None


_selected: str | None = None  # the FUSE_LIBRARY_PATH that select() set, not the user


def select() -> None:
    """Point mfusepy at the chosen libfuse; must run before mfusepy is first imported in this process."""
    global _selected
    if "mfusepy" in sys.modules or "FUSE_LIBRARY_PATH" in os.environ or "FUSE_LIBRARY_NAME" in os.environ:
        return
    path = library_path()
    if path:
        os.environ["FUSE_LIBRARY_PATH"] = _selected = path


def server_env(choice: str | None = None) -> dict[str, str]:
    """The environment of a server process that should run on ``choice`` (None: as this process would)."""
    env = dict(os.environ)
    if choice is not None:
        library_path(choice)  # an unknown or missing library fails here, in the caller, not in the server
        env[LIBFUSE_ENV] = choice
        if _selected is not None and env.get("FUSE_LIBRARY_PATH") == _selected:
            del env["FUSE_LIBRARY_PATH"]  # our own earlier choice, not the user's: let the server choose
    return env


def keep_read_buffers_on_heap() -> None:
    """Make libfuse's per-request reply buffers reuse heap memory (glibc only; elsewhere a no-op)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


# The kernel caps a FUSE mount's readahead at 128 KiB, whatever libfuse asks for; a window of a few
# full-size requests lets it send them (libfuse3) and keep the next ones queued while we serve one.
READAHEAD_REQUESTS = 4


def _unescape(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash in mount points as octal escapes.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mount_device(mountpoint: str) -> str | None:
    """``major:minor`` of the filesystem mounted at ``mountpoint`` (the newest such mount), or None."""
    target, found = os.path.realpath(mountpoint), None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == target:
                found = fields[2]
    return found


def raise_readahead(mountpoint: str, kib: int) -> str | None:
    """Let the kernel read ahead ``kib`` KiB on this mount; returns why it could not, or None."""
    try:
        device = mount_device(mountpoint)
    except OSError as e:
        return f"cannot read /proc/self/mountinfo ({e.strerror})"
    if device is None:
        return f"{mountpoint} is not in /proc/self/mountinfo"
    path = f"/sys/class/bdi/{device}/read_ahead_kb"
    try:
        with open(path) as f:
            if int(f.read()) >= kib:
                return None
        with open(path, "w") as f:
            f.write(str(kib))
    except (OSError, ValueError) as e:
        return f"cannot raise the readahead window ({path}: {e}); reads stay at 128 KiB per request"
    return None
