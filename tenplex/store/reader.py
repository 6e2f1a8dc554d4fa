"""Reading a committed version: manifest, verified shard regions, JSON documents, layouts.

May import: numpy, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.errors``, ``tenplex.layout``,
``tenplex.files`` (its JSON codec), ``tenplex._gc``, this package's ``manifest``, ``shardfile``,
``_descriptor`` and ``_safetensors`` (C-order byte spans), and the standard library.

A reader holds its version directory open (a directory descriptor) and opens
every file relative to it, so it reads exactly the version it opened: after a
delete and a new commit of the same number, :meth:`VersionReader.current` is
False and reads of the old files fail rather than mixing versions. It holds no
shard file open or mapped between reads, so deleting a version frees its space.
Any thread may close a reader while others read through it: the directory
descriptor is closed once, after the last read under way (``_descriptor``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ._safetensors import c_span, c_strides
from ._descriptor import SharedDescriptor
from .shardfile import ShardFile
from .manifest import LAYOUT_DOC, MANIFEST_FORMAT, CorruptShard, NotFound, OutOfRange, ShardEntry
from .._gc import paused_gc
from ..box import Box
from ..files import loads as parse_json
from ..dtypes import itemsize, numpy_storage
from ..errors import LayoutError, StoreError
from ..layout import Layout, from_dict as layout_from_dict


class VersionReader:
    """A committed version on this host: its manifest, shards (read with verification) and JSON documents."""

    def __init__(self, path: Path):
        self.path = path
        self._deleted = False
        self._dir = SharedDescriptor(os.open(path, os.O_RDONLY | os.O_DIRECTORY), self._closed_error)
        try:
            with self._dir.use() as dirfd:
                st = os.fstat(dirfd)
            self.identity = (st.st_dev, st.st_ino)
            try:
                doc = parse_json(self._read_bytes("manifest.json"))
                if doc.get("format") != MANIFEST_FORMAT:
                    raise StoreError(f"expected format {MANIFEST_FORMAT!r}, found {doc.get('format')!r}")
                self.version = int(doc["version"])
                self.host = doc["host"]
                self.entries = [ShardEntry.from_dict(row) for row in doc["shards"]]
                doc["json"].items()
            except (ValueError, KeyError, TypeError, AttributeError, StoreError) as e:
                raise StoreError(f"{path}/manifest.json is damaged ({type(e).__name__}: {e}); delete this "
                                 f"version or restore it from another host") from None
        except BaseException:
            self._dir.close()  # the one close: collecting this half-built reader closes nothing again
            raise
        self.manifest = doc
        self._by_device: dict[str, list[ShardEntry]] = {}
        self._by_tensor: dict[tuple[str, str], list[ShardEntry]] = {}  # (device, tensor): find's index
        self._files: dict[str, ShardFile] = {}
        for entry in self.entries:
            self._by_device.setdefault(entry.device, []).append(entry)
            self._by_tensor.setdefault((entry.device, entry.tensor), []).append(entry)
            self._files[entry.file] = ShardFile(entry, self._open, f"version {self.version} on host {self.host}, "
                                                f"device {entry.device}, tensor {entry.tensor!r}, "
                                                f"file {path}/{entry.file}")

    def _open(self, name: str) -> int:
        try:
            with self._dir.use() as dirfd:
                return os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
        except FileNotFoundError:
            if not self.current():  # its files go while a deleted version's directory is emptied
                raise self._gone() from None
            raise

    def _gone(self) -> NotFound:
        self._deleted = True
        return NotFound(f"version {self.version} on host {self.host} was deleted (or replaced by a new commit) "
                        f"while it was being read; {self.path} no longer holds what this read began")

    def _read_bytes(self, name: str) -> bytes:
        fd = self._open(name)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def current(self) -> bool:
        """Whether ``path`` still is the version directory this reader opened (not deleted or re-committed)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity and os.path.exists(self.path / "manifest.json")

    def _closed_error(self) -> StoreError:
        if self._deleted:
            return self._gone()
        return StoreError(f"the reader of {self.path} is closed")

    def close(self, deleted: bool = False) -> None:
        """Release the version directory (once the reads under way are done); the reader reads nothing
        afterwards. ``deleted``: because the version was deleted or replaced, which later reads then say. Any
        thread, any number of times."""
        self._deleted = self._deleted or deleted
        self._dir.close()

    def __del__(self) -> None:
        shared = getattr(self, "_dir", None)
        if shared is not None:
            shared.close()

    def devices(self) -> list[str]:
        return sorted(self._by_device)

    def layout_shards(self, device: str) -> list[tuple[str, Box, str]]:
        """(tensor, box, dtype) of every shard ``device`` stores in this version."""
        return [(e.tensor, e.box, e.dtype) for e in self._by_device.get(device, [])]

    def entries_of(self, device: str) -> list[ShardEntry]:
        return list(self._by_device.get(device, []))

    def find(self, device: str, tensor: str, box: Box) -> ShardEntry:
        """The stored shard of ``device`` whose box contains ``box``."""
        candidates = self._by_tensor.get((device, tensor), ())
        for e in candidates:
            if e.box.ndim == box.ndim and e.box.contains(box):
                return e
        if device not in self._by_device:
            raise NotFound(f"version {self.version} on host {self.host} holds nothing for device {device}; "
                           f"devices here: {self.devices()}")
        if not candidates:
            raise NotFound(f"device {device} holds no box of tensor {tensor!r} in version {self.version} "
                           f"on host {self.host}")
        raise OutOfRange(f"box {box} of tensor {tensor!r} lies inside no box device {device} stores "
                         f"(stored: {', '.join(str(e.box) for e in candidates)}) in version {self.version}")

    @staticmethod
    def byte_span(entry: ShardEntry, box: Box) -> tuple[int, int, tuple[int, ...]]:
        """(first data byte, bytes up to the last element, byte strides) of region ``box`` in ``entry``'s file."""
        item = itemsize(entry.dtype)
        strides = c_strides(entry.box.lengths, item)
        local = box.local(entry.box)
        return (*c_span(strides, local.offsets, local.lengths, item), strides)

    def link_file(self, entry: ShardEntry, dest: Path) -> None:
        """Hard-link ``entry``'s file of exactly this version (opened through the version's directory) to ``dest``."""
        try:
            with self._dir.use() as dirfd:
                os.link(entry.file, dest, src_dir_fd=dirfd)
        except FileNotFoundError:
            if not self.current():
                raise self._gone() from None
            raise CorruptShard(f"version {self.version} on host {self.host}, device {entry.device}, tensor "
                               f"{entry.tensor!r}: the file {self.path}/{entry.file} is gone (deleted from the "
                               f"committed version)") from None

    def shard_file(self, entry: ShardEntry) -> ShardFile:
        """The verified reader of one stored shard (for callers that stream its bytes)."""
        return self._files[entry.file]

    def region(self, entry: ShardEntry, box: Box, verified: set | None = None, digest=None) -> np.ndarray:
        """The region ``box`` (global coordinates, inside ``entry.box``) of a stored shard, read and verified:
        a C-contiguous array, unless its rows do not line up (:func:`row_geometry`) or ``digest`` is given and
        the region is not one run of the file; then a strided view of the bytes from its first to last element.

        Every block the region's bytes touch is checked. ``verified`` and ``digest`` (fed the bytes read, in
        order: from the region's first to its last element): see ``ShardFile.read_into``."""
        dtype = np.dtype(numpy_storage(entry.dtype))
        out = np.empty(box.lengths, dtype)
        if box.is_empty() or self._fill(entry, box, out, verified, digest):
            return out
        start, span, strides = self.byte_span(entry, box)
        buffer = np.empty(span, np.uint8)
        self._files[entry.file].read_into(start, memoryview(buffer), verified=verified, digest=digest)
        return np.ndarray(box.lengths, dtype=dtype, buffer=buffer, strides=strides)

    def _fill(self, entry: ShardEntry, box: Box, target: np.ndarray, verified: set | None = None,
              digest=None) -> bool:
        """Read region ``box`` straight into ``target`` (its shape, the stored item size, any strides); False,
        with nothing read, when that needs an intermediate buffer (the caller reads the span instead).

        One contiguous run of the file into a contiguous target is ``pread`` in place; rows that line up in
        both (:func:`row_geometry`) are copied from each verified piece while it is in cache."""
        start, span, strides = self.byte_span(entry, box)
        file = self._files[entry.file]
        if target.flags.c_contiguous and span == target.nbytes:
            file.read_into(start, memoryview(target.reshape(-1).view(np.uint8)), verified=verified, digest=digest)
            return True
        rows = None if digest is not None else row_geometry(box.lengths, strides, target.strides, target.itemsize)
        if rows is None:
            return False
        count, run, src_stride, dst_stride = rows
        first_item = target[tuple(slice(0, 1) for _ in box.lengths)].reshape(1).view(np.uint8)
        file.read_rows(start, src_stride, np.lib.stride_tricks.as_strided(first_item, (count, run), (dst_stride, 1)),
                       verified)
        return True

    def array(self, entry: ShardEntry) -> np.ndarray:
        """The whole stored shard, read and verified."""
        return self.region(entry, entry.box)

    def read(self, device: str, tensor: str, box: Box) -> np.ndarray:
        """The region ``box`` (global coordinates) of ``device``'s shard, read into memory; every block of the
        file it touches is verified (:class:`CorruptShard` on a mismatch or a truncated file)."""
        entry = self.find(device, tensor, box)
        return self.region(entry, box)

    def readinto(self, device: str, tensor: str, box: Box, dest) -> None:
        """Fill ``dest`` with that region of ``device``'s shard, verified.

        ``dest`` is a writable buffer of ``box``'s C-order bytes, or a writable
        numpy array of ``box``'s shape and the stored item size with any
        strides (say a column block of a larger tensor). A region that is one
        contiguous run of the file goes straight into a contiguous ``dest``;
        otherwise the rows are copied into place from each piece while it is
        in cache, with no intermediate buffer, whenever the region and ``dest``
        are both rows of a contiguous run; anything else is read whole and copied."""
        entry = self.find(device, tensor, box)
        item = itemsize(entry.dtype)
        if isinstance(dest, np.ndarray):
            if dest.shape != box.lengths or dest.itemsize != item or not dest.flags.writeable:
                raise StoreError(f"{tensor!r} {box}: destination array {dest.shape} of {dest.itemsize}-byte items "
                                 f"(writable: {dest.flags.writeable}); the region needs {box.lengths} of {item}")
            target = dest
        else:
            raw = memoryview(dest).cast("B")
            if raw.nbytes != box.volume * item:
                raise StoreError(f"{tensor!r} {box}: destination of {raw.nbytes} bytes, the region has "
                                 f"{box.volume * item}")
            target = np.frombuffer(raw, np.uint8).view(np.dtype(f"V{item}")).reshape(box.lengths)
        if not box.is_empty() and not self._fill(entry, box, target):
            target[...] = self.region(entry, box).view(target.dtype)

    def verify(self) -> list[str]:
        """Check every block of every shard; return descriptions of the ones that do not match (empty: all good)."""
        bad = []
        for e in self.entries:
            problem = self._files[e.file].verify()
            if problem is not None:
                bad.append(f"{e.device} {e.tensor} {e.box}: {problem}")
        return bad

    def json_names(self) -> list[str]:
        return sorted(self.manifest["json"])

    def get_json(self, name: str):
        """A JSON document, read with the json module (it may hold Infinity, NaN or integers beyond 64 bits)."""
        return self._document(name, json.loads)

    def _document(self, name: str, parse):
        rel = self.manifest["json"].get(name)
        if rel is None:
            raise NotFound(f"version {self.version} on host {self.host} has no JSON document {name!r}; "
                           f"it has: {self.json_names() or 'none'}")
        try:
            return parse(self._read_bytes(rel))
        except ValueError as e:
            raise StoreError(f"JSON document {name!r} of version {self.version} on host {self.host} "
                             f"({self.path}/{rel}) is damaged: {e}") from None

    def layout(self) -> Layout:
        """The whole layout recorded with ``put_layout`` (or by the transformer)."""
        try:
            with paused_gc():  # a whole 1,024-device layout is millions of small objects (only str and int: orjson)
                return layout_from_dict(self._document(LAYOUT_DOC, parse_json), source=f"{self.path}/{LAYOUT_DOC}")
        except StoreError:
            raise StoreError(f"version {self.version} on host {self.host} has no recorded layout; rebuild one from "
                             f"every host's manifest with tenplex.store.layout_from_manifests") from None


