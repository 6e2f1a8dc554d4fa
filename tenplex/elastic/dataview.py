"""The dataset view of an elastic job: one FUSE mount per node and job, switched by every world before it reads.

May import: ``fuse_vfs`` (lazily: ``tenplex`` works without FUSE), ``tenplex.dataset``,
``tenplex.integration.exchange``, ``tenplex.errors``, ``tenplex.flock``, ``tenplex.parallel`` (a type),
torch.distributed (on use) and the standard library.

``tenplex run --dataset DIR --data-mount PATH`` calls :func:`ensure_view`: it
mounts DIR at PATH once per node (a later ``tenplex run`` with the same options
reuses the mount, as it reuses the store; a mount of another dataset there is
refused) and tells its workers where (``TENPLEX_DATA_VIEW=PATH``,
``TENPLEX_DATASET=DIR``). Until a world switches it, the mount serves a
placeholder without a world. Each world's :meth:`tenplex.elastic.Job.restore`
calls :func:`follow`: the first training rank on each host switches its
node's mount to the world's dp degree, the data position it restored (after a
failure, that of the newest restorable version: the lost steps are replayed
from the view too) and the world id; then every training rank passes a
barrier, so no rank reads before its node's view is switched. The world id is
the view's generation across nodes: ``"world"`` in the mount's and every rank
directory's ``state.json``, and ``TENPLEX_DATA_GENERATION`` in the worker's
environment (set by ``follow``, inherited by the processes it starts, e.g.
DataLoader workers). :func:`rank_dir` refuses, with one line, a view that no
world switched yet or that another world switched.

Several jobs on a node each have their own mount point, state file and server
process: one job's switch never touches another's mount.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError, TenplexError
from ..flock import held

if TYPE_CHECKING:
    from ..dataset import DatasetState
    from ..parallel import ParallelConfig


class Job(Protocol):
    """What this module reads of a :class:`tenplex.elastic.Job` (which imports this module, so it names the
    attributes instead of importing the class)."""

    host: str
    world_id: str

    @property
    def group(self) -> Any: ...  # the training ranks' process group (None: the default group)

    @property
    def config(self) -> "ParallelConfig": ...

    @property
    def coords(self) -> dict[str, int]: ...

VIEW_ENV = "TENPLEX_DATA_VIEW"              # the node's mount point of this job's view (set by tenplex run)
GENERATION_ENV = "TENPLEX_DATA_GENERATION"  # the world the view serves (set in each worker by follow)
STATE_DIR = ".tenplex-view"                 # under the store root: each mount's state file and server log
SAVED_KEY = "tenplex.data_view"             # in a save's extra: the world whose view it read (operator status)


class DataViewError(TenplexError, RuntimeError):
    """A dataset view that is missing, not switched yet, or switched by another world (says which and why)."""


def _names(state_dir: Path, mountpoint: Path) -> tuple[Path, Path]:
    """The state file and server log of the mount at ``mountpoint`` (one pair per mount point)."""
    key = hashlib.sha256(str(mountpoint).encode()).hexdigest()[:16]
    return state_dir / f"view-{key}.json", state_dir / f"view-{key}.log"


def _lock(path: Path, wait: float):
    """One ``tenplex run`` at a time checks or mounts a view: two runs starting at once mount it once. A run
    stopped or hung while it holds the lock keeps it: past ``wait`` seconds this raises, naming it."""
    return held(path, wait, "checking or mounting the dataset view", DataViewError)


def ensure_view(dataset: str | os.PathLike, mountpoint: str | os.PathLike, state_dir: str | os.PathLike,
                timeout: float = 120.0) -> dict[str, Any]:
    """Mount ``dataset`` at ``mountpoint`` unless a tenplex mount of it is there already; its ``/state.json``."""
    import fuse_vfs

    from ..dataset import DatasetState, open_dataset, write_state_file

    info = open_dataset(dataset)
    mount = Path(mountpoint).resolve()
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    with _lock(state_dir / "lock", timeout + 60.0):  # a holder mounts for at most ``timeout``
        if os.path.ismount(mount):
            try:
                root = fuse_vfs.read_root(mount)
            except fuse_vfs.VfsError as e:
                raise ConfigError(f"--data-mount {mount} is mounted by something else: {e}") from None
            if root["dataset"] != info.identity:
                raise ConfigError(f"--data-mount {mount} serves dataset {root['dataset_path']}, not {info.root}: "
                                  f"each job needs a mount point of its own")
            if root.get("error"):
                raise DataViewError(f"the view at {mount} failed ({root['error']}); unmount it with "
                                    f"`tenplex vfs unmount --lazy {mount}` and start again")
            return root
        with contextlib.suppress(fuse_vfs.VfsError):  # a mount whose server died (ENOTCONN): detach it
            fuse_vfs.unmount(mount, lazy=True)
        mount.mkdir(parents=True, exist_ok=True)
        state_file, log = _names(state_dir, mount)
        # A placeholder until the first world switches: valid (dp 1, global batch 1), but naming no world.
        write_state_file(state_file, DatasetState(info.identity, info.num_samples, 0, 0, 1), dp=1)
        # the path as given: a source file (tenplex.source/1) carries options its data directory does not
        fuse_vfs.mount(Path(dataset).absolute(), mount, state_file, log_path=log, timeout=timeout)
        return fuse_vfs.read_root(mount)


def switch(mountpoint: str | os.PathLike, state: "DatasetState", dp: int, world: str,
           timeout: float = 120.0) -> dict[str, Any]:
    """Switch this node's mount to ``state`` under ``dp`` for ``world``; its ``/state.json`` once served."""
    import fuse_vfs

    try:
        return fuse_vfs.switch(mountpoint, state=state, dp=dp, world=world, timeout=timeout)
    except fuse_vfs.VfsError as e:
        raise DataViewError(f"cannot switch the dataset view at {mountpoint}: {e}") from None


