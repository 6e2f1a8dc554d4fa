"""A layout indexed once for planning per destination: who holds which box, found without scanning the layout.

May import: ``tenplex._gc``, ``tenplex.box``, ``tenplex.regions``, ``tenplex.layout`` and the standard
library. Pure.

:func:`tenplex.share_planner.plan_share` plans only the transfers into some
devices. Scanning every (device, box) entry of a 16,384-device layout takes
seconds in Python, so the index never does: replicas share one tuple of shards
(:func:`tenplex.ptc.layout` hands every dp replica the same tuple, and
:func:`tenplex.layout.from_dict` the same ``Shard`` objects), so devices are
grouped by their tuple of shards and only each group's shards are read (on
the first per-tensor query). Per tensor, on first use only, the distinct boxes
go into a :class:`~tenplex.regions.RegionIndex` with the groups that hold
each. Building the index costs O(devices) (device order and hosts: 12-20 ms at
16k devices); the groups are made on first use, which only the layout a share
reads from (and a digest) needs: O(distinct entries), milliseconds for
replicated layouts, but a ZeRO-sharded layout has no two devices alike, so
grouping it and indexing its tensors reads every entry (a share took 1.8-1.9 s
at 16k devices when a rank restores *from* a ZeRO layout; restoring *into* one
costs nothing extra). A rank that plans its share touches only the tensors it
receives. Build it once per layout and share it between the planning calls of
a host's ranks when they run in one process.

:meth:`LayoutIndex.digest` fingerprints the layout from the same groups, so
ranks can check cheaply that they plan from the same layouts.
"""

from __future__ import annotations

import hashlib
import operator

from ._gc import paused_gc
from .box import Box
from .layout import Layout, Shard
from .regions import Region, RegionIndex


class TensorHolders:
    """One tensor of an indexed layout: its distinct boxes, which device groups hold each, and an overlap index."""

    def __init__(self, index: "LayoutIndex", boxes: list[tuple[int, Box]]) -> None:
        self.layout_index = index
        self.regions: list[Region] = sorted({(box.offsets, box.ends) for _, box in boxes})
        number = {r: i for i, r in enumerate(self.regions)}
        self.groups: list[list[int]] = [[] for _ in self.regions]  # region -> groups holding it, in group order
        for g, box in boxes:
            self.groups[number[(box.offsets, box.ends)]].append(g)
        self.index = RegionIndex(self.regions)
        self.tiled = self.index.disjoint()  # no two distinct boxes partly overlap

    def held_by(self, i: int, device: str) -> bool:
        return self.layout_index.group_of.get(device, -1) in self.groups[i]

    def on_host(self, i: int, host: str) -> list[str]:
        """The devices of ``host`` that hold region ``i``, in device order."""
        found: list[str] = []
        for g in self.groups[i]:
            found += self.layout_index.group_hosts(g).get(host, ())
        return sorted(found) if len(self.groups[i]) > 1 else found

    def replicas(self, i: int) -> int:
        return sum(len(self.layout_index.members[g]) for g in self.groups[i])

    def replica(self, i: int, turn: int) -> str:
        """The ``turn``-th holder of region ``i`` (modulo their number), counting group by group."""
        members = self.layout_index.members
        turn %= self.replicas(i)
        for g in self.groups[i]:
            if turn < len(members[g]):
                return members[g][turn]
            turn -= len(members[g])
        raise AssertionError("unreachable: turn is below the number of holders")


