"""Which saved version a restore reads: the newest one the job's hosts can assemble completely.

May import: ``tenplex.store``, ``tenplex.replication``, ``tenplex.layout``, ``tenplex.devices``, this
package's :mod:`.exchange` and :mod:`.nontensor`, and torch.distributed (collectives over the job's group).

Available to a restore are the hosts of the job that hold a version, and hosts that left but whose recorded
store still answers with it. When a host of the version is gone (it left and its store does not answer, or it
is back in the job with an empty store), its regions come from the copies the job's hosts hold. A version some
region of which no available host holds is skipped; when no version is left and a host that left took regions
with it, :class:`~tenplex.replication.LostStateError` names what was lost.

A host that left may hold versions newer than any the job's hosts hold: it trained in a world in which the job's
hosts idled (an idle rank's host is in no saved layout and receives no copies), then hung or left. So the stores of
the hosts that left whose addresses are known (``stores``, and the records of the newest version here) are asked
for their versions first, and a newer version one of them still serves is a candidate like the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

import torch.distributed as dist

from ..devices import host_of, parse_device
from ..layout import Layout, from_dict as layout_from_dict
from ..replication import LostStateError, assemble
from ..replication.copier import held_layout
from ..replication.plan import Lost
from ..replication.stores import STORES_DOC, answering, held_by, replicas_of
from ..store import LAYOUT_DOC, Store
from .exchange import all_gather_json, broadcast_json
from .nontensor import StateMismatchError

STATE_DOC = "tenplex.torch_state"
STATE_FORMAT = "tenplex.torch_state/1"
DEPARTED_PROBE_S = 1.0  # a departed host's store gets this long to answer (a dead host's port mostly refuses at once)

log = logging.getLogger(__name__)


@dataclass
class Found:
    """A version to restore: its source layout (with copy devices when hosts are gone) and state."""

    version: int
    layout: Layout
    state: dict
    addresses: dict[str, str]          # departed hosts whose recorded store still serves the version
    lost_hosts: list[str] = field(default_factory=list)
    replica_devices: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    highest: int = 0                   # the highest version any store that answered holds: new versions go above


class VersionFinder:
    """Finds the version to restore from the ranks' gathered documents (``device``, ``host``, ``versions``,
    ``copies``). Collective over ``group``: every rank calls :meth:`find` with the same documents."""

    def __init__(self, store: Store, host: str, stores: Mapping[str, str], token: str | None, group):
        self.store, self.host, self.stores, self.token, self.group = store, host, stores, token, group

    def find(self, docs, wanted: int | None) -> Found | None:
        """The newest version (or ``wanted``) the available hosts can assemble completely; None: none saved."""
        job_hosts = {d["host"]: set(d["versions"]) for d in docs}
        elsewhere = self._departed_versions(docs, job_hosts)  # host -> [address, versions] of departed hosts
        candidates = sorted({v for d in docs for v in d["versions"]}, reverse=True)
        newer = sorted({v for _, vs in elsewhere.values() for v in vs if v > max(candidates, default=0)},
                       reverse=True)
        candidates = newer + candidates
        highest = max([max(vs, default=0) for _, vs in elsewhere.values()] + candidates, default=0)
        if wanted is not None:
            if wanted not in candidates:
                raise StateMismatchError(f"version {wanted} is committed on none of this job's hosts "
                                         f"({', '.join(sorted(job_hosts))}); committed: {candidates or 'none'}")
            candidates = [wanted]
        skipped: list[dict] = []
        losses: list[tuple[int, int, list[str], list[Lost], int]] = []
        for v in candidates:
            payload = self._broadcast_version(v, docs, job_hosts, elsewhere)
            old = layout_from_dict(payload["layout"], source=f"version {v}")
            step = payload["state"]["step"]
            # A host of the job that should hold v but does not: v's commit did not finish there, or the host
            # came back with an empty store. Either way only copies elsewhere can stand in for its shards.
            lacking = [h for h in old.hosts() if h in job_hosts and v not in job_hosts[h]]
            departed = [h for h in old.hosts() if h not in job_hosts and h not in payload["answering"]]
            if not lacking and not departed:
                return Found(v, old, payload["state"], payload["answering"], skipped=skipped, highest=highest)
            gone = sorted(lacking + departed)
            found = self._assemble(v, old, gone, docs)
            if not found.lost:
                return Found(v, found.layout, payload["state"], {}, gone, found.replica_devices, skipped, highest)
            if not departed:  # no copy stands in for a host of the job: as before, v is not complete
                skipped.append({"version": v, "step": step, "reason": f"not committed on {', '.join(lacking)}"})
                continue
            skipped.append({"version": v, "step": step, "reason": f"lost {len(found.lost)} region(s) of "
                                                                  f"{', '.join(gone)}: {found.lost[0]}"})
            losses.append((v, step, gone, found.lost, payload["replicas"]))
        if losses:
            raise LostStateError(lost_message(losses), losses[0][3])
        return None

    def _departed_versions(self, docs, job_hosts) -> dict[str, list]:
        """The versions held by the answering stores of hosts that left (known addresses: ``stores`` and the
        records of the newest version here), probed by the first rank and sent to every rank. Collective."""
        found: dict[str, list] | None = None
        if dist.get_rank(self.group) == 0:
            known = dict(self.stores)
            newest = max(docs[0]["versions"], default=None)
            if newest is not None:
                try:
                    reader = self.store.open(newest)
                    if STORES_DOC in reader.json_names():
                        known = {**reader.get_json(STORES_DOC)["stores"], **known}
                except Exception as e:  # noqa: BLE001 -- a record only adds candidates
                    log.warning("cannot read the store record of version %d: %s", newest, e)
            departed = {h: a for h, a in known.items() if h not in job_hosts and a}
            found = {h: [a, vs] for h, (a, vs) in held_by(departed, self.token, DEPARTED_PROBE_S).items()}
        return broadcast_json(found, src=global_rank(0, self.group), group=self.group)

    def _broadcast_version(self, v: int, docs, job_hosts, elsewhere) -> dict:
        """``v``'s documents, read by the first rank whose host holds it (the first rank from a store that holds
        it elsewhere, when no host of the job does) and sent to every rank."""
        holders = [r for r, d in enumerate(docs) if v in d["versions"]]
        src = min(holders, default=0)
        payload = None
        if dist.get_rank(self.group) == src:
            try:
                payload = self._read_version(v, job_hosts) if holders else \
                    self._read_elsewhere(v, job_hosts, min(a for a, vs in elsewhere.values() if v in vs))
            except Exception as e:  # noqa: BLE001 -- every rank raises it after the broadcast
                payload = {"error": f"{type(e).__name__}: {e}"}
        payload = broadcast_json(payload, src=global_rank(src, self.group), group=self.group)
        if "error" in payload:
            raise StateMismatchError(f"cannot read version {v} on host {docs[src]['host']}: {payload['error']}")
        return payload

    def _read_version(self, v: int, job_hosts) -> dict:
        """Layout, state and replication record of ``v`` from this host, and which departed hosts still serve it."""
        reader = self.store.open(v)
        recorded = reader.get_json(STORES_DOC) if STORES_DOC in reader.json_names() else None
        return self._documents(v, job_hosts, reader.get_json(LAYOUT_DOC), reader.get_json(STATE_DOC), recorded)

    def _read_elsewhere(self, v: int, job_hosts, address: str) -> dict:
        """The same as :meth:`_read_version`, read from the store at ``address`` of a host that left the job."""
        from ..store.client import RemoteStoreError, StoreClient

        with StoreClient(address, token=self.token) as client:
            try:
                recorded = client.get_json(v, STORES_DOC)
            except RemoteStoreError:  # saved without a record
                recorded = None
            return self._documents(v, job_hosts, client.get_json(v, LAYOUT_DOC), client.get_json(v, STATE_DOC),
                                   recorded)

    def _documents(self, v: int, job_hosts, layout: dict, state: dict, recorded: dict | None) -> dict:
        departed = sorted({host_of(d) for d in layout["devices"]} - set(job_hosts))
        candidates = {h: self.stores.get(h) or (recorded or {"stores": {}})["stores"].get(h) for h in departed}
        return {"layout": layout, "state": state, "replicas": replicas_of(recorded, v),
                "answering": answering(candidates, v, self.token) if departed else {}}

    def _assemble(self, v: int, old: Layout, gone: list[str], docs):
        """What the job's hosts can put together of ``v`` from their shards and the copies they hold. Collective."""
        leaders = {d["host"]: r for r, d in reversed(list(enumerate(docs)))}
        held = {}
        if leaders[self.host] == dist.get_rank(self.group):
            for origin in gone:
                if v not in docs[leaders[self.host]]["copies"].get(origin, []):
                    continue
                try:
                    held[origin] = held_layout(self.store.root, self.host, origin, v).to_dict()
                except Exception as e:  # noqa: BLE001 -- an unreadable copy counts as absent; the others go on
                    log.warning("ignoring host %s's copy of %s's version %d: %s", self.host, origin, v, e)
        gathered = all_gather_json(held, self.group)
        copies = {docs[r]["host"]: {o: layout_from_dict(doc, source=f"copies of {o}'s version {v}")
                                    for o, doc in gathered[r].items()} for r in leaders.values()}
        taken: dict[str, set[int]] = {}
        for d in docs:
            taken.setdefault(d["host"], set()).add(parse_device(d["device"])[1])
        available = [h for h in old.hosts() if h in taken and h not in gone]
        return assemble(old, available, copies, taken)


