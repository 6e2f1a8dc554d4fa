"""Reading and writing tenplex JSON documents (layouts, plans) on disk.

May import: ``tenplex.layout``, ``tenplex.transfer_plan``, ``tenplex.errors``,
``tenplex._gc`` and the standard library. Writes are atomic: a temporary file
in the same directory is renamed over the target, so a reader never sees half
a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from ._gc import paused_gc
from .errors import LayoutError, PlanError
from .layout import Layout, from_dict as layout_from_dict
from .transfer_plan import Plan, plan_from_dict


def write_json_atomic(path: str | os.PathLike, doc: Any) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes the file private; layouts and plans are for sharing
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
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
        return json.loads(read_bytes(Path(path)) if read_bytes is not None else Path(path).read_bytes())
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
