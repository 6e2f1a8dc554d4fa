"""A deterministic benchmark state whose value at every global index is known, so any box can be checked.

May import: numpy, ``tenplex.box``, ``tenplex.layout``, ``tenplex.devices``,
``tenplex.store`` and the standard library.

The element at global C-order index ``i`` of tensor ``t`` is
``float((i + seed(t)) % PRIME)``: an integer below 2**24, so exact in float32.
Every replica of a box therefore holds the same values, and a box read back
after any resharding (tenplex, the centralised transformer or DCP) can be
compared with :func:`values` bit for bit without keeping a reference copy.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from ..box import Box
from ..devices import host_of
from ..layout import Layout

PRIME = 16_777_213  # the largest prime below 2**24: every value is exact in float32


def values(tensor: str, shape: tuple[int, ...], box: Box) -> np.ndarray:
    """The float32 values of ``box`` of ``tensor`` (global shape ``shape``)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    index = np.asarray(zlib.crc32(tensor.encode()) % PRIME, dtype=np.int64)
    for d, (offset, length) in enumerate(zip(box.offsets, box.lengths)):
        axis = [1] * len(shape)
        axis[d] = length
        # shape [1, .., length, .., 1]: broadcasting builds the global index of every element of the box
        index = index + (np.arange(offset, offset + length, dtype=np.int64) * strides[d]).reshape(axis)
    return (index % PRIME).astype(np.float32)


def write_version(root: Path, layout: Layout, version: int) -> None:
    """Commit ``version`` of ``layout`` into one local store per host under ``root`` (``root/<host>``)."""
    from ..store import Store, fill

    fill.write_version({h: Store(root / h, h) for h in layout.hosts()}, layout, version,
                       lambda tensor, box: values(tensor, layout.tensors[tensor].shape, box), {"step": {"step": 1000}})


def mismatches(root: Path, layout: Layout, version: int) -> list[str]:
    """The (device, tensor, box) of every shard of ``version`` under ``root`` whose values are wrong or missing."""
    from ..store import Store

    wrong = []
    for host in layout.hosts():
        reader = Store(root / host, host).open(version)
        for device, shard in layout.iter_shards():
            if host_of(device) != host:
                continue
            spec = layout.tensors[shard.tensor]
            try:
                if not np.array_equal(reader.read(device, shard.tensor, shard.box),
                                      values(shard.tensor, spec.shape, shard.box)):
                    wrong.append(f"{device} {shard.tensor} {shard.box}: values differ")
            except Exception as e:  # noqa: BLE001 - reported as a mismatch naming the shard
                wrong.append(f"{device} {shard.tensor} {shard.box}: {e}")
    return wrong
