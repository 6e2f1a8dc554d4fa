"""Planning per destination: the transfers into some devices only, in time proportional to their share.

May import: ``tenplex.box``, ``tenplex.regions``, ``tenplex.plan_index``, ``tenplex.layout``,
``tenplex.transfer_plan``, ``tenplex.planner`` (its tensor checks), ``tenplex.errors``, ``tenplex._gc`` and the
standard library. Pure and deterministic.

``plan_share(old, new, devices)`` (both layouts as :class:`~tenplex.plan_index.LayoutIndex`) returns the
transfers whose ``dst`` is one of ``devices``; every rank can plan its own device (or the first rank of a host
its host's devices) without the others. It follows the steps of :mod:`tenplex.planner` (kept, local, fan-out,
remote) for the same new boxes in the same order on each host (tensor name, then device), so the union of the
shares of all devices is a valid plan by the ``tenplex.plan/1`` contract that crosses hosts exactly the lower bound:

- a fan-out depends only on the destination's own host: the first device of the host (in device order) whose
  new box needs a region no old shard on the host holds receives it from another host; later devices of the
  host copy it from that device's new shard. A share therefore walks its hosts' devices in order up to its
  last device (for a tensor whose boxes are disjoint on both sides, only those with one of the share's boxes);
  their transfers decide the fan-outs, only the share's own are kept;
- senders are chosen by a rule every rank applies alone, instead of the global planner's greedy least-loaded
  choice (which needs every earlier transfer): each receiving device spreads the bytes it reads from one set of
  replicas (the devices that hold the same old box) evenly over them. Its transfers from that set, in plan
  order, cut its bytes into as many equal stripes as there are replicas; a transfer comes from the replica of
  the stripe its middle byte falls in, counted from the device's own place in the new layout's device order
  (so that devices which need the same few regions start at different replicas). Copies within a host do the
  same over the host's replicas. On the benchmark's scenarios the most-loaded sender carries 0.2-0.35x the
  bytes of the greedy planner's, and every host sends the same within 0.01 %.

Statistics of a share count its own transfers; ``max_host_*`` only its own. ``inter_host_lower_bound`` is
the share's part of the global bound, from the layouts alone: per box of the share, what neither the host's
old boxes nor the host's earlier new boxes (in device order) hold. So the shares of any split of the devices
add up to the global bound. :func:`plan_by_hosts` is the union of all shares, the whole plan as per-rank
planning makes it (for tools and the transformer).
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Callable, Iterable

from ._gc import paused_gc
from .box import Box
from .errors import PlanError
from .layout import Layout, TensorSpec
from .plan_index import LayoutIndex, TensorHolders
from .planner import check_tensors
from .regions import Region, RegionIndex, cover, ignore, intersect, to_box, volume
from .transfer_plan import Plan, PlanStats, Transfer

Fragment = tuple[Region, Box, int, int]  # (region, as a box, old region number, bytes)


class _Share:
    """The transfers of a share by kind, with their byte counts; senders are picked at the end (``_pick``)."""

    def __init__(self, old_host: dict[str, str], new: LayoutIndex, wanted: set[str]) -> None:
        self.old_host, self.new, self.wanted = old_host, new, wanted
        self.kinds: dict[str, list[list]] = {"kept": [], "local": [], "remote": [], "fanout": []}
        self.bytes = {"kept": 0, "local": 0, "remote": 0, "lower_bound": 0, "target": 0, "initialized": 0}
        # (receiving device, sender set) -> its transfers still without a sender, with their bytes
        self.unsent: dict[tuple[str, tuple], list[tuple[list, int]]] = {}
        self.senders: dict[tuple, tuple[int, Callable[[int], str]]] = {}  # sender set -> (size, k-th sender)

    def add(self, kind: str, tensor: str, src: str, dst: str, region: Region | Box, nbytes: int) -> None:
        box = region if isinstance(region, Box) else to_box(region)
        self.kinds[kind].append([tensor, src, dst, box])
        self.bytes["local" if kind == "fanout" else kind] += nbytes

    def add_unsent(self, kind: str, tensor: str, dst: str, piece: Box, nbytes: int, senders: tuple,
                   size: int, sender: Callable[[int], str]) -> None:
        """A transfer whose sender is one of a set of ``size`` replicas (``sender(k)`` is the k-th)."""
        entry = [tensor, None, dst, piece]
        self.kinds[kind].append(entry)
        self.bytes[kind] += nbytes
        self.unsent.setdefault((dst, senders), []).append((entry, nbytes))
        self.senders.setdefault(senders, (size, sender))

    def _pick(self) -> None:
        """Each receiving device spreads its bytes from one set of replicas evenly over them: its transfers,
        in plan order, cut its bytes into equal stripes, one per replica, starting at its own place in the
        new layout's device order (so devices that need the same few regions start at different replicas)."""
        for (dst, senders), entries in self.unsent.items():
            size, sender = self.senders[senders]
            total, before, start = sum(n for _, n in entries), 0, self.new.number[dst]
            for entry, nbytes in entries:
                entry[1] = sender(int((before + nbytes / 2) * size / total) + start)
                before += nbytes

    def plan(self, new_tensors: list[str]) -> Plan:
        self._pick()
        sent: dict[str, int] = {}
        received: dict[str, int] = {}
        for tensor, src, dst, box in self.kinds["remote"]:
            nbytes = box.volume * self.new.layout.tensors[tensor].itemsize
            sent[self.old_host[src]] = sent.get(self.old_host[src], 0) + nbytes
            received[self.new.host[dst]] = received.get(self.new.host[dst], 0) + nbytes
        b = self.bytes
        stats = PlanStats(target_bytes=b["target"], kept_bytes=b["kept"], intra_host_bytes=b["local"],
                          inter_host_bytes=b["remote"], inter_host_lower_bound=b["lower_bound"],
                          max_host_send_bytes=max(sent.values(), default=0),
                          max_host_recv_bytes=max(received.values(), default=0), initialized_bytes=b["initialized"])
        transfers = tuple(Transfer(t, src, dst, "new" if kind == "fanout" else "old", box)
                          for kind in ("kept", "local", "remote", "fanout") for t, src, dst, box in self.kinds[kind])
        return Plan(transfers, stats, tuple(new_tensors))


