"""The layout a centralised transformer assembles: the middle of ``bench compare``'s and ``bench simulate``'s
centralised method (gather everything on one host, then scatter it).

May import: ``tenplex.box``, ``tenplex.layout`` and the standard library.
"""

from __future__ import annotations


def central_layout(old):
    """Every tensor whole on one new device of the first old host: what a centralised transformer assembles."""
    from ..box import Box
    from ..layout import Layout, Shard

    device = f"{old.hosts()[0]}/{1 + max(int(d.rsplit('/', 1)[1]) for d in old.devices)}"
    return Layout.build(old.tensors, {device: tuple(Shard(t, Box.whole(s.shape))
                                                    for t, s in sorted(old.tensors.items()))})
