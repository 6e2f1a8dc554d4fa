"""Reading and writing tenplex JSON documents (layouts, plans) on disk.

May import: ``tenplex.layout``, ``tenplex.transfer_plan``, ``tenplex.errors``,
``tenplex._gc``, orjson (optional) and the standard library. Writes are
atomic: a temporary file in the same directory is renamed over the target,
so a reader never sees half a file.

A 1,024-device layout or plan is 25-75 MB of JSON. orjson, when installed,
encodes and parses it several times faster than the json module; without it
the json module's C encoder is used in one shot (``json.dump`` to a file
would take its pure-Python path). Either way the output is the same compact
standard JSON (UTF-8), which the json module reads.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

try:
    import orjson
except ImportError:  # optional: the standard library does the same, slower
    orjson = None  # type: ignore[assignment]

from ._gc import paused_gc
from .errors import LayoutError, PlanError
from .layout import Layout, from_dict as layout_from_dict
from .transfer_plan import Plan, plan_from_dict


def dumps(doc: Any) -> bytes:
    """``doc`` as compact UTF-8 JSON."""
    if orjson is not None:
        return orjson.dumps(doc)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes | str) -> Any:
    """Parse JSON; malformed input raises json.JSONDecodeError (orjson's error is a subclass of it)."""
    return orjson.loads(data) if orjson is not None else json.loads(data)


def write_json_atomic(path: str | os.PathLike, doc: Any) -> None:
    path = Path(path)
    data = dumps(doc)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes the file private; layouts and plans are for sharing
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | os.PathLike, error: type[Exception], missing: str = "no such file",
              read_bytes: Callable[[Path], bytes] | None = None) -> Any:
    """The JSON document in ``path``: the one reader that turns a missing or malformed file into ``error``.

    The message names the file: ``"{path}: {missing}"`` or ``"{path}: not valid
    JSON (…)"``. ``read_bytes`` reads from elsewhere (a remote dataset).
    """
    try:
        return loads(read_bytes(Path(path)) if read_bytes is not None else Path(path).read_bytes())
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def load_layout(path: str | os.PathLike) -> Layout:
    with paused_gc():  # a 1,024-device layout is millions of small JSON objects
        return layout_from_dict(read_json(path, LayoutError), source=str(path))


def save_layout(layout: Layout, path: str | os.PathLike) -> None:
    write_json_atomic(path, layout.to_dict())


def load_plan(path: str | os.PathLike) -> Plan:
    return plan_from_dict(read_json(path, PlanError), source=str(path))


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    write_json_atomic(path, plan.to_dict())
