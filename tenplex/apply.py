"""An in-memory executor: apply a plan to numpy shards, enforcing the plan contract. Used to prove plans correct.

May import: ``numpy``, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.layout``,
``tenplex.transfer_plan``, ``tenplex.devices``, ``tenplex.errors`` and the standard
library. Pure: no file, network or torch access.

Shards are ``dict[device, dict[Shard, numpy.ndarray]]``: for each device, each
:class:`~tenplex.layout.Shard` (tensor name and global box) of its layout maps
to an array of exactly ``box.lengths``, of the tensor's numpy storage dtype
(bfloat16 as ``uint16`` bits, see :mod:`tenplex.dtypes`). :func:`shards_from_global`
cuts such shards from whole global arrays.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .box import Box
from .devices import host_of
from .dtypes import numpy_storage
from .errors import PlanError
from .layout import Layout, Shard
from .transfer_plan import Plan

Shards = dict[str, dict[Shard, np.ndarray]]


def shards_from_global(layout: Layout, tensors: Mapping[str, np.ndarray]) -> Shards:
    """Every device's shards of ``layout``, cut from the whole global arrays ``tensors``."""
    return {device: {shard: np.array(tensors[shard.tensor][shard.box.slices()]) for shard in shards}
            for device, shards in layout.devices.items()}


def _containing(shards: Mapping[Shard, np.ndarray], tensor: str, box: Box) -> tuple[Shard, np.ndarray] | None:
    for shard, array in shards.items():
        if shard.tensor == tensor and shard.box.contains(box):
            return shard, array
    return None


def _check_shards(layout: Layout, shards: Shards) -> None:
    for device, expected in layout.devices.items():
        have = shards.get(device, {})
        for shard in expected:
            array = have.get(shard)
            if array is None:
                raise PlanError(f"old shards lack {shard.tensor!r} {shard.box} on {device}")
            storage = numpy_storage(layout.tensors[shard.tensor].dtype)
            if array.shape != shard.box.lengths or array.dtype != np.dtype(storage):
                raise PlanError(f"old shard {shard.tensor!r} {shard.box} on {device} is a {array.dtype} array of "
                                f"shape {array.shape}; expected {storage} {shard.box.lengths}")


def apply_plan(plan: Plan, old_layout: Layout, new_layout: Layout, old_shards: Shards) -> Shards:
    """Run ``plan`` on ``old_shards`` and return the new layout's shards.

    Raises PlanError if the plan breaks its contract: a transfer outside the
    boxes of its source or destination, a ``"from": "new"`` read across hosts
    or of a region not yet filled, a region filled twice, or a new box left
    partly empty (boxes of ``plan.new_tensors`` excepted; they stay zero).
    """
    _check_shards(old_layout, old_shards)
    new_shards: Shards = {}
    filled: dict[str, dict[Shard, np.ndarray]] = {}
    for device, shards in new_layout.devices.items():
        new_shards[device] = {}
        filled[device] = {}
        for shard in shards:
            storage = numpy_storage(new_layout.tensors[shard.tensor].dtype)
            new_shards[device][shard] = np.zeros(shard.box.lengths, dtype=storage)
            filled[device][shard] = np.zeros(shard.box.lengths, dtype=bool)

    for n, t in enumerate(plan.transfers):
        where = f"transfer {n} ({t.tensor!r} {t.box} {t.src} -> {t.dst}, from {t.source})"
        target = _containing(new_shards.get(t.dst, {}), t.tensor, t.box)
        if target is None:
            raise PlanError(f"{where}: the region lies in no new box of {t.dst}")
        if t.source == "old":
            source = _containing(old_shards.get(t.src, {}), t.tensor, t.box)
            if source is None:
                raise PlanError(f"{where}: the region lies in no old box of {t.src}")
        else:
            if host_of(t.src) != host_of(t.dst):
                raise PlanError(f"{where}: reads from new shards must stay within a host")
            source = _containing(new_shards.get(t.src, {}), t.tensor, t.box)
            if source is None:
                raise PlanError(f"{where}: the region lies in no new box of {t.src}")
            if not filled[t.src][source[0]][t.box.local(source[0].box).slices()].all():
                raise PlanError(f"{where}: reads part of {t.src}'s new shard before any transfer filled it")
        into = t.box.local(target[0].box).slices()
        mask = filled[t.dst][target[0]]
        if mask[into].any():
            raise PlanError(f"{where}: part of the region was already filled by an earlier transfer")
        target[1][into] = source[1][t.box.local(source[0].box).slices()]
        mask[into] = True

    skip = set(plan.new_tensors)
    for device, masks in filled.items():
        for shard, mask in masks.items():
            if shard.tensor not in skip and not mask.all():
                raise PlanError(f"the plan leaves part of {shard.tensor!r} {shard.box} on {device} unfilled")
    return new_shards