class LayoutIndex:
    """``layout`` grouped by shared shard tuples, with per-host device lists; per-tensor holders on demand."""

    def __init__(self, layout: Layout) -> None:
        with paused_gc():  # a few hundred thousand small objects at 16k devices; none is cyclic
            self._build(layout)

    def _build(self, layout: Layout) -> None:
        self.layout = layout
        self.host: dict[str, str] = {}
        self.devices_on: dict[str, list[str]] = {}  # host -> its devices, in device order
        for device in sorted(layout.devices):
            # Layout.validate parsed every device id already: HOST/INDEX, so the host is what precedes the last /
            host = self.host[device] = device.rpartition("/")[0]
            self.devices_on.setdefault(host, []).append(device)
        self.number = {device: k for k, device in enumerate(self.host)}  # device -> its place in device order
        self._grouped: tuple[list[tuple[Shard, ...]], list[list[str]], dict[str, int]] | None = None
        self._boxes: dict[str, list[tuple[int, Box]]] | None = None  # tensor -> (group, box), on first use
        self._hosts_of_group: dict[int, dict[str, list[str]]] = {}
        self._tensors: dict[str, TensorHolders] = {}

    @property
    def shards(self) -> list[tuple[Shard, ...]]:
        """Group -> its shards."""
        return self._groups()[0]

    @property
    def members(self) -> list[list[str]]:
        """Group -> its devices, in device order."""
        return self._groups()[1]

    @property
    def group_of(self) -> dict[str, int]:
        """Device -> its group."""
        return self._groups()[2]

    def _groups(self) -> tuple[list[tuple[Shard, ...]], list[list[str]], dict[str, int]]:
        """Devices grouped by the shards they share, on first use: only the layout a share reads from (or a
        digest) needs them. A ZeRO-sharded layout at 16k devices has no two devices alike, and grouping it
        reads every entry (0.2 s), which the layout a share writes into never needs."""
        if self._grouped is None:
            with paused_gc():
                self._grouped = self._group_devices()
        return self._grouped

    def _group_devices(self) -> tuple[list[tuple[Shard, ...]], list[list[str]], dict[str, int]]:
        shards: list[tuple[Shard, ...]] = []
        members: list[list[str]] = []
        group_of: dict[str, int] = {}
        devices = self.layout.devices
        by_object: dict[int, int] = {}  # id(shards tuple) -> group
        # (length, first and last Shard object) -> groups, each checked entry by entry: O(1) per device with
        # shards of its own (ZeRO), one pass at C speed per replica (from_dict shares Shards, not tuples); a key of
        # every Shard's id cost 0.2-0.4 s at 16k devices
        by_shards: dict[tuple[int, int, int], list[int]] = {}
        for device in self.host:  # device order
            held = devices[device]
            g = by_object.get(id(held))
            if g is None:
                key = (len(held), id(held[0]), id(held[-1])) if held else (0, 0, 0)
                g = by_object[id(held)] = _group(shards, members, held, by_shards.setdefault(key, []))
            members[g].append(device)
            group_of[device] = g
        return shards, members, group_of

    def tensor(self, name: str) -> TensorHolders:
        """``name``'s distinct boxes and their holders (indexed on first use)."""
        held = self._tensors.get(name)
        if held is None:
            if self._boxes is None:
                with paused_gc():
                    self._boxes = {}
                    for g, shards in enumerate(self.shards):  # O(distinct entries): once per layout
                        for shard in shards:
                            self._boxes.setdefault(shard.tensor, []).append((g, shard.box))
            held = self._tensors[name] = TensorHolders(self, self._boxes.get(name, []))
        return held

    def group_hosts(self, g: int) -> dict[str, list[str]]:
        """Host -> the devices of group ``g`` on it."""
        hosts = self._hosts_of_group.get(g)
        if hosts is None:
            hosts = self._hosts_of_group[g] = {}
            for device in self.members[g]:
                hosts.setdefault(self.host[device], []).append(device)
        return hosts

    def digest(self) -> str:
        """SHA-256 of the tensors and every device's boxes: equal layouts give equal digests on every rank,
        however their devices share shard tuples (each group's boxes are hashed once)."""
        h = hashlib.sha256()
        for name, spec in sorted(self.layout.tensors.items()):
            h.update(f"{name}\0{list(spec.shape)}\0{spec.dtype}\n".encode())
        boxes = [hashlib.sha256(repr([(s.tensor, s.box.offsets, s.box.lengths) for s in shards]).encode()).digest()
                 for shards in self.shards]
        for device, g in self.group_of.items():  # device order
            h.update(device.encode() + b"\0" + boxes[g])
        return h.hexdigest()


def _group(shards: list[tuple[Shard, ...]], members: list[list[str]], held: tuple[Shard, ...],
           candidates: list[int]) -> int:
    """The group of the devices holding these very Shard objects (a new one if none does yet)."""
    for g in candidates:
        if len(shards[g]) == len(held) and all(map(operator.is_, shards[g], held)):
            return g
    candidates.append(len(shards))
    shards.append(held)
    members.append([])
    return candidates[-1]
