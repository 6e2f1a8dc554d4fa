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
