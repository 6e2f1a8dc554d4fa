"""The local tensor store of one host: versioned, atomically committed shard files in one directory.

May import: this package's ``contract``, ``manifest``, ``reader`` and ``writer``, ``tenplex.box``,
``tenplex.errors`` and the standard library. No network: workers on the host use this module
directly (writing: ``writer``; reading: ``reader``).

The POSIX implementation of the store's contract (``contract.TensorStore``, with every optional
capability: its writers link, its readers are file-backed, it reports its free space); mypy checks
that it keeps it. The store server and replication rely on it being POSIX (see their docstrings).

Directory layout under ``root``::

    versions/<N>/manifest.json        committed version N (tenplex.store.manifest/1)
    versions/<N>/<part>/*.safetensors one file per (device, tensor, box) shard (a slice row's: a hard
                                      link to the older shard file it is a run of)
    versions/<N>/<part>/json/*.json   version-level JSON documents
    staging/<N>/<part>/...            a version being written (invisible to readers)
    staging/<N>/<part>.part.json      a prepared (durable) part of a staged version
    datasets/...                      read-only files served by ReadFile/StatFile (``datasets_dir``)
    replicas/<origin>/...             a nested store: this host's copies of ``origin``'s regions
                                      (``tenplex.replication.copier``)
    .lock                             serialises commit, delete and gc between processes

A version becomes visible only when ``staging/<N>`` (with its merged
``manifest.json`` written and fsynced) is renamed to ``versions/<N>``; a rename
is atomic, so a crash at any moment leaves every committed version complete.
Deletion renames a version into ``trash/`` before removing it for the same reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..box import Box
from ..errors import StoreError
from .manifest import (MANIFEST_FORMAT, AlreadyCommitted, InvalidArgument, NotFound, ShardEntry, check_name, fsync_dir,
                       write_json_durable)
from .reader import VersionReader
from .writer import VersionWriter


class Store:
    """One host's store rooted at a directory (created if missing)."""

    def __init__(self, root: str | os.PathLike, host: str):
        self.root = Path(root)
        self.host = host
        for sub in ("versions", "staging", "trash", "datasets"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r}, host={self.host!r})"

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

    def free_bytes(self) -> int:
        """Free space, for an unprivileged writer, on the file system that holds the store's root."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    @property
    def datasets_dir(self) -> Path:
        """The local directory whose files the store server serves read-only (``ReadFile``, ``StatFile``)."""
        return self.root / "datasets"

    def open(self, version: int) -> "VersionReader":
        path = self.root / "versions" / str(int(version))
        if not (path / "manifest.json").is_file():
            raise NotFound(f"store {self.root} (host {self.host}) has no committed version {version}; "
                           f"committed versions: {self.versions() or 'none'}")
        try:
            return VersionReader(path)
        except FileNotFoundError:  # deleted meanwhile
            raise NotFound(f"store {self.root} (host {self.host}): version {version} was deleted while opening it; "
                           f"committed versions: {self.versions() or 'none'}") from None

    # ---- writing -------------------------------------------------------
    def begin(self, version: int, part: str | None = None) -> "VersionWriter":
        """Start writing (a part of) ``version``. Several writers (e.g. one per worker) may stage
        parts of one version; ``VersionWriter.commit`` or :meth:`commit` publishes them together."""
        version = int(version)
        if version < 0:
            raise InvalidArgument(f"version must be a non-negative integer, got {version}")
        path = self.root / "versions" / str(version)
        if path.exists() and not (path / "manifest.json").is_file():
            raise StoreError(f"version {version} in store {self.root} is damaged (no manifest.json): it cannot be "
                             f"read; delete it (Store.delete, or gc removes it) before writing that number again")
        if path.exists():
            raise AlreadyCommitted(f"version {version} is already committed in store {self.root}; "
                             f"write a higher version (latest is {self.latest()})")
        part = check_name("part", part or f"p{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return VersionWriter(self.root / "staging" / str(version), version, part, self.commit)

    def staged_parts(self, version: int) -> list[str]:
        """Names of the prepared parts of a staged version."""
        staging = self.root / "staging" / str(int(version))
        if not staging.is_dir():
            return []
        return sorted(p.name[: -len(".part.json")] for p in staging.glob("*.part.json"))

    def commit(self, version: int, parts: list[str] | None = None) -> None:
        """Publish staged ``version`` atomically from its prepared parts (all of them, or exactly ``parts``).

        A writer or coordinator that died after preparing leaves its part staged; name the ``parts``
        you expect (or ``abort`` the version first) so that such leftovers are never published."""
        version = int(version)
        staging = self.root / "staging" / str(version)
        with self._locked():
            target = self.root / "versions" / str(version)
            if target.exists():
                raise AlreadyCommitted(f"version {version} is already committed in store {self.root}")
            prepared = self.staged_parts(version)
            if parts is not None:
                missing = sorted(set(parts) - set(prepared))
                if missing:
                    raise StoreError(f"cannot commit version {version}: parts {missing} were not prepared "
                                     f"(prepared: {prepared or 'none'})")
                prepared = sorted(parts)
            if not prepared:
                raise StoreError(f"cannot commit version {version} in store {self.root}: nothing was prepared")
            manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "version": version, "host": self.host,
                                        "shards": [], "json": {}}
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
                        raise StoreError(f"cannot commit version {version}: JSON document {name!r} written by "
                                         f"two parts")
                    manifest["json"][name] = rel
            write_json_durable(staging / "manifest.json", manifest)
            os.rename(staging, target)
            fsync_dir(target.parent)
            fsync_dir(staging.parent)

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
        """Delete all but the newest ``keep`` committed versions, damaged version directories (no manifest),
        stale staging and trash; return the deleted committed versions."""
        if keep < 1:
            raise StoreError(f"gc must keep at least one version, got keep={keep}")
        with self._locked():
            versions = self.versions()
            doomed = versions[:-keep]
            for v in doomed:
                self._delete(v)
            for entry in (self.root / "versions").iterdir():
                # A committed directory always holds its manifest (commit renames it in with it): one without
                # is damaged, invisible to readers, and would block its number forever.
                if entry.name.isdigit() and not (entry / "manifest.json").is_file():
                    self._delete(int(entry.name))
            newest = versions[-1] if versions else None
            for staging in (self.root / "staging").iterdir():
                # Versions only grow, so a staged version not newer than the newest committed one is
                # left over from an interrupted write (commit would still accept it: gc drops it here).
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
        fsync_dir(path.parent)
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


if TYPE_CHECKING:  # mypy proves that the local store keeps the contract, with every capability
    from .contract import FileBackedReader, LinkingWriter, SpaceReportingStore

    def _keeps_the_contract(store: Store, writer: VersionWriter,
                            reader: VersionReader) -> tuple[SpaceReportingStore, LinkingWriter, FileBackedReader]:
        return store, writer, reader
