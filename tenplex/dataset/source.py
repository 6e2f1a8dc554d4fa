"""Record sources: where the bytes of a dataset's record files come from.

May import: the standard library, ``tenplex.dataset.format`` and (lazily, for
remote datasets) ``tenplex.store``'s client.

The FUSE layer and the in-process reader only ever ask a source for
``read(file_no, offset, length)``; a local source also hands out the open file
descriptor of a record file so that FUSE can serve reads from it without a copy
through Python. ``changed()`` reports when the files on disk no longer are the
files the dataset was opened with (replaced, truncated or grown), so a mount or
reader can refuse to serve a mix of old and new bytes.
"""

from __future__ import annotations

import os
import threading
import zlib
from typing import Protocol

from .format import DatasetError, DatasetInfo, check_record


class RecordSource(Protocol):
    def read(self, file_no: int, offset: int, length: int) -> bytes: ...
    def fileno(self, file_no: int) -> int | None: ...
    def changed(self) -> str | None: ...
    def close(self) -> None: ...


class LocalRecords:
    """Record files on a local filesystem, read with ``os.pread`` from descriptors opened once.

    Picklable (for DataLoader workers): descriptors are reopened lazily in each process.
    """

    def __init__(self, info: DatasetInfo):
        self.info = info
        self._fds: list[int] | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._stats = [self._stat(i) for i in range(len(info.files))]

    def _stat(self, file_no: int) -> tuple[int, int, int]:
        st = os.stat(self.info.record_path(file_no))
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _open(self) -> list[int]:
        with self._lock:
            if self._fds is None or self._pid != os.getpid():
                self._fds = [os.open(self.info.record_path(i), os.O_RDONLY | os.O_CLOEXEC)
                             for i in range(len(self.info.files))]
                self._pid = os.getpid()
            return self._fds

    def fileno(self, file_no: int) -> int:
        return self._open()[file_no]

    def read(self, file_no: int, offset: int, length: int) -> bytes:
        return os.pread(self._open()[file_no], length, offset)

    def changed(self) -> str | None:
        for i, before in enumerate(self._stats):
            path = self.info.record_path(i)
            try:
                now = self._stat(i)
            except FileNotFoundError:
                return f"{path} was removed"
            if now != before:
                return (f"{path} changed after it was opened (size {before[1]} -> {now[1]}, "
                        f"inode {before[0]} -> {now[0]})")
        return None

    def close(self) -> None:
        with self._lock:
            if self._fds is not None and self._pid == os.getpid():
                for fd in self._fds:
                    os.close(fd)
            self._fds = None

    def __getstate__(self):
        return {"info": self.info, "_stats": self._stats}

    def __setstate__(self, state):
        self.info, self._stats = state["info"], state["_stats"]
        self._fds, self._pid, self._lock = None, -1, threading.Lock()


def read_verified(source: RecordSource, info: DatasetInfo, sample: int) -> bytes:
    """Sample ``sample``'s record, checked against its length and crc32 (DatasetError names file and offset)."""
    file_no, offset, length, crc = info.index[sample].tolist()  # one conversion: this runs once per sample
    data = source.read(file_no, offset, length)
    if len(data) != length or zlib.crc32(data) != crc:  # check_record says what is wrong, naming the file
        check_record(data, info.index[sample], str(info.record_path(file_no)), sample)
    return data


def check_unchanged(source: RecordSource) -> None:
    """Raise DatasetError if the record files changed under the reader."""
    why = source.changed()
    if why:
        raise DatasetError(f"dataset changed while in use: {why}; reopen it (and re-pack if it was rewritten)")
