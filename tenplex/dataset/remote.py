"""Datasets that live on another host's tenplex store, read through its gRPC service with a local cache.

May import: ``tenplex.store.client`` (lazily, when a remote dataset is opened),
``tenplex.dataset`` (format, source), numpy and the standard library.

The store serves files under ``<store root>/datasets/``; a dataset there is named
by its path relative to that directory. Record files are fetched in aligned
blocks of ``BLOCK_BYTES`` and kept in a local cache directory (one file per
block, written aside and renamed, so a crash never leaves half a block). The
cache is keyed by the dataset identity, so a re-packed dataset never reuses
stale blocks; each sample is still verified against its crc32 by the readers.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path, PurePosixPath

from .format import DatasetError, DatasetInfo, open_dataset, safe_name

BLOCK_BYTES = 4 << 20
CHANGE_CHECK_S = 1.0  # how often changed() asks the store (it is polled by the mount's watcher)


def _relative(dataset: str) -> PurePosixPath:
    path = PurePosixPath(dataset)
    if path.is_absolute() or not path.parts:
        raise DatasetError(f"remote dataset {dataset!r} must be a path relative to the store's datasets/ directory")
    for part in path.parts:
        safe_name(part, "remote dataset path component")
    return path


class RemoteRecords:
    """Record files read from a store (``StoreClient.read_file``), cached locally in blocks."""

    def __init__(self, client, info: DatasetInfo, remote_root: PurePosixPath, cache_dir: Path,
                 block_bytes: int = BLOCK_BYTES):
        self.client, self.info, self.remote_root = client, info, remote_root
        self.block_bytes = block_bytes
        self.cache = cache_dir / info.identity[:32]
        self.cache.mkdir(parents=True, exist_ok=True)
        self._stats = [self._stat(i) for i in range(len(info.files))]
        self._checked, self._last_change = time.monotonic(), None
        self._lock = threading.Lock()
        self.remote_reads = 0  # blocks fetched from the store (the rest came from the cache)

    def _remote(self, file_no: int) -> str:
        return str(self.remote_root / self.info.files[file_no].name)

    def _stat(self, file_no: int) -> tuple[int, int]:
        st = self.client.stat_file(self._remote(file_no))
        return st["size"], st["mtime"]

    def _block(self, file_no: int, block: int) -> bytes:
        path = self.cache / f"{self.info.files[file_no].name}.{block}"
        try:
            return path.read_bytes()
        except FileNotFoundError:
            pass
        size = self.info.files[file_no].bytes
        start = block * self.block_bytes
        data = self.client.read_file(self._remote(file_no), start, min(self.block_bytes, size - start))
        with self._lock:
            self.remote_reads += 1
        fd, tmp = tempfile.mkstemp(dir=self.cache, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return data

    def read(self, file_no: int, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        first, last = offset // self.block_bytes, (offset + length - 1) // self.block_bytes
        data = b"".join(self._block(file_no, b) for b in range(first, last + 1))
        skip = offset - first * self.block_bytes
        return data[skip:skip + length]

    def fileno(self, file_no: int) -> None:
        return None  # no local descriptor: the FUSE layer gathers the bytes instead

    def changed(self) -> str | None:
        now = time.monotonic()
        if self._last_change is None and now - self._checked >= CHANGE_CHECK_S:
            self._checked = now
            for i, before in enumerate(self._stats):
                try:
                    after = self._stat(i)
                except Exception:  # an unreachable store is reported by the read that needs it
                    continue
                if after != before:
                    self._last_change = (f"{self.client.address}:{self._remote(i)} changed on the store "
                                         f"(size {before[0]} -> {after[0]})")
                    break
        return self._last_change

    def close(self) -> None:
        self.client.close()


def open_remote(address: str, dataset: str, cache_dir: str | os.PathLike | None = None,
                token: str | None = None) -> tuple[DatasetInfo, RemoteRecords]:
    """Validate the dataset ``dataset`` on the store at ``address`` and return it with its record source."""
    import grpc
    from tenplex.store.client import RemoteStoreError, StoreClient

    remote_root = _relative(dataset)
    client = StoreClient(address, token=token)

    def missing_as_file_not_found(call):
        try:
            return call()
        except RemoteStoreError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(str(e)) from None
            raise

    def read_bytes(path: Path) -> bytes:
        return missing_as_file_not_found(lambda: client.read_file(str(remote_root / path.name)))

    def file_size(path: Path) -> int:
        return missing_as_file_not_found(lambda: client.stat_file(str(remote_root / path.name))["size"])

    try:
        info = open_dataset(Path(f"{address}:{remote_root}"), read_bytes=read_bytes, file_size=file_size)
    except Exception:
        client.close()
        raise
    cache = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "tenplex-dataset-cache"
    return info, RemoteRecords(client, info, remote_root, cache)