def rank_dir(mountpoint: str | os.PathLike, dp_rank: int, world: str | None) -> Path:
    """The directory of ``dp_rank``'s view of ``world`` (``MOUNT/.gN/rankR``: it never changes under a reader;
    once another world switches the mount it is gone, and open files fail with ESTALE)."""
    link = Path(mountpoint) / f"rank{dp_rank}"
    if world is None:
        raise DataViewError(f"the dataset view at {mountpoint} is not switched for this worker's world yet "
                            f"({GENERATION_ENV} is not set): call job.restore(...) before reading it")
    try:
        target = Path(mountpoint) / os.readlink(link)
        doc = json.loads((target / "state.json").read_bytes())
    except FileNotFoundError:
        raise DataViewError(f"{link}: no such rank in the dataset view at {mountpoint}: it serves another dp "
                            f"degree than this world's (was it switched by another world?)") from None
    except OSError as e:
        raise DataViewError(f"{link}: cannot read the dataset view: {e}") from None
    if doc.get("world") != world:
        raise DataViewError(f"the dataset view at {mountpoint} serves world {doc.get('world') or '(none yet)'}, "
                            f"not this worker's world {world}: it was switched by another world or not yet")
    return target


def follow(job: Job, state: "DatasetState") -> Path | None:
    """Switch this node's view to ``job``'s world at ``state`` (collective over the training ranks) and return
    this rank's view directory; None when the job runs without a view (no ``TENPLEX_DATA_VIEW``)."""
    from ..integration.exchange import all_gather_json

    mount = os.environ.get(VIEW_ENV, "").strip()
    if not mount:
        return None
    hosts = all_gather_json(job.host, group=job.group)  # the training ranks' hosts, in rank order
    error = ""
    if _first_here(hosts, job):
        try:
            switch(mount, state, job.config.dp, job.world_id)
        except TenplexError as e:
            error = str(e)
    # This exchange is the barrier: nobody reads before every node's view is switched, and a node that could
    # not switch fails the whole world with its reason.
    errors = [e for e in all_gather_json(error, group=job.group) if e]
    if errors:
        raise DataViewError(errors[0])
    os.environ[GENERATION_ENV] = job.world_id
    return rank_dir(mount, job.coords["dp"], job.world_id)


