"""Datasets that live on another host's tenplex store, read through its gRPC service with a local cache.

May import: ``tenplex.store.client`` and grpc (lazily, when a remote dataset is
opened), ``tenplex.dataset`` (format, source), numpy and the standard library.

The store serves files under ``<store root>/datasets/``; a dataset there is named
by its path relative to that directory. Record files are fetched in aligned
blocks of ``BLOCK_BYTES`` and kept in a local cache directory (one file per
block, written aside and renamed, so a crash never leaves half a block). The
cache is keyed by the dataset identity, so a re-packed dataset never reuses
stale blocks; each sample is still verified against its crc32 by the readers.

Only packed datasets (``tenplex data pack``) can be remote, not the sources read in
place (``inplace``): the store serves files by name and cannot list a directory
(a source's shards, Parquet files or Arrow files are found by listing), and a
source's identity and index take one pass over every byte (whole-file sha256s,
a crc32 per sample), which remotely would pull the whole dataset to every host
that opens it. A packed dataset carries both in ``dataset.json`` and its index,
so a remote open reads two small files. ``REMOTE_NEEDS_PACKED`` says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
import time
from pathlib import Path, PurePosixPath

from .format import METADATA_NAME, DatasetError, DatasetInfo, open_packed, safe_name

BLOCK_BYTES = 4 << 20
REMOTE_NEEDS_PACKED = ("not a tenplex dataset (no dataset.json): a remote (--store) dataset must be packed; for a "
                       "Hugging Face, Parquet, WebDataset or Megatron source run `tenplex data pack --from "
                       "hf|parquet|webdataset|megatron SRC OUT` where it lies and put OUT under the store's "
                       "datasets/ directory")
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
                 block_bytes: int = BLOCK_BYTES, stats: dict[str, tuple[int, int]] | None = None):
        """``stats`` maps record file names to (size, mtime) already fetched by the caller."""
        self.client, self.info, self.remote_root = client, info, remote_root
        self.block_bytes = block_bytes
        self.cache = cache_dir / info.identity[:32]
        self.cache.mkdir(parents=True, exist_ok=True)
        stats = stats or {}
        self._stats = [stats.get(f.name) or self._stat(i) for i, f in enumerate(info.files)]
        self._checked, self._last_change = time.monotonic(), None  # type: float, str | None
        self._lock = threading.Lock()
        self.remote_reads = 0  # blocks fetched from the store (the rest came from the cache)

    def _remote(self, file_no: int) -> str:
        return str(self.remote_root / self.info.files[file_no].name)

    def _stat(self, file_no: int) -> tuple[int, int]:
        st = self.client.stat_file(self._remote(file_no))
        return st["size"], st["mtime"]

    def _fetch_block(self, file_no: int, block: int, path: Path) -> bytes:
        """Fetch a whole block from the store and cache it (written aside and renamed)."""
        size = self.info.files[file_no].bytes
        start = block * self.block_bytes
        data = self.client.read_file(self._remote(file_no), start, min(self.block_bytes, size - start))
        with self._lock:
            self.remote_reads += 1
        fd, tmp = tempfile.mkstemp(dir=self.cache, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return data

    def _block_range(self, file_no: int, block: int, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of one block: only that range is read on a cache hit."""
        path = self.cache / f"{self.info.files[file_no].name}.{block}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return bytes(memoryview(self._fetch_block(file_no, block, path))[start:start + length])
        try:
            data = os.pread(fd, length, start)
        finally:
            os.close(fd)
        if len(data) != length:  # blocks are only ever renamed into place whole, so this is corruption
            raise OSError(errno.EIO, f"cached block {path} is shorter than expected "
                                     f"(wanted {length} bytes at {start}, got {len(data)}); delete it")
        return data

    def read(self, file_no: int, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        parts, end = [], offset + length
        while offset < end:
            block, start = divmod(offset, self.block_bytes)
            n = min(self.block_bytes - start, end - offset)
            parts.append(self._block_range(file_no, block, start, n))
            offset += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

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

    stats: dict[str, tuple[int, int]] = {}  # kept so RemoteRecords need not stat every file again

    def file_size(path: Path) -> int:
        st = missing_as_file_not_found(lambda: client.stat_file(str(remote_root / path.name)))
        stats[path.name] = (st["size"], st["mtime"])
        return st["size"]

    try:
        root = Path(f"{address}:{remote_root}")
        try:  # first, so that an in-place source on the store is refused saying what to do instead
            missing_as_file_not_found(lambda: client.stat_file(str(remote_root / METADATA_NAME)))
        except FileNotFoundError:
            raise DatasetError(f"{root}: {REMOTE_NEEDS_PACKED}") from None
        info = open_packed(root, read_bytes=read_bytes, file_size=file_size)
        cache = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "tenplex-dataset-cache"
        return info, RemoteRecords(client, info, remote_root, cache, stats=stats)
    except BaseException:
        client.close()
        raise
