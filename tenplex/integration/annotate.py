"""Explicit annotations for plain local tensors (Megatron-style models).

May import: ``tenplex.box``, ``tenplex.layout``, ``tenplex.ptc``,
``tenplex.parallel``, ``tenplex.errors`` and the standard library. Pure.

A model that keeps its shards as ordinary tensors cannot tell tenplex which
part of the global tensor each one is. An annotation says so. The common case
is an :class:`Annotation`:

* ``global_shape``: the tensor's real, unpadded shape, the same under every
  configuration;
* ``offsets``: where the local tensor's first element lies in the global
  tensor.

The box a rank holds is ``offsets`` with lengths ``min(local, global - offset)``
per dimension. A local tensor larger than that box is padded (for example a
vocabulary padded to a multiple of tp): only the box is state; padding is
neither saved nor overwritten on restore.

A :class:`ShardMap` is the general form: several (global box, region of the
local tensor) pairs, for fused tensors whose tp slice holds a part of each
block (a fused QKV weight). :func:`annotations_from_ptc` builds them from the
partition rules of the PTC core, :func:`annotations_from_layout` from a layout
made in advance, for one device: there, several boxes of one tensor are held
stacked along the one dimension in which they differ, in global order (the
Megatron convention for fused weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..box import Box
from ..errors import LayoutError
from ..layout import Layout
from ..parallel import ParallelConfig
from ..ptc import PTC


@dataclass(frozen=True)
class Annotation:
    """A plain local tensor that holds one (maybe padded) box starting at ``offsets``."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(n) for n in self.offsets))
        if len(self.global_shape) != len(self.offsets):
            raise LayoutError(f"annotation offsets {list(self.offsets)} and global shape "
                              f"{list(self.global_shape)} differ in rank")

    def pieces(self, name: str, local_shape: Sequence[int]) -> list[tuple[Box, Box]]:
        """[(global box, region of the local tensor)] for a local tensor of ``local_shape``."""
        _check_rank(name, local_shape, self.global_shape)
        if any(o > g for o, g in zip(self.offsets, self.global_shape)):
            raise LayoutError(f"tensor {name!r}: annotated offsets {list(self.offsets)} lie outside the global "
                              f"shape {list(self.global_shape)}")
        lengths = tuple(min(n, g - o) for n, g, o in zip(local_shape, self.global_shape, self.offsets))
        return [(Box(self.offsets, lengths), Box((0,) * len(lengths), lengths))]


@dataclass(frozen=True)
class ShardMap:
    """A plain local tensor whose regions ``local`` hold the global boxes ``boxes`` (same order, same lengths)."""

    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    local: tuple[Box, ...]

    def pieces(self, name: str, local_shape: Sequence[int]) -> list[tuple[Box, Box]]:
        _check_rank(name, local_shape, self.global_shape)
        whole = Box.whole(tuple(local_shape))
        for box, region in zip(self.boxes, self.local):
            if box.lengths != region.lengths or not whole.contains(region):
                raise LayoutError(f"tensor {name!r}: box {box} does not fit region {region} of the local tensor "
                                  f"of shape {list(local_shape)}")
        return list(zip(self.boxes, self.local))


AnyAnnotation = Annotation | ShardMap
Annotations = Mapping[str, AnyAnnotation]


def _check_rank(name: str, local_shape: Sequence[int], global_shape: Sequence[int]) -> None:
    if len(local_shape) != len(global_shape):
        raise LayoutError(f"tensor {name!r}: local shape {list(local_shape)} and annotated global shape "
                          f"{list(global_shape)} differ in rank")


def annotations_from_ptc(ptc: PTC, config: ParallelConfig, rank: int) -> dict[str, ShardMap]:
    """The annotation of every tensor ``rank`` holds under ``config``, from the PTC's partition rules."""
    return {shard.tensor: ShardMap(ptc.rules[shard.tensor].shape, tuple(r.box for r in shard.regions),
                                   tuple(r.local for r in shard.regions))
            for shard in ptc.local_shards(config, rank)}


def annotations_from_layout(layout: Layout, device: str) -> dict[str, ShardMap]:
    """The annotation of every tensor ``device`` holds in ``layout``; several boxes are stacked (see above)."""
    if device not in layout.devices:
        raise LayoutError(f"device {device} holds nothing in the given layout; it has devices "
                          f"{', '.join(sorted(layout.devices)[:8])}{' …' if len(layout.devices) > 8 else ''}")
    held: dict[str, list[Box]] = {}
    for shard in layout.devices[device]:
        held.setdefault(shard.tensor, []).append(shard.box)
    result = {}
    for name, boxes in held.items():
        boxes.sort()
        differing = {d for b in boxes[1:] for d in range(b.ndim) if b.offsets[d] != boxes[0].offsets[d]}
        if len(differing) > 1:
            raise LayoutError(f"device {device} holds {len(boxes)} boxes of tensor {name!r} that differ in "
                              f"dimensions {sorted(differing)}; only boxes that differ in one dimension can be "
                              f"stacked into one local tensor")
        dim = differing.pop() if differing else 0
        local, start = [], 0
        for box in boxes:
            local.append(Box(tuple(start if d == dim else 0 for d in range(box.ndim)), box.lengths))
            start += box.lengths[dim] if box.ndim else 0
        result[name] = ShardMap(layout.tensors[name].shape, tuple(boxes), tuple(local))
    return result
