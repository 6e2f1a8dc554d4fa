"""The restore's steps after the version is chosen: bring the state within each rank's reach, apply the rest.

May import: ``tenplex.box``, ``tenplex.devices``, ``tenplex.layout``, ``tenplex.share_planner``,
``tenplex.replication``, ``tenplex.store``, this package's modules, torch and torch.distributed.

:meth:`Checkpointer.restore` finds the version (:mod:`.versions`) and checks the new layout (:mod:`.layouts`);
:func:`bring_within_reach` then puts the state where every rank reads its pieces from its own host's store
(a version with lost hosts put together from copies first, then a read-through or a transformation when the
state must move between hosts), and :func:`apply_state` applies the non-tensor state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch.distributed as dist

from ..box import Box
from ..devices import host_of
from ..layout import Layout
from ..share_planner import plan_for
from ..store import Store
from ..store.manifest import PROMOTE_PART
from .commit import stage_and_commit
from .layouts import local_sources
from .memory import Memory
from .moves import plan_my_share, read_plan_through, transform_stored
from .nontensor import apply_rng, derived_seed, from_json, seed_rng
from .pieces import Piece, set_optimizer_scalars
from .savedoc import store_addresses
from .shardio import read_piece
from .versions import Found

Sources = dict[str, dict[tuple[str, Box], list[tuple[str, Box]]]]  # new device -> box -> (stored device, region)


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
    # This rank's restored tensor bytes by where they came from: its own memory (a survivor in place,
    # :mod:`.memory`), this host's store, other hosts' stores (the regions its share of the plan brought from
    # there, also when the stores ran the plan)
    bytes: dict = field(default_factory=lambda: {"memory": 0, "this_host": 0, "other_hosts": 0})


@dataclass
class Reach:
    """Where this rank is: what :func:`bring_within_reach` needs of the checkpointer."""

    store: Store
    device: str
    token: str | None
    group: object
    overrides: Mapping[str, str]  # ``stores``/``TENPLEX_STORES``


def bring_within_reach(at: Reach, found: Found, new: Layout, docs, pieces: list[Piece],
                       info: RestoreInfo, memory: Memory | None = None) -> Sources | None:
    """Put the found state where each rank can read its pieces from its own host's store. Collective.

    Returns, per new device and box, the (stored device, region) pairs to read from ``info.version``; None
    when every rank already read its pieces straight from the stores (``info.read_through``). On the way:
    a version with lost hosts is first put together from copies (``info.promoted_version``), and a change
    that needs other hosts' shards is read through or transformed into a new version. With ``memory`` (which
    filled the pieces already), this rank reads only the regions memory lacks."""
    old = found.layout
    # Above every version any store holds, a departed host's newer ones too: a number never names two states.
    newest = max([v for d in docs for v in d["versions"]] + [found.highest])
    source_version = found.version
    if found.lost_hosts:
        source_version = info.version = info.promoted_version = promote(at.store, at.group, found, newest + 1, docs)
        newest = source_version
    sources = local_sources(old, new)
    if sources is not None:
        return sources
    addresses = {**found.addresses, **store_addresses(docs, at.overrides)}
    # Each rank plans only its own device's transfers; the sum of the shares decides the way (tenplex.share_planner).
    mine, shares = plan_my_share(old, new, at.device, at.group)
    info.plan_stats = shares.stats
    # Read through only when that crosses hosts no more than the plan and leaves the job depending on no
    # store outside it (a departed host's store may go away before the job's next save).
    inside = shares.read_hosts <= {d["host"] for d in docs}
    if memory is not None:  # after the choice: what memory holds its host's store holds too, so it never
        mine = memory.cut_share(mine, at.device)  # crosses hosts or fans out, and cannot change the choice
    count_share(mine, at.device, new, info.bytes)
    if inside and not shares.fans_out and read_plan_through(
            mine, old, source_version, pieces, addresses, store=at.store, device=at.device,
            token=at.token, group=at.group):
        info.read_through = True
        return None
    info.version = transform_stored(lambda: plan_for(old, new, new.devices), old, new, source_version, newest + 1,
                                    addresses, token=at.token, group=at.group)
    info.transformed = True
    return {d: {(s.tensor, s.box): [(d, s.box)] for s in shards} for d, shards in new.devices.items()}


def count_share(share, device: str, new: Layout, counts: dict) -> None:
    """Add ``device``'s transfers of ``share`` to ``counts``: from this host's store (kept, same host, a region
    fanned out on this host) or from other hosts'."""
    here = host_of(device)
    for t in share.transfers:
        if t.dst == device:
            counts["this_host" if host_of(t.src) == here else "other_hosts"] += t.box.volume * new.tensors[
                t.tensor].itemsize


def read_local(store: Store, version: int, sources: Mapping, pieces: list[Piece], memory: Memory | None,
               counts: dict | None) -> None:
    """Read each piece's ``sources`` (stored device, region) tiles from ``version`` in this host's store, but
    the regions ``memory`` filled; add the bytes to ``counts["this_host"]`` (None: counted already, from the
    plan's share)."""
    reader = store.open(version)
    try:
        for piece in pieces:
            tiles = sources[(piece.name, piece.box)]
            if memory is not None:
                tiles = memory.cut_tiles(piece, tiles)
            read_piece(reader, tiles, piece)
            if counts is not None:
                counts["this_host"] += sum(r.volume for _, r in tiles) * piece.local.element_size()
    finally:
        reader.close()


def promote(store: Store, group, found: Found, target: int, docs) -> int:
    """Commit ``target`` on the surviving hosts from their shards and copies of the found version. Collective."""
    from ..replication import promote as promoting

    rank = dist.get_rank(group)
    leader = min(r for r, d in enumerate(docs) if d["host"] == store.host)
    stages = rank == leader and store.host in found.layout.hosts()  # a host of the found version stages its part

    def stage():
        if stages:
            promoting.stage(store, found.version, target, found.layout, found.replica_devices)
    stage_and_commit(store, group, f"restore: putting version {found.version} together from surviving shards and "
                     "copies", target, stage, [PROMOTE_PART], stages)
    return target


def apply_state(state: dict, model, optimizer, scheduler, scaler, extra, rng: bool, coord: str) -> None:
    """Apply a version's non-tensor state: optimizer scalars, scheduler, scaler, ``extra`` and this rank's RNG
    streams (streams derived from the step and ``coord`` when none were saved for it)."""
    if optimizer is not None:
        set_optimizer_scalars(model, optimizer, state["scalars"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(from_json(state["scheduler"]))
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(from_json(state["scaler"]))
    if extra is not None and isinstance(state["extra"], dict):
        extra.update(from_json(state["extra"]))
    if rng:
        if coord in state["rng"]:
            apply_rng(state["rng"][coord])
        else:
            seed_rng(derived_seed(state["step"], coord))
