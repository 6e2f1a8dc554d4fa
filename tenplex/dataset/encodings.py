"""How the samples of in-place sources are bytes: Arrow rows as IPC streams, WebDataset samples as tar streams.

May import: the standard library, ``tenplex.errors`` and pyarrow (lazily: only Arrow and Parquet sources
need it).

These functions are shared by the sources that write the encodings (``arrowsrc``, ``tarshards``) and by
``format.decode_sample``, which reads them back; ``inplace`` documents the encoding of each source.
"""

from __future__ import annotations

import io
import re
import tarfile
from typing import Any

from ..errors import TenplexError

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")   # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")                 # webdataset's default skip_meta


class MissingLibrary(TenplexError, ImportError):
    """An optional library a source needs is not installed (says what to install)."""


def pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise MissingLibrary("reading Hugging Face or Parquet datasets needs pyarrow: pip install "
                             "'tenplex[data]'") from None
    return pa


def encode_row(table: Any, row: int) -> bytes:
    """Row ``row`` of a pyarrow table as an Arrow IPC stream (schema without metadata, one 1-row batch)."""
    pa = pyarrow()
    part = table.slice(row, 1).replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, part.schema) as writer:
        writer.write_table(part)
    return sink.getvalue().to_pybytes()


def decode_arrow(data: bytes) -> dict[str, Any]:
    """An encoded row as a dict of columns."""
    return pyarrow().ipc.open_stream(data).read_all().to_pylist()[0]


def split_name(name: str) -> tuple[str | None, str | None]:
    """(key, field) of a tar member name as webdataset splits it; the field in lower case."""
    match = _KEY.match(name)
    return (match.group(1), match.group(2).lower()) if match else (None, None)


def wanted(member: tarfile.TarInfo) -> bool:
    """Whether webdataset makes ``member`` part of a sample (a regular file with a key, not ``__meta__``)."""
    return member.isreg() and not _META.match(member.name) and split_name(member.name)[0] is not None


def decode_tar(data: bytes) -> dict[str, Any]:
    """A sample's tar bytes as webdataset's raw sample: ``{"__key__": key, field: bytes, ...}``."""
    sample = _decode_plain_tar(data)
    return sample if sample is not None else _decode_with_tarfile(data)


_BLOCK = 512


def _decode_plain_tar(data: bytes) -> dict[str, Any] | None:
    """The common case without ``tarfile`` (its stream reader costs ~100 µs per member): regular files with
    ustar or v7 headers. None for anything else (pax or GNU headers, links, directories, base-256 sizes):
    then ``tarfile`` decides. The bytes were crc-checked, so header checksums are not checked again."""
    view, at = memoryview(data), 0
    sample: dict[str, Any] = {}
    while at + _BLOCK <= len(data):
        header = bytes(view[at:at + _BLOCK])
        if not header.strip(b"\0"):
            break  # an end-of-archive block
        if header[156:157] not in (b"0", b"\0") or header[124] & 0x80:
            return None
        name = header[:100].split(b"\0", 1)[0]
        # the POSIX prefix field (GNU headers, "ustar  ", keep times there instead: tarfile's rule)
        prefix = header[345:500].split(b"\0", 1)[0] if header[257:265] == b"ustar\x0000" else b""
        path = (prefix + b"/" + name if prefix else name).decode("utf-8", "surrogateescape")
        size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        if path.endswith("/"):
            return None
        key, field = split_name(path)
        if key is not None and field is not None and not _META.match(path):
            sample.setdefault("__key__", key)
            sample[field] = bytes(view[at + _BLOCK:at + _BLOCK + size])
        at += _BLOCK + -(-size // _BLOCK) * _BLOCK
    return sample


def _decode_with_tarfile(data: bytes) -> dict[str, Any]:
    sample: dict[str, Any] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        for member in tar:
            if not wanted(member):
                continue
            key, field = split_name(member.name)
            sample.setdefault("__key__", key)
            reader = tar.extractfile(member)
            sample[field] = reader.read() if reader else b""  # type: ignore[index]
    return sample