def plan_share(old: LayoutIndex, new: LayoutIndex, devices: Iterable[str], allow_new_tensors: bool = False) -> Plan:
    """The transfers into ``devices`` (devices of ``new``) that turn ``old`` into ``new`` (module docstring)."""
    wanted = set(devices)
    unknown = sorted(wanted - new.number.keys())
    if unknown:
        raise PlanError(f"device(s) {', '.join(unknown[:5])} hold nothing in the new layout; plan a share only "
                        f"for devices of the new layout")
    with paused_gc():
        missing = check_tensors(old.layout, new.layout, allow_new_tensors)
        out = _Share(old.host, new, wanted)
        for host in sorted({new.host[d] for d in wanted}):
            _plan_host(out, old, new, host)
        return out.plan(missing)


def plan_by_hosts(old: LayoutIndex, new: LayoutIndex, allow_new_tensors: bool = False) -> Plan:
    """The whole plan as the union of every host's share: what the ranks' shares add up to (tools, transformer)."""
    return plan_share(old, new, new.number, allow_new_tensors)


def _plan_host(out: _Share, old: LayoutIndex, new: LayoutIndex, host: str) -> None:
    """The share's transfers into ``host``: walk its devices up to the share's last one, tensor by tensor."""
    on_host = new.devices_on[host]
    last = max(k for k, d in enumerate(on_host) if d in out.wanted)
    boxes: dict[str, list[tuple[str, Box]]] = {}  # tensor -> (device, new box), in device order
    wanted_tensors: set[str] = set()
    for device in on_host[:last + 1]:
        for shard in new.layout.devices[device]:
            boxes.setdefault(shard.tensor, []).append((device, shard.box))
            if device in out.wanted:
                wanted_tensors.add(shard.tensor)
    for name in sorted(wanted_tensors):
        spec = new.layout.tensors[name]
        mine = [(d, b) for d, b in boxes[name] if d in out.wanted]
        out.bytes["target"] += sum(b.volume for _, b in mine) * spec.itemsize
        if name not in old.layout.tensors:
            out.bytes["initialized"] += sum(b.volume for _, b in mine) * spec.itemsize
            continue
        _HostTensor(out, name, spec, old.tensor(name), host).fill(boxes[name], mine)


