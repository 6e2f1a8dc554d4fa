"""The read-only FUSE filesystem: one directory per data-parallel rank, served from the record files.

May import: mfusepy (or fusepy), numpy, the standard library, ``fuse_vfs`` (binding, bufvec) and ``tenplex.dataset``.

Tree::

    /state.json               the mount: generation, world, dataset, state, dp, state file, pid, error
    /rank{r}                  symlink to .g{N}/rank{r}, N the current generation
    /.g{N}/rank{r}/data       rank r's remaining samples of the epoch, back to back (zero-copy view)
    /.g{N}/rank{r}/index.npy  (n, 4) int64: sample id, offset in data, length, crc32
    /.g{N}/rank{r}/state.json the rank's view: state, dp, rank, generation, micro-batch sizes

A *generation* is one immutable view (state + dp degree). Switching replaces the
current generation with one assignment, so a lookup sees either the old or the
new tree, and ``.g{N}`` of older generations disappears. Because every
generation has its own paths, it has its own inodes and page cache: the kernel
may cache a view's bytes, and a cached page is always of the generation its
file was opened in. A file handle belongs to that generation: once a newer one
is current, reads that reach this process fail with ESTALE, so a reader of an
old handle gets old bytes or a clear error, never a mix. If the dataset changes
under the mount, every open and uncached read fails with EIO and
``/state.json`` says why.

Reads of ``data`` return a ``fuse_bufvec`` of (record file descriptor, offset,
length) pieces (``fuse_vfs.bufvec``): libfuse copies straight from the record files, so
no sample passes through Python and nothing is duplicated on disk.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import re
import sys
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from tenplex.dataset.format import DatasetInfo
from tenplex.dataset.source import RecordSource
from tenplex.dataset.state import DatasetState
from tenplex.dataset.view import DATA_NAME, RANK_FILES, STATE_NAME, RankView, build_view

from . import binding
from .bufvec import BUF, PieceTable, memory_bufvec

binding.select()  # before the first import of mfusepy: it loads its libfuse when imported
try:
    import mfusepy as fuse
except ImportError:  # pragma: no cover - the unmaintained fusepy has the same API
    import fuse

# "major.minor" of the libfuse in use (fusepy only runs on libfuse2).
LIBFUSE_VERSION = f"{getattr(fuse, 'fuse_version_major', 2)}.{getattr(fuse, 'fuse_version_minor', 9)}"

ROOT_FORMAT = "tenplex.vfs/1"
# Largest read request. libfuse3 gets the kernel to send requests this large (libfuse2: 128 KiB), and
# splices them: record pages go into a pipe and from there into the reply, saving a copy. That pipe
# must hold the request plus a page per piece, and an unprivileged pipe stops at 1 MiB
# (/proc/sys/fs/pipe-max-size): with 1 MiB requests libfuse would always fall back to copying.
MAX_READ = 896 << 10
# Sizes and the rank directories change on a switch: the kernel must never cache them.
MOUNT_OPTIONS = {"ro": True, "fsname": "tenplex", "max_read": MAX_READ,
                 "attr_timeout": 0, "entry_timeout": 0, "negative_timeout": 0}
_RANK_DIR = re.compile(r"^rank(0|[1-9][0-9]{0,8})$")


def _gen_dir(gen: "Generation") -> str:
    return f".g{gen.number}"


_CAP_SPLICE_WRITE = 1 << 7                # FUSE_CAP_SPLICE_WRITE (fuse_common.h, libfuse2 and 3)
_CAP_AUTO_INVAL_DATA = 1 << 12            # FUSE_CAP_AUTO_INVAL_DATA (fuse_common.h)
if hasattr(fuse, "fuse_buf"):
    assert ctypes.sizeof(fuse.fuse_buf) == BUF.itemsize, "unexpected struct fuse_buf layout"


@dataclass(frozen=True)
class Generation:
    number: int
    state: DatasetState
    dp: int
    views: tuple[RankView, ...]
    files: tuple[dict[str, bytes], ...]  # per rank: index.npy and state.json contents
    created_ns: int = field(default_factory=time.time_ns)
    pieces: tuple[PieceTable, ...] = ()  # per rank, when the records have descriptors (set by TenplexFS)
    world: str | None = None             # the elastic job's world that switched to it (tenplex run)


def build_generation(info: DatasetInfo, state: DatasetState, dp: int, number: int,
                     world: str | None = None) -> Generation:
    views = tuple(build_view(info, state, dp, r, number, world) for r in range(dp))
    files = tuple({"index.npy": v.index_npy(), STATE_NAME: v.state_json()} for v in views)
    return Generation(number, state, dp, views, files, world=world)


@dataclass
class _Handle:
    generation: Generation
    rank: int | None       # None: the root state.json
    name: str
    content: bytes = b""   # snapshot of a small file at open time


class TenplexFS(fuse.Operations):
    use_ns = True

    def __init__(self, info: DatasetInfo, source: RecordSource, generation: Generation,
                 root_doc: Callable[[], dict[str, Any]], on_init: Callable[[], None] = lambda: None):
        self.info, self.source = info, source
        self.error: str | None = None  # set when the dataset changed under the mount; never cleared
        self._root_doc, self._on_init = root_doc, on_init
        self._handles: dict[int, _Handle] = {}
        self._ids = itertools.count(1)
        self._fds = None
        if all(source.fileno(i) is not None for i in range(len(info.files))):
            self._fds = np.array([source.fileno(i) for i in range(len(info.files))], dtype=np.int32)
        self._uid, self._gid = os.getuid(), os.getgid()
        self.generation = self._with_pieces(generation)

    # -- switching -------------------------------------------------------------------------------
    def switch(self, generation: Generation) -> None:
        """Make ``generation`` current: one reference assignment, so lookups see old or new, never both."""
        self.generation = self._with_pieces(generation)

    def _with_pieces(self, gen: Generation) -> Generation:
        # Built before the switch, so the first reads of a new view pay nothing for it.
        if self._fds is None:
            return gen
        return replace(gen, pieces=tuple(PieceTable(view, self._fds) for view in gen.views))

    def fail(self, why: str) -> None:
        self.error = why

    # -- lookups -----------------------------------------------------------------------------------
    def _parse(self, path: str, gen: Generation) -> tuple[str, int | None, str | None]:
        """(kind, rank, file) of a path of the current tree; ENOENT for anything else.

        kind: "root" (the root or its state.json), "link" (``rank{r}`` -> ``.g{N}/rank{r}``),
        "gen" (``.g{N}``), or "view" (``.g{N}/rank{r}`` and its files). Only the current N exists.
        """
        parts = path.strip("/").split("/") if path != "/" else []
        if not parts:
            return "root", None, None
        if parts == [STATE_NAME]:
            return "root", None, STATE_NAME
        rank = self._rank(parts[0], gen)
        if rank is not None and len(parts) == 1:
            return "link", rank, None
        if parts[0] == _gen_dir(gen):
            if len(parts) == 1:
                return "gen", None, None
            rank = self._rank(parts[1], gen)
            if rank is not None and len(parts) == 2:
                return "view", rank, None
            if rank is not None and len(parts) == 3 and parts[2] in RANK_FILES:
                return "view", rank, parts[2]
        raise fuse.FuseOSError(errno.ENOENT)

    @staticmethod
    def _rank(name: str, gen: Generation) -> int | None:
        match = _RANK_DIR.match(name)
        return int(match.group(1)) if match and int(match.group(1)) < gen.dp else None

    def _size(self, gen: Generation, rank: int | None, name: str) -> int:
        if rank is None:
            return len(self._root_json())
        if name == DATA_NAME:
            return gen.views[rank].data_size
        return len(gen.files[rank][name])

    def _root_json(self) -> bytes:
        return json.dumps(self._root_doc(), separators=(",", ":")).encode()

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        handle = self._handles.get(fh.fh) if fh is not None and hasattr(fh, "fh") else None
        rank: int | None
        name: str | None
        if handle is not None and handle.rank is not None:  # fstat of an open file: its own generation
            gen, kind, rank, name = handle.generation, "view", handle.rank, handle.name
        else:
            gen = self.generation
            kind, rank, name = self._parse(path, gen)
        times = {"st_mtime": gen.created_ns, "st_ctime": gen.created_ns, "st_atime": gen.created_ns}
        owner = {"st_uid": self._uid, "st_gid": self._gid}
        if kind == "link":
            target = self._link_target(gen, rank)
            return {"st_mode": stat.S_IFLNK | 0o777, "st_nlink": 1, "st_size": len(target), **times, **owner}
        if name is None:
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, **times, **owner}
        return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": self._size(gen, rank, name),
                **times, **owner}

    @staticmethod
    def _link_target(gen: Generation, rank: int | None) -> str:  # rank is set for every "link" path
        return f"{_gen_dir(gen)}/rank{rank}"

    def readlink(self, path: str) -> str:
        gen = self.generation
        kind, rank, _ = self._parse(path, gen)
        if kind != "link":
            raise fuse.FuseOSError(errno.EINVAL)
        return self._link_target(gen, rank)

    def readdir(self, path: str, fh: Any) -> list[str]:
        gen = self.generation
        kind, rank, name = self._parse(path, gen)
        if name is not None or kind == "link":
            raise fuse.FuseOSError(errno.ENOTDIR)
        ranks = [f"rank{r}" for r in range(gen.dp)]
        if kind == "root":   # the generation directory stays out of listings: ranks are what users see
            return [".", "..", STATE_NAME, *ranks]
        if kind == "gen":
            return [".", "..", *ranks]
        return [".", "..", *RANK_FILES]

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0, "f_bavail": 0,
                "f_files": 0, "f_ffree": 0, "f_namemax": 255}

    # -- files ------------------------------------------------------------------------------------
    def open(self, path: str, fi: Any) -> int:
        if fi.flags & os.O_ACCMODE != os.O_RDONLY or fi.flags & (os.O_TRUNC | os.O_CREAT):
            raise fuse.FuseOSError(errno.EROFS)
        gen = self.generation
        kind, rank, name = self._parse(path, gen)
        if name is None:
            raise fuse.FuseOSError(errno.EISDIR)
        if rank is not None and self.error:
            raise fuse.FuseOSError(errno.EIO)
        if rank is None:
            content = self._root_json()
        elif name == DATA_NAME:
            content = b""
        else:
            content = gen.files[rank][name]
        fh = next(self._ids)
        self._handles[fh] = _Handle(gen, rank, name, content)
        fi.fh = fh
        # A view file's path names its generation and its bytes never change, so the kernel may keep
        # its pages across opens (warm re-reads never reach this process); a newer generation has
        # other paths, hence other inodes and caches. The root state.json changes: never cache it.
        fi.keep_cache = int(rank is not None)
        fi.direct_io = int(rank is None)
        return 0

    def _handle(self, fi: Any) -> _Handle:
        handle = self._handles.get(fi.fh if hasattr(fi, "fh") else fi)
        if handle is None:
            raise fuse.FuseOSError(errno.EBADF)
        if handle.rank is not None:
            if self.error:
                raise fuse.FuseOSError(errno.EIO)
            if handle.generation is not self.generation:
                raise fuse.FuseOSError(errno.ESTALE)
        return handle

    def read_buf(self, path: str, bufpp: Any, size: int, offset: int, fi: Any) -> int:
        handle = self._handle(fi)
        if handle.name != DATA_NAME or handle.rank is None:
            ptr = memory_bufvec(handle.content[offset:offset + size])
        elif handle.generation.pieces:
            ptr = handle.generation.pieces[handle.rank].bufvec(offset, size)
        else:  # a remote source has no descriptors: gather the pieces into one buffer
            ptr = memory_bufvec(self._gather(*handle.generation.views[handle.rank].segments(offset, size)))
        bufpp[0] = ctypes.cast(ptr, ctypes.POINTER(fuse.fuse_bufvec))
        return 0

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        """Copying read, used only by bindings without ``read_buf`` (fusepy)."""
        handle = self._handle(fi)
        if handle.name != DATA_NAME or handle.rank is None:
            return handle.content[offset:offset + size]
        return self._gather(*handle.generation.views[handle.rank].segments(offset, size))

    def _gather(self, files: np.ndarray, pos: np.ndarray, lengths: np.ndarray) -> bytes:
        try:
            return b"".join(self.source.read(int(f), int(p), int(n)) for f, p, n in zip(files, pos, lengths))
        except OSError as e:
            raise fuse.FuseOSError(e.errno or errno.EIO) from None
        except Exception as e:  # the reader only sees EIO: say what went wrong in the server's log
            print(f"tenplex vfs: read failed, returning EIO: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            raise fuse.FuseOSError(errno.EIO) from None

    def release(self, path: str, fi: Any) -> int:
        self._handles.pop(fi.fh if hasattr(fi, "fh") else fi, None)
        return 0

    # -- lifecycle --------------------------------------------------------------------------------
    def init_with_config(self, conn: Any, config: Any) -> None:
        """mfusepy's init: size the connection, then start the watcher."""
        if conn is not None and hasattr(conn, "max_read"):
            conn.max_read = MAX_READ  # libfuse3 refuses to start unless this matches the max_read option
        if conn is not None:
            # libfuse3 turns this on: with attr_timeout=0 every read would then ask us for attributes.
            # A view file never changes (its path names its generation), so its cache needs no checks.
            conn.want &= ~_CAP_AUTO_INVAL_DATA
            # Replies of record pieces are spliced from the record files: measured ~40% less server CPU.
            conn.want |= conn.capable & _CAP_SPLICE_WRITE
        self.init("/")

    def init(self, path: str) -> None:
        """fusepy's init (mfusepy calls init_with_config instead): start the watcher once mounted."""
        threading.Thread(target=self._on_init, name="tenplex-vfs-watch", daemon=True).start()
