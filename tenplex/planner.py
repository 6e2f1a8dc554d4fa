"""The minimal-movement planner: ``plan(old_layout, new_layout) -> Plan``.

May import: ``tenplex.box``, ``tenplex.regions``, ``tenplex.layout``, ``tenplex.transfer_plan``,
``tenplex.devices``, ``tenplex.errors``, ``tenplex._gc`` and the standard
library. Pure and deterministic: the same two layouts always give the same
plan.

For every box B of the new layout on device d (host h), in order of tensor
name, then device, B is covered piece by piece:

1. **kept**: the parts of B that d already holds (``src == dst``, from old);
2. **local**: parts that another device of h holds in the old layout,
   copied from the least-loaded such device;
3. **fan-out**: parts that an earlier transfer already brought onto h from
   another host, copied from that device's new shard (``"from": "new"``);
4. **remote**: the rest crosses hosts, from one of the old replicas (see below).

A region crosses into host h only in step 4, and only if neither h's old
shards nor earlier transfers into h have it, so each region crosses once per
destination host and ``inter_host_bytes == inter_host_lower_bound`` always.
The lower bound is computed from the layouts alone, not from the transfers.

Sender balancing is greedy: each remote piece comes from the replica whose
host has sent the fewest bytes so far (then the least-loaded device, then the
first in device order). That spreads load over all replicas, but it is not
an optimal schedule of ``max_host_send_bytes``. A replica set on 8 hosts or
more finds that host through a heap shared by the sets on the same hosts (the
same choice as a scan, in O(log hosts): at 16,384 devices a set spans 128
hosts).

The plan lists every ``"from": "old"`` transfer (kept, local, remote, in that
order) before the fan-outs, so a fan-out always follows the transfer that
filled its source; transfers from old shards can run in any order.

Speed: boxes are handled as (lo, hi) tuples; for each tensor the distinct old
boxes (replicas share one) go into a sorted-offsets index
(:class:`tenplex.regions.RegionIndex`) that finds the boxes overlapping a query
without scanning them all. When the distinct boxes of each
layout are pairwise disjoint (always so for layouts made by partition rules),
a new box splits into one fragment per old box it overlaps, the same on every
device, so fragments are computed once per distinct box and the per-device
work is a few dictionary lookups. The cost is about linear in the number of
(device, box) entries of the two layouts. Hand-written layouts with partly
overlapping boxes take the general path (box subtraction) and still plan
correctly, only slower.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from ._gc import paused_gc
from .box import Box
from .devices import host_of
from .errors import PlanError
from .layout import Layout
from .regions import Region, RegionIndex, cover as _cover, ignore as _ignore, intersect as _intersect
from .regions import to_box as _box, volume as _volume
from .transfer_plan import Plan, PlanStats, Transfer


class _Builder:
    """Collects transfers by kind and keeps the byte counts and sender loads."""

    def __init__(self, hosts: dict[str, str]) -> None:
        self.host = hosts
        self.kept: list[Transfer] = []
        self.local: list[Transfer] = []
        self.remote: list[Transfer] = []
        self.fanout: list[Transfer] = []
        self.bytes = {"kept": 0, "local": 0, "remote": 0}
        # Every device and host starts at 0, so loads are plain dict lookups in the hot loop.
        self.device_sent = dict.fromkeys(hosts, 0)
        self.host_sent = dict.fromkeys(hosts.values(), 0)
        self.host_received = dict.fromkeys(hosts.values(), 0)
        self.heaps: dict[tuple[str, ...], _HostHeap] = {}

    def add(self, kind: str, tensor: str, src: str, dst: str, region: Region | Box, nbytes: int) -> None:
        box = region if isinstance(region, Box) else _box(region)
        transfer = Transfer(tensor, src, dst, "new" if kind == "fanout" else "old", box)
        getattr(self, kind).append(transfer)
        self.bytes["local" if kind == "fanout" else kind] += nbytes
        if kind != "kept":
            self.device_sent[src] += nbytes
        if kind == "remote":
            self.host_sent[self.host[src]] += nbytes
            self.host_received[self.host[dst]] += nbytes

    def least_loaded(self, devices: list[str]) -> str:
        return devices[0] if len(devices) == 1 else min(devices, key=self.device_sent.__getitem__)

    def least_loaded_remote(self, holders_on: dict[str, list[str]], heap: "_HostHeap | None") -> str:
        """The least-loaded device of the host that has sent least (the first such host in ``holders_on``'s
        order); ``holders_on`` maps host -> devices, ``heap`` (for many hosts) finds that host in O(log hosts)."""
        if heap is not None:
            return self.least_loaded(holders_on[heap.least(self.host_sent)])
        hosts = list(holders_on)
        if len(hosts) > 1:
            loads = list(map(self.host_sent.__getitem__, hosts))
            return self.least_loaded(holders_on[hosts[loads.index(min(loads))]])
        return self.least_loaded(holders_on[hosts[0]])

    def heap(self, hosts: tuple[str, ...]) -> "_HostHeap | None":
        """The one heap of these hosts (replica sets of many tensors share their hosts), if they are many."""
        if len(hosts) < HEAP_FROM:
            return None
        found = self.heaps.get(hosts)
        if found is None:
            found = self.heaps[hosts] = _HostHeap(hosts, self.host_sent)
        return found


HEAP_FROM = 8  # replica sets on this many hosts or more find their least-loaded host by a heap, not a scan


class _HostHeap:
    """The hosts of a replica set by (bytes sent, place in the set): the first least-loaded one in O(log n).

    Loads only grow, so an entry's load is at most its host's load now; when the top's load is stale it is
    replaced by the current one and the heap looked at again. A top whose load is current is the least
    (every other entry's load now is at least its recorded one), and the place breaks ties as a scan would:
    the same host as ``loads.index(min(loads))``."""

    def __init__(self, hosts: tuple[str, ...], host_sent: dict[str, int]) -> None:
        self.entries = [(host_sent[h], k, h) for k, h in enumerate(hosts)]
        heapq.heapify(self.entries)

    def least(self, host_sent: dict[str, int]) -> str:
        entries = self.entries
        while True:
            load, k, host = entries[0]
            now = host_sent[host]
            if now == load:
                return host
            heapq.heapreplace(entries, (now, k, host))


class _TensorIndex:
    """One tensor's distinct old and new boxes as regions, who holds each old one, and whether both are tiled."""

    def __init__(self, out: _Builder, old: list[tuple[str, Box]], new: list[tuple[str, Box]]) -> None:
        host = out.host
        self.regions = sorted({(box.offsets, box.ends) for _, box in old})
        number = {r: i for i, r in enumerate(self.regions)}
        self.holders_on: list[dict[str, list[str]]] = [{} for _ in self.regions]  # old region -> host -> devices
        self.own: dict[str, set[int]] = {}  # device -> old regions it holds
        for device, box in old:
            i = number[(box.offsets, box.ends)]
            self.holders_on[i].setdefault(host[device], []).append(device)
            self.own.setdefault(device, set()).add(i)
        self.heaps = [out.heap(tuple(on)) for on in self.holders_on]
        self.index = RegionIndex(self.regions)
        self.targets = sorted({(box.offsets, box.ends) for _, box in new})
        self.target_index = RegionIndex(self.targets)
        # "Tiled": the distinct boxes of each layout are pairwise disjoint (replicas share boxes, nothing partly
        # overlaps), as in every layout made by partition rules.
        self.tiled = self.index.disjoint() and self.target_index.disjoint()

    def fragments(self, box: Box, itemsize: int) -> list[tuple[Region, Box, int, int]] | None:
        """Tiled only: (region, box, old region, bytes) per old box ``box`` overlaps; None if they leave a gap."""
        target = (box.offsets, box.ends)
        found = []
        for i in self.index.overlapping(target):
            r = _intersect(target, self.regions[i])
            if r is not None:
                found.append((r, box if r == target else _box(r), i, _volume(r) * itemsize))
        complete = sum(nbytes for *_, nbytes in found) == box.volume * itemsize
        return found if complete else None


def _plan_tensor(out: _Builder, name: str, itemsize: int, old: list[tuple[str, Box]],
                 new: list[tuple[str, Box]]) -> int:
    """Append the transfers that fill ``name``'s new boxes; return its inter-host lower bound in bytes."""
    tensor = _TensorIndex(out, old, new)
    arrived: dict[str, dict[Region, str]] = {}  # host -> regions brought in from other hosts -> device holding it
    fragments: dict[Region, list[tuple[Region, Box, int, int]] | None] = {}  # target -> its fragments, once
    for dst, box in new:
        here = arrived.setdefault(out.host[dst], {})
        if tensor.tiled:
            # Disjoint old boxes cut the target into the same fragments on every device (one per old box it
            # overlaps), and disjoint new boxes mean a fragment arrives on a host whole or not at all.
            target = (box.offsets, box.ends)
            if target not in fragments:
                fragments[target] = tensor.fragments(box, itemsize)  # None: let the general path name the gap
            found = fragments[target]
            if found is not None:
                _fill_tiled(out, name, tensor, dst, found, here)
                continue
        _fill_general(out, name, itemsize, tensor, dst, box, here)
    return _lower_bound(tensor, new, out.host) * itemsize


def _fill_tiled(out: _Builder, name: str, tensor: _TensorIndex, dst: str,
                fragments: list[tuple[Region, Box, int, int]], here: dict[Region, str]) -> None:
    """Steps 1-4 of the module docstring for a box of a tiled tensor: each fragment goes one way, whole."""
    h, mine = out.host[dst], tensor.own.get(dst, ())
    for r, piece, i, nbytes in fragments:
        if i in mine:
            out.add("kept", name, dst, dst, piece, nbytes)
        elif h in tensor.holders_on[i]:
            out.add("local", name, out.least_loaded(tensor.holders_on[i][h]), dst, piece, nbytes)
        elif r in here:
            out.add("fanout", name, here[r], dst, piece, nbytes)
        else:
            out.add("remote", name, out.least_loaded_remote(tensor.holders_on[i], tensor.heaps[i]), dst, piece, nbytes)
            here[r] = dst


def _fill_general(out: _Builder, name: str, itemsize: int, tensor: _TensorIndex, dst: str, box: Box,
                  here: dict[Region, str]) -> None:
    """Steps 1-4 of the module docstring for any box: cover what is left, kind by kind, by box subtraction."""
    h, mine, holders_on = out.host[dst], tensor.own.get(dst, ()), tensor.holders_on
    target = (box.offsets, box.ends)
    overlapping = tensor.index.overlapping(target)
    pieces = [target]

    def emit(kind: str, src: str) -> Callable[[Region], None]:
        return lambda r: out.add(kind, name, src, dst, r, _volume(r) * itemsize)

    for i in overlapping:
        if i in mine and pieces:
            pieces = _cover(pieces, tensor.regions[i], emit("kept", dst))
    for i in overlapping:
        if pieces and i not in mine and h in holders_on[i]:
            pieces = _cover(pieces, tensor.regions[i], emit("local", out.least_loaded(holders_on[i][h])))
    for region, src in list(here.items()):
        if not pieces:
            break
        pieces = _cover(pieces, region, emit("fanout", src))
    for i in overlapping:
        if pieces and h not in holders_on[i]:
            src = out.least_loaded_remote(holders_on[i], tensor.heaps[i])

            def receive(r: Region, src: str = src) -> None:
                out.add("remote", name, src, dst, r, _volume(r) * itemsize)
                here[r] = dst
            pieces = _cover(pieces, tensor.regions[i], receive)
    if pieces:
        raise PlanError(f"no device of the old layout holds region {_box(pieces[0])} of tensor {name!r}, "
                        f"which {dst} needs; the old layout must cover every tensor it shares with the new one")


def _lower_bound(tensor: _TensorIndex, new: Iterable[tuple[str, Box]], host: dict[str, str]) -> int:
    """Sum over hosts h of |union of new boxes on h - union of old boxes on h| (elements)."""
    number = {r: j for j, r in enumerate(tensor.targets)}
    wanted: dict[str, set[int]] = {}  # host -> the distinct new boxes on it
    for device, box in new:
        wanted.setdefault(host[device], set()).add(number[(box.offsets, box.ends)])
    missing = _missing_tiled if tensor.tiled else _missing_general
    return missing(tensor, wanted)


def _missing_tiled(tensor: _TensorIndex, wanted: dict[str, set[int]]) -> int:
    """The lower bound when both layouts are tiled: disjoint boxes make each union a plain sum, so a host lacks
    each of its new boxes less the parts that old boxes on the host hold."""
    regions, holders_on, targets = tensor.regions, tensor.holders_on, tensor.targets
    overlaps: dict[int, list[tuple[int, int]]] = {}  # new box -> (old box, elements in common), once per new box
    total = 0
    for h, on_host in wanted.items():
        for j in sorted(on_host):
            if j not in overlaps:
                overlaps[j] = [(i, _volume(common)) for i in tensor.index.overlapping(targets[j])
                               if (common := _intersect(targets[j], regions[i])) is not None]
            total += _volume(targets[j]) - sum(n for i, n in overlaps[j] if h in holders_on[i])
    return total


def _missing_general(tensor: _TensorIndex, wanted: dict[str, set[int]]) -> int:
    """The lower bound for any boxes, by subtraction: what is left of each new box on a host once the earlier new
    boxes on that host (counted already) and the old boxes the host holds are taken away."""
    regions, holders_on, targets = tensor.regions, tensor.holders_on, tensor.targets
    total = 0
    for h, on_host in wanted.items():
        for j in sorted(on_host):
            pieces = [targets[j]]
            for k in tensor.target_index.overlapping(targets[j]):
                if k < j and k in on_host:
                    pieces = _cover(pieces, targets[k], _ignore)
            for i in tensor.index.overlapping(targets[j]):
                if h in holders_on[i]:
                    pieces = _cover(pieces, regions[i], _ignore)
            total += sum(map(_volume, pieces))
    return total


def check_tensors(old: Layout, new: Layout, allow_new_tensors: bool) -> list[str]:
    """Names of new tensors absent from ``old``; raise PlanError for changed or (unless allowed) new ones."""
    changed = [f"{name!r} {list(old.tensors[name].shape)} {old.tensors[name].dtype} -> "
               f"{list(spec.shape)} {spec.dtype}"
               for name, spec in sorted(new.tensors.items()) if name in old.tensors and old.tensors[name] != spec]
    if changed:
        raise PlanError(f"{len(changed)} tensor(s) change shape or dtype between the layouts, which resharding "
                        f"cannot do: {'; '.join(changed[:5])}{' …' if len(changed) > 5 else ''}")
    missing = sorted(set(new.tensors) - set(old.tensors))
    if missing and not allow_new_tensors:
        raise PlanError(f"the new layout has {len(missing)} tensor(s) that the old layout lacks: "
                        f"{', '.join(map(repr, missing[:5]))}{' …' if len(missing) > 5 else ''}; "
                        f"allow new tensors (they are then left to be initialised) or add them to the old layout")
    return missing


def plan(old: Layout, new: Layout, allow_new_tensors: bool = False) -> Plan:
    """The transfers that turn ``old`` into ``new`` with minimal data movement (see the module docstring).

    Tensors of ``old`` that ``new`` lacks are dropped. Tensors of ``new`` that
    ``old`` lacks are a PlanError unless ``allow_new_tensors``; then they get
    no transfers, their bytes are ``stats.initialized_bytes`` and their names
    ``plan.new_tensors``.
    """
    with paused_gc():
        return _plan(old, new, allow_new_tensors)


def _plan(old: Layout, new: Layout, allow_new_tensors: bool) -> Plan:
    missing = check_tensors(old, new, allow_new_tensors)
    hosts = {d: host_of(d) for d in (*old.devices, *new.devices)}
    out = _Builder(hosts)
    lower_bound = initialized = target = 0
    for name in sorted(new.tensors):
        itemsize = new.tensors[name].itemsize
        new_shards = new.shards_of(name)
        nbytes = sum(box.volume for _, box in new_shards) * itemsize
        target += nbytes
        if name in old.tensors:
            lower_bound += _plan_tensor(out, name, itemsize, old.shards_of(name), new_shards)
        else:
            initialized += nbytes
    stats = PlanStats(
        target_bytes=target, kept_bytes=out.bytes["kept"], intra_host_bytes=out.bytes["local"],
        inter_host_bytes=out.bytes["remote"], inter_host_lower_bound=lower_bound,
        max_host_send_bytes=max(out.host_sent.values(), default=0),
        max_host_recv_bytes=max(out.host_received.values(), default=0), initialized_bytes=initialized)
    return Plan(tuple(out.kept + out.local + out.remote + out.fanout), stats, tuple(missing))
