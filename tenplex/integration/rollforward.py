"""Finish, after hosts were lost, the newest version whose surviving ranks all prepared their parts.

May import: ``tenplex.store``, this package's :mod:`.commit` and :mod:`.exchange`, torch.distributed and the
standard library.

A snapshot commits once every rank prepared its part (:mod:`.snapshot`): the decision is a key in the job's
key-value store, and each host's first rank commits its host's parts when it reads it. That store lives in rank
0's process (torchrun's ``MASTER_ADDR:MASTER_PORT``), so when rank 0's host dies right after the decision, the
other hosts may hold their parts prepared and never learn it: the decision was on the dead host only. The same
happens to a blocking save whose hosts commit one after the other.

So the version's first rank on each host records which parts every host has (``tenplex.parts``), and a restore
first looks at the versions staged on the job's hosts above their newest committed one. The newest such version
is committed on the job's hosts (:func:`roll_forward`, collective) when every host of the job that has a part in
it prepared all of its parts, or committed it: the ranks that did not prepare are on lost hosts, and every rank
staged its state at the same step boundary, so the surviving parts are whole, consistent state of that step.
Whether they hold every region is the restore's usual question (:mod:`.versions`): under DDP or HSDP they do; a
version some region of which only a lost host held is skipped as any other. A version that a host of the job
did not finish preparing (a rank killed during its write, its host still in the job) is never rolled forward.
"""

from __future__ import annotations

import json
import logging

import torch.distributed as dist

from ..store import Store
from .commit import stage_and_commit
from .exchange import all_gather_json

log = logging.getLogger(__name__)
PARTS_DOC = "tenplex.parts"  # {"format": ..., "hosts": {host: [part, ...]}}: in the first rank's part of a version
PARTS_FORMAT = "tenplex.parts/1"


def parts_doc(parts: dict[str, list[str]]) -> dict:
    return {"format": PARTS_FORMAT, "hosts": {h: sorted(p) for h, p in sorted(parts.items())}}


def staged_report(store: Store) -> dict[str, dict]:
    """The versions staged on this host above its newest committed one: {version: {"hosts": [...], "complete":
    whether every part of this host is prepared}} (a version without a readable parts record: not listed)."""
    latest = store.latest() or 0
    staging = store.root / "staging"
    found: dict[str, dict] = {}
    for entry in staging.iterdir() if staging.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) <= latest:
            continue
        version = int(entry.name)
        prepared = store.staged_parts(version)
        record = _parts_record(store, version, prepared)
        if record is not None:
            mine = record["hosts"].get(store.host, [])
            found[str(version)] = {"hosts": sorted(record["hosts"]), "complete": bool(mine) and set(mine) <=
                                   set(prepared), "parts": mine}
    return found


def _parts_record(store: Store, version: int, prepared: list[str]) -> dict | None:
    staging = store.root / "staging" / str(version)
    for part in prepared:
        try:
            rel = json.loads((staging / f"{part}.part.json").read_text())["json"].get(PARTS_DOC)
            if rel is not None:
                record = json.loads((staging / rel).read_text())
                return record if record.get("format") == PARTS_FORMAT else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: not rolled forward
    return None


def chosen(docs: list[dict]) -> int | None:
    """The version to roll forward, from every rank's ``{"host", "latest", "staged"}`` (the same on every rank):
    the newest staged one, when no host committed a newer one and every host of the job that has parts in it
    prepared all of them or committed it."""
    staged = {int(v) for d in docs for v in d["staged"]}
    if not staged:
        return None
    version = max(staged)  # older staged versions are leftovers of earlier attempts
    if any((d["latest"] or 0) > version for d in docs):
        return None
    hosts = {h for d in docs for h in d["staged"].get(str(version), {}).get("hosts", [])}
    by_host = {d["host"]: d for d in docs}
    for host in hosts & set(by_host):
        report, committed = by_host[host]["staged"].get(str(version)), by_host[host]["latest"] == version
        if not committed and (report is None or not report["complete"]):
            return None
    return version


def roll_forward(store: Store, group) -> int | None:
    """Commit the newest version that the job's hosts prepared completely (see the module docstring); returns it,
    or None. Collective: one all-gather, and a commit on every host or on none."""
    rank = dist.get_rank(group)
    staged = staged_report(store)
    docs = all_gather_json({"host": store.host, "latest": store.latest(), "staged": staged}, group)
    version = chosen(docs)
    if version is None:
        return None
    leader = rank == min(r for r, d in enumerate(docs) if d["host"] == store.host)
    report = staged.get(str(version))
    parts = [] if report is None else report["parts"]
    try:
        stage_and_commit(store, group, f"restore: committing version {version}, which every surviving rank "
                         "prepared", version, lambda: None, parts, leader and bool(parts))
    except Exception as e:  # noqa: BLE001 -- raised on every rank alike: restore an older version
        log.warning("tenplex: could not commit version %d, prepared by every surviving rank: %s; restoring an older "
                    "one", version, e)
        return None
    if rank == 0:
        lost = sorted({h for d in docs for h in d["staged"].get(str(version), {}).get("hosts", [])}
                      - {d["host"] for d in docs})
        log.warning("tenplex: committed version %d, which every rank of the job's hosts had prepared; the ranks "
                    "that did not commit it were on %s", version, ", ".join(lost) or "no lost host")
    return version
