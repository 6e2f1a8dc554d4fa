"""The local tensor store of one host: versioned, atomically committed shard files in one directory.

May import: this package's ``_publish``, ``contract``, ``manifest``, ``reader`` and ``writer``, ``tenplex.box``,
``tenplex.errors``, ``tenplex.files`` (its atomic JSON write), ``tenplex.flock`` and the standard library. No
network: workers on the host use this module directly (writing: ``writer``; reading: ``reader``).

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
    publishing/<N>-<pid>-<random>/    a commit being put together (hard links to staged files, manifest)
    datasets/...                      read-only files served by ReadFile/StatFile (``datasets_dir``)
    replicas/<origin>/...             a nested store: this host's copies of ``origin``'s regions
                                      (``tenplex.replication.copier``)
    trash/...                         whatever is being removed
    .lock                             only where renameat2 is missing: serialises the last step of commits

A version becomes visible only when a complete directory (hard links to its
staged parts' files and its merged ``manifest.json``, written and fsynced) is
renamed to ``versions/<N>``; a rename is atomic, so a crash at any moment
leaves every committed version complete. Deletion renames a version into
``trash/`` before removing it for the same reason.

No operation takes a lock that another waits for (where the file system has
``renameat2(RENAME_NOREPLACE)``: Linux's local ones and tmpfs): the rename that
publishes a version fails if that version exists, and delete, abort and gc
only rename things into ``trash/``. Several processes share a store root (the
workers of a node, its store server), and a process stopped (SIGSTOP) or hung
in the middle of an operation must not block the others' commits: a lock's
holder that is stopped keeps it, the kernel frees it only when it dies. Where
the flag is missing, the publishing rename runs under the ``flock`` of
``.lock``, held for a check and a rename only; a wait longer than
``lock_timeout`` raises a ``StoreError`` naming the holder
(``tenplex.flock``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..box import Box
from ..errors import StoreError
from ..files import write_json_atomic
from ..flock import held
from ._publish import link_at, link_tree, open_dir, rename_noreplace
from .manifest import (MANIFEST_FORMAT, AlreadyCommitted, InvalidArgument, NotFound, ShardEntry, check_name,
                       fsync_dir)
from .reader import VersionReader
from .writer import VersionWriter


LOCK_TIMEOUT_S = 60.0  # the longest wait for ``.lock`` where it is used (a commit holds it for a check and a rename)


class Store:
    """One host's store rooted at a directory (created if missing)."""

    def __init__(self, root: str | os.PathLike, host: str, lock_timeout: float = LOCK_TIMEOUT_S):
        self.root = Path(root)
        self.host = host
        self.lock_timeout = lock_timeout
        # publishing/ is made by the first commit: a read-only root that an older tenplex made opens as before
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
        you expect (or ``abort`` the version first) so that such leftovers are never published.

        Lock-free: the version is put together in a directory of this call's own (hard links to the
        staged files, the merged manifest) and renamed to ``versions/<N>`` only if no version ``N`` is
        there (``renameat2(RENAME_NOREPLACE)``), so several processes may commit at once (exactly one
        wins a version, the others get ``AlreadyCommitted``) and none waits for another: a process
        stopped or hung in the middle of a commit holds nothing that others need."""
        version = int(version)
        target = self.root / "versions" / str(version)
        if target.exists():
            raise self._already_committed(version)
        try:
            staging = os.open(self.root / "staging" / str(version), os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise self._not_staged(version, target) from None
        try:  # everything is read through this one directory, even if it is renamed away meanwhile
            tree = self._assemble(version, staging, parts)
        finally:
            os.close(staging)
        try:
            self._publish(tree, target, version)
        except BaseException:
            self._discard(tree, f"publishing-{version}", durable=False)
            raise
        fsync_dir(target.parent)
        self.abort(version)  # the staged parts are published (or were never asked for): drop them

    def _assemble(self, version: int, staging: int, parts: list[str] | None) -> Path:
        """A private, complete copy (by hard links) of the chosen parts of the version staged in the directory
        ``staging`` (a descriptor), with its merged manifest: ``publishing/<N>-<pid>-<random>``."""
        try:
            prepared = self._chosen_parts(version, staging, parts)
            docs = {part: _read_json_at(staging, f"{part}.part.json") for part in prepared}
        except FileNotFoundError:
            raise self._not_staged(version, self.root / "versions" / str(version)) from None
        manifest = self._merged_manifest(version, docs)
        tree = self.root / "publishing" / f"{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tree.mkdir(parents=True)
        try:
            linked: set[str] = set()
            made = ["."]
            for part in prepared:
                linked |= link_tree(staging, part, tree, made)
                with open_dir(tree) as top:
                    link_at(staging, top, f"{part}.part.json")
            wanted = {row["file"] for row in manifest["shards"]} | set(manifest["json"].values())
            if not wanted <= linked:  # a file was removed before it was listed
                raise FileNotFoundError(f"a staged file of version {version} vanished")
            write_json_atomic(tree / "manifest.json", manifest)
            # Durable before it is published. After all the links: on a journaling file system the first
            # fsync commits them all, and the others find nothing left to do.
            for made_dir in made:
                fsync_dir(tree / made_dir)
        except BaseException as e:
            self._discard(tree, f"publishing-{version}", durable=False)
            if isinstance(e, FileNotFoundError):  # the staging was removed under us (abort, gc, a winner)
                raise self._not_staged(version, self.root / "versions" / str(version)) from None
            raise
        return tree

    def _chosen_parts(self, version: int, staging: int, parts: list[str] | None) -> list[str]:
        prepared = sorted(name[: -len(".part.json")] for name in os.listdir(staging) if name.endswith(".part.json"))
        if parts is not None:
            missing = sorted(set(parts) - set(prepared))
            if missing:
                raise StoreError(f"cannot commit version {version}: parts {missing} were not prepared "
                                 f"(prepared: {prepared or 'none'})")
            prepared = sorted(parts)
        if not prepared:
            raise StoreError(f"cannot commit version {version} in store {self.root}: nothing was prepared")
        return prepared

    def _merged_manifest(self, version: int, docs: dict[str, dict]) -> dict[str, Any]:
        """The version's manifest from its parts' documents; refuses overlapping boxes and twice-written JSON."""
        manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "version": version, "host": self.host,
                                    "shards": [], "json": {}}
        seen: dict[tuple[str, str], list[Box]] = {}
        for doc in docs.values():
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
        return manifest

    def _publish(self, tree: Path, target: Path, version: int) -> None:
        """Rename the complete ``tree`` to ``target`` unless a version is there: atomically where the file system
        can (no lock); elsewhere under the store's lock, whose wait is bounded (``lock_timeout``)."""
        try:
            if rename_noreplace(tree, target):
                return
        except FileExistsError:
            raise self._already_committed(version) from None
        except FileNotFoundError:  # gc dropped our tree: the version is older than the newest committed one
            raise self._not_staged(version, target) from None
        with held(self.root / ".lock", self.lock_timeout, f"store {self.root}: committing version {version}",
                  StoreError):
            if target.exists():
                raise self._already_committed(version)
            os.rename(tree, target)  # a committed version is never empty, so this never replaces one

    def _already_committed(self, version: int) -> AlreadyCommitted:
        return AlreadyCommitted(f"version {version} is already committed in store {self.root}")

    def _not_staged(self, version: int, target: Path) -> StoreError:
        """The error for a commit whose staging is gone: another process committed it, or nothing was staged, or
        it was aborted (``abort``, or ``gc`` as older than the newest committed version) meanwhile."""
        if target.exists():
            return self._already_committed(version)
        return StoreError(f"cannot commit version {version} in store {self.root}: nothing was prepared, or its "
                          f"staging was aborted meanwhile (abort, or gc: versions not newer than the newest "
                          f"committed one are dropped)")

    def abort(self, version: int) -> None:
        """Drop everything staged for ``version`` (committed versions are untouched)."""
        self._discard(self.root / "staging" / str(int(version)), f"staging-{int(version)}", durable=False)

    def delete(self, version: int) -> bool:
        """Delete committed ``version``; False if it did not exist (or another process deleted it first)."""
        return self._discard(self.root / "versions" / str(int(version)), str(int(version)))

    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed versions, damaged version directories (no manifest),
        stale staging and trash; return the deleted committed versions. Lock-free like ``commit``: it only
        renames things into ``trash/`` (a name another process removed first is skipped) and then removes
        the trash, so it never deletes a version newer than the newest it saw, and runs alongside commits."""
        if keep < 1:
            raise StoreError(f"gc must keep at least one version, got keep={keep}")
        versions = self.versions()
        doomed = versions[:-keep]
        for v in doomed:
            self.delete(v)
        for entry in (self.root / "versions").iterdir():
            # A committed directory always holds its manifest (commit renames it in with it): one without
            # is damaged, invisible to readers, and would block its number forever.
            if entry.name.isdigit() and not (entry / "manifest.json").is_file():
                self.delete(int(entry.name))
        newest = versions[-1] if versions else None
        for staging in (self.root / "staging").iterdir():
            # Versions only grow, so a staged version not newer than the newest committed one is
            # left over from an interrupted write (commit would still accept it: gc drops it here).
            if staging.name.isdigit() and newest is not None and int(staging.name) <= newest:
                self.abort(int(staging.name))
        publishing = self.root / "publishing"
        for tree in publishing.iterdir() if publishing.is_dir() else ():  # the same for interrupted commits
            number = tree.name.split("-", 1)[0]
            if number.isdigit() and newest is not None and int(number) <= newest:
                self._discard(tree, f"publishing-{number}", durable=False)
        for junk in (self.root / "trash").iterdir():
            shutil.rmtree(junk, ignore_errors=True)
        return doomed

    def _discard(self, path: Path, label: str, durable: bool = True) -> bool:
        """Rename ``path`` into ``trash/`` (atomic: readers see it whole or not at all), then remove it there;
        False if it was not there (never was, or another process took it first). ``durable``: the rename
        survives a crash (a deleted version must not come back; dropped staging may: gc drops it again)."""
        trash = self.root / "trash" / f"{label}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return False
        if durable:
            fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
        return True


def _read_json_at(directory: int, name: str) -> Any:
    fd = os.open(name, os.O_RDONLY, dir_fd=directory)
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read())


if TYPE_CHECKING:  # mypy proves that the local store keeps the contract, with every capability
    from .contract import FileBackedReader, LinkingWriter, SpaceReportingStore

    def _keeps_the_contract(store: Store, writer: VersionWriter,
                            reader: VersionReader) -> tuple[SpaceReportingStore, LinkingWriter, FileBackedReader]:
        return store, writer, reader