def lost_message(losses) -> str:
    """The LostStateError message for versions that lost regions: what, where, why, and what to do."""
    v, step, gone, lost, replicas = losses[0]
    shown = "; ".join(map(str, lost[:5])) + (f"; and {len(lost) - 5} more" if len(lost) > 5 else "")
    if replicas is None:
        why = ("it was made by a restore (a transformation, or put together from copies), and such versions are "
               "not copied; the next save is")
    elif replicas == 0:
        why = "it was saved with replication off (replicas=0)"
    else:
        why = (f"it asked for {replicas} copy(ies) of each such region, but no host of this job holds a committed "
               f"copy (the copying had not finished, or the hosts holding the copies are gone too)")
    older = "" if len(losses) == 1 else \
        f" Older version(s) {', '.join(str(loss[0]) for loss in losses[1:])} lost regions too."
    return (f"cannot restore: version {v} (step {step}) lost {len(lost)} region(s) whose only copies were on "
            f"host(s) {', '.join(gone)}, which are gone (not in this job, and no recorded store of theirs answers): "
            f"{shown}. {why[0].upper()}{why[1:]}.{older} Nothing was restored. To survive the loss of a host, save "
            f"with tenplex.Checkpointer(replicas=1) (the default with two or more hosts whose store addresses are "
            f"known) and let the copies finish (Checkpointer.wait_replicated), or restart the lost host's store "
            f"with its directory")


def global_rank(group_rank: int, group) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
