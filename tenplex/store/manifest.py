"""The on-disk records of a store: manifest rows, formats, names, and durable JSON writes.

May import: ``tenplex.box``, ``tenplex.errors``, ``tenplex.files`` and the standard library.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..box import Box
from ..errors import StoreError
from ..files import write_json_atomic


class NotFound(StoreError, LookupError):
    """Unknown version, device, tensor, JSON document or dataset file (gRPC NOT_FOUND)."""


class OutOfRange(StoreError, IndexError):
    """A region outside what is stored (gRPC OUT_OF_RANGE)."""


class InvalidArgument(StoreError, ValueError):
    """A malformed name, version or request (gRPC INVALID_ARGUMENT)."""


class AlreadyCommitted(StoreError):
    """The version is already committed here (gRPC ALREADY_EXISTS): write a higher version."""


class Conflict(StoreError):
    """Another writer is writing the same version right now (gRPC ABORTED)."""


class CorruptShard(StoreError):
    """Stored bytes do not match their checksum, or the file is truncated (gRPC DATA_LOSS). The message names
    the version, host, device, tensor and file; read the region from another replica."""


MANIFEST_FORMAT = "tenplex.store.manifest/1"
PART_FORMAT = "tenplex.store.part/1"
LAYOUT_DOC = "layout"  # version-level JSON doc holding the whole tenplex.layout/1
# Staged parts tenplex itself names (a part is one writer's share of a version):
RPC_PART = "remote"           # shards written through the WriteShard RPC without a part name
TRANSFORM_PART = "transform"  # a destination host's part of a transformation
REPLICA_PART = "copy"         # a host's copies of another host's regions (tenplex.replication.copier)
PROMOTE_PART = "promote"      # survivors' shards and copies put together after a host was lost (replication.promote)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidArgument(f"{kind} name {_shorten(name)} is not a simple identifier (letters, digits, '_', '.', "
                              f"'-'; not starting with '.' or '-'; at most 128 characters)")
    return name


def _shorten(name) -> str:
    text = repr(name)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(name)} characters)"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, doc) -> None:
    """Replace ``path`` atomically and make the rename itself durable."""
    write_json_atomic(path, doc)
    fsync_dir(path.parent)


@dataclass(frozen=True)
class ShardEntry:
    """One stored shard of a version: manifest row."""

    device: str
    tensor: str
    box: Box
    dtype: str
    shape: tuple[int, ...] | None  # global shape when the writer knew it
    file: str                      # relative to the version directory
    xxh3: str                      # with blocks: xxh3 of the block digests (see ``blocks``); else of the data
    nbytes: int
    block_bytes: int = 0                   # per-block checksums (``tenplex.store.blocks``); rows written
    blocks: tuple[str, ...] | None = None  # before them have none and are verified whole
    # A slice row: the data is bytes [file_start, file_start + nbytes) of the file's tensor data, which holds
    # file_nbytes bytes (an old shard's file hard-linked: see ``writer.VersionWriter.link``). None: the whole file.
    file_start: int = 0
    file_nbytes: int | None = None

    @property
    def is_slice(self) -> bool:
        return self.file_nbytes is not None

    @property
    def file_data_bytes(self) -> int:
        """The data bytes of the row's file: its own, or for a slice those of the file it is part of."""
        return self.nbytes if self.file_nbytes is None else self.file_nbytes

    def to_dict(self) -> dict:
        row: dict = {"device": self.device, "tensor": self.tensor, "offsets": list(self.box.offsets),
               "lengths": list(self.box.lengths), "dtype": self.dtype,
               "shape": None if self.shape is None else list(self.shape),
               "file": self.file, "xxh3": self.xxh3, "nbytes": self.nbytes}
        if self.blocks is not None:
            row.update(block_bytes=self.block_bytes, blocks=list(self.blocks))
        if self.file_nbytes is not None:
            row["slice"] = {"start": self.file_start, "file_nbytes": self.file_nbytes}
        return row

    @classmethod
    def from_dict(cls, d: dict) -> "ShardEntry":
        blocks, piece = d.get("blocks"), d.get("slice")
        entry = cls(d["device"], d["tensor"], Box(tuple(d["offsets"]), tuple(d["lengths"])), d["dtype"],
                    None if d.get("shape") is None else tuple(d["shape"]), d["file"], d["xxh3"], int(d["nbytes"]),
                    int(d.get("block_bytes", 0)), None if blocks is None else tuple(blocks),
                    0 if piece is None else int(piece["start"]),
                    None if piece is None else int(piece["file_nbytes"]))
        if entry.file_nbytes is not None and \
                not 0 <= entry.file_start <= entry.file_start + entry.nbytes <= entry.file_nbytes:
            raise StoreError(f"manifest row of {entry.tensor!r} on {entry.device} ({entry.file}): the slice of "
                             f"{entry.nbytes} bytes at {entry.file_start} lies outside the file's "
                             f"{entry.file_nbytes} data bytes")
        if blocks is not None and (entry.block_bytes <= 0 or
                                   len(blocks) != -(-entry.nbytes // entry.block_bytes)):
            raise StoreError(f"manifest row of {entry.tensor!r} on {entry.device} ({entry.file}): {len(blocks)} "
                             f"block checksums of {entry.block_bytes} bytes do not cover {entry.nbytes} bytes")
        return entry
