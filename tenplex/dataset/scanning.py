"""Scanning an in-place source once: whole-file digests, per-sample crc32s, and where the scan is cached.

May import: numpy and the standard library.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import numpy as np

CACHE_ENV = "TENPLEX_CACHE_DIR"
_DIGEST_CHUNK = 8 << 20


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tenplex" / "sources")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_DIGEST_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def range_crcs(path: Path, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """crc32 of each byte range ``[offsets[i], offsets[i] + lengths[i])`` of ``path``; int64, shape (n,)."""
    if not len(offsets):
        return np.empty(0, dtype=np.int64)
    with open(path, "rb") as f:
        data = np.memmap(f, dtype=np.uint8, mode="r") if os.fstat(f.fileno()).st_size else np.empty(0, np.uint8)
        view = memoryview(data) if len(data) else memoryview(b"")
        return np.array([zlib.crc32(view[o:o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())],
                        dtype=np.int64)
