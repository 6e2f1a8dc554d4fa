"""Which saved regions get copies on other hosts, and what the available hosts can still assemble.

May import: ``tenplex.box``, ``tenplex.layout``, ``tenplex.devices``, ``tenplex.errors`` and the
standard library. Pure: no file, network, torch or store access.

**Replication rule** (:func:`copies`). The ring is the saved layout's hosts in
sorted order. For every shard of the saved layout (device ``d`` on host ``h``,
tensor ``t``, box ``B``), the part of ``B`` that no other host holds (``B``
minus every box of ``t`` on the other hosts, minus what ``h``'s earlier shards
of ``t`` already gave) is copied to the next ``R`` hosts of the ring after
``h``, with ``R = min(replicas, hosts - 1)``. A region that another host
already holds (a data-parallel replica on another host) is not copied again.

**Assembly rule** (:func:`assemble`). A version can be restored by a set of
available hosts when every region of every shard on an unavailable host is
covered by the shards of available hosts plus the committed copies that
available hosts hold of the unavailable hosts' regions. Each copy becomes a
device of its holder (``HOLDER/INDEX``, with an index above every index the
holder uses), so the planner and the transformer read it like any other
replica. Otherwise every uncovered region is reported (:class:`Lost`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..box import Box, subtract_all
from ..devices import device_id, host_of, parse_device
from ..errors import PermanentError
from ..layout import Layout, Shard


class LostStateError(PermanentError, RuntimeError):
    """No available host holds some region of the state (not even a replica copy); nothing was restored.

    ``lost`` lists the regions (:class:`Lost`) of the newest version that were lost."""

    def __init__(self, message: str, lost: "list[Lost] | None" = None):
        super().__init__(message)
        self.lost = list(lost or [])


@dataclass(frozen=True, order=True)
class Copy:
    """One region of a saved shard that ``holder`` keeps a copy of."""

    origin: str   # host of the saved shard
    holder: str   # host that keeps the copy
    device: str   # the saved shard's device (on ``origin``)
    tensor: str
    box: Box


@dataclass(frozen=True, order=True)
class Lost:
    """A region whose every copy was on unavailable hosts."""

    tensor: str
    box: Box
    host: str     # the unavailable host that held it
    device: str   # its device there

    def __str__(self) -> str:
        return f"tensor {self.tensor!r} box {self.box} (device {self.device} on host {self.host})"


def ring(layout: Layout) -> list[str]:
    return layout.hosts()


def effective_replicas(replicas: int | None, hosts: int) -> int:
    """Copies per region: ``replicas`` capped at ``hosts - 1``; None means 1 with two or more hosts."""
    wanted = 1 if replicas is None else int(replicas)
    if wanted < 0:
        raise ValueError(f"replicas must be >= 0 or None, got {replicas}")
    return max(0, min(wanted, hosts - 1))


def unique_regions(layout: Layout) -> list[tuple[str, str, Box]]:
    """(device, tensor, region) of every region that only one host holds, in layout order, without overlaps."""
    holders: dict[str, dict[Box, dict[str, str]]] = {}  # tensor -> box -> host -> first device holding it
    for device, shard in layout.iter_shards():
        holders.setdefault(shard.tensor, {}).setdefault(shard.box, {}).setdefault(host_of(device), device)
    found = []
    for tensor in sorted(holders):
        boxes = holders[tensor]  # replicas share a box: each distinct box is handled once
        given: dict[str, list[Box]] = {}  # host -> regions of this tensor already listed for it
        for box, hosts in boxes.items():
            if len(hosts) > 1:
                continue  # held whole by two hosts or more
            (host, device), = hosts.items()
            others = [b for b, hs in boxes.items() if b.overlaps(box) and any(h != host for h in hs)]
            others += [b for b in given.get(host, ()) if b.overlaps(box)]
            for region in subtract_all(box, others):
                found.append((device, tensor, region))
                given.setdefault(host, []).append(region)
    return found


def copies(layout: Layout, replicas: int | None) -> list[Copy]:
    """Every copy the replication rule asks for (see the module docstring), sorted."""
    hosts = ring(layout)
    count = effective_replicas(replicas, len(hosts))
    if count == 0:
        return []
    position = {h: i for i, h in enumerate(hosts)}
    out = []
    for device, tensor, region in unique_regions(layout):
        origin = host_of(device)
        for k in range(1, count + 1):
            out.append(Copy(origin, hosts[(position[origin] + k) % len(hosts)], device, tensor, region))
    return sorted(out)


def copy_layout(saved: Layout, held: Iterable[Copy]) -> Layout:
    """The layout of one set of copies (their origin devices and regions), as recorded with the copies."""
    devices: dict[str, list[Shard]] = {}
    for c in held:
        devices.setdefault(c.device, []).append(Shard(c.tensor, c.box))
    tensors = {name: saved.tensors[name] for name in sorted({s.tensor for ss in devices.values() for s in ss})}
    return Layout.build(tensors, devices)


@dataclass
class Assembly:
    """What the available hosts can assemble of one saved version."""

    lost: list[Lost]
    layout: Layout | None = None   # the source layout, when nothing is lost
    # copy device -> (holder host, origin device): where each copy device's shards come from
    replica_devices: dict[str, tuple[str, str]] = field(default_factory=dict)


def assemble(saved: Layout, available: Iterable[str], held: Mapping[str, Mapping[str, Layout]],
             taken: Mapping[str, Iterable[int]] | None = None) -> Assembly:
    """Can the ``available`` hosts restore ``saved``? (see the module docstring).

    ``held[holder][origin]`` is the layout of the committed copies ``holder``
    keeps of ``origin``'s regions; ``taken[host]`` are device indices the
    copies must not use (those of the job's current devices).
    """
    available = set(available)
    missing = [h for h in saved.hosts() if h not in available]
    devices = {d: list(shards) for d, shards in saved.devices.items() if host_of(d) in available}
    replica_devices: dict[str, tuple[str, str]] = {}
    for holder in sorted(h for h in held if h in available):
        used = {parse_device(d)[1] for d in saved.devices if host_of(d) == holder} | set((taken or {}).get(holder, ()))
        index = max(used, default=-1) + 1
        for origin in sorted(o for o in held[holder] if o in missing):
            for origin_device, shards in sorted(held[holder][origin].devices.items()):
                device = device_id(holder, index)
                index += 1
                devices[device] = list(shards)
                replica_devices[device] = (holder, origin_device)
    boxes: dict[str, list[Box]] = {}
    for available_shards in devices.values():
        for s in available_shards:
            boxes.setdefault(s.tensor, []).append(s.box)
    lost = []
    for device, shard in saved.iter_shards():
        if host_of(device) in available:
            continue
        covering = [b for b in boxes.get(shard.tensor, ()) if b.overlaps(shard.box)]
        lost += [Lost(shard.tensor, region, host_of(device), device) for region in subtract_all(shard.box, covering)]
    if lost:
        return Assembly(sorted(lost))
    return Assembly([], Layout.build(saved.tensors, devices), replica_devices)
