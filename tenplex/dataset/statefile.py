"""The state file: a ``tenplex.dataset-state/1`` document plus ``"dp"``, the control channel of a mount.

May import: ``tenplex.dataset`` (format, state), ``tenplex.files`` and the standard library.
``state`` stays pure; reading and writing the file lives here.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..files import read_json, write_json_atomic
from .format import DatasetError, DatasetInfo
from .state import DatasetState, StateError


def check_state_matches(state: DatasetState, info: DatasetInfo, *, require_identity: bool = False,
                        error: type[Exception] = DatasetError, source: str = "state",
                        holder: str = "the dataset") -> None:
    """Refuse a state made for another dataset than ``info``.

    A state without a dataset identity is accepted unless ``require_identity`` (a mount insists on
    one). ``error`` is the exception raised; ``source`` and ``holder`` name the state and the dataset.
    """
    if (state.dataset or require_identity) and state.dataset != info.identity:
        raise error(f"{source}: state is for dataset {state.dataset[:12] or '(none)'}…, but {holder} "
                    f"{info.root} = {info.identity[:12]}…; use the state saved with this dataset or create "
                    f"one with `tenplex data state {info.root}`")
    if state.num_samples != info.num_samples:
        raise error(f"{source}: state has {state.num_samples} samples, dataset {info.root} has "
                    f"{info.num_samples}")


def write_state_file(path: str | os.PathLike, state: DatasetState, dp: int, world: str | None = None) -> None:
    """Write the state a mount serves (atomically: a mount never reads half a file).

    ``world``: the elastic job's world that switched the view to this state (``tenplex run``); every
    rank directory's ``state.json`` then names it, so a worker can refuse a view of another world.
    """
    write_json_atomic(path, {**state.to_dict(), "dp": dp, **({"world": world} if world is not None else {})})


def load_state_file(path: str | os.PathLike, info: DatasetInfo) -> tuple[DatasetState, int]:
    """The state and dp degree in ``path``, checked against the dataset ``info`` (StateError if not)."""
    state, dp, _ = load_state_file_world(path, info)
    return state, dp


def load_state_file_world(path: str | os.PathLike, info: DatasetInfo) -> tuple[DatasetState, int, str | None]:
    """:func:`load_state_file` plus the world that wrote it (None when no elastic job did)."""
    path = Path(path)
    doc = read_json(path, StateError, missing="state file is missing; create it with `tenplex data state`")
    state = DatasetState.from_dict(doc, source=str(path))
    dp = doc.get("dp")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp <= 0:
        raise StateError(f"{path}: 'dp' must be a positive integer (the data-parallel degree), got {dp!r}")
    world = doc.get("world")
    if world is not None and (not isinstance(world, str) or not world):
        raise StateError(f"{path}: 'world' must be a non-empty string (the world that switched the view), got "
                         f"{world!r}")
    check_state_matches(state, info, require_identity=True, error=StateError, source=str(path),
                        holder="the mount serves")
    return state, dp, world
