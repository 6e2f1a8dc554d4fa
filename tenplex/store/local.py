"""The local tensor store of one host: versioned, atomically committed shard files in one directory.

May import: numpy, xxhash, ``tenplex.box``, ``tenplex.layout``, ``tenplex.dtypes``,
``tenplex.errors``, ``tenplex.files``, this package's ``_safetensors`` and the
standard library. No network: workers on the host use this module directly.

Directory layout under ``root``::

    versions/<N>/manifest.json        committed version N (tenplex.store.manifest/1)
    versions/<N>/<part>/*.safetensors one file per (device, tensor, box) shard
    versions/<N>/<part>/json/*.json   version-level JSON documents
    staging/<N>/<part>/...            a version being written (invisible to readers)
    staging/<N>/<part>.part.json      a prepared (durable) part of a staged version
    datasets/...                      read-only files served by ReadFile/StatFile
    .lock                             serialises commit, delete and gc between processes

A version becomes visible only when ``staging/<N>`` (with its merged
``manifest.json`` written and fsynced) is renamed to ``versions/<N>``; a rename
is atomic, so a crash at any moment leaves every committed version complete.
Deletion renames a version into ``trash/`` before removing it for the same reason.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
import shutil
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from . import _safetensors as st
from .target import ShardTarget, checksum
from ..box import Box
from ..dtypes import itemsize, numpy_storage
from ..errors import LayoutError, StoreError
from ..layout import Layout, from_dict as layout_from_dict

MANIFEST_FORMAT = "tenplex.store.manifest/1"
PART_FORMAT = "tenplex.store.part/1"
LAYOUT_DOC = "layout"  # version-level JSON doc holding the whole tenplex.layout/1
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise StoreError(f"{kind} name {name!r} is not a simple identifier (letters, digits, '_', '.', '-'; "
                         f"not starting with '.' or '-')")
    return name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durable(path: Path, doc) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(frozen=True)
class ShardEntry:
    """One stored shard of a version: manifest row."""

    device: str
    tensor: str
    box: Box
    dtype: str
    shape: tuple[int, ...] | None  # global shape when the writer knew it
    file: str                      # relative to the version directory
    xxh3: str
    nbytes: int

    def to_dict(self) -> dict:
        return {"device": self.device, "tensor": self.tensor, "offsets": list(self.box.offsets),
                "lengths": list(self.box.lengths), "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape),
                "file": self.file, "xxh3": self.xxh3, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict) -> "ShardEntry":
        return cls(d["device"], d["tensor"], Box(tuple(d["offsets"]), tuple(d["lengths"])), d["dtype"],
                   None if d.get("shape") is None else tuple(d["shape"]), d["file"], d["xxh3"], int(d["nbytes"]))


class Store:
    """One host's store rooted at a directory (created if missing)."""

    def __init__(self, root: str | os.PathLike, host: str):
        self.root = Path(root)
        self.host = host
        for sub in ("versions", "staging", "trash", "datasets"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # ---- queries -------------------------------------------------------
    def versions(self) -> list[int]:
        """Committed versions, ascending."""
        found = []
        for entry in (self.root / "versions").iterdir():
            if entry.name.isdigit() and (entry / "manifest.json").is_file():
                found.append(int(entry.name))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def open(self, version: int) -> "VersionReader":
        path = self.root / "versions" / str(int(version))
        if not (path / "manifest.json").is_file():
            raise StoreError(f"store {self.root} (host {self.host}) has no committed version {version}; "
                             f"committed versions: {self.versions() or 'none'}")
        return VersionReader(path)

    # ---- writing -------------------------------------------------------
    def begin(self, version: int, part: str | None = None) -> "VersionWriter":
        """Start writing (a part of) ``version``. Several writers (e.g. one per worker) may stage
        parts of one version; ``VersionWriter.commit`` or :meth:`commit` publishes them together."""
        version = int(version)
        if version < 0:
            raise StoreError(f"version must be a non-negative integer, got {version}")
        if (self.root / "versions" / str(version)).exists():
            raise StoreError(f"version {version} is already committed in store {self.root}; "
                             f"write a higher version (latest is {self.latest()})")
        part = _check_name("part", part or f"p{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return VersionWriter(self, version, part)

    def staged_parts(self, version: int) -> list[str]:
        """Names of the prepared parts of a staged version."""
        staging = self.root / "staging" / str(int(version))
        if not staging.is_dir():
            return []
        return sorted(p.name[: -len(".part.json")] for p in staging.glob("*.part.json"))

    def commit(self, version: int, parts: list[str] | None = None, expect_new: bool = True) -> None:
        """Publish staged ``version`` atomically from its prepared parts (all of them, or exactly ``parts``)."""
        version = int(version)
        staging = self.root / "staging" / str(version)
        with self._locked():
            target = self.root / "versions" / str(version)
            if target.exists():
                raise StoreError(f"version {version} is already committed in store {self.root}")
            prepared = self.staged_parts(version)
            if parts is not None:
                missing = sorted(set(parts) - set(prepared))
                if missing:
                    raise StoreError(f"cannot commit version {version}: parts {missing} were not prepared "
                                     f"(prepared: {prepared or 'none'})")
                prepared = sorted(parts)
            if not prepared:
                raise StoreError(f"cannot commit version {version} in store {self.root}: nothing was prepared")
            manifest = {"format": MANIFEST_FORMAT, "version": version, "host": self.host, "shards": [], "json": {}}
            seen: dict[tuple[str, str], list[Box]] = {}
            for part in prepared:
                doc = json.loads((staging / f"{part}.part.json").read_text())
                for row in doc["shards"]:
                    entry = ShardEntry.from_dict(row)
                    boxes = seen.setdefault((entry.device, entry.tensor), [])
                    if any(b.overlaps(entry.box) for b in boxes):
                        raise StoreError(f"cannot commit version {version}: two parts store overlapping boxes "
                                         f"of tensor {entry.tensor!r} on device {entry.device} ({entry.box})")
                    boxes.append(entry.box)
                    manifest["shards"].append(row)
                for name, rel in doc["json"].items():
                    if name in manifest["json"]:
                        raise StoreError(f"cannot commit version {version}: JSON document {name!r} written by two parts")
                    manifest["json"][name] = rel
            _write_json_durable(staging / "manifest.json", manifest)
            os.rename(staging, target)
            _fsync_dir(target.parent)
            _fsync_dir(staging.parent)

    def abort(self, version: int) -> None:
        """Drop everything staged for ``version`` (committed versions are untouched)."""
        staging = self.root / "staging" / str(int(version))
        if staging.exists():
            trash = self.root / "trash" / f"staging-{int(version)}-{uuid.uuid4().hex[:8]}"
            os.rename(staging, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def delete(self, version: int) -> bool:
        """Delete committed ``version``; False if it did not exist."""
        with self._locked():
            return self._delete(int(version))

    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed versions, stale staging and trash; return deleted versions."""
        if keep < 1:
            raise StoreError(f"gc must keep at least one version, got keep={keep}")
        with self._locked():
            versions = self.versions()
            doomed = versions[:-keep]
            for v in doomed:
                self._delete(v)
            newest = versions[-1] if versions else None
            for staging in (self.root / "staging").iterdir():
                # A staged version not newer than a committed one can never be committed.
                if staging.name.isdigit() and newest is not None and int(staging.name) <= newest:
                    self.abort(int(staging.name))
            for junk in (self.root / "trash").iterdir():
                shutil.rmtree(junk, ignore_errors=True)
            return doomed

    def _delete(self, version: int) -> bool:
        path = self.root / "versions" / str(version)
        if not path.exists():
            return False
        trash = self.root / "trash" / f"{version}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        _fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class VersionWriter:
    """Stages one part of a version. Use as a context manager: an exception inside aborts the part.

    ``put`` writes a complete shard; ``allocate`` returns a writable memory map of
    a new shard to be filled in place (its checksum is computed at ``prepare``);
    ``link`` reuses an already committed shard file without copying.
    """

    def __init__(self, store: Store, version: int, part: str):
        self.store, self.version, self.part = store, version, part
        self.staging = store.root / "staging" / str(version)
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

    def _add(self, entry: ShardEntry, target: ShardTarget | None = None) -> None:
        with self._lock:
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
        data = st.write(path, tensor, dtype, array, self._metadata(device, tensor, box, shape))
        self._add(ShardEntry(device, tensor, box, dtype, shape and tuple(shape), rel, checksum(data), data.nbytes))

    def create(self, device: str, tensor: str, box: Box, dtype: str,
               shape: tuple[int, ...] | None = None, reserve: bool = True) -> ShardTarget:
        """A new zero-filled shard to fill region by region (``target.write``) before ``prepare``.
        ``reserve=False`` defers allocating its space to ``target.reserve()`` (which may run while
        other threads already write)."""
        rel, path = self._claim(device, tensor, box, dtype, shape)
        offset, nbytes = st.create(path, tensor, dtype, box.lengths, self._metadata(device, tensor, box, shape),
                                   reserve=reserve)
        target = ShardTarget(path, offset, box, dtype)
        self._add(ShardEntry(device, tensor, box, dtype, shape and tuple(shape), rel, "", nbytes), target)
        return target

    def allocate(self, device: str, tensor: str, box: Box, dtype: str,
                 shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A writable, zero-filled memory map of a new shard; fill it before ``prepare``."""
        return self.create(device, tensor, box, dtype, shape).array

    def link(self, device: str, reader: "VersionReader", entry: ShardEntry) -> None:
        """Make ``entry`` (a committed shard of ``reader``'s version on this host) ``device``'s shard, by hard link."""
        rel, path = self._claim(device, entry.tensor, entry.box, entry.dtype, entry.shape)
        os.link(reader.path / entry.file, path)
        self._add(replace(entry, device=device, file=rel))

    def put_json(self, name: str, doc) -> None:
        """A version-level JSON document (step, RNG state, layout, dataset position, …)."""
        _check_name("JSON document", name)
        if self._state != "open":
            raise StoreError(f"version {self.version} part {self.part} is {self._state}; it takes no more documents")
        rel = f"{self.part}/json/{name}.json"
        path = self.staging / rel
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        self._json[name] = rel

    def put_layout(self, layout: Layout) -> None:
        """Record the whole layout so that ``VersionReader.layout()`` can recover it."""
        self.put_json(LAYOUT_DOC, layout.to_dict())

    def prepare(self) -> None:
        """Make this part durable (files synced, part manifest written); it can then be committed."""
        if self._state == "prepared":
            return
        if self._state != "open":
            raise StoreError(f"version {self.version} part {self.part} is {self._state}; cannot prepare")
        with self._lock:
            self._state = "preparing"
        self._entries = [replace(e, xxh3=self._pending[e.file].finish()) if e.file in self._pending else e
                         for e in self._entries]
        self._pending.clear()
        _fsync_dir(self.dir)
        _fsync_dir(self.dir / "json")
        doc = {"format": PART_FORMAT, "part": self.part, "shards": [e.to_dict() for e in self._entries],
               "json": dict(self._json)}
        _write_json_durable(self.staging / f"{self.part}.part.json", doc)
        _fsync_dir(self.staging.parent)
        self._state = "prepared"

    def commit(self) -> None:
        """Prepare this part and publish the version with every prepared part (atomic)."""
        self.prepare()
        try:
            self.store.commit(self.version)
        except BaseException:
            self._state = "failed"
            raise
        self._state = "committed"

    def abort(self) -> None:
        """Forget this part (other parts of the version are untouched)."""
        for target in self._pending.values():
            target.close()
        self._pending.clear()
        (self.staging / f"{self.part}.part.json").unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        self._state = "aborted"


class VersionReader:
    """A committed version on this host: its manifest, shards (memory-mapped) and JSON documents."""

    def __init__(self, path: Path):
        self.path = path
        doc = json.loads((path / "manifest.json").read_text())
        if doc.get("format") != MANIFEST_FORMAT:
            raise StoreError(f"{path}/manifest.json: expected format {MANIFEST_FORMAT!r}, found {doc.get('format')!r}")
        self.manifest = doc
        self.version = int(doc["version"])
        self.host = doc["host"]
        self.entries = [ShardEntry.from_dict(row) for row in doc["shards"]]
        self._by_device: dict[str, list[ShardEntry]] = {}
        for e in self.entries:
            self._by_device.setdefault(e.device, []).append(e)
        self._maps: dict[str, np.ndarray] = {}

    def devices(self) -> list[str]:
        return sorted(self._by_device)

    def layout_shards(self, device: str) -> list[tuple[str, Box, str]]:
        """(tensor, box, dtype) of every shard ``device`` stores in this version."""
        return [(e.tensor, e.box, e.dtype) for e in self._by_device.get(device, [])]

    def entries_of(self, device: str) -> list[ShardEntry]:
        return list(self._by_device.get(device, []))

    def find(self, device: str, tensor: str, box: Box) -> ShardEntry:
        """The stored shard of ``device`` whose box contains ``box``."""
        candidates = [e for e in self._by_device.get(device, []) if e.tensor == tensor]
        for e in candidates:
            if e.box.ndim == box.ndim and e.box.contains(box):
                return e
        if device not in self._by_device:
            raise StoreError(f"version {self.version} on host {self.host} holds nothing for device {device}; "
                             f"devices here: {self.devices()}")
        if not candidates:
            raise StoreError(f"device {device} holds no box of tensor {tensor!r} in version {self.version} "
                             f"on host {self.host}")
        raise StoreError(f"box {box} of tensor {tensor!r} lies inside no box device {device} stores "
                         f"(stored: {', '.join(str(e.box) for e in candidates)}) in version {self.version}")

    def array(self, entry: ShardEntry) -> np.ndarray:
        """The whole stored shard as a read-only memory-mapped array."""
        mapped = self._maps.get(entry.file)
        if mapped is None:
            offset, header = st.read_header(self.path / entry.file)
            mapped = st.map_array(self.path / entry.file, offset, entry.dtype, entry.box.lengths)
            self._maps[entry.file] = mapped
        return mapped

    def read(self, device: str, tensor: str, box: Box) -> np.ndarray:
        """The region ``box`` (global coordinates) of ``device``'s shard: a read-only view into the memory map;
        only the pages of that region are read. Copy it (``np.array``) to keep it past the reader."""
        entry = self.find(device, tensor, box)
        return self.array(entry)[box.local(entry.box).slices()]

    def verify(self) -> list[str]:
        """Recompute every shard's checksum; return descriptions of the ones that do not match (empty: all good)."""
        bad = []
        for e in self.entries:
            data = self.array(e)
            actual = checksum(memoryview(np.ascontiguousarray(data)).cast("B")) if data.size else checksum(b"")
            if actual != e.xxh3:
                bad.append(f"{e.device} {e.tensor} {e.box}: xxh3 {actual} != manifest {e.xxh3} ({e.file})")
        return bad

    def json_names(self) -> list[str]:
        return sorted(self.manifest["json"])

    def get_json(self, name: str):
        rel = self.manifest["json"].get(name)
        if rel is None:
            raise StoreError(f"version {self.version} on host {self.host} has no JSON document {name!r}; "
                             f"it has: {self.json_names() or 'none'}")
        return json.loads((self.path / rel).read_text())

    def layout(self) -> Layout:
        """The whole layout recorded with ``put_layout`` (or by the transformer)."""
        try:
            return layout_from_dict(self.get_json(LAYOUT_DOC), source=f"{self.path}/{LAYOUT_DOC}")
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
