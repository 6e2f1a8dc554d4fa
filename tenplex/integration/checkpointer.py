"""Save and restore a parallel PyTorch job's state through the per-host tensor stores.

May import: every layer below it (``tenplex.store``, ``tenplex.transform``,
``tenplex.planner``, ``tenplex.layout``, …), torch and torch.distributed.

Save (every rank, collectively):

1. map model and optimizer state to pieces (:mod:`.pieces`);
2. all-gather every rank's tensor specs and boxes as JSON (no pickles); within
   a host, only the first rank holding a given box writes it (replicas on one
   host would be identical copies);
3. each rank stages its shards as one part of version N+1 in its host's store
   (memory-mapped, no network); the first rank of each host adds the whole
   layout and the non-tensor state (``tenplex.torch_state``);
4. once every rank prepared its part, each host commits. A failure anywhere
   aborts the staged version everywhere and raises on every rank;
5. the version records every host's store address (``tenplex.stores``), and the
   first rank of each host starts pulling, in the background, its copies of
   the regions that only one other host holds (``replicas``; see
   :mod:`tenplex.replication`).

Restore (every rank, collectively):

1. the new layout comes from the ranks' own model and optimizer (or is given);
2. the newest version that the available hosts can assemble completely is
   chosen; its layout and state document are broadcast from a rank whose host
   has it. Available: the hosts of the job that hold it, and hosts that left
   but whose recorded store still answers with it. When a host of the version
   is gone (it left and its store does not answer, or it is back in the job
   with an empty store), its regions come from the copies the job's hosts
   hold: they first put together a new version from their own shards and
   those copies (hard links, :mod:`tenplex.replication.promote`). A version
   some region of which no available host holds is skipped; when no version
   is left and a host that left took regions with it,
   :class:`~tenplex.replication.LostStateError` names what was lost;
3. mismatches (a tensor missing on either side, a shape or dtype change, an
   optimizer of another kind) raise StateMismatchError on every rank;
4. if every box a rank needs can be assembled from shards stored on its own
   host, the rank reads them straight from the store files; otherwise every
   rank plans the change (``tenplex.planner``, deterministic). When no region is
   fanned out and every host the plan reads from is in the job, every rank
   reads its own transfers of the plan into its tensors, locally or from other
   hosts' stores (:mod:`.readthrough`), and no version is made; otherwise, or
   when such a read fails, the stores run the plan (``tenplex.transform``) into
   a new version on the job's hosts, and every rank reads from it;
5. non-tensor state is applied (see :data:`SEMANTICS` and the README).
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..devices import host_of, parse_device, parse_host_addresses
from ..errors import ConfigError, StoreError
from ..layout import Layout, Shard, TensorSpec, from_dict as layout_from_dict
from ..box import Box, tile
from ..replication import LostStateError, assemble, effective_replicas
from ..replication.copier import Replicator, held_layout, held_versions
from ..replication.plan import Lost
from ..replication.stores import STORES_DOC, answering, replicas_of, stores_doc
from ..planner import plan as make_plan
from ..store import LAYOUT_DOC, Store
from ..store.client import StoreClient
from ..store.manifest import PROMOTE_PART
from ..transfer_plan import Plan
from .annotate import Annotations
from .exchange import agree, all_gather_json, broadcast_json
from .names import likely_cause, parameter_names
from .nontensor import (StateMismatchError, apply_optimizer_doc, apply_rng, capture_rng, derived_seed, from_json,
                        optimizer_doc, seed_rng, to_json)
from .pieces import (OPTIMIZER_PREFIX, Piece, init_optimizer_state, model_pieces, optimizer_pieces, optimizer_scalars,
                     set_optimizer_scalars)
from .readthrough import RemoteVersion, fans_out, read_hosts, read_through, source_hosts
from .shardio import RegionReader, read_piece, write_piece

STATE_DOC = "tenplex.torch_state"
STATE_FORMAT = "tenplex.torch_state/1"

log = logging.getLogger(__name__)
READ_STALL_S = 5.0  # a store that sends nothing for this long while a restore reads from it is dead
_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()  # their background copies are cancelled at exit


@dataclass
class RestoreInfo:
    """What the last :meth:`Checkpointer.restore` did (for logs and tests)."""

    version: int | None = None        # the version restored from (after a transformation: the new one)
    saved_version: int | None = None  # the version that was saved
    step: int | None = None           # the step that version saved
    transformed: bool = False         # the stores ran the plan and committed a new version (``version``)
    read_through: bool = False        # every rank read its regions of the plan straight from ``version`` (the
                                      # saved one, or the one put together from copies); no version was made
    plan_stats: dict = field(default_factory=dict)
    lost_hosts: list[str] = field(default_factory=list)  # hosts of the saved version that were gone
    promoted_version: int | None = None  # the version put together from survivors' shards and copies
    replica_devices: dict[str, list[str]] = field(default_factory=dict)  # copy device -> [holder, origin device]
    skipped: list[dict] = field(default_factory=list)  # newer versions not restorable: {version, step, reason}


class Checkpointer:
    """Where this rank's state goes: its host's store directory, its device id, the other hosts' stores.

    Every argument has an environment default, so that whatever launches the
    workers configures the job and the training script only calls
    :func:`tenplex.save` / :func:`tenplex.restore`: ``tenplex run``
    (:mod:`tenplex.elastic.launcher`, in each worker pod of the Kubernetes
    operator too), :func:`tenplex.runtime.launch.run_job` (``tenplex demo``),
    or any torchrun wrapper that sets the variables:

    * ``store_root``: ``TENPLEX_STORE_ROOT`` — this host's store directory;
    * ``host``: ``TENPLEX_HOST`` (default ``h0``);
    * ``device``: ``TENPLEX_DEVICE`` (default ``HOST/LOCAL_RANK``);
    * ``store_address``: ``TENPLEX_STORE_ADDRESS`` — this host's store server
      (``tenplex run`` sets it). Every save records the address of every host's
      store, so a restore that moves data between hosts, and replication, find
      them without a list;
    * ``stores``: ``TENPLEX_STORES`` = ``h0=127.0.0.1:5000,h1=…`` — an override:
      addresses of hosts' store processes, preferred to the recorded ones;
    * ``replicas``: copies of every region that only one host holds, kept on
      the next hosts of a ring (see :mod:`tenplex.replication`) and pulled in
      the background after each save. None (default): one copy when the job
      spans two or more hosts; 0: off. :meth:`wait_replicated` waits for them.
      The next save and the process's exit cancel copies still running: wait
      after the last save before a planned exit, or that save has no copies;
    * ``coords``: this rank's parallel coordinates, for example
      ``{"pp": 0, "dp": 1, "tp": 0}``; RNG states are keyed by them (default: the rank);
    * ``keep``: committed versions kept per store after a save (default 2);
    * ``group``: the process group (default: the world);
    * ``token``: ``TENPLEX_TOKEN`` — the shared token of stores bound beyond loopback.
    """

    def __init__(self, store_root: str | os.PathLike | None = None, host: str | None = None,
                 device: str | None = None, stores: Mapping[str, str] | None = None,
                 coords: Mapping[str, int] | None = None, keep: int = 2, group=None, token: str | None = None,
                 store_address: str | None = None, replicas: int | None = None):
        env = os.environ
        root = store_root or env.get("TENPLEX_STORE_ROOT")
        if not root:
            raise ConfigError("no store directory: pass store_root= or set TENPLEX_STORE_ROOT")
        self.host = host or env.get("TENPLEX_HOST", "h0")
        self.device = device or env.get("TENPLEX_DEVICE") or f"{self.host}/{env.get('LOCAL_RANK', '0')}"
        if host_of(self.device) != self.host:
            raise ConfigError(f"device {self.device} is not on host {self.host}; device ids are HOST/INDEX")
        self.store = Store(root, self.host)
        self.stores = (dict(stores) if stores is not None
                       else parse_host_addresses(env.get("TENPLEX_STORES", ""), "TENPLEX_STORES"))
        self.coords = dict(coords) if coords is not None else None
        self.keep = keep
        self.group = group
        self.token = token or env.get("TENPLEX_TOKEN")
        self.store_address = store_address or env.get("TENPLEX_STORE_ADDRESS") or self.stores.get(self.host)
        if replicas is not None and replicas < 0:
            raise ConfigError(f"replicas must be >= 0 (0: no copies) or None (the default), got {replicas}")
        self.replicas = replicas
        self.last_restore = RestoreInfo()
        self._replicator: Replicator | None = None
        self._replicated_version: int | None = None  # the last saved version, once replication was set up
        self.last_replication: list[dict] = []  # every host's copier status, as the last wait_replicated saw it
        _LIVE.add(self)

    # ------------------------------------------------------------------ save
    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
             extra: Any = None, scheduler=None, scaler=None, annotations: Annotations | None = None,
             rng: bool = True) -> int:
        """Save the state at ``step`` as a new version on every host; returns the version. Collective."""
        rank = dist.get_rank(self.group)
        self._cancel_replication()  # the new version supersedes the one still being copied
        pieces = [p for p in _pieces(model, optimizer, annotations) if not p.box.is_empty()]
        mine = {"device": self.device, "host": self.host, "latest": self.store.latest(), "store": self.store_address,
                "tensors": _specs(pieces), "boxes": [[p.name, list(p.box.offsets), list(p.box.lengths)]
                                                    for p in pieces],
                "coord": self._coord_key(rank), "rng": capture_rng() if rng else None,
                "scalars": optimizer_scalars(model, optimizer) if optimizer is not None else {},
                "groups": _group_names(model, optimizer)}
        docs = all_gather_json(mine, self.group)
        tensors = agree("save: check tensors", lambda: _merge_specs(docs), self.group)
        writers = _first_holder_per_host(docs)
        version = 1 + max((d["latest"] for d in docs if d["latest"] is not None), default=0)
        leader = min(r for r, d in enumerate(docs) if d["host"] == self.host)
        addresses = self._addresses(docs)
        ring = sorted({d["host"] for d in docs if d["boxes"]})  # the hosts of the saved layout
        replicas = agree("save: check the replicas", lambda: self._replica_count(addresses, ring), self.group)
        saved: list[Layout] = []

        def stage():
            with self.store.begin(version, part=f"rank{rank}") as writer:
                for piece in pieces:
                    if writers[(self.host, piece.name, piece.box)] == rank:
                        write_piece(writer, self.device, piece)
                if rank == leader:
                    saved.append(_saved_layout(tensors, docs, writers))
                    writer.put_layout(saved[0])
                    writer.put_json(STATE_DOC, self._state_doc(docs, step, extra, scheduler, scaler, optimizer))
                    writer.put_json(STORES_DOC, stores_doc(version, {h: addresses.get(h) for h in ring}, replicas,
                                                           ring))
                writer.prepare()

        # Name the parts: a crashed earlier attempt may have left other ranks' parts of this version staged.
        parts = [f"rank{r}" for r, d in enumerate(docs) if d["host"] == self.host]
        self._stage_and_commit(f"save of step {step}", version, stage, parts, rank == leader)
        if rank == leader:
            self.store.gc(self.keep)
            if replicas:
                self._replicator = Replicator(self.store, version, saved[0], replicas, addresses, token=self.token,
                                              keep=self.keep).start()
        self._replicated_version = version
        return version

    def _stage_and_commit(self, what: str, version: int, stage: Callable[[], None], parts: list[str],
                          leader: bool) -> None:
        """Every rank runs ``stage``, then the ranks with ``leader`` set (one per host) commit their host's
        ``parts``; a failure anywhere takes the version back on every host and raises on every rank. Collective."""
        try:
            agree(f"{what} (staging version {version})", stage, self.group)
            agree(f"{what} (committing version {version})",
                  lambda: self.store.commit(version, parts=parts) if leader else None, self.group)
        except Exception:
            if leader:
                self.store.abort(version)
                # Committed here but not on every host: take it back, so that no later restore can pick a
                # version that some host lacks (the version number is new, so nothing older is touched).
                self.store.delete(version)
            raise

    # ----------------------------------------------------------- replication
    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the copies of the last saved version. Collective.

        True on every rank when every copy the replication rule asks for is
        committed on its host (trivially so when it asks for none: ``replicas=0``
        or one host); False when some copy failed, was cancelled, is not done in
        time, or nothing was saved yet. :meth:`replication_status` says why.
        """
        replicator = self._replicator
        ok = self._replicated_version is not None and (replicator is None or replicator.wait(timeout))
        reports = all_gather_json({"host": self.host, "ok": ok,
                                   "status": None if replicator is None else replicator.status()}, self.group)
        self.last_replication = [r for r in reports if r["status"] is not None]
        return all(r["ok"] for r in reports)

    def replication_status(self) -> dict | None:
        """This process's copies of the last saved version: version, state (pending, running, replicated,
        failed, cancelled), copies, bytes, seconds, error; None when this rank pulls none."""
        return None if self._replicator is None else self._replicator.status()

    def close(self) -> None:
        """Cancel background replication (its staged copy is dropped; committed copies stay)."""
        self._cancel_replication()

    def _cancel_replication(self) -> None:
        if self._replicator is not None:
            self._replicator.cancel()

    def _addresses(self, docs) -> dict[str, str]:
        """host -> store address: what the ranks report, overridden by ``stores``/``TENPLEX_STORES``."""
        found = {d["host"]: d["store"] for d in docs if d.get("store")}
        found.update(self.stores)
        return found

    def _replica_count(self, addresses: dict[str, str], ring: list[str]) -> int:
        count = effective_replicas(self.replicas, len(ring))
        unknown = [h for h in ring if h not in addresses]
        if count and unknown:
            if self.replicas is not None:
                raise ConfigError(f"replicas={self.replicas} needs every host's store address, but host(s) "
                                  f"{', '.join(unknown)} reported none: set TENPLEX_STORE_ADDRESS on every host "
                                  f"(tenplex run does), pass store_address=, or pass replicas=0")
            if dist.get_rank(self.group) == 0:
                log.warning("state is not replicated: host(s) %s reported no store address (set "
                            "TENPLEX_STORE_ADDRESS, as tenplex run does); a lost host loses its shards",
                            ", ".join(unknown))
            return 0
        return count

    def _coord_key(self, rank: int) -> str:
        coords = self.coords if self.coords is not None else {"rank": rank}
        return ",".join(f"{k}={v}" for k, v in sorted(coords.items()))

    def _state_doc(self, docs, step, extra, scheduler, scaler, optimizer) -> dict:
        rng: dict[str, Any] = {}
        for d in docs:
            if d["rng"] is not None:
                rng.setdefault(d["coord"], d["rng"])
        scalars: dict = {}
        for d in docs:
            scalars.update(d["scalars"])
        doc = {"format": STATE_FORMAT, "step": int(step), "extra": to_json(extra, "extra"), "rng": rng,
               "scheduler": None if scheduler is None else to_json(scheduler.state_dict(), "the LR scheduler's state"),
               "scaler": None if scaler is None else to_json(scaler.state_dict(), "the gradient scaler's state"),
               "optimizer": None, "scalars": scalars}
        if optimizer is not None:
            names = [sorted({n for d in docs for n in d["groups"][i]}) for i in range(len(optimizer.param_groups))]
            doc["optimizer"] = optimizer_doc(optimizer, names)
        return doc

    # --------------------------------------------------------------- restore
    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                extra: dict | None = None,
                scheduler=None, scaler=None, annotations: Annotations | None = None, rng: bool = True,
                layout: Layout | None = None, version: int | None = None) -> int | None:
        """Load the newest saved state into ``model`` and ``optimizer`` (in place); return its step. Collective.

        Returns None when no state was saved yet (the optimizer then holds its
        fresh, zeroed state). ``extra``, if given, is updated with the saved
        ``extra`` dict. Without an optimizer only the model is restored and the
        saved optimizer state is ignored. ``layout`` is a new
        layout made in advance (by partition rules) to plan with instead of
        the one gathered from the ranks; it must give every rank what it needs.
        """
        rank = dist.get_rank(self.group)
        if optimizer is not None:
            init_optimizer_state(optimizer)
        pieces = [p for p in _pieces(model, optimizer, annotations) if not p.box.is_empty()]
        mine = {"device": self.device, "host": self.host, "versions": self.store.versions(),
                "copies": held_versions(self.store.root, self.host), "store": self.store_address,
                "tensors": _specs(pieces), "boxes": [[p.name, list(p.box.offsets), list(p.box.lengths)]
                                                    for p in pieces]}
        docs = all_gather_json(mine, self.group)
        found = self._find_version(docs, version)
        if found is None:
            return None
        old, state = found.layout, found.state
        new = agree("restore: check the new layout",
                    lambda: _check_and_build(old, docs, layout, self.device, pieces,
                                             with_optimizer=optimizer is not None), self.group)
        if optimizer is not None:
            agree("restore: check the optimizer", lambda: _check_optimizer(optimizer, model, state), self.group)
        info = RestoreInfo(version=found.version, saved_version=found.version, step=state["step"],
                           lost_hosts=found.lost_hosts, skipped=found.skipped,
                           replica_devices={d: list(v) for d, v in found.replica_devices.items()})
        newest = max(v for d in docs for v in d["versions"])
        source_version = found.version
        if found.lost_hosts:
            source_version = info.version = info.promoted_version = self._promote(found, newest + 1, docs)
            newest = source_version
        sources = _local_sources(old, new)
        if sources is None:
            addresses = {**found.addresses, **self._addresses(docs)}
            the_plan = agree("restore: planning the change", lambda: make_plan(old, new), self.group)
            info.plan_stats = asdict(the_plan.stats)
            # Read through only when that crosses hosts no more than the plan and leaves the job depending on no
            # store outside it (a departed host's store may go away before the job's next save).
            inside = read_hosts(the_plan) <= {d["host"] for d in docs}
            if inside and not fans_out(the_plan) and self._read_through(the_plan, old, source_version, pieces,
                                                                         addresses):
                info.read_through = True
            else:
                info.version = self._transform(the_plan, old, new, source_version, newest + 1, addresses)
                info.transformed = True
                sources = {d: {(s.tensor, s.box): [(d, s.box)] for s in shards} for d, shards in new.devices.items()}

        def load():
            reader = self.store.open(info.version)
            for piece in pieces:
                read_piece(reader, sources[self.device][(piece.name, piece.box)], piece)
        if not info.read_through:
            agree(f"restore: reading version {info.version}", load, self.group)
        self._apply_state(state, model, optimizer, scheduler, scaler, extra, rng, rank)
        self.last_restore = info
        return state["step"]

    def _find_version(self, docs, wanted) -> "_Found | None":
        """The newest version the available hosts can assemble completely (see the module docstring)."""
        job_hosts = {d["host"]: set(d["versions"]) for d in docs}
        candidates = sorted({v for d in docs for v in d["versions"]}, reverse=True)
        if wanted is not None:
            if wanted not in candidates:
                raise StateMismatchError(f"version {wanted} is committed on none of this job's hosts "
                                         f"({', '.join(sorted(job_hosts))}); committed: {candidates or 'none'}")
            candidates = [wanted]
        skipped: list[dict] = []
        losses: list[tuple[int, int, list[str], list[Lost], int]] = []
        for v in candidates:
            src = min(r for r, d in enumerate(docs) if v in d["versions"])
            payload = None
            if dist.get_rank(self.group) == src:
                try:
                    payload = self._read_version(v, job_hosts)
                except Exception as e:  # noqa: BLE001 -- every rank raises it after the broadcast
                    payload = {"error": f"{type(e).__name__}: {e}"}
            payload = broadcast_json(payload, src=_global_rank(src, self.group), group=self.group)
            if "error" in payload:
                raise StateMismatchError(f"cannot read version {v} on host {docs[src]['host']}: {payload['error']}")
            old = layout_from_dict(payload["layout"], source=f"version {v}")
            step = payload["state"]["step"]
            # A host of the job that should hold v but does not: v's commit did not finish there, or the host
            # came back with an empty store. Either way only copies elsewhere can stand in for its shards.
            lacking = [h for h in old.hosts() if h in job_hosts and v not in job_hosts[h]]
            departed = [h for h in old.hosts() if h not in job_hosts and h not in payload["answering"]]
            if not lacking and not departed:
                return _Found(v, old, payload["state"], payload["answering"], skipped=skipped)
            gone = sorted(lacking + departed)
            found = self._assemble(v, old, gone, docs)
            if not found.lost:
                return _Found(v, found.layout, payload["state"], {}, gone, found.replica_devices, skipped)
            if not departed:  # no copy stands in for a host of the job: as before, v is not complete
                skipped.append({"version": v, "step": step, "reason": f"not committed on {', '.join(lacking)}"})
                continue
            skipped.append({"version": v, "step": step, "reason": f"lost {len(found.lost)} region(s) of "
                                                                  f"{', '.join(gone)}: {found.lost[0]}"})
            losses.append((v, step, gone, found.lost, payload["replicas"]))
        if losses:
            raise LostStateError(_lost_message(losses), losses[0][3])
        return None

    def _read_version(self, v: int, job_hosts) -> dict:
        """Layout, state and replication record of ``v`` from this host, and which departed hosts still serve it."""
        reader = self.store.open(v)
        layout = reader.get_json(LAYOUT_DOC)
        recorded = reader.get_json(STORES_DOC) if STORES_DOC in reader.json_names() else None
        departed = sorted({host_of(d) for d in layout["devices"]} - set(job_hosts))
        candidates = {h: self.stores.get(h) or (recorded or {"stores": {}})["stores"].get(h) for h in departed}
        return {"layout": layout, "state": reader.get_json(STATE_DOC), "replicas": replicas_of(recorded, v),
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

    def _promote(self, found: "_Found", target: int, docs) -> int:
        """Commit ``target`` on the surviving hosts from their shards and copies of the found version. Collective."""
        from ..replication import promote

        rank = dist.get_rank(self.group)
        leader = min(r for r, d in enumerate(docs) if d["host"] == self.host)
        stages = rank == leader and self.host in found.layout.hosts()  # a host of the found version stages its part

        def stage():
            if stages:
                promote.stage(self.store, found.version, target, found.layout, found.replica_devices)
        self._stage_and_commit(f"restore: putting version {found.version} together from surviving shards and copies",
                               target, stage, [PROMOTE_PART], stages)
        return target

    def _read_through(self, the_plan: Plan, old: Layout, version: int, pieces: list[Piece],
                      addresses: dict[str, str]) -> bool:
        """Every rank reads its device's transfers of ``the_plan`` from ``version`` into its pieces. Collective.

        True when every rank did; False when a store or the network failed on some rank (logged): the caller
        then lets the stores run the plan, which retries failed sources from other replicas."""
        hosts = source_hosts(the_plan, self.device)
        dtypes = {name: spec.dtype for name, spec in old.tensors.items()}

        def run() -> str | None:
            """None when done; the failure when a store or the network failed (other errors raise everywhere)."""
            _require_addresses(hosts - {self.host}, addresses)
            clients: list[StoreClient] = []
            local = None
            try:
                readers: dict[str, RegionReader] = {}
                for host in sorted(hosts):
                    if host == self.host:
                        readers[host] = local = self.store.open(version)
                    else:
                        clients.append(StoreClient(addresses[host], token=self.token, stall_timeout=READ_STALL_S))
                        readers[host] = RemoteVersion(clients[-1], version, dtypes)
                read_through(the_plan, self.device, pieces, readers)
                return None
            except (StoreError, OSError) as e:
                return f"{type(e).__name__}: {e}"
            finally:
                for client in clients:
                    client.close()
                if local is not None:
                    local.close()

        mine = agree("restore: reading the plan's regions", run, self.group)
        failures = [(r, f) for r, f in enumerate(all_gather_json(mine, self.group)) if f]
        if dist.get_rank(self.group) == 0:
            for r, failure in failures[:3]:
                log.warning("restore: rank %d could not read its regions directly (%s); the stores run the plan "
                            "instead", r, failure)
        return not failures

    def _transform(self, the_plan: Plan, old: Layout, new: Layout, old_version: int, target: int,
                   addresses: dict[str, str]) -> int:
        from ..transform import transform

        def run():
            if dist.get_rank(self.group) != 0:
                return None
            _require_addresses(set(old.hosts()) | set(new.hosts()), addresses)
            # The transformer carries the JSON documents (the state doc included) into the new version.
            transform(the_plan, old, new, stores=addresses, old_version=old_version, new_version=target,
                      token=self.token)
            return target

        agree("restore: transforming the stored state", run, self.group)
        return target

    def _apply_state(self, state, model, optimizer, scheduler, scaler, extra, rng, rank) -> None:
        if optimizer is not None:
            set_optimizer_scalars(model, optimizer, state["scalars"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(from_json(state["scheduler"]))
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(from_json(state["scaler"]))
        if extra is not None and isinstance(state["extra"], dict):
            extra.update(from_json(state["extra"]))
        if rng:
            coord = self._coord_key(rank)
            if coord in state["rng"]:
                apply_rng(state["rng"][coord])
            else:
                seed_rng(derived_seed(state["step"], coord))


@atexit.register
def _cancel_replication_at_exit() -> None:
    for ckpt in list(_LIVE):
        ckpt.close()


# ---------------------------------------------------------------- helpers
@dataclass
class _Found:
    """A version to restore: its source layout (with copy devices when hosts are gone) and state."""

    version: int
    layout: Layout
    state: dict
    addresses: dict[str, str]          # departed hosts whose recorded store still serves the version
    lost_hosts: list[str] = field(default_factory=list)
    replica_devices: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)


def _lost_message(losses) -> str:
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


def _require_addresses(hosts: set[str], addresses: Mapping[str, str]) -> None:
    missing = sorted(hosts - set(addresses))
    if missing:
        raise StateMismatchError(
            f"restoring into this configuration moves state between devices, which needs the store "
            f"process of every host; no address for host(s) {', '.join(missing)}: set "
            f"TENPLEX_STORE_ADDRESS on every host (tenplex run does), or pass stores= / "
            f"TENPLEX_STORES=h0=HOST:PORT,…")


def _global_rank(group_rank: int, group) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _pieces(model, optimizer, annotations) -> list[Piece]:
    pieces = model_pieces(model, annotations)
    if optimizer is not None:
        pieces += optimizer_pieces(model, optimizer, annotations)
    return pieces


def _specs(pieces: list[Piece]) -> dict[str, list]:
    return {p.name: [list(p.spec.shape), p.spec.dtype] for p in pieces}


def _group_names(model, optimizer) -> list[list[str]]:
    if optimizer is None:
        return []
    names = parameter_names(model)
    return [[names[id(p)] for p in g["params"] if id(p) in names] for g in optimizer.param_groups]


def _merge_specs(docs) -> dict[str, TensorSpec]:
    """One spec per tensor; ranks that disagree on a global shape or dtype are an error naming both."""
    merged: dict[str, tuple[TensorSpec, str]] = {}
    for d in docs:
        for name, (shape, dtype) in d["tensors"].items():
            spec = TensorSpec(tuple(shape), dtype)
            seen = merged.setdefault(name, (spec, d["device"]))
            if seen[0] != spec:
                raise StateMismatchError(f"tensor {name!r} has global shape {list(seen[0].shape)} {seen[0].dtype} on "
                                         f"{seen[1]} but {list(shape)} {dtype} on {d['device']}; every rank must agree")
    return {name: spec for name, (spec, _) in merged.items()}


def _first_holder_per_host(docs) -> dict[tuple[str, str, Box], int]:
    """(host, tensor, box) -> the lowest rank on that host holding exactly that box: the one that writes it."""
    writers: dict[tuple[str, str, Box], int] = {}
    for rank, d in enumerate(docs):
        for name, offsets, lengths in d["boxes"]:
            writers.setdefault((d["host"], name, Box(tuple(offsets), tuple(lengths))), rank)
    return writers


def _saved_layout(tensors, docs, writers) -> Layout:
    devices: dict[str, list[Shard]] = {}
    for (_host, name, box), rank in sorted(writers.items(), key=lambda kv: (kv[1], kv[0][1], kv[0][2])):
        devices.setdefault(docs[rank]["device"], []).append(Shard(name, box))
    return Layout.build(tensors, devices)


def _needed_layout(docs) -> Layout:
    tensors = _merge_specs(docs)
    devices = {d["device"]: [Shard(name, Box(tuple(o), tuple(n))) for name, o, n in d["boxes"]] for d in docs}
    return Layout.build(tensors, devices)


def _check_and_build(old: Layout, docs, given: Layout | None, device: str, pieces: list[Piece],
                     with_optimizer: bool = True) -> Layout:
    """The new layout, after checking it against the saved one; StateMismatchError names what differs.
    Without an optimizer, saved optimizer tensors are not expected."""
    needed = _needed_layout(docs)
    problems = []
    for name, spec in sorted(needed.tensors.items()):
        saved = old.tensors.get(name)
        if saved is None:
            problems.append(f"tensor {name!r} (shape {list(spec.shape)}, {spec.dtype}) is not in the saved state")
        elif saved.shape != spec.shape or saved.dtype != spec.dtype:
            problems.append(f"tensor {name!r} has shape {list(spec.shape)} {spec.dtype} in the restored job but "
                            f"{list(saved.shape)} {saved.dtype} in the saved state")
    for name in sorted(set(old.tensors) - set(needed.tensors)):
        if not with_optimizer and name.startswith(OPTIMIZER_PREFIX):
            continue
        problems.append(f"tensor {name!r} (shape {list(old.tensors[name].shape)}) was saved but the restored job "
                        f"has no such tensor")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        expected = set(needed.tensors) | ({n for n in old.tensors if n.startswith(OPTIMIZER_PREFIX)}
                                          if not with_optimizer else set())
        cause = likely_cause(set(old.tensors), expected, OPTIMIZER_PREFIX)
        lead = f"{cause}. In detail, " if cause else ""
        raise StateMismatchError(f"{lead}the restored job does not match the saved state ({len(problems)} "
                                 f"differences): " + "; ".join(problems[:10]) + more)
    if given is None:
        return needed
    held = {(s.tensor, s.box) for s in given.devices.get(device, ())}
    lacking = [f"{p.name} {p.box}" for p in pieces if (p.name, p.box) not in held]
    if lacking:
        raise StateMismatchError(f"the given layout does not give device {device} what its model needs: "
                                 f"{', '.join(lacking[:5])}{' …' if len(lacking) > 5 else ''}")
    return given


def _check_optimizer(optimizer, model, state) -> None:
    if state["optimizer"] is None:
        raise StateMismatchError("the state was saved without an optimizer; restore without one, or save with it")
    apply_optimizer_doc(optimizer, state["optimizer"], _group_names(model, optimizer))


def _local_sources(old: Layout, new: Layout) -> dict[str, dict[tuple[str, Box], list[tuple[str, Box]]]] | None:
    """For each new device and box it needs, (old device on the same host, region) pairs that tile the box;
    None if some box cannot be assembled from its own host's shards (then the state must be transformed)."""
    by_host: dict[tuple[str, str], list[tuple[Box, str]]] = {}
    for device, shard in old.iter_shards():
        by_host.setdefault((host_of(device), shard.tensor), []).append((shard.box, device))
    sources: dict[str, dict[tuple[str, Box], list[tuple[str, Box]]]] = {}
    for device, shards in new.devices.items():
        for shard in shards:
            # The device's own old shards first: after a same-configuration restart nothing is shared.
            candidates = sorted(by_host.get((host_of(device), shard.tensor), []), key=lambda c: c[1] != device)
            tiles, remaining = tile(shard.box, ((src, box) for box, src in candidates))
            if remaining:
                return None
            sources.setdefault(device, {})[(shard.tensor, shard.box)] = tiles
    return sources
