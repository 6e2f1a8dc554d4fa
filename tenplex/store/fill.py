"""Write a whole version from a layout: each host's shards, cut from values the caller gives, committed per host.

May import: numpy, this package, ``tenplex.box``, ``tenplex.layout``,
``tenplex.devices`` and the standard library.

Tests and benchmarks fill stores this way, with direct local writes; a
training job saves through :mod:`tenplex.integration` instead.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..box import Box
from ..devices import host_of
from ..layout import Layout
from .local import Store

Values = Callable[[str, Box], np.ndarray]  # (tensor, box) -> array of shape box.lengths


def write_version(stores: Mapping[str, Store], layout: Layout, version: int, values: Values,
                  docs: Mapping[str, Any] | None = None) -> None:
    """Store every shard of ``layout`` as ``version`` on its host's store, with ``docs`` and the layout itself.

    ``stores`` maps each host of the layout to its store. Each host commits on
    its own, so a failure can leave the version on some hosts only.
    """
    for host in layout.hosts():
        with stores[host].begin(version) as w:
            for device, shards in sorted(layout.devices.items()):
                if host_of(device) != host:
                    continue
                for shard in shards:
                    spec = layout.tensors[shard.tensor]
                    w.put(device, shard.tensor, shard.box, values(shard.tensor, shard.box), spec.dtype,
                          shape=spec.shape)
            for name, doc in (docs or {}).items():
                w.put_json(name, doc)
            w.put_layout(layout)
            w.commit()