def layout_from_manifests(manifests: list[dict]) -> Layout:
    """Rebuild a Layout from the manifests of one version on every host (shards must carry global shapes)."""
    from ..layout import Shard, TensorSpec

    tensors: dict[str, TensorSpec] = {}
    devices: dict[str, list[Shard]] = {}
    for manifest in manifests:
        for row in manifest["shards"]:
            e = ShardEntry.from_dict(row)
            if e.shape is None:
                raise LayoutError(f"shard {e.tensor!r} on {e.device} was stored without its global shape; "
                                  f"cannot rebuild the layout (write it with put(..., shape=...) or put_layout)")
            spec = TensorSpec(e.shape, e.dtype)
            if tensors.setdefault(e.tensor, spec) != spec:
                raise LayoutError(f"tensor {e.tensor!r} is stored with different shapes/dtypes: "
                                  f"{tensors[e.tensor]} and {spec}")
            devices.setdefault(e.device, []).append(Shard(e.tensor, e.box))
    return Layout.build(tensors, devices)


def row_geometry(lengths: tuple[int, ...], src_strides, dst_strides, item: int) -> tuple[int, int, int, int] | None:
    """(rows, bytes per row, source row stride, destination row stride) when a region of shape ``lengths`` is,
    in both its source and its destination (byte strides given), a sequence of equally spaced contiguous
    rows; None otherwise. Dimensions of length 1 do not count."""
    dims = [(n, s, d) for n, s, d in zip(lengths, src_strides, dst_strides) if n != 1]
    run = item
    while dims and dims[-1][1] == run and dims[-1][2] == run:  # contiguous in both: part of the row
        run *= dims.pop()[0]
    while len(dims) > 1:  # outer dimensions that step evenly in both merge into one
        (n0, s0, d0), (n1, s1, d1) = dims[-2], dims[-1]
        if s0 != s1 * n1 or d0 != d1 * n1:
            return None
        dims[-2:] = [(n0 * n1, s1, d1)]
    if not dims:
        return 1, run, run, run
    count, src_stride, dst_stride = dims[0]
    return count, run, src_stride, dst_stride