def _first_here(hosts: list[str], job: Job) -> bool:
    """Whether this rank is the first training rank on its host (it switches the host's view)."""
    import torch.distributed as dist

    return hosts.index(job.host) == dist.get_rank(job.group)


def open_rank(view: Path | None, state: "DatasetState"):
    """A :class:`~tenplex.dataset.torch_data.RankDataset` over the rank's view directory ``view``, which must serve
    ``state`` (the rest of that epoch)."""
    from ..dataset.reader import MountedRankReader
    from ..dataset.torch_data import RankDataset

    if view is None:  # follow() found no TENPLEX_DATA_VIEW at the epoch's switch
        raise DataViewError(f"{VIEW_ENV} was unset while the job read through its dataset view")
    data = RankDataset(MountedRankReader(view))
    if data.reader.state != state:
        raise DataViewError(f"the dataset view {view} serves position {data.reader.state.position}, not "
                            f"this rank's {state.position}: it was not switched to this world's position in this epoch")
    return data


def checked(view: Path | None, restored: bool) -> Path | None:
    """``Job.data_view``: the rank's view directory; a job with a view (``TENPLEX_DATA_VIEW``) that has not
    restored yet has none of this world: it is switched in ``Job.restore``."""
    if view is None and not restored and os.environ.get(VIEW_ENV, "").strip():
        raise DataViewError(f"the dataset view at {os.environ[VIEW_ENV]} is not switched for this world yet: "
                            f"call job.restore(...) before reading it")
    return view

def server_pid(mountpoint: str | os.PathLike) -> int | None:
    """The pid of the FUSE server of the view at ``mountpoint``; None when nothing serves there."""
    import fuse_vfs

    try:
        return int(fuse_vfs.read_root(mountpoint)["pid"])
    except fuse_vfs.VfsError:
        return None


def switches(mountpoint: str | os.PathLike) -> int | None:
    """How often the view at ``mountpoint`` was switched since it was mounted; None when nothing serves there."""
    import fuse_vfs

    try:
        return int(fuse_vfs.read_root(mountpoint)["generation"]) - 1
    except fuse_vfs.VfsError:
        return None


def unmount_views(mountpoints: list[Path]) -> None:
    """Unmount the views at ``mountpoints``, lazily (a killed worker's file may still be open), also those whose
    server died with their node; a mount point with nothing mounted is skipped."""
    import fuse_vfs

    for mount in mountpoints:
        with contextlib.suppress(fuse_vfs.VfsError):  # not mounted
            fuse_vfs.unmount(mount, lazy=True)


def summarize_views(record: Path, views: Path) -> dict[str, Any]:
    """``tenplex demo --elastic --fuse``: whether every worker of every world read through its node's view of its
    own world (the ``data_view`` its record's start names, a ``.gN`` directory), and how often each node's view
    was switched (``views``, written before the views were unmounted)."""
    starts = [json.loads(line) for path in sorted(record.glob("rank-*.jsonl"))
              for line in path.read_text().splitlines() if '"event": "start"' in line]
    read = bool(starts) and all(d.get("data_view") and "/.g" in d["data_view"] for d in starts)
    return {"read": read, "worlds": len({d["world_id"] for d in starts}), "switches": json.loads(views.read_text())}


def require_fuse() -> None:
    """Raise :class:`fuse_vfs.FuseUnavailableError` (one line) where FUSE cannot be used: no fallback to in-process
    reading where a view was asked for."""
    import fuse_vfs

    reason = fuse_vfs.fuse_unavailable_reason()
    if reason:
        raise fuse_vfs.FuseUnavailableError(f"--fuse: {reason}")


def saved_doc(job: Job) -> dict[str, Any]:
    """What a save records of the view: its generation (the world that switched it) and its dp degree."""
    return {"generation": job.world_id, "dp": job.config.dp}