class _HostTensor:
    """One tensor's new boxes on one host: steps 1-4 of ``tenplex.planner`` with the rule-based senders."""

    def __init__(self, out: _Share, name: str, spec: TensorSpec, held: TensorHolders, host: str) -> None:
        self.out, self.name, self.itemsize, self.held, self.host = out, name, spec.itemsize, held, host
        self.here: dict[Region, str] = {}  # regions brought in from other hosts -> the device that received it
        self._on_host: dict[int, list[str]] = {}

    def on_host(self, i: int) -> list[str]:
        found = self._on_host.get(i)
        if found is None:
            found = self._on_host[i] = self.held.on_host(i, self.host)
        return found

    def local(self, dst: str, piece: Box, i: int, nbytes: int) -> None:
        holders = self.on_host(i)
        self.out.add_unsent("local", self.name, dst, piece, nbytes, ("local", *holders), len(holders),
                            lambda k: holders[k % len(holders)])

    def remote(self, dst: str, piece: Box, i: int, nbytes: int) -> None:
        held = self.held
        self.out.add_unsent("remote", self.name, dst, piece, nbytes, ("remote", *held.groups[i]), held.replicas(i),
                            partial(held.replica, i))

    def fill(self, boxes: list[tuple[str, Box]], mine: list[tuple[str, Box]]) -> None:
        """Plan ``mine``, the share's boxes among ``boxes`` (the host's, in device order, up to the share's last)."""
        targets = sorted({(b.offsets, b.ends) for _, b in boxes})
        wanted = self.out.wanted
        if self.held.tiled and RegionIndex(targets).disjoint():
            # Disjoint boxes on both sides: a box's fragments go their ways whatever the host's other boxes do,
            # so only the devices with one of the share's boxes matter (the first of them receives, the rest
            # fan out or take turns copying).
            fragments = {target: self.fragments(target) for target in {(b.offsets, b.ends) for _, b in mine}}
            seen: set[Region] = set()
            for dst, box in boxes:
                target = (box.offsets, box.ends)
                found = fragments.get(target, ())
                if found is None:
                    self.fill_general(dst, box)  # a gap: let the general path name it
                elif found:
                    self.fill_tiled(dst, found)
                    if dst in wanted and target not in seen:  # the host's first box of it: its lower bound
                        self.out.bytes["lower_bound"] += sum(n for _, _, i, n in found if not self.on_host(i))
                    seen.add(target)
            return
        for k, (dst, box) in enumerate(boxes):
            self.fill_general(dst, box)
            if dst in wanted:
                self.out.bytes["lower_bound"] += self.lower_bound(box, boxes[:k]) * self.itemsize

    def fragments(self, target: Region) -> list[Fragment] | None:
        """(region, box, old region, bytes) per old box that ``target`` overlaps; None if they leave a gap."""
        regions, found = self.held.regions, []
        for i in self.held.index.overlapping(target):
            r = intersect(target, regions[i])
            if r is not None:
                found.append((r, to_box(r), i, volume(r) * self.itemsize))
        return found if sum(f[3] for f in found) == volume(target) * self.itemsize else None

    def fill_tiled(self, dst: str, fragments: list[Fragment]) -> None:
        """Disjoint boxes: each fragment arrives whole, one way."""
        wanted = dst in self.out.wanted
        add = self.out.add if wanted else _skip
        for r, piece, i, nbytes in fragments:
            if self.held.held_by(i, dst):
                add("kept", self.name, dst, dst, piece, nbytes)
            elif self.on_host(i):
                if wanted:
                    self.local(dst, piece, i, nbytes)
            elif r in self.here:
                add("fanout", self.name, self.here[r], dst, piece, nbytes)
            else:
                if wanted:
                    self.remote(dst, piece, i, nbytes)
                self.here[r] = dst

    def fill_general(self, dst: str, box: Box) -> None:
        """Any boxes: cover what is left, kind by kind, by box subtraction."""
        wanted = dst in self.out.wanted
        add = self.out.add if wanted else _skip
        target, regions = (box.offsets, box.ends), self.held.regions
        overlapping = self.held.index.overlapping(target)
        pieces = [target]

        def emit(kind: str, src: str) -> Callable[[Region], None]:
            return lambda r: add(kind, self.name, src, dst, r, volume(r) * self.itemsize)

        for i in overlapping:
            if pieces and self.held.held_by(i, dst):
                pieces = cover(pieces, regions[i], emit("kept", dst))
        for i in overlapping:
            if pieces and not self.held.held_by(i, dst) and self.on_host(i):
                def copy(r: Region, i: int = i) -> None:
                    if wanted:
                        self.local(dst, to_box(r), i, volume(r) * self.itemsize)
                pieces = cover(pieces, regions[i], copy)
        for region, src in list(self.here.items()):
            if not pieces:
                break
            pieces = cover(pieces, region, emit("fanout", src))
        for i in overlapping:
            if pieces and not self.on_host(i):
                def receive(r: Region, i: int = i) -> None:
                    if wanted:
                        self.remote(dst, to_box(r), i, volume(r) * self.itemsize)
                    self.here[r] = dst
                pieces = cover(pieces, regions[i], receive)
        if pieces:
            raise PlanError(f"no device of the old layout holds region {to_box(pieces[0])} of tensor {self.name!r}, "
                            f"which {dst} needs; the old layout must cover every tensor it shares with the new one")

    def lower_bound(self, box: Box, earlier: list[tuple[str, Box]]) -> int:
        """Elements of ``box`` that neither the host's old boxes nor its ``earlier`` new boxes hold."""
        target = (box.offsets, box.ends)
        pieces = [target]
        for _, other in earlier:
            pieces = cover(pieces, (other.offsets, other.ends), ignore)
        for i in self.held.index.overlapping(target):
            if self.on_host(i):
                pieces = cover(pieces, self.held.regions[i], ignore)
        return sum(map(volume, pieces))


def _skip(kind: str, tensor: str, src: str, dst: str, region: Region | Box, nbytes: int) -> None:
    """``_Share.add`` for devices outside the share: walked for their fan-outs, not planned."""


def plan_for(old: Layout, new: Layout, devices: Iterable[str], allow_new_tensors: bool = False) -> Plan:
    """The plan for these destination devices, from the layouts themselves (indexes them; see :func:`plan_share`)."""
    return plan_share(LayoutIndex(old), LayoutIndex(new), devices, allow_new_tensors)


def layouts_digest(old: LayoutIndex, new: LayoutIndex) -> str:
    """One fingerprint of both layouts, for ranks to check that they planned from the same ones."""
    return hashlib.sha256(f"{old.digest()}:{new.digest()}".encode()).hexdigest()
