"""Reading a committed version: manifest, memory-mapped shard regions, JSON documents, layouts.

May import: numpy, ``tenplex.box``, ``tenplex.errors``, ``tenplex.layout``, this
package's ``_safetensors``, ``manifest`` and ``target``, and the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import _safetensors as st
from .manifest import LAYOUT_DOC, MANIFEST_FORMAT, NotFound, OutOfRange, ShardEntry
from .target import checksum
from ..box import Box
from ..errors import LayoutError, StoreError
from ..layout import Layout, from_dict as layout_from_dict


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
            raise NotFound(f"version {self.version} on host {self.host} holds nothing for device {device}; "
                           f"devices here: {self.devices()}")
        if not candidates:
            raise NotFound(f"device {device} holds no box of tensor {tensor!r} in version {self.version} "
                           f"on host {self.host}")
        raise OutOfRange(f"box {box} of tensor {tensor!r} lies inside no box device {device} stores "
                         f"(stored: {', '.join(str(e.box) for e in candidates)}) in version {self.version}")

    def array(self, entry: ShardEntry) -> np.ndarray:
        """The whole stored shard as a read-only memory-mapped array."""
        mapped = self._maps.get(entry.file)
        if mapped is None:
            offset, header = st.read_header(self.path / entry.file)
            mapped = st.map_array(self.path / entry.file, offset, entry.dtype, entry.box.lengths)
            self._maps[entry.file] = mapped
        return mapped

    def close(self) -> None:
        """Forget this reader's memory maps; each is unmapped once no array handed out still uses it."""
        self._maps.clear()

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
            raise NotFound(f"version {self.version} on host {self.host} has no JSON document {name!r}; "
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
