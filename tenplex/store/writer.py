"""Staging one part of a version: shard files, JSON documents, prepare (durable), commit.

May import: numpy, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.errors``,
``tenplex.layout``, ``tenplex.files`` (its JSON codec), ``tenplex._gc``, this package's
``_safetensors``, ``blocks``, ``contract``, ``manifest`` and ``target``, and the standard library. Not
``local``: the store hands a writer its staging directory and the function that publishes a version, so the
two do not import each other.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from . import _safetensors as st
from .contract import FileBackedReader
from .manifest import LAYOUT_DOC, PART_FORMAT, ShardEntry, check_name, fsync_dir, write_json_durable
from .blocks import BLOCK_BYTES, block_digests, root_digest, slice_digests
from .target import ShardTarget
from .._gc import paused_gc
from ..box import Box
from ..dtypes import itemsize, numpy_storage
from ..errors import StoreError
from ..files import dumps as json_bytes
from ..layout import Layout


class VersionWriter:
    """Stages one part of a version. Use as a context manager: an exception inside aborts the part.

    ``put`` writes a complete shard; ``allocate`` returns a writable memory map of
    a new shard to be filled in place (its checksum is computed at ``prepare``);
    ``link`` reuses an already committed shard file without copying.

    ``staging`` is the version's staging directory (this part writes ``staging/<part>/`` and
    ``staging/<part>.part.json``); ``publish(version)`` commits the version with every prepared part
    (``Store.commit``).
    """

    def __init__(self, staging: Path, version: int, part: str, publish: Callable[[int], None]):
        self.version, self.part, self._publish = version, part, publish
        self.staging = staging
        self.dir = self.staging / part
        if self.dir.exists() or (self.staging / f"{part}.part.json").exists():
            # A writer of the same name crashed earlier: its files are stale.
            (self.staging / f"{part}.part.json").unlink(missing_ok=True)
            shutil.rmtree(self.dir)
        (self.dir / "json").mkdir(parents=True)
        self._entries: list[ShardEntry] = []
        self._pending: dict[str, ShardTarget] = {}  # file -> shard being filled, checksummed at prepare
        self._json: dict[str, str] = {}
        self._boxes: dict[tuple[str, str], list[Box]] = {}
        self._names = itertools.count()
        self._lock = threading.Lock()  # the server's WriteShard calls may fill one part concurrently
        self._state = "open"

    def __enter__(self) -> "VersionWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.abort()
            raise StoreError(f"version {self.version} part {self.part}: the with-block ended without commit() "
                             f"or prepare(); nothing was stored")

    def _claim(self, device: str, tensor: str, box: Box, dtype: str, shape) -> tuple[str, Path]:
        """Check and reserve (device, tensor, box); return a fresh file name for it."""
        itemsize(dtype)
        if dtype not in st.SAFETENSORS_DTYPE:
            raise StoreError(f"dtype {dtype!r} cannot be stored in safetensors")
        if shape is not None and not Box.whole(shape).contains(box):
            raise StoreError(f"box {box} of tensor {tensor!r} lies outside its global shape {list(shape)}")
        with self._lock:
            if self._state != "open":
                raise StoreError(f"version {self.version} part {self.part} is {self._state}; it takes no more shards")
            boxes = self._boxes.setdefault((device, tensor), [])
            if any(b.overlaps(box) for b in boxes):
                raise StoreError(f"device {device} already has a box of tensor {tensor!r} overlapping {box} "
                                 f"in this part")
            boxes.append(box)
            rel = f"{self.part}/{next(self._names):05d}.safetensors"
        return rel, self.staging / rel

    def _release(self, device: str, tensor: str, box: Box, path: Path) -> None:
        """Undo ``_claim`` for a shard whose file could not be written."""
        with self._lock:
            self._boxes[(device, tensor)].remove(box)
        path.unlink(missing_ok=True)

    def _add(self, entry: ShardEntry, target: ShardTarget | None = None) -> None:
        with self._lock:
            if self._state != "open":  # aborted while its file was made (abort removes the part's directory)
                if target is not None:
                    target.close()
                raise StoreError(f"version {self.version} part {self.part} is {self._state}; it takes no more shards")
            self._entries.append(entry)
            if target is not None:
                self._pending[entry.file] = target

    @staticmethod
    def _metadata(device: str, tensor: str, box: Box, shape) -> dict[str, str]:
        return {"tenplex.device": device, "tenplex.tensor": tensor,
                "tenplex.offsets": json.dumps(list(box.offsets)),
                "tenplex.global_shape": json.dumps(None if shape is None else list(shape))}

    def put(self, device: str, tensor: str, box: Box, array: np.ndarray, dtype: str,
            shape: tuple[int, ...] | None = None) -> None:
        """Store ``array`` (shape == box.lengths; bfloat16 as uint16 bits) as ``device``'s box of ``tensor``."""
        array = np.asarray(array)
        if tuple(array.shape) != tuple(box.lengths):
            raise StoreError(f"tensor {tensor!r} on {device}: array shape {list(array.shape)} differs from "
                             f"box lengths {list(box.lengths)}")
        if array.dtype != np.dtype(numpy_storage(dtype)):
            raise StoreError(f"tensor {tensor!r} on {device}: array dtype {array.dtype} cannot hold {dtype} "
                             f"(expected numpy {numpy_storage(dtype)})")
        rel, path = self._claim(device, tensor, box, dtype, shape)
        try:
            data = st.write(path, tensor, dtype, array, self._metadata(device, tensor, box, shape))
        except BaseException:
            self._release(device, tensor, box, path)
            raise
        blocks = block_digests(data)
        self._add(ShardEntry(device, tensor, box, dtype, shape and tuple(shape), rel, root_digest(blocks), data.nbytes,
                             BLOCK_BYTES, tuple(blocks)))

    def create(self, device: str, tensor: str, box: Box, dtype: str,
               shape: tuple[int, ...] | None = None, reserve: bool = True) -> ShardTarget:
        """A new zero-filled shard to fill region by region (``target.write``) before ``prepare``.
        ``reserve=False`` defers allocating its space to ``target.reserve()`` (which may run while
        other threads already write)."""
        rel, path = self._claim(device, tensor, box, dtype, shape)
        try:
            offset, nbytes = st.create(path, tensor, dtype, box.lengths, self._metadata(device, tensor, box, shape),
                                       reserve=reserve)
        except BaseException:  # e.g. a full disk: release the claim and the file, the box may be written again
            self._release(device, tensor, box, path)
            raise
        target = ShardTarget(path, offset, box, dtype)
        self._add(ShardEntry(device, tensor, box, dtype, shape and tuple(shape), rel, "", nbytes), target)
        return target

    def allocate(self, device: str, tensor: str, box: Box, dtype: str,
                 shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A writable, zero-filled memory map of a new shard; fill it before ``prepare``."""
        return self.create(device, tensor, box, dtype, shape).array

    def discard(self, target: ShardTarget) -> None:
        """Forget a shard from ``create`` that could not be filled (its entry, box claim and file), so that
        ``prepare`` can never publish it partly zero; the same box may then be written again."""
        rel = str(target.path.relative_to(self.staging))
        with self._lock:
            if self._state != "open":
                raise StoreError(f"version {self.version} part {self.part} is {self._state}; cannot discard {rel}")
            entry = next((e for e in self._entries if e.file == rel), None)
            if entry is None:
                raise StoreError(f"version {self.version} part {self.part} has no shard file {rel}")
            self._entries.remove(entry)
            self._pending.pop(rel, None)
            self._boxes[(entry.device, entry.tensor)].remove(entry.box)
        target.close()
        target.path.unlink(missing_ok=True)

    def link(self, device: str, reader: FileBackedReader, entry: ShardEntry, box: Box | None = None) -> None:
        """Make ``entry`` (a committed shard of ``reader``'s version on this host), or its region ``box``, ``device``'s
        shard, by hard link: no byte is copied.

        A region (``box`` inside ``entry.box``) must be one contiguous run of the file (a slab along dim 0, say):
        its row is a slice of the linked file (``ShardEntry.file_start``). The region's bytes are read once and
        verified (``CorruptShard`` if they are damaged: nothing is linked); its block checksums are the stored
        ones where a block of the region is one stored block (the region starts on a block boundary), the others
        are hashed as they are read. The linked file keeps all of its bytes for as long as a version refers to
        it."""
        box = entry.box if box is None else box
        if box == entry.box:
            rel, path = self._claim(device, entry.tensor, entry.box, entry.dtype, entry.shape)
            self._linked(path, device, entry, box, reader, lambda: replace(entry, device=device, file=rel))
            return
        if entry.blocks is None:
            raise StoreError(f"the shard of tensor {entry.tensor!r} stored for {entry.device} has no block checksums "
                             f"(written by an older tenplex): copy its region {box} instead of linking a slice")
        if not box.is_run_of(entry.box):
            raise StoreError(f"region {box} of tensor {entry.tensor!r} is not one contiguous run of the shard "
                             f"{entry.box} stored for {entry.device}: it cannot be linked as a slice")
        start, nbytes, _ = reader.byte_span(entry, box)
        rel, path = self._claim(device, entry.tensor, box, entry.dtype, entry.shape)

        def row() -> ShardEntry:
            blocks = slice_digests(reader.shard_file(entry), start, nbytes)
            return replace(entry, device=device, box=box, file=rel, xxh3=root_digest(blocks), nbytes=nbytes,
                           block_bytes=BLOCK_BYTES, blocks=tuple(blocks), file_start=entry.file_start + start,
                           file_nbytes=entry.file_data_bytes)
        self._linked(path, device, entry, box, reader, row)

    def _linked(self, path: Path, device: str, entry: ShardEntry, box: Box, reader: FileBackedReader,
                row: Callable[[], ShardEntry]) -> None:
        """Hard-link ``entry``'s file to ``path`` (claimed for ``box``) and add its ``row`` (both undone on failure)."""
        try:
            reader.link_file(entry, path)
            linked = row()
        except BaseException:
            self._release(device, entry.tensor, box, path)
            raise
        self._add(linked)

    def put_json(self, name: str, doc) -> None:
        """A version-level JSON document (step, RNG state, layout, dataset position, …)."""
        # the json module, not orjson: documents may hold Infinity, NaN or integers beyond 64 bits (a scheduler's
        # best loss, a numpy generator's state); compact, in one shot (``json.dump`` to a file encodes in Python)
        self._write_json(name, json.dumps(doc, separators=(",", ":")).encode())

    def put_layout(self, layout: Layout) -> None:
        """Record the whole layout so that ``VersionReader.layout()`` can recover it. A layout holds only
        strings and integers, so it takes the fast codec (orjson when installed; 50 MB for 1,024 devices)."""
        with paused_gc():  # a 1,024-device layout is millions of small objects
            self._write_json(LAYOUT_DOC, json_bytes(layout.to_dict()))

    def _write_json(self, name: str, data: bytes) -> None:
        check_name("JSON document", name)
        if self._state != "open":
            raise StoreError(f"version {self.version} part {self.part} is {self._state}; it takes no more documents")
        rel = f"{self.part}/json/{name}.json"
        with open(self.staging / rel, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._json[name] = rel

    def prepare(self) -> None:
        """Make this part durable (files synced, part manifest written); it can then be committed."""
        if self._state == "prepared":
            return
        if self._state != "open":
            raise StoreError(f"version {self.version} part {self.part} is {self._state}; cannot prepare")
        with self._lock:
            self._state = "preparing"
        self._entries = [self._finished(e, self._pending[e.file].finish()) if e.file in self._pending else e
                         for e in self._entries]
        self._pending.clear()
        fsync_dir(self.dir)
        fsync_dir(self.dir / "json")
        doc = {"format": PART_FORMAT, "part": self.part, "shards": [e.to_dict() for e in self._entries],
               "json": dict(self._json)}
        write_json_durable(self.staging / f"{self.part}.part.json", doc)
        fsync_dir(self.staging.parent)
        self._state = "prepared"

    @staticmethod
    def _finished(entry: ShardEntry, blocks: list[str]) -> ShardEntry:
        return replace(entry, xxh3=root_digest(blocks), block_bytes=BLOCK_BYTES, blocks=tuple(blocks))

    def commit(self) -> None:
        """Prepare this part and publish the version with every prepared part of it (atomic).

        Like ``Store.commit(version)`` without ``parts``, this also publishes a
        part that an earlier, crashed writer left prepared: use it when this
        writer is the version's only one (abort the version first when in
        doubt), and ``Store.commit(version, parts)`` for several writers."""
        self.prepare()
        try:
            self._publish(self.version)
        except BaseException:
            self._state = "failed"
            raise
        self._state = "committed"

    def abort(self) -> None:
        """Forget this part (other parts of the version are untouched). A shard another thread (a WriteShard call)
        creates meanwhile is refused: the part takes no more shards."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            self._state = "aborted"
        for target in pending:
            target.close()
        (self.staging / f"{self.part}.part.json").unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
